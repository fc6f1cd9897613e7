// The query's RoPE and the cache append of one decode step, in one launch
// (pipeline steps 1 and 3 of docs/architecture.md: the down-projection's new latent
// row goes into the cache at its position, q_pe is rotated at the same
// position into the attention's query buffer). Positions come from the
// device (seqlens[b] - 1), so a captured graph serves every step.
#pragma once

#include <cstdint>

#include "../../platform/bf16.h"

namespace mla {

struct RopeAppendParams {
  const bf16_t* q_pe;      // [bs, heads, rope], unit last stride
  int64_t q_b_stride, q_h_stride;
  bf16_t* q_out;           // [bs, heads, rope], unit last stride
  int64_t o_b_stride, o_h_stride;
  const bf16_t* kv_new;    // [bs, width], unit last stride
  int64_t kv_b_stride;
  bf16_t* cache;           // [bs, max_len, width], unit last stride
  int64_t c_b_stride, c_row_stride;
  bf16_t* kpe_out;         // or nullptr: [bs, >= max_len, rope], unit last stride: the new row's
  int64_t k_b_stride, k_row_stride;  //   last rope columns, rotated at pos, go to kpe_out[b, pos]
  const int32_t* seqlens;  // [bs]: the new row's position is seqlens[b] - 1
  const bf16_t* rope_cs;   // [positions, rope]: cos of the rope/2 angles | their sin
  int bs, heads, rope, width, max_len, positions;
};

// One rotation pair of the task's RoPE, bit for bit: x1 = x[j], x2 =
// x[j + rope/2] (bf16 values), c / s the cos / sin of angle j; returns
// (y[j], y[j + rope/2]) = (x1 c - x2 s, x2 c + x1 s), each product and the
// sum rounded to bf16. Shared by rope_append and the fused Hopper query.
MLA_DEVICE void rope_pair(float x1, float x2, float c, float s, bf16_t* y1, bf16_t* y2) {
  *y1 = float_to_bf16(round_bf16(x1 * c) + round_bf16(-x2 * s));
  *y2 = float_to_bf16(round_bf16(x2 * c) + round_bf16(x1 * s));
}

// rot(x) = x*cos + cat(-x2, x1)*sin with each product and the sum rounded
// to bf16 (the task's RoPE, bit for bit); cache[b, pos] = kv_new[b]; with
// kpe_out, kpe_out[b, pos] = rot(kv_new[b, width - rope:]). A
// position outside [0, min(max_len, positions)) writes nothing for that
// sequence (the host checks lengths before the launch).
const char* launch_rope_append(const RopeAppendParams& p, stream_t stream);

}  // namespace mla
