// The projection kernels' parameters built from tensors, for the ops and the
// decode step (ops_projections.cpp). Each builder checks its operands and
// raises (ValueError / TypeError) before anything is launched.
#pragma once

#include <torch/types.h>

#include "../kernels/projections/gemm.h"
#include "../kernels/projections/query.h"

namespace mla::api {

// y0 = x w0^T (and y1 = x w1^T; row_pos1: the cache append's device-placed rows).
GemmParams gemm_params(const at::Tensor& x, const at::Tensor& w0, const at::Tensor& y0,
                       const c10::optional<at::Tensor>& w1, const c10::optional<at::Tensor>& y1,
                       const c10::optional<at::Tensor>& row_pos1, bool pdl);
// Plans p (gemm_sm90_config), takes its split-K workspace from the caching
// allocator and launches on the current stream; raises on failure.
void run_gemm(GemmParams p, const at::Tensor& x);

// The fused query (query.h); with kv_new, seqlens, rope_cs and cache also
// the cache append and the rotation of q_pe.
QueryParams query_params(const at::Tensor& q_lora, const at::Tensor& w_qu, const at::Tensor& w_uk,
                         const at::Tensor& q_abs, const at::Tensor& q_pe, bool pdl,
                         const c10::optional<at::Tensor>& kv_new, const c10::optional<at::Tensor>& seqlens,
                         const c10::optional<at::Tensor>& rope_cs, const c10::optional<at::Tensor>& cache,
                         const c10::optional<at::Tensor>& kpe_out);

}  // namespace mla::api
