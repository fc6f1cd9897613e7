// Torch glue of the projection stages' own kernels: rope_append, the
// Hopper skinny GEMM (gemm_nt, gemm_nt_config) and the Hopper fused query
// (query_fused): checks, launch, registration
// as torch.ops.mla_decode.*. Which product runs on which GEMM is decided in
// mla_decode/kernel_choice.py.
#include <ATen/cuda/CUDAContext.h>
#include <algorithm>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../kernels/projections/gemm.h"
#include "../kernels/projections/query.h"
#include "../kernels/projections/rope_append.h"
#include "../kernels/projections/stream.h"
#include "checks.h"
#include "ops.h"
#include "projection_ops.h"

namespace mla::api {

namespace {

// rope_append's operands checked and described (rope_append.h): q_out [bs,
// heads, rope] the rotated destination; q_pe, where given, its un-rotated
// source of the same shape (the fused query has none: it rotates its
// accumulators). Raises before anything is written.
RopeAppendParams rope_append_params(const at::Tensor* q_pe, const at::Tensor& q_out, const at::Tensor& kv_new,
                                    const at::Tensor& seqlens, const at::Tensor& rope_cs, const at::Tensor& cache,
                                    const c10::optional<at::Tensor>& kpe_out) {
  if (!q_out.is_cuda()) fail_value("q_out must be on a GPU, got " + q_out.device().str());
  const at::Device dev = q_out.device();
  if (q_pe != nullptr) check_device(*q_pe, "q_pe", dev);
  check_device(kv_new, "kv_new", dev);
  check_device(seqlens, "seqlens", dev);
  check_device(rope_cs, "rope_cs", dev);
  check_device(cache, "cache", dev);
  if (q_pe != nullptr) check_dtype(*q_pe, "q_pe", at::kBFloat16);
  check_dtype(kv_new, "kv_new", at::kBFloat16);
  check_dtype(seqlens, "seqlens", at::kInt);
  check_dtype(rope_cs, "rope_cs", at::kBFloat16);
  check_dtype(q_out, "q_out", at::kBFloat16);
  check_dtype(cache, "cache", at::kBFloat16);
  check_shape(q_out, "q_out", {-1, -1, -1}, "[bs, heads, rope]");
  const int64_t bs = q_out.size(0), heads = q_out.size(1), rope = q_out.size(2);
  if (bs <= 0 || heads <= 0 || rope <= 0 || rope % 2)
    fail_value("q_out must have shape [bs, heads, rope] with bs, heads > 0 and rope even and > 0, got " +
               shape_str(q_out));
  if (q_pe != nullptr) check_shape(*q_pe, "q_pe", {bs, heads, rope}, "[bs, heads, rope] (as q_out)");
  check_shape(kv_new, "kv_new", {bs, -1}, "[bs, width]");
  const int64_t width = kv_new.size(1);
  check_shape(cache, "cache", {bs, -1, width}, "[bs, max_seq_len, width] (width as kv_new)");
  check_shape(seqlens, "seqlens", {bs}, "[bs]");
  check_contiguous(seqlens, "seqlens");
  check_shape(rope_cs, "rope_cs", {-1, rope}, "[positions, rope]");
  check_contiguous(rope_cs, "rope_cs");
  for (const at::Tensor* t : {q_pe, &q_out, &kv_new, &cache})
    if (t != nullptr && t->numel() && t->stride(-1) != 1)
      fail_value("rope_append: every tensor must have a unit last stride");
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
  if (q_pe != nullptr) {
    p.q_pe = reinterpret_cast<const bf16_t*>(q_pe->data_ptr());
    p.q_b_stride = q_pe->stride(0);
    p.q_h_stride = q_pe->stride(1);
  }
  p.q_out = reinterpret_cast<bf16_t*>(q_out.data_ptr());
  p.o_b_stride = q_out.stride(0);
  p.o_h_stride = q_out.stride(1);
  p.kv_new = reinterpret_cast<const bf16_t*>(kv_new.data_ptr());
  p.kv_b_stride = kv_new.stride(0);
  p.kpe_out = kpe_out.has_value() ? reinterpret_cast<bf16_t*>(kpe_out->data_ptr()) : nullptr;
  p.k_b_stride = kpe_out.has_value() ? kpe_out->stride(0) : 0;
  p.k_row_stride = kpe_out.has_value() ? kpe_out->stride(1) : 0;
  p.seqlens = seqlens.data_ptr<int32_t>();
  p.bs = static_cast<int>(bs);
  p.heads = static_cast<int>(heads);
  p.rope = static_cast<int>(rope);
  set_append_target(p, cache, rope_cs);
  return p;
}

}  // namespace

void set_append_target(RopeAppendParams& p, const at::Tensor& cache, const at::Tensor& rope_cs) {
  p.cache = reinterpret_cast<bf16_t*>(cache.data_ptr());
  p.c_b_stride = cache.stride(0);
  p.c_row_stride = cache.stride(1);
  p.width = static_cast<int>(cache.size(2));
  p.max_len = static_cast<int>(cache.size(1));
  p.rope_cs = reinterpret_cast<const bf16_t*>(rope_cs.data_ptr());
  p.positions = static_cast<int>(std::min<int64_t>(rope_cs.size(0), INT32_MAX));
}

QueryParams query_params(const QueryOperands& op, const RopeAppendParams& ra, const PlanParams& plan, bool pdl) {
  QueryParams p{};
  static_cast<QueryOperands&>(p) = op;
  p.ra = ra;
  p.plan = plan;
  p.pdl = pdl;
  return p;
}

void rope_append(const at::Tensor& q_pe, const at::Tensor& kv_new, const at::Tensor& seqlens,
                 const at::Tensor& rope_cs, at::Tensor& q_out, at::Tensor& cache,
                 const c10::optional<at::Tensor>& kpe_out) {
  if (!q_pe.is_cuda()) fail_value("q_pe must be on a GPU, got " + q_pe.device().str());
  check_device(q_out, "q_out", q_pe.device());
  const RopeAppendParams p = rope_append_params(&q_pe, q_out, kv_new, seqlens, rope_cs, cache, kpe_out);
  const at::Device dev = q_pe.device();
  c10::cuda::CUDAGuard guard(dev);
  check_launch(launch_rope_append(p, at::cuda::getCurrentCUDAStream().stream()), "rope_append launch");
}


namespace {

// [m, k] or [batch, m, k] (a 2-D tensor is batch 1) as (batch, rows, cols, row stride, batch stride).
struct Mat {
  int64_t batch, rows, cols, rs, bs;
};
Mat as_mat(const at::Tensor& t, const char* name) {
  if (t.dim() != 2 && t.dim() != 3) fail_value(std::string(name) + " must be 2-D or 3-D, got " + shape_str(t));
  check_last_dim_contiguous(t, name);
  if (t.dim() == 2) return {1, t.size(0), t.size(1), t.stride(0), 0};
  return {t.size(0), t.size(1), t.size(2), t.stride(1), t.stride(0)};
}

// A weight's segment from w already read as mw (gemm_params reads it once for its checks).
GemmSeg seg_of(const at::Tensor& w, const Mat& mw, bf16_t* y, int64_t y_row_stride, int64_t y_batch_stride) {
  GemmSeg s{};
  s.w = reinterpret_cast<const bf16_t*>(w.data_ptr());
  s.w_row_stride = mw.rs;
  s.w_batch_stride = mw.bs;
  s.n = static_cast<int>(mw.rows);
  s.y = y;
  s.y_row_stride = y_row_stride;
  s.y_batch_stride = y_batch_stride;
  return s;
}

}  // namespace

GemmSeg gemm_seg(const at::Tensor& w, const char* name, bf16_t* y, int64_t y_row_stride, int64_t y_batch_stride) {
  return seg_of(w, as_mat(w, name), y, y_row_stride, y_batch_stride);
}

GemmParams gemm_params(const at::Tensor& x, const at::Tensor& w0, const at::Tensor& y0,
                       const c10::optional<at::Tensor>& w1, const c10::optional<at::Tensor>& y1,
                       const c10::optional<at::Tensor>& row_pos1, bool pdl) {
  if (!x.is_cuda()) fail_value("x must be on a GPU, got " + x.device().str());
  const at::Device dev = x.device();
  if (w1.has_value() != y1.has_value()) fail_value("gemm_nt: w1 and y1 go together");
  if (row_pos1.has_value() && !w1.has_value()) fail_value("gemm_nt: row_pos1 needs w1 and y1");
  check_dtype(x, "x", at::kBFloat16);
  const Mat mx = as_mat(x, "x");
  // (the size rules are the kernel's own, gemm_sm90_sizes, asked at the end; this keeps the int casts exact)
  if (mx.rows > INT32_MAX || mx.cols > INT32_MAX || mx.batch > INT32_MAX)
    fail_value("gemm_nt: x's dimensions must fit int32, got " + shape_str(x));
  GemmParams p{};
  p.x = reinterpret_cast<const bf16_t*>(x.data_ptr());
  p.x_row_stride = mx.rs;
  p.x_batch_stride = mx.bs;
  p.m = static_cast<int>(mx.rows);
  p.k = static_cast<int>(mx.cols);
  p.batch = static_cast<int>(mx.batch);
  p.nseg = w1.has_value() ? 2 : 1;
  p.pdl = pdl;
  for (int i = 0; i < p.nseg; ++i) {
    const at::Tensor& w = i == 0 ? w0 : *w1;
    const at::Tensor& y = i == 0 ? y0 : *y1;
    const char* wn = i == 0 ? "w0" : "w1";
    const char* yn = i == 0 ? "y0" : "y1";
    check_device(w, wn, dev);
    check_device(y, yn, dev);
    check_dtype(w, wn, at::kBFloat16);
    check_dtype(y, yn, at::kBFloat16);
    const Mat mw = as_mat(w, wn);
    if (mw.rows > INT32_MAX) fail_value(std::string(wn) + "'s rows must fit int32, got " + shape_str(w));
    if (mw.cols != mx.cols || mw.batch != mx.batch || (w.dim() == 3) != (x.dim() == 3))
      fail_value(std::string(wn) + " must be [n, k] (or [batch, n, k] with x's batch) with x's k = " + num(mx.cols) +
                 ", got " + shape_str(w) + " for x " + shape_str(x));
    GemmSeg& s = p.seg[i];
    s = seg_of(w, mw, reinterpret_cast<bf16_t*>(y.data_ptr()), 0, 0);  // (y's strides below)
    if (i == 1 && row_pos1.has_value()) {
      const at::Tensor& rp = *row_pos1;
      check_device(rp, "row_pos1", dev);
      check_dtype(rp, "row_pos1", at::kInt);
      check_shape(rp, "row_pos1", {mx.rows}, "[m]");
      check_contiguous(rp, "row_pos1");
      if (x.dim() != 2) fail_value("gemm_nt: row_pos1 takes a 2-D x");
      check_shape(y, yn, {mx.rows, -1, mw.rows}, "[m, positions, n] (with row_pos1)");
      check_last_dim_contiguous(y, yn);
      s.y_row_stride = y.stride(0);
      s.y_pos_stride = y.stride(1);
      s.row_pos = rp.data_ptr<int32_t>();
      s.pos_limit = static_cast<int>(std::min<int64_t>(y.size(1), INT32_MAX));
    } else {
      const Mat my = as_mat(y, yn);
      if (my.batch != mx.batch || my.rows != mx.rows || my.cols != mw.rows || y.dim() != x.dim())
        fail_value(std::string(yn) + " must be [m, n] (or [batch, m, n]) = [" + num(mx.rows) + ", " + num(mw.rows) +
                   "], got " + shape_str(y));
      s.y_row_stride = my.rs;
      s.y_batch_stride = my.bs;
    }
  }
  if (const char* e = gemm_sm90_sizes(p.m, p.k, p.batch, p.nseg, p.seg[0].n, p.nseg > 1 ? p.seg[1].n : 0))
    fail_value(std::string(e) + "; got x " + shape_str(x) + ", w0 " + shape_str(w0) +
               (w1.has_value() ? ", w1 " + shape_str(*w1) : std::string()));
  return p;
}

void run_gemm(GemmParams p, const at::Tensor& x) {
  GemmConfig c{};
  check_launch(gemm_sm90_config(p, &c), "gemm_nt launch");  // (the launcher's own errors, raised as its launch's)
  at::Tensor ws;  // the split-K partials (L2-resident; from the caching allocator, stream-ordered)
  if (c.ws_bytes > 0) {
    ws = at::empty({(c.ws_bytes + 3) / 4}, x.options().dtype(at::kFloat));
    p.ws = ws.data_ptr<float>();
    p.ws_bytes = c.ws_bytes;
  }
  check_launch(launch_gemm_sm90(p, c, at::cuda::getCurrentCUDAStream().stream()), "gemm_nt launch");
}

void gemm_nt(const at::Tensor& x, const at::Tensor& w0, at::Tensor& y0, const c10::optional<at::Tensor>& w1,
             c10::optional<at::Tensor> y1, const c10::optional<at::Tensor>& row_pos1, bool pdl) {
  const GemmParams p = gemm_params(x, w0, y0, w1, y1, row_pos1, pdl);
  c10::cuda::CUDAGuard guard(x.device());
  run_gemm(p, x);
}

// The launcher's choice for these operands: [bn, bm, splits, stages, blocks, smem, group, workspace bytes], or a
// ValueError naming why the Hopper GEMM does not take them.
std::vector<int64_t> gemm_nt_config(const at::Tensor& x, const at::Tensor& w0, const at::Tensor& y0,
                                    const c10::optional<at::Tensor>& w1, const c10::optional<at::Tensor>& y1) {
  const GemmParams p = gemm_params(x, w0, y0, w1, y1, c10::nullopt, false);
  c10::cuda::CUDAGuard guard(x.device());
  GemmConfig c{};
  if (const char* e = gemm_sm90_config(p, &c)) fail_value(e);
  return {c.bn, c.bm, c.splits, c.stages, c.blocks, c.smem, c.group, c.ws_bytes};
}

// q_abs [heads, m, r] = (q_lora W_qu^T)[:, h, :nope] W_uk[h] and q_pe [m, heads, rope] = (q_lora W_qu^T)[:, h,
// nope:] in one launch (query.h). With kv_new, seqlens, rope_cs and cache (and optionally kpe_out), also
// rope_append's work in the same launch: q_pe is written rotated at position seqlens[b] - 1, the new cache rows
// (and their rotated k_pe) are written.
QueryParams query_params(const at::Tensor& q_lora, const at::Tensor& w_qu, const at::Tensor& w_uk,
                         const at::Tensor& q_abs, const at::Tensor& q_pe, bool pdl,
                         const c10::optional<at::Tensor>& kv_new, const c10::optional<at::Tensor>& seqlens,
                         const c10::optional<at::Tensor>& rope_cs, const c10::optional<at::Tensor>& cache,
                         const c10::optional<at::Tensor>& kpe_out) {
  if (!q_lora.is_cuda()) fail_value("q_lora must be on a GPU, got " + q_lora.device().str());
  const at::Device dev = q_lora.device();
  const std::pair<const at::Tensor*, const char*> ts[] = {
      {&q_lora, "q_lora"}, {&w_qu, "w_qu"}, {&w_uk, "w_uk"}, {&q_abs, "q_abs"}, {&q_pe, "q_pe"}};
  for (const auto& t : ts) {
    check_device(*t.first, t.second, dev);
    check_dtype(*t.first, t.second, at::kBFloat16);
    check_last_dim_contiguous(*t.first, t.second);
  }
  check_shape(q_lora, "q_lora", {-1, -1}, "[m, q_lora_rank]");
  check_shape(w_uk, "w_uk", {-1, -1, -1}, "[heads, nope, r]");
  const int64_t m = q_lora.size(0), k = q_lora.size(1);
  const int64_t heads = w_uk.size(0), nope = w_uk.size(1), r = w_uk.size(2);
  if (m < 1 || k < 1 || heads < 1 || nope < 1 || r < 1)
    fail_value("query_fused: empty operand: q_lora " + shape_str(q_lora) + ", w_uk " + shape_str(w_uk));
  check_shape(w_qu, "w_qu", {-1, k}, "[heads * (nope + rope), q_lora_rank]");
  if (w_qu.size(0) % heads != 0 || w_qu.size(0) / heads <= nope)
    fail_value("query_fused: w_qu must have heads * (nope + rope) rows with rope > 0 (heads " + num(heads) +
               ", nope " + num(nope) + "), got " + shape_str(w_qu));
  const int64_t rope = w_qu.size(0) / heads - nope;
  check_shape(q_abs, "q_abs", {heads, m, r}, "[heads, m, r]");
  check_shape(q_pe, "q_pe", {m, heads, rope}, "[m, heads, rope]");
  if (m > INT32_MAX || k > INT32_MAX || heads > INT32_MAX || r > INT32_MAX)
    fail_value("query_fused: sizes overflow int32");
  RopeAppendParams ra{};  // (none: ra.seqlens null)
  if (kv_new.has_value() || seqlens.has_value() || rope_cs.has_value() || cache.has_value() || kpe_out.has_value()) {
    if (!kv_new.has_value() || !seqlens.has_value() || !rope_cs.has_value() || !cache.has_value())
      fail_value("query_fused: the append takes kv_new, seqlens, rope_cs and cache together (kpe_out optional)");
    ra = rope_append_params(nullptr, q_pe, *kv_new, *seqlens, *rope_cs, *cache, kpe_out);
    if (reinterpret_cast<uintptr_t>(ra.rope_cs) % 4 != 0)
      fail_value("query_fused: rope_cs needs a 4-byte aligned base");
  }
  const QueryOperands op{.q_lora = reinterpret_cast<const bf16_t*>(q_lora.data_ptr()),
                         .q_lora_stride = q_lora.stride(0),
                         .w_qu = reinterpret_cast<const bf16_t*>(w_qu.data_ptr()),
                         .w_qu_stride = w_qu.stride(0),
                         .w_uk = reinterpret_cast<const bf16_t*>(w_uk.data_ptr()),
                         .w_uk_row_stride = w_uk.stride(1),
                         .w_uk_head_stride = w_uk.stride(0),
                         .q_abs = reinterpret_cast<bf16_t*>(q_abs.data_ptr()),
                         .qa_head_stride = q_abs.stride(0),
                         .qa_row_stride = q_abs.stride(1),
                         .q_pe = reinterpret_cast<bf16_t*>(q_pe.data_ptr()),
                         .qp_row_stride = q_pe.stride(0),
                         .qp_head_stride = q_pe.stride(1),
                         .m = static_cast<int>(m),
                         .k = static_cast<int>(k),
                         .heads = static_cast<int>(heads),
                         .nope = static_cast<int>(nope),
                         .rope = static_cast<int>(rope),
                         .r = static_cast<int>(r)};
  return query_params(op, ra, PlanParams{}, pdl);
}

void query_fused(const at::Tensor& q_lora, const at::Tensor& w_qu, const at::Tensor& w_uk, at::Tensor& q_abs,
                 at::Tensor& q_pe, bool pdl, const c10::optional<at::Tensor>& kv_new,
                 const c10::optional<at::Tensor>& seqlens, const c10::optional<at::Tensor>& rope_cs,
                 const c10::optional<at::Tensor>& cache, const c10::optional<at::Tensor>& kpe_out) {
  const QueryParams p = query_params(q_lora, w_qu, w_uk, q_abs, q_pe, pdl, kv_new, seqlens, rope_cs, cache, kpe_out);
  c10::cuda::CUDAGuard guard(q_lora.device());
  if (const char* e = query_sm90_check(p)) fail_value(e);
  check_launch(launch_query_sm90(p, at::cuda::getCurrentCUDAStream().stream()), "query_fused launch");
}

// The bare stream of t's bytes (stream.h): one read of them at the device's
// streaming rate, a full wave of blocks (the ceiling of a weight stage of
// the same bytes, benchmarks/bench_projections.py).
void stream_read(const at::Tensor& t) {
  if (!t.is_cuda()) fail_value("stream_read: t must be on a GPU, got " + t.device().str());
  check_contiguous(t, "t");
  const int64_t nbytes = static_cast<int64_t>(t.nbytes());
  if (nbytes == 0 || nbytes % 16 != 0 || offset16(t) != 0)
    fail_value("stream_read: t must be a non-empty whole number of 16-byte pieces from a 16-byte boundary, got " +
               num(nbytes) + " bytes at byte offset " + num(offset16(t)) + " from 16-byte alignment");
  c10::cuda::CUDAGuard guard(t.device());
  const auto* props = at::cuda::getCurrentDeviceProperties();
  const int blocks = props->multiProcessorCount * std::max(1, props->maxThreadsPerMultiProcessor / kStreamThreads);
  at::Tensor sink = at::empty({1}, t.options().dtype(at::kInt));
  StreamParams p{};
  p.src = t.data_ptr();
  p.n16 = nbytes / 16;
  p.sink = reinterpret_cast<uint32_t*>(sink.data_ptr());
  p.threads = static_cast<int64_t>(blocks) * kStreamThreads;
  check_launch(launch_stream_read(p, blocks, at::cuda::getCurrentCUDAStream().stream()), "stream_read launch");
}

}  // namespace mla::api

