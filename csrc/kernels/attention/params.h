// Parameters of the split-KV absorbed MQA decode (plain data, host and device).
//
// Every query row attends over one shared latent row per position:
//   key   = [c_t | k_pe_t]      (kD = 576 wide; k_pe rotated on the fly when rope_cs is set)
//   value = c_t                 (kDv = 512 wide)
// Query rows are (s_q, h_q) flattened: row r = i * h_q + h.
#pragma once

#include <cstdint>

#include "../../platform/bf16.h"

namespace mla {

struct AttnParams {
  const bf16_t* q;            // [bs, s_q, h_q, D], row stride q_row_stride, batch stride q_batch_stride
  const bf16_t* kv;           // latent cache; row t of sequence b lives at
                              //   kv + page(b, t) * kv_page_stride + (t % page_size) * kv_row_stride
  const int32_t* block_table; // [bs, block_table_stride] page ids, or nullptr: page(b, t) = b
  const int32_t* seqlens;     // [bs] number of valid cache rows per sequence (device)
  const bf16_t* rope_cs;      // [>= max length, rope]: cos of the rope/2 freqs | sin of them (bf16),
                              //   or nullptr when keys are used as stored
  const bf16_t* kpe;          // or nullptr: the key's last `rope` columns of row t of sequence b are read
                              //   from kpe + b * kpe_batch_stride + t * kpe_row_stride instead of the
                              //   cache (a rotated copy kept by the decoder; not with a block table)
  bf16_t* o;                  // [bs, s_q, h_q, Dv], contiguous
  float* lse;                 // [bs, h_q, s_q], natural-log LSE
  float* o_part;              // [max_parts, rows, Dv] fp32 partial outputs (split sequences only)
  float* lse_part;            // [max_parts, rows]
  const int32_t* plan;        // planner output, see plan.h

  int64_t q_row_stride;       // elements between heads (query rows)
  int64_t q_batch_stride;     // elements between sequences
  int64_t kv_row_stride;      // elements between cache rows
  int64_t kv_page_stride;     // elements between pages (between sequences when not paged)
  int64_t block_table_stride; // entries per sequence in block_table
  int64_t kpe_row_stride;     // elements between kpe rows
  int64_t kpe_batch_stride;   // elements between kpe sequences
  int page_size;              // rows per page (max_seq_len when not paged)
  int max_len;                // cache capacity per sequence: lengths are clamped to [0, max_len]

  int bs, s_q, h_q;
  int rows;                   // s_q * h_q
  int max_parts;              // grid.y: upper bound on planned parts
  int rope;                   // rope width inside D (the last `rope` columns of the key)
  float scale_log2;           // softmax_scale * log2(e)
  bool causal;                // s_q > 1: query i sees positions < L - (s_q - 1 - i)
  bool f16;                   // q, kv, kpe and o hold fp16 (else bf16); on-the-fly RoPE is bf16 only
};

// Combine: merge the split partials of every sequence that was split.
struct CombineParams {
  const float* o_part;        // [max_parts, rows, Dv]
  const float* lse_part;      // [max_parts, rows]
  const int32_t* seq_info;    // [bs, 2]: (number of splits, first part) per sequence
  bool skip_single_split;     // sequences with one split were written by the attention kernel
  bf16_t* o;                  // [bs, rows, Dv]  (= [bs, s_q, h_q, Dv])
  float* lse;                 // [bs, h_q, s_q]
  int bs, s_q, h_q, rows, dv;
  bool f16;                   // o is fp16 (else bf16)
};

}  // namespace mla
