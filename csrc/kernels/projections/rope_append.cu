// See rope_append.h. Memory-bound and tiny (bs * heads * rope * 4 +
// bs * width * 4 bytes): grid (bs, ceil(heads * rope / 2 / 256)), one
// rotation pair per thread, so that even bs = 1 spreads over many blocks
// (one block per sequence was slower: docs/projections.md).
#include "rope_append.h"

namespace mla {
namespace {

constexpr int kThreads = 256;

MLA_GLOBAL void __launch_bounds__(kThreads) rope_append_kernel(RopeAppendParams p) {
  const int b = block_x();
  const int pos = p.seqlens[b] - 1;
  if (pos < 0 || pos >= p.max_len || pos >= p.positions) return;
  const int half = p.rope / 2;
  const bf16_t* cs = p.rope_cs + static_cast<int64_t>(pos) * p.rope;
  const bf16_t* q = p.q_pe + b * p.q_b_stride;
  bf16_t* o = p.q_out + b * p.o_b_stride;
  // one rotation pair: x[j], x[j + half] -> y[j], y[j + half]
  auto rotate = [&](const bf16_t* x, bf16_t* y, int j) {
    rope_pair(bf16_to_float(x[j]), bf16_to_float(x[j + half]), bf16_to_float(cs[j]), bf16_to_float(cs[half + j]),
              &y[j], &y[j + half]);
  };
  const int i = block_y() * kThreads + thread_x();
  if (i < p.heads * half) {
    const int h = i / half;
    rotate(q + h * p.q_h_stride, o + h * p.o_h_stride, i - h * half);
  }
  if (block_y() != 0) return;
  const bf16_t* src = p.kv_new + b * p.kv_b_stride;
  bf16_t* dst = p.cache + b * p.c_b_stride + static_cast<int64_t>(pos) * p.c_row_stride;
  for (int k = thread_x(); k < p.width; k += kThreads) dst[k] = src[k];
  if (p.kpe_out != nullptr && thread_x() < half)
    rotate(src + p.width - p.rope, p.kpe_out + b * p.k_b_stride + static_cast<int64_t>(pos) * p.k_row_stride,
           thread_x());
}

}  // namespace

const char* launch_rope_append(const RopeAppendParams& p, stream_t stream) {
  if (p.bs <= 0 || p.heads <= 0 || p.width <= 0 || p.rope <= 0 || p.rope % 2)
    return "launch_rope_append: bad parameters (bs, heads, width > 0; rope even and > 0)";
  const int pairs = p.heads * (p.rope / 2);
  dim3 grid(p.bs, (pairs + kThreads - 1) / kThreads);
  if (grid.y > 65535) return "launch_rope_append: heads * rope / 2 too large";
  rope_append_kernel<<<grid, kThreads, 0, stream>>>(p);
  return last_launch_error();
}

}  // namespace mla