TORCH_LIBRARY_FRAGMENT(mla_decode, m) {
  m.def(
      "rope_append(Tensor q_pe, Tensor kv_new, Tensor seqlens, Tensor rope_cs, Tensor(a!) q_out, "
      "Tensor(b!) cache, Tensor(c!)? kpe_out=None) -> ()");
  m.def(
      "gemm_nt(Tensor x, Tensor w0, Tensor(a!) y0, Tensor? w1=None, Tensor(b!)? y1=None, Tensor? row_pos1=None, "
      "bool pdl=False) -> ()");
  m.def("gemm_nt_config(Tensor x, Tensor w0, Tensor y0, Tensor? w1=None, Tensor? y1=None) -> int[]");
  m.def(
      "query_fused(Tensor q_lora, Tensor w_qu, Tensor w_uk, Tensor(a!) q_abs, Tensor(b!) q_pe, bool pdl=False, "
      "Tensor? kv_new=None, Tensor? seqlens=None, Tensor? rope_cs=None, Tensor(c!)? cache=None, "
      "Tensor(d!)? kpe_out=None) -> ()");
  m.def("stream_read(Tensor t) -> ()");
}

TORCH_LIBRARY_IMPL(mla_decode, CUDA, m) {
  m.impl("rope_append", &mla::api::rope_append);
  m.impl("gemm_nt", &mla::api::gemm_nt);
  m.impl("gemm_nt_config", &mla::api::gemm_nt_config);
  m.impl("query_fused", &mla::api::query_fused);
  m.impl("stream_read", &mla::api::stream_read);
}
