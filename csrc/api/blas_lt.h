// The output stage's products on cuBLASLt, chosen per call (NVIDIA).
#pragma once

#include <torch/types.h>

namespace mla::api {

// y [m, n] = x [m, k] w [n, k]^T, bf16 with fp32 accumulation, on the
// current stream through cuBLASLt. False (nothing launched) where this build
// has no cuBLASLt (ROCm), cuBLASLt offers no kernel for the shapes, or an
// operand is less than 16-byte aligned: the caller then runs the product
// another way. The caller checks dtypes, shapes and unit last strides.
bool gemm_nt_lt(const at::Tensor& x, const at::Tensor& w, at::Tensor& y);

// cuBLASLt's scratch per product (bytes).
constexpr int64_t kLtScratchBytes = int64_t{4} << 20;

// The same for a strided batch, from pointers the caller has checked (the
// decode step's W_UV per head, and its wo with batch 1): y_b [m, n] = x_b
// [m, k] w_b [n, k]^T for b < batch, bf16, unit last strides, ld* row
// strides and s* batch strides in elements; on the current stream of
// `like`'s device, which must be the current device (the caller's guard),
// with `scratch` (kLtScratchBytes, 256-byte aligned, stream-ordered like the
// operands) or, if null, scratch allocated like `like`. False as above, and
// where a batch stride breaks the alignment.
bool gemm_nt_lt_batched(const void* x, int64_t ldx, int64_t sx, const void* w, int64_t ldw, int64_t sw, void* y,
                        int64_t ldy, int64_t sy, int64_t m, int64_t n, int64_t k, int64_t batch,
                        const at::Tensor& like, void* scratch);

}  // namespace mla::api
