// Torch glue of the combine op: merges the fp32 partials of splits given by
// the caller (the attention op launches the same kernel on its own partials).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>
#include <tuple>

#include "attention_internal.h"
#include "checks.h"
#include "ops.h"

namespace mla::api {

std::tuple<at::Tensor, at::Tensor> combine(const at::Tensor& o_part, const at::Tensor& lse_part) {
  if (!o_part.is_cuda()) fail_value("o_part must be on a GPU, got " + o_part.device().str());
  check_device(lse_part, "lse_part", o_part.device());
  check_dtype(o_part, "o_part", at::kFloat);
  check_dtype(lse_part, "lse_part", at::kFloat);
  check_shape(o_part, "o_part", {-1, -1, -1, -1, -1}, "[bs, num_splits, s_q, h_q, dv]");
  const int64_t bs = o_part.size(0), n = o_part.size(1), s_q = o_part.size(2), h_q = o_part.size(3);
  const int64_t dv = o_part.size(4);
  if (detail::shape_index(dv, 0) < 0) fail_value("o_part's last dimension (dv) must be 64, 128, 256 or 512, got " + shape_str(o_part));
  if (bs <= 0 || n <= 0 || s_q <= 0 || h_q <= 0) fail_value("o_part must be non-empty, got " + shape_str(o_part));
  check_shape(lse_part, "lse_part", {bs, n, s_q, h_q}, "[bs, num_splits, s_q, h_q] (matching o_part)");
  check_contiguous(o_part, "o_part");
  check_contiguous(lse_part, "lse_part");
  if (bs * n > INT32_MAX || s_q * h_q > INT32_MAX) fail("combine: sizes overflow int32");

  c10::cuda::CUDAGuard guard(o_part.device());
  auto i32 = o_part.options().dtype(at::kInt);
  at::Tensor seq_info = at::stack({at::full({bs}, n, i32), at::arange(bs, i32) * n}, 1).contiguous();
  at::Tensor out = at::empty({bs, s_q, h_q, dv}, o_part.options().dtype(at::kBFloat16));
  at::Tensor lse = at::empty({bs, h_q, s_q}, o_part.options());

  CombineParams cp{};
  cp.o_part = o_part.data_ptr<float>();
  cp.lse_part = lse_part.data_ptr<float>();
  cp.seq_info = seq_info.data_ptr<int32_t>();
  cp.skip_single_split = false;
  cp.o = reinterpret_cast<bf16_t*>(out.data_ptr());
  cp.lse = lse.data_ptr<float>();
  cp.bs = static_cast<int>(bs);
  cp.s_q = static_cast<int>(s_q);
  cp.h_q = static_cast<int>(h_q);
  cp.rows = static_cast<int>(s_q * h_q);
  cp.dv = static_cast<int>(dv);
  cp.f16 = false;
  check_launch(launch_combine(cp, at::cuda::getCurrentCUDAStream().stream()), "combine launch");
  return {out, lse};
}

}  // namespace mla::api
