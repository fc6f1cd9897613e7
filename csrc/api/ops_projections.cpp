// Torch glue of the projection stages' own kernel (rope_append): checks,
// launch, registration as torch.ops.mla_decode.rope_append. The products
// themselves are the vendor BLAS through PyTorch (mla_decode/projections.py).
#include <ATen/cuda/CUDAContext.h>
#include <algorithm>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../kernels/projections/rope_append.h"
#include "checks.h"
#include "ops.h"

namespace mla::api {

void rope_append(const at::Tensor& q_pe, const at::Tensor& kv_new, const at::Tensor& seqlens,
                 const at::Tensor& rope_cs, at::Tensor& q_out, at::Tensor& cache,
                 const c10::optional<at::Tensor>& kpe_out) {
  if (!q_pe.is_cuda()) fail_value("q_pe must be on a GPU, got " + q_pe.device().str());
  const at::Device dev = q_pe.device();
  check_device(kv_new, "kv_new", dev);
  check_device(seqlens, "seqlens", dev);
  check_device(rope_cs, "rope_cs", dev);
  check_device(q_out, "q_out", dev);
  check_device(cache, "cache", dev);
  check_dtype(q_pe, "q_pe", at::kBFloat16);
  check_dtype(kv_new, "kv_new", at::kBFloat16);
  check_dtype(seqlens, "seqlens", at::kInt);
  check_dtype(rope_cs, "rope_cs", at::kBFloat16);
  check_dtype(q_out, "q_out", at::kBFloat16);
  check_dtype(cache, "cache", at::kBFloat16);
  check_shape(q_pe, "q_pe", {-1, -1, -1}, "[bs, heads, rope]");
  const int64_t bs = q_pe.size(0), heads = q_pe.size(1), rope = q_pe.size(2);
  if (bs <= 0 || heads <= 0 || rope <= 0 || rope % 2)
    fail_value("q_pe must have shape [bs, heads, rope] with bs, heads > 0 and rope even and > 0, got " +
               shape_str(q_pe));
  check_shape(q_out, "q_out", {bs, heads, rope}, "[bs, heads, rope] (as q_pe)");
  check_shape(kv_new, "kv_new", {bs, -1}, "[bs, width]");
  const int64_t width = kv_new.size(1);
  check_shape(cache, "cache", {bs, -1, width}, "[bs, max_seq_len, width] (width as kv_new)");
  check_shape(seqlens, "seqlens", {bs}, "[bs]");
  check_contiguous(seqlens, "seqlens");
  check_shape(rope_cs, "rope_cs", {-1, rope}, "[positions, rope]");
  check_contiguous(rope_cs, "rope_cs");
  for (const at::Tensor* t : {&q_pe, static_cast<const at::Tensor*>(&q_out), &kv_new, static_cast<const at::Tensor*>(&cache)})
    if (t->numel() && t->stride(-1) != 1) fail_value("rope_append: every tensor must have a unit last stride");
  if (width <= 0 || cache.size(1) <= 0) fail_value("kv_new and cache must be non-empty, got " + shape_str(cache));
  if (rope_cs.size(0) < cache.size(1))
    fail_value("rope_cs must cover every cache position (" + num(cache.size(1)) + " rows), got " +
               shape_str(rope_cs));
  if (width < rope) fail_value("kv_new must be at least rope (" + num(rope) + ") wide, got " + shape_str(kv_new));
  if (kpe_out.has_value()) {
    check_device(*kpe_out, "kpe_out", dev);
    check_dtype(*kpe_out, "kpe_out", at::kBFloat16);
    check_shape(*kpe_out, "kpe_out", {bs, -1, rope}, "[bs, >= max_seq_len, rope]");
    check_last_dim_contiguous(*kpe_out, "kpe_out");
    if (kpe_out->size(1) < cache.size(1))
      fail_value("kpe_out must have a row for every cache position (" + num(cache.size(1)) + "), got " +
                 shape_str(*kpe_out));
  }
  if (cache.size(1) > INT32_MAX || heads * rope > INT32_MAX) fail("rope_append: sizes overflow int32");

  RopeAppendParams p{};
  p.q_pe = reinterpret_cast<const bf16_t*>(q_pe.data_ptr());
  p.q_b_stride = q_pe.stride(0);
  p.q_h_stride = q_pe.stride(1);
  p.q_out = reinterpret_cast<bf16_t*>(q_out.data_ptr());
  p.o_b_stride = q_out.stride(0);
  p.o_h_stride = q_out.stride(1);
  p.kv_new = reinterpret_cast<const bf16_t*>(kv_new.data_ptr());
  p.kv_b_stride = kv_new.stride(0);
  p.cache = reinterpret_cast<bf16_t*>(cache.data_ptr());
  p.c_b_stride = cache.stride(0);
  p.c_row_stride = cache.stride(1);
  p.kpe_out = kpe_out.has_value() ? reinterpret_cast<bf16_t*>(kpe_out->data_ptr()) : nullptr;
  p.k_b_stride = kpe_out.has_value() ? kpe_out->stride(0) : 0;
  p.k_row_stride = kpe_out.has_value() ? kpe_out->stride(1) : 0;
  p.seqlens = seqlens.data_ptr<int32_t>();
  p.rope_cs = reinterpret_cast<const bf16_t*>(rope_cs.data_ptr());
  p.bs = static_cast<int>(bs);
  p.heads = static_cast<int>(heads);
  p.rope = static_cast<int>(rope);
  p.width = static_cast<int>(width);
  p.max_len = static_cast<int>(cache.size(1));
  p.positions = static_cast<int>(std::min<int64_t>(rope_cs.size(0), INT32_MAX));
  c10::cuda::CUDAGuard guard(dev);
  check_launch(launch_rope_append(p, at::cuda::getCurrentCUDAStream().stream()), "rope_append launch");
}

}  // namespace mla::api

TORCH_LIBRARY_FRAGMENT(mla_decode, m) {
  m.def(
      "rope_append(Tensor q_pe, Tensor kv_new, Tensor seqlens, Tensor rope_cs, Tensor(a!) q_out, "
      "Tensor(b!) cache, Tensor(c!)? kpe_out=None) -> ()");
}

TORCH_LIBRARY_IMPL(mla_decode, CUDA, m) { m.impl("rope_append", &mla::api::rope_append); }
