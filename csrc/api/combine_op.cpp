// Torch glue of the combine op: merges the fp32 partials of splits given by
// the caller (the attention op launches the same kernel on its own partials);
// and of the merge op: N whole partial results (decode context parallelism).
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
  if (offset16(o_part) != 0)
    fail_value("o_part must start on a 16-byte boundary (the combine reads 16-byte pieces), got a view at byte offset " +
               num(offset16(o_part)) + " from 16-byte alignment");
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
  cp.max_warps = INT32_MAX;  // a warp per task: every sequence here is merged
  cp.wave_warps = at::cuda::getCurrentDeviceProperties()->multiProcessorCount * kCombineWarpsPerSm;
  check_launch(launch_combine(cp, at::cuda::getCurrentCUDAStream().stream()), "combine launch");
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> merge_states(const at::Tensor& outs, const at::Tensor& lses) {
  if (!outs.is_cuda()) fail_value("outs must be on a GPU, got " + outs.device().str());
  check_device(lses, "lses", outs.device());
  int type = -1;
  if (outs.scalar_type() == at::kBFloat16) type = 0;
  if (outs.scalar_type() == at::kHalf) type = 1;
  if (outs.scalar_type() == at::kFloat) type = 2;
  if (type < 0) fail_type("outs must be bfloat16, float16 or float32, got " + std::string(c10::toString(outs.scalar_type())));
  check_dtype(lses, "lses", at::kFloat);
  check_shape(outs, "outs", {-1, -1, -1, -1, -1}, "[N, b, s_q, h_q, dv]");
  const int64_t n = outs.size(0), bs = outs.size(1), s_q = outs.size(2), h_q = outs.size(3), dv = outs.size(4);
  if (n <= 0 || bs <= 0 || s_q <= 0 || h_q <= 0 || dv <= 0) fail_value("outs must be non-empty, got " + shape_str(outs));
  check_shape(lses, "lses", {n, bs, h_q, s_q}, "[N, b, h_q, s_q] (matching outs)");
  check_contiguous(outs, "outs");
  check_contiguous(lses, "lses");
  if (n * bs * s_q * h_q > INT32_MAX || n * bs * s_q * h_q * dv > (int64_t{1} << 40)) fail("merge_states: sizes overflow");

  c10::cuda::CUDAGuard guard(outs.device());
  at::Tensor out = at::empty({bs, s_q, h_q, dv}, outs.options());
  at::Tensor lse = at::empty({bs, h_q, s_q}, lses.options());
  MergeParams mp{};
  mp.outs = outs.data_ptr();
  mp.lses = lses.data_ptr<float>();
  mp.out = out.data_ptr();
  mp.lse = lse.data_ptr<float>();
  mp.n = static_cast<int>(n);
  mp.bs = static_cast<int>(bs);
  mp.s_q = static_cast<int>(s_q);
  mp.h_q = static_cast<int>(h_q);
  mp.dv = static_cast<int>(dv);
  mp.type = type;
  const int64_t piece = type == 2 ? 4 : 8;  // elements per 16 bytes
  mp.vec = dv % piece == 0 && reinterpret_cast<uintptr_t>(outs.data_ptr()) % 16 == 0 &&
           reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0;
  check_launch(launch_merge(mp, at::cuda::getCurrentCUDAStream().stream()), "merge_states launch");
  return {out, lse};
}

}  // namespace mla::api
