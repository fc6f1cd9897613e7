// The projection kernels' parameters built from tensors, for the ops and the
// decode step (ops_projections.cpp). Each builder checks its operands and
// raises (ValueError / TypeError) before anything is launched.
#pragma once

#include <torch/types.h>

#include "../kernels/projections/gemm.h"
#include "../kernels/projections/query.h"

namespace mla::api {

// One weight of a GEMM: w [n, k] or [batch, n, k] (unit last stride; `name`
// for the error) and its output rows at y, y_row_stride and y_batch_stride
// apart: the one place a segment is read off its weight tensor (the op
// below, the decode step's down projections).
GemmSeg gemm_seg(const at::Tensor& w, const char* name, bf16_t* y, int64_t y_row_stride, int64_t y_batch_stride);

// y0 = x w0^T (and y1 = x w1^T; row_pos1: the cache append's device-placed rows).
GemmParams gemm_params(const at::Tensor& x, const at::Tensor& w0, const at::Tensor& y0,
                       const c10::optional<at::Tensor>& w1, const c10::optional<at::Tensor>& y1,
                       const c10::optional<at::Tensor>& row_pos1, bool pdl);
// Plans p (gemm_sm90_config), takes its split-K workspace from the caching
// allocator and launches on the current stream; raises on failure.
void run_gemm(GemmParams p, const at::Tensor& x);

// The fused query's parameters from its operands (named by the caller: the op
// below from its tensors, the decode step from its workspace), the append
// (ra.seqlens null: none), the plan it writes (plan.plan null: none) and the
// launch mode: the one place QueryParams is put together.
QueryParams query_params(const QueryOperands& op, const RopeAppendParams& ra, const PlanParams& plan, bool pdl);

// The append's destination in rope_append's parameters (rope_append.h): the
// cache [bs, max_len, width] and the RoPE table [positions, rope], with the
// bounds a position is checked against (positions capped at int32). The
// caller has checked both tensors.
void set_append_target(RopeAppendParams& p, const at::Tensor& cache, const at::Tensor& rope_cs);

// The fused query (query.h); with kv_new, seqlens, rope_cs and cache also
// the cache append and the rotation of q_pe.
QueryParams query_params(const at::Tensor& q_lora, const at::Tensor& w_qu, const at::Tensor& w_uk,
                         const at::Tensor& q_abs, const at::Tensor& q_pe, bool pdl,
                         const c10::optional<at::Tensor>& kv_new, const c10::optional<at::Tensor>& seqlens,
                         const c10::optional<at::Tensor>& rope_cs, const c10::optional<at::Tensor>& cache,
                         const c10::optional<at::Tensor>& kpe_out);

}  // namespace mla::api
