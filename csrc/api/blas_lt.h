// The output projection's product on cuBLASLt, chosen per call (NVIDIA).
#pragma once

#include <torch/types.h>

namespace mla::api {

// y [m, n] = x [m, k] w [n, k]^T, bf16 with fp32 accumulation, on the
// current stream through cuBLASLt. False (nothing launched) where this build
// has no cuBLASLt (ROCm), cuBLASLt offers no kernel for the shapes, or an
// operand is less than 16-byte aligned: the caller then runs the product
// another way. The caller checks dtypes, shapes and unit last strides.
bool gemm_nt_lt(const at::Tensor& x, const at::Tensor& w, at::Tensor& y);

}  // namespace mla::api
