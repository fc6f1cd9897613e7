// The rope-score pre-pass of per-head rope keys (MHA2MLA): the rope part of
// every score, q_pe[h] . k_pe[t, h], into the fp32 workspace that the
// attention kernels add to their latent scores (RopeScoreParams).
#include "../../platform/bf16.h"
#include "../../platform/vendor.h"

#include "attention.h"
#include "block_table.h"

namespace mla {
namespace {

// Per-head rope keys: thread (key t, head slot) of a 32-key block, 8 head
// slots; each thread holds one key's rope row of a head in registers and
// dots it with that head's q_pe for every query token.
constexpr int kRsBlockKeys = 32, kRsHeadSlots = 8;

template <int kRope, bool kF16>
__global__ void __launch_bounds__(kRsBlockKeys* kRsHeadSlots) rope_scores_kernel(const RopeScoreParams p) {
  using E = Half16<kF16>;
  constexpr int kVec = kRope / 8;  // 16-byte vectors per rope row
  const int b = block_y();
  const int L = min(max(p.seqlens[b], 0), p.max_len);
  if (block_x() * kRsBlockKeys >= L) return;
  const int t = block_x() * kRsBlockKeys + thread_x() % kRsBlockKeys;
  const bool valid = t < L;
  const bf16_t* krow = p.kpe;
  if (valid) {
    const int64_t page =
        p.block_table == nullptr ? b : page_id(p.block_table, b * p.block_table_stride + t / p.page_size, p.num_pages);
    krow = p.kpe + page * p.page_stride + static_cast<int64_t>(t % p.page_size) * p.row_stride;
  }
  for (int h = thread_x() / kRsBlockKeys; h < p.h_q; h += kRsHeadSlots) {
    float k[kRope];
    if (valid) {
      const uint4* kv4 = reinterpret_cast<const uint4*>(krow + h * p.head_stride);
#pragma unroll
      for (int v = 0; v < kVec; ++v) {
        const uint4 w = kv4[v];
        const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          k[8 * v + 2 * e] = E::lo(ws[e]);
          k[8 * v + 2 * e + 1] = E::hi(ws[e]);
        }
      }
    }
    for (int i = 0; i < p.s_q; ++i) {
      const int r = i * p.h_q + h;
      const uint4* q4 =
          reinterpret_cast<const uint4*>(p.q + b * p.q_batch_stride + r * p.q_row_stride + p.q_col0);
      float acc = 0.f;
#pragma unroll
      for (int v = 0; v < kVec; ++v) {
        const uint4 w = q4[v];
        const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) acc += E::lo(ws[e]) * k[8 * v + 2 * e] + E::hi(ws[e]) * k[8 * v + 2 * e + 1];
      }
      if (valid) p.out[(static_cast<int64_t>(b) * p.rows + r) * p.out_stride + t] = acc;
    }
  }
}

}  // namespace

const char* launch_rope_scores(const RopeScoreParams& p, stream_t stream) {
  if (p.bs <= 0 || p.h_q <= 0 || p.s_q <= 0 || p.max_len <= 0) return nullptr;  // nothing to score
  dim3 grid((p.max_len + kRsBlockKeys - 1) / kRsBlockKeys, p.bs);
  const dim3 block(kRsBlockKeys * kRsHeadSlots);
  switch (p.rope * 2 + (p.f16 ? 1 : 0)) {
#define MLA_CASE(R)                                                              \
  case 2 * R:                                                                    \
    rope_scores_kernel<R, false><<<grid, block, 0, stream>>>(p);                 \
    break;                                                                       \
  case 2 * R + 1:                                                                \
    rope_scores_kernel<R, true><<<grid, block, 0, stream>>>(p);                  \
    break;
    MLA_CASE(8) MLA_CASE(16) MLA_CASE(32) MLA_CASE(64)
#undef MLA_CASE
    default:
      return "launch_rope_scores: rope width must be 8, 16, 32 or 64";
  }
  return last_launch_error();
}

}  // namespace mla
