// The query stage in one launch (pipeline step 2): per head h,
//   q_h   = q_lora W_qu[h]^T            [m, nope + rope], rounded to bf16
//   q_abs = q_h[:, :nope] W_UK[h]       [m, r], rounded to bf16
//   q_pe  = q_h[:, nope:]               un-rotated, or with `append` the
//                                       attention's rotated q_pe (below)
// so q_h never goes through memory and W_qu's and W_UK's bytes stream once.
// With append (ra.seqlens set), the kernel also does rope_append's work (see
// rope_append.h) in the same launch: q_pe is rotated at position
// seqlens[b] - 1 as it is stored (ra.q_pe / q_b_stride / q_h_stride unused:
// the rotation reads the accumulators), and the new cache row and its
// rotated k_pe are written (the producer warp's idle lanes, one sequence per
// block in turn).
// One block per head (Hopper only: wgmma + TMA; the AMD build and the
// shapes it does not take keep the two-product path of
// mla_decode/projections.py).
#pragma once

#include <cstdint>

#include "../../platform/bf16.h"
#include "../attention/plan.h"
#include "rope_append.h"

namespace mla {

// The operands by name: pointers, element strides and sizes. The op names them from its tensors, the decode step
// from its workspace and weights (QueryParams adds the append, the plan and the launch mode).
struct QueryOperands {
  const bf16_t* q_lora;  // [m, k], unit last stride
  int64_t q_lora_stride;
  const bf16_t* w_qu;    // [heads * (nope + rope), k], unit last stride
  int64_t w_qu_stride;
  const bf16_t* w_uk;    // [heads, nope, r], unit last stride
  int64_t w_uk_row_stride, w_uk_head_stride;
  bf16_t* q_abs;         // [heads, m, r], unit last stride
  int64_t qa_head_stride, qa_row_stride;
  bf16_t* q_pe;          // [m, heads, rope], unit last stride
  int64_t qp_row_stride, qp_head_stride;
  int m, k, heads, nope, rope, r;
};

struct QueryParams : QueryOperands {
  RopeAppendParams ra;  // append when ra.seqlens != nullptr (its q_pe and q_out fields unused: q_pe above is written)
  // With append, plan.plan != nullptr: every sequence's length is plan.fill_len (positions plan.fill_len - 1;
  // ra.seqlens is not read), and block 0 writes the lengths to plan.fill_lens and the attention's plan for
  // them (write_uniform_plan: plan.no_split, plan.max_parts == plan.bs == m) once kv_new has landed, in
  // place of a planner launch. The attention after this kernel reads both.
  PlanParams plan;
  bool pdl;  // launch as a programmatic dependent (the weights stream before the wait for q_lora)
};

// nullptr when the fused query takes these sizes (m rows of q_lora, k its
// width, heads of nope + rope columns, latent width r), else why not: the
// size rules alone, the same on every device and build (mla_decode's
// kernel_choice asks them).
const char* query_sm90_sizes(int m, int k, int heads, int nope, int rope, int r);
// nullptr when the Hopper kernel takes p (sizes, alignment, plan; else why not).
const char* query_sm90_check(const QueryParams& p);
// Launches p, which query_sm90_check must have accepted (the op checks once,
// to raise a ValueError, and launches); error string or nullptr.
const char* launch_query_sm90(const QueryParams& p, stream_t stream);

}  // namespace mla
