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

// Division by the page size without a hardware divide (the pair loops map
// keys to block-table entries and page rows every pair; an integer division
// by a runtime value is a long chain of dependent instructions):
// k / size == (k * magic) >> shift for 0 <= k < 2^31, with shift = 32 +
// ceil(log2 size) and magic = ceil(2^shift / size) (Granlund and Montgomery,
// 1994: magic * size - 2^shift < size <= 2^(shift - 32)).
struct PageDiv {
  uint64_t magic;
  int shift;
  int size;
  MLA_HOST_DEVICE int div(int k) const {
    return static_cast<int>((static_cast<uint64_t>(static_cast<uint32_t>(k)) * magic) >> shift);
  }
  MLA_HOST_DEVICE int mod(int k) const { return k - div(k) * size; }
};

// (a size below 1, which no valid cache has, maps every key to entry k and row 0 of size 1)
inline PageDiv make_page_div(int size) {
  if (size < 1) size = 1;
  int l = 0;
  while ((int64_t{1} << l) < size) ++l;
  const int shift = 32 + l;
  const uint64_t magic = ((uint64_t{1} << shift) + static_cast<uint64_t>(size) - 1) / static_cast<uint64_t>(size);
  return PageDiv{magic, shift, size};
}

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
  int32_t* counter;           // or nullptr: the Hopper kernel's work counter and done count (2 ints, zero at
                              //   the launch) for this call alone; nullptr: the plan's own (plan.h)
  bool live_lens;             // the plan was made before this call (for other lengths, perhaps): every part
                              //   takes its sequence's length from seqlens now, and a sequence's last part
                              //   runs to it (part.h)

  int64_t q_row_stride;       // elements between heads (query rows)
  int64_t q_batch_stride;     // elements between sequences
  int64_t kv_row_stride;      // elements between cache rows
  int64_t kv_page_stride;     // elements between pages (between sequences when not paged)
  int64_t block_table_stride; // entries per sequence in block_table
  int64_t kpe_row_stride;     // elements between kpe rows
  int64_t kpe_batch_stride;   // elements between kpe sequences
  int64_t num_pages;          // pages in kv (bs when not paged): block-table ids are held below it
  int64_t kpe_rows;           // rows per sequence in kpe (when kpe is set)
  int page_size;              // rows per page (max_seq_len when not paged)
  PageDiv page_div;           // make_page_div(page_size): k / page_size and k % page_size in the kernels
  int max_len;                // cache capacity per sequence: lengths are clamped to [0, max_len]

  int bs, s_q, h_q;
  int rows;                   // s_q * h_q
  int max_parts;              // upper bound on planned parts
  int ctas;                   // Hopper kernel: blocks resident at once (SMs x blocks per SM); > 0 makes it
                              //   persistent (blocks take work items from the plan's counter), 0: one block per item
  const float* rope_scores;   // or nullptr: per-head rope keys, the rope part of the score of row r for key t
                              //   of sequence b at rope_scores[(b * rows + r) * rs_stride + t] (fp32, unscaled);
                              //   then the key is the Dv latent columns alone (rope == 0)
  int64_t rs_stride;          // >= the key tiles' reach, a multiple of 4
  int dv;                     // value width Dv (D = dv + rope)
  int rope;                   // rope width inside D (the last `rope` columns of the key); 0 with rope_scores
  float scale_log2;           // softmax_scale * log2(e)
  bool causal;                // s_q > 1: query i sees positions < L - (s_q - 1 - i)
  bool f16;                   // q, kv, kpe and o hold fp16 (else bf16); on-the-fly RoPE is bf16 only
  bool kv_fp8;                // kv holds e4m3 values (float8_e4m3fn on NVIDIA, float8_e4m3fnuz on AMD) that
                              //   stand for value * scale (portable kernel; bf16 q, d 576, no rope_cs / kpe):
                              //   scale_log2 carries the scale, and o_scale multiplies the output
  float o_scale;              // kv_fp8: the cache's per-tensor scale (unused otherwise)
};

// Per-head rope keys (MHA2MLA): out[b, r, t] = q_pe[b, r] . k_pe[b, t, h(r)]
// for t < L_b, in fp32, where row r = i * h_q + h and q_pe = q[..., q_col0:].
struct RopeScoreParams {
  const bf16_t* q;            // q_pe of row r of sequence b: q + b * q_batch_stride + r * q_row_stride + q_col0
  const bf16_t* kpe;          // head h of row t of sequence b:
                              //   kpe + page(b, t) * page_stride + (t % page_size) * row_stride + h * head_stride
  const int32_t* block_table; // [bs, block_table_stride] page ids, or nullptr: page(b, t) = b
  const int32_t* seqlens;     // [bs]
  float* out;                 // [bs, rows, out_stride]
  int64_t q_row_stride, q_batch_stride, page_stride, row_stride, head_stride, block_table_stride, out_stride;
  int64_t num_pages;          // pages in kpe (bs when not paged): block-table ids are held below it
  int q_col0, page_size, max_len, bs, s_q, h_q, rows, rope;
  bool f16;
};

// Combine: merge the split partials of every sequence that was split.
struct CombineParams {
  const float* o_part;        // [max_parts, rows, Dv]
  const float* lse_part;      // [max_parts, rows]
  const int32_t* seq_info;    // [bs, 2]: (number of splits, first part) per sequence
  bool skip_single_split;     // sequences with one split were written by the attention kernel
  bool pdl;                   // launched as a programmatic dependent of the attention kernel (NVIDIA sm_90)
  bf16_t* o;                  // [bs, rows, Dv]  (= [bs, s_q, h_q, Dv])
  float* lse;                 // [bs, h_q, s_q]
  int bs, s_q, h_q, rows, dv;
  bool f16;                   // o is fp16 (else bf16)
  int max_warps;              // the grid's warps at most (> 0); past it each takes a run of (row, chunk) tasks
  int wave_warps;             // a wave of the combine's warps on this GPU (SMs x kCombineWarpsPerSm, > 0): where
                              //   a warp per (row, chunk) would take more, a warp takes a whole row
};

// Merge of N partial results of the same queries over disjoint key sets (the
// ranks of decode context parallelism): out = sum_r exp(lse_r - lse) out_r,
// lse = logsumexp_r lse_r, in fp32; a partial with lse -inf is never read.
struct MergeParams {
  const void* outs;  // [n, bs, s_q, h_q, dv] in `type`
  const float* lses;  // [n, bs, h_q, s_q]
  void* out;          // [bs, s_q, h_q, dv] in `type`
  float* lse;         // [bs, h_q, s_q]
  int n, bs, s_q, h_q, dv;
  int type;           // 0 bf16, 1 fp16, 2 fp32
  bool vec;           // 16-byte pieces (dv a multiple of 16 bytes' elements, bases 16-byte aligned)
};

}  // namespace mla
