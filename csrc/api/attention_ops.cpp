// Torch glue of the attention op: its checks, its split plan (made here or
// passed in from the plan op), its workspaces and its launches (rope scores,
// attention, combine). No kernel code here.
//
// PyTorch's ROCm build keeps the at::cuda / c10::cuda names (HIP underneath),
// so this file serves both vendors unchanged.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <utility>

#include "../platform/switches.h"
#include "attention_internal.h"
#include "checks.h"
#include "ops.h"

namespace mla::api {

namespace detail {
bool capturing(stream_t stream) {
  bool c = false;
  check_launch(stream_capturing(stream, &c), "stream capture query");
  return c;
}
}  // namespace detail

using detail::AttnKernel;
using detail::capturing;
using detail::DeviceAttnInfo;
using detail::device_attn_info;
using detail::plan_parts;
using detail::shape_index;

namespace {

// The fp8 cache format the portable kernel reads: the platform's e4m3 (copy.h).
#if defined(USE_ROCM)
constexpr at::ScalarType kFp8Dtype = at::kFloat8_e4m3fnuz;
#else
constexpr at::ScalarType kFp8Dtype = at::kFloat8_e4m3fn;
#endif

// The scores' factor the kernels take: softmax_scale, times an fp8 cache's
// per-tensor scale, in log2 units, as float32 (checked as such, then passed).
float scores_factor_log2(double softmax_scale, double kv_scale) {
  return static_cast<float>(softmax_scale * kv_scale * 1.4426950408889634);
}

struct KvLayout {
  int64_t row_stride, page_stride, page_size, capacity, bt_stride;
};

// kv holds rows of `width` columns (the key: d, or dv with per-head rope keys).
KvLayout check_kv(const at::Tensor& kv, const c10::optional<at::Tensor>& block_table, int64_t bs,
                  const at::Device& dev, at::ScalarType dtype, int64_t width) {
  const std::string w = num(width);
  check_device(kv, "kv", dev);
  check_dtype(kv, dtype == kFp8Dtype ? "kv" : "kv (the same dtype as q, or the fp8 cache format)", dtype);
  check_last_dim_contiguous(kv, "kv");
  KvLayout l{};
  if (block_table.has_value()) {
    const auto& bt = *block_table;
    check_device(bt, "block_table", dev);
    check_dtype(bt, "block_table", at::kInt);
    check_last_dim_contiguous(bt, "block_table");
    check_shape(bt, "block_table", {bs, -1}, "[bs, max_blocks_per_seq]");
    if (!(kv.dim() == 3 || (kv.dim() == 4 && kv.size(2) == 1)) || kv.size(-1) != width)
      fail_value("paged kv must have shape [num_blocks, block_size, " + w + "] or [num_blocks, block_size, 1, " + w +
                 "], got " + shape_str(kv));
    l.page_stride = kv.stride(0);
    l.row_stride = kv.stride(1);
    l.page_size = kv.size(1);
    l.capacity = bt.size(1) * l.page_size;
    l.bt_stride = bt.stride(0);
  } else {
    check_shape(kv, "kv", {bs, -1, width}, ("[bs, max_seq_len, " + w + "]").c_str());
    l.page_stride = kv.stride(0);
    l.row_stride = kv.stride(1);
    l.page_size = kv.size(1);
    l.capacity = kv.size(1);
    l.bt_stride = 0;
  }
  if (l.page_size <= 0) fail_value("kv must hold at least one row per page, got " + shape_str(kv));
  check_rows_aligned(kv, "kv");
  return l;
}

struct Planned {
  at::Tensor plan;
  int64_t max_parts;
};

// The planner's parameters for bs sequences (plan.h), pointers unset, and
// the plan's size in int32 elements; nothing allocated or launched.
PlanParams plan_params(int64_t bs, int64_t s_q, int64_t h_q, int64_t capacity, const DeviceAttnInfo& info, bool split,
                       int64_t* plan_elems) {
  const auto [target_parts, max_parts] = plan_parts(bs, s_q, h_q, info, split);
  *plan_elems = plan_size(static_cast<int>(bs), static_cast<int>(max_parts));
  PlanParams pp{};
  pp.bs = static_cast<int>(bs);
  pp.max_parts = static_cast<int>(max_parts);
  pp.target_parts = static_cast<int>(target_parts);
  pp.tile = info.kernel.tile;
  pp.s_q = static_cast<int>(s_q);
  pp.max_len = static_cast<int>(capacity);
  pp.p0_only = switches().plan_p0 ? 1 : 0;
  pp.no_split = split ? 0 : 1;
  pp.tail_free = info.kernel.one_key_tail ? 1 : 0;
  return pp;
}

// A plan tensor for these lengths (plan.h) and the planner's parameters
// that fill it; nothing launched.
std::pair<at::Tensor, PlanParams> new_plan(const at::Tensor& seqlens, int64_t s_q, int64_t h_q, int64_t capacity,
                                           const DeviceAttnInfo& info, bool split) {
  int64_t elems = 0;
  PlanParams pp = plan_params(seqlens.size(0), s_q, h_q, capacity, info, split, &elems);
  at::Tensor plan = at::empty({elems}, seqlens.options().dtype(at::kInt));
  pp.seqlens = seqlens.data_ptr<int32_t>();
  pp.plan = plan.data_ptr<int32_t>();
  return {plan, pp};
}

// The split plan of one call (plan.h), computed on the device from the
// lengths: no host synchronisation, so it is captured with the call.
Planned make_plan(const at::Tensor& seqlens, int64_t s_q, int64_t h_q, int64_t capacity, const DeviceAttnInfo& info,
                  stream_t stream, bool split) {
  auto [plan, pp] = new_plan(seqlens, s_q, h_q, capacity, info, split);
  check_launch(launch_plan(pp, stream), "split planner launch");
  return {plan, pp.max_parts};
}

}  // namespace

at::Tensor plan(const at::Tensor& seqlens, int64_t s_q, int64_t h_q, int64_t capacity, bool split) {
  if (!seqlens.is_cuda()) fail_value("seqlens must be on a GPU, got " + seqlens.device().str());
  check_dtype(seqlens, "seqlens", at::kInt);
  check_contiguous(seqlens, "seqlens");
  if (seqlens.dim() != 1 || seqlens.size(0) <= 0) fail_value("seqlens must have shape [bs], bs >= 1, got " + shape_str(seqlens));
  if (s_q <= 0 || h_q <= 0 || capacity < 0)
    fail_value("plan: s_q and h_q must be positive and capacity non-negative, got s_q=" + num(s_q) + " h_q=" + num(h_q) +
               " capacity=" + num(capacity));
  c10::cuda::CUDAGuard guard(seqlens.device());
  const DeviceAttnInfo& info = device_attn_info(seqlens.device().index(), detail::kDv, detail::kRope, false, s_q * h_q);
  const stream_t stream = at::cuda::getCurrentCUDAStream().stream();
  // (the counter pool of the calls a graph will capture with this plan: looked up outside a capture)
  if (info.kind == AttnKernel::kHopper && !capturing(stream)) prepare_counter_pool(seqlens.device().index());
  return make_plan(seqlens, s_q, h_q, capacity, info, stream, split).plan;
}

PlanParams step_plan_params(int device, int64_t bs, int64_t h_q, int64_t capacity, bool split, int64_t* plan_elems) {
  return plan_params(bs, 1, h_q, capacity, device_attn_info(device, detail::kDv, detail::kRope, true, h_q), split,
                     plan_elems);
}

namespace {

// One attention call whose operands have passed the checks (attention_out_impl's, or the decode step's own):
// what enqueue_attention needs of them.
struct AttnCall {
  const at::Tensor& q;
  const at::Tensor& kv;
  const at::Tensor& seqlens;
  const c10::optional<at::Tensor>& block_table;
  const c10::optional<at::Tensor>& rope_cs;
  const c10::optional<at::Tensor>& kpe;
  const c10::optional<at::Tensor>& kpe_heads;
  const c10::optional<at::Tensor>& plan_in;
  at::Tensor& out;
  at::Tensor& lse;
  double softmax_scale;
  bool causal, split, plan_fresh, f16, per_head;
  int64_t bs, s_q, h_q, dv, rope, rope_in_key;
  KvLayout kl;
  bool fp8 = false;       // kv holds e4m3 values standing for value * kv_scale (the portable kernel's fp8 instance)
  double kv_scale = 1.0;  // fp8: the cache's per-tensor scale
};

void enqueue_attention(const AttnCall& c);

void attention_out_impl(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& seqlens,
                        const c10::optional<at::Tensor>& block_table, const c10::optional<at::Tensor>& rope_cs,
                        double softmax_scale, bool causal, at::Tensor& out, at::Tensor& lse,
                        const c10::optional<at::Tensor>& kpe, int64_t head_dim_v,
                        const c10::optional<at::Tensor>& kpe_heads, const c10::optional<at::Tensor>& plan_in,
                        bool split, bool plan_fresh, double kv_scale) {
  // device
  if (!q.is_cuda()) fail_value("q must be on a GPU, got " + q.device().str());
  const at::Device dev = q.device();
  check_device(seqlens, "seqlens", dev);
  check_device(out, "out", dev);
  check_device(lse, "lse", dev);
  // dtype: bf16 or fp16 (q, kv, kpe and out alike)
  const at::ScalarType elt = q.scalar_type();
  if (elt != at::kBFloat16 && elt != at::kHalf)
    fail_type("q must be torch.bfloat16 or torch.float16, got " + std::string(c10::toString(elt)));
  const bool f16 = elt == at::kHalf;
  check_dtype(seqlens, "seqlens", at::kInt);
  check_dtype(out, "out (the same dtype as q)", elt);
  check_dtype(lse, "lse", at::kFloat);
  // shape family: d = dv + rope; the rope keys in the latent row (shared by
  // all heads) or per head in kpe_heads (then kv rows are dv wide)
  check_shape(q, "q", {-1, -1, -1, -1}, "[bs, s_q, h_q, d]");
  const int64_t bs = q.size(0), s_q = q.size(1), h_q = q.size(2), d = q.size(3);
  const int64_t dv = head_dim_v, rope = d - dv;
  const bool per_head = kpe_heads.has_value();
  if (shape_index(dv, 0) < 0 || rope <= 0 || shape_index(dv, rope) < 0)
    fail_value("unsupported attention shape: q's head dim d=" + num(d) + " with head_dim_v=" + num(dv) +
               " (rope width d - dv = " + num(rope) + "); " + kAttnShapesSupported);
  const int64_t rope_in_key = per_head ? 0 : rope, key_width = per_head ? dv : d;
  if (bs <= 0 || s_q <= 0 || h_q <= 0) fail_value("q must have non-empty bs, s_q and h_q, got " + shape_str(q));
  check_last_dim_contiguous(q, "q");
  if (s_q != 1 && q.stride(1) != h_q * q.stride(2))
    fail_value("q must have its (s_q, h_q) dimensions laid out densely (stride(1) == h_q * stride(2)), got strides " +
               list_str(q.strides()));
  check_rows_aligned(q, "q");
  // an fp8 cache: the platform's e4m3 format, one scale for the whole cache (vLLM's layout)
  const bool fp8 = kv.scalar_type() == kFp8Dtype;
  if (!fp8 && (kv.scalar_type() == at::kFloat8_e4m3fn || kv.scalar_type() == at::kFloat8_e4m3fnuz ||
               kv.scalar_type() == at::kFloat8_e5m2 || kv.scalar_type() == at::kFloat8_e5m2fnuz))
    fail_type("an fp8 kv cache must be " + std::string(c10::toString(kFp8Dtype)) + " on this platform, got " +
              c10::toString(kv.scalar_type()));
  if (fp8) {
    if (f16) fail_type("an fp8 kv cache takes bf16 q, got float16");
    if (dv != detail::kDv || rope != detail::kRope || per_head || rope_cs.has_value() || kpe.has_value())
      fail_value(std::string("an fp8 kv cache: ") + kAttnFp8Supported +
                 ", the keys used as stored (no rope_cs, kpe or kpe_heads); got d=" + num(d) + ", head_dim_v=" +
                 num(dv));
    // (checked as the kernel takes it: float32, and folded into the scores' factor)
    const float o_scale = static_cast<float>(kv_scale);
    const float s_scale = scores_factor_log2(softmax_scale, kv_scale);
    if (!(o_scale > 0.f) || !std::isfinite(o_scale) || !std::isfinite(s_scale))
      fail_value("kv_scale must be a positive number that stays finite and nonzero in float32, also times "
                 "softmax_scale (the fp8 cache's per-tensor scale), got " + num(kv_scale));
  } else if (kv_scale != 1.0) {
    fail_value("kv_scale applies to an fp8 kv cache (" + std::string(c10::toString(kFp8Dtype)) + "); kv is " +
               c10::toString(kv.scalar_type()));
  }
  const KvLayout kl = check_kv(kv, block_table, bs, dev, fp8 ? kFp8Dtype : elt, key_width);
  check_shape(seqlens, "seqlens", {bs}, "[bs]");
  check_contiguous(seqlens, "seqlens");
  check_shape(out, "out", {bs, s_q, h_q, dv}, ("[bs, s_q, h_q, " + num(dv) + "]").c_str());
  check_contiguous(out, "out");
  if (offset16(out) != 0)
    fail_value("out must be 16-byte aligned (the kernels write whole 16-byte rows), got a view at byte offset " +
               num(offset16(out)) + " from 16-byte alignment");
  check_shape(lse, "lse", {bs, h_q, s_q}, "[bs, h_q, s_q]");
  check_contiguous(lse, "lse");
  if (per_head && (rope_cs.has_value() || kpe.has_value()))
    fail_value("with per-head rope keys (kpe_heads) the keys are used as stored: pass neither rope_cs nor kpe");
  if (rope_cs.has_value()) {
    if (f16) fail_type("rope_cs (the keys' RoPE on the fly) is implemented for bf16 only; q is float16");
    check_device(*rope_cs, "rope_cs", dev);
    check_dtype(*rope_cs, "rope_cs", at::kBFloat16);
    check_contiguous(*rope_cs, "rope_cs");
    check_shape(*rope_cs, "rope_cs", {-1, rope}, ("[positions, " + num(rope) + "]").c_str());
    if (rope_cs->size(0) < kl.capacity)
      fail_value("rope_cs must cover every cache position (" + num(kl.capacity) + " rows), got " +
                 shape_str(*rope_cs));
  }
  if (kpe.has_value()) {
    check_device(*kpe, "kpe", dev);
    check_dtype(*kpe, "kpe (the same dtype as q)", elt);
    check_last_dim_contiguous(*kpe, "kpe");
    if (block_table.has_value()) fail_value("kpe (separate rope keys) is not supported with a block table");
    check_shape(*kpe, "kpe", {bs, -1, rope}, ("[bs, >= max_seq_len, " + num(rope) + "]").c_str());
    if (kpe->size(1) < kl.capacity)
      fail_value("kpe must have a row for every cache position (" + num(kl.capacity) + "), got " + shape_str(*kpe));
    check_rows_aligned(*kpe, "kpe");
  }
  if (per_head) {
    const at::Tensor& kh = *kpe_heads;
    check_device(kh, "kpe_heads", dev);
    check_dtype(kh, "kpe_heads (the same dtype as q)", elt);
    check_last_dim_contiguous(kh, "kpe_heads");
    if (block_table.has_value())
      check_shape(kh, "kpe_heads", {kv.size(0), kl.page_size, h_q, rope},
                  ("[num_blocks, block_size, h_q, rope] = [" + num(kv.size(0)) + ", " + num(kl.page_size) + ", " +
                   num(h_q) + ", " + num(rope) + "] (the pages of kv)").c_str());
    else {
      check_shape(kh, "kpe_heads", {bs, -1, h_q, rope},
                  ("[bs, >= max_seq_len, h_q, rope] with h_q=" + num(h_q) + ", rope=" + num(rope)).c_str());
      if (kh.size(1) < kl.capacity)
        fail_value("kpe_heads must have a row for every cache position (" + num(kl.capacity) + "), got " +
                   shape_str(kh));
    }
    // the rope-score kernel reads 16-byte vectors of kpe_heads rows and of q's rope columns
    if (!rows_aligned16(kh)) fail_value("kpe_heads must be 16-byte aligned with strides that are multiples of 8, got strides " + list_str(kh.strides()));
    if (!rows_aligned16(q)) fail_value("q must be 16-byte aligned with strides that are multiples of 8 (per-head rope keys), got strides " + list_str(q.strides()));
  }
  if (!(softmax_scale > 0.0)) fail_value("softmax_scale must be positive, got " + num(softmax_scale));
  enqueue_attention({.q = q, .kv = kv, .seqlens = seqlens, .block_table = block_table, .rope_cs = rope_cs,
                     .kpe = kpe, .kpe_heads = kpe_heads, .plan_in = plan_in, .out = out, .lse = lse,
                     .softmax_scale = softmax_scale, .causal = causal, .split = split, .plan_fresh = plan_fresh,
                     .f16 = f16, .per_head = per_head, .bs = bs, .s_q = s_q, .h_q = h_q, .dv = dv, .rope = rope,
                     .rope_in_key = rope_in_key, .kl = kl, .fp8 = fp8, .kv_scale = kv_scale});
}

// The split plan (made here or passed in), the partials' workspaces, the launches: rope scores, attention, combine.
void enqueue_attention(const AttnCall& c) {
  const at::Tensor& q = c.q;
  const at::Tensor& kv = c.kv;
  const at::Tensor& seqlens = c.seqlens;
  const c10::optional<at::Tensor>& block_table = c.block_table;
  const c10::optional<at::Tensor>& rope_cs = c.rope_cs;
  const c10::optional<at::Tensor>& kpe = c.kpe;
  const c10::optional<at::Tensor>& kpe_heads = c.kpe_heads;
  const c10::optional<at::Tensor>& plan_in = c.plan_in;
  const bool split = c.split, per_head = c.per_head, f16 = c.f16;
  const int64_t bs = c.bs, s_q = c.s_q, h_q = c.h_q, dv = c.dv, rope = c.rope, rope_in_key = c.rope_in_key;
  const KvLayout& kl = c.kl;
  const at::Device dev = q.device();
  const int device = dev.index();
  c10::cuda::CUDAGuard guard(dev);
  const int64_t rows = s_q * h_q;
  // an fp8 cache the Hopper kernel's fp8 instances can read: by TMA (not switched off), dense or in pages of a
  // multiple of 64 rows, rows and pages 16-byte aligned; the portable kernel's fp8 instances read the others
  const bool fp8_tma = c.fp8 && switches().tma && (!block_table.has_value() || kl.page_size % 64 == 0) &&
                       kl.row_stride % 16 == 0 && kl.page_stride % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(kv.data_ptr()) % 16 == 0;
  const DeviceAttnInfo& info = device_attn_info(device, dv, rope_in_key, rope_cs.has_value(), rows, c.fp8, fp8_tma);
  auto stream = at::cuda::getCurrentCUDAStream(device).stream();
  // the split plan: made here (the planner launch), or passed in from the
  // plan op (planned beforehand, once for every call with these lengths)
  Planned pl;
  if (plan_in.has_value() && c.plan_fresh) {  // (the step's own, planned for this kernel)
    pl = {*plan_in, plan_parts(bs, s_q, h_q, info, split).second};
  } else if (plan_in.has_value()) {
    const at::Tensor& pt = *plan_in;
    const DeviceAttnInfo& pinfo = device_attn_info(device, detail::kDv, detail::kRope, false, rows);  // what the plan op plans with
    if (pinfo.kind != info.kind || pinfo.kernel.tile != info.kernel.tile ||
        pinfo.kernel.rows_per_block != info.kernel.rows_per_block ||
        pinfo.kernel.blocks_per_sm != info.kernel.blocks_per_sm)
      fail_value("plan: the plan op plans for the kernel of dv 512 with 64 rope columns in the key; this call "
                 "(dv=" + num(dv) + ", rope in key=" + num(rope_in_key) + ", rope_cs " +
                 (rope_cs.has_value() ? "given" : "none") + (c.fp8 ? ", an fp8 cache" : "") +
                 ") runs a kernel that splits the work differently (tile, rows per block or blocks per SM): pass no plan");
    check_device(pt, "plan", dev);
    check_dtype(pt, "plan", at::kInt);
    check_contiguous(pt, "plan");
    const int64_t parts = plan_parts(bs, s_q, h_q, info, split).second;
    const int64_t size = plan_size(static_cast<int>(bs), static_cast<int>(parts));
    check_shape(pt, "plan", {size},
                ("[" + num(size) + "] (plan(seqlens, s_q, h_q, capacity, split=" + (split ? "True" : "False") +
                 ") for this call: a plan made with the other split setting has the other size)")
                    .c_str());
    if (offset16(pt) != 0)
      fail_value("plan must be 16-byte aligned (the kernels read its parts as 16-byte vectors), got a view at byte "
                 "offset " + num(offset16(pt)) + " from 16-byte alignment");
    pl = {pt, parts};
  } else {
    pl = make_plan(seqlens, s_q, h_q, kl.capacity, info, stream, split);
  }
  const int64_t max_parts = pl.max_parts;
  at::Tensor plan = pl.plan;

  // fp32 partials of split sequences, merged by the combine launched after the
  // attention; a plan that splits nothing (split false) needs neither
  auto f32 = q.options().dtype(at::kFloat);
  at::Tensor o_part = split ? at::empty({max_parts, rows, dv}, f32) : at::Tensor();
  at::Tensor lse_part = split ? at::empty({max_parts, rows}, f32) : at::Tensor();

  // per-head rope keys: their scores first, [bs, rows, rs_stride] fp32 (the
  // attention reads whole key tiles of it, so rows reach a tile multiple)
  at::Tensor rope_scores;
  int64_t rs_stride = 0;
  if (per_head) {
    const int64_t tile = info.kernel.tile;
    rs_stride = std::max<int64_t>(tile, (kl.capacity + tile - 1) / tile * tile);
    rope_scores = at::empty({bs, rows, rs_stride}, f32);
    const at::Tensor& kh = *kpe_heads;
    RopeScoreParams rp{};
    rp.q = reinterpret_cast<const bf16_t*>(q.data_ptr());
    rp.kpe = reinterpret_cast<const bf16_t*>(kh.data_ptr());
    rp.block_table = block_table.has_value() ? block_table->data_ptr<int32_t>() : nullptr;
    rp.seqlens = seqlens.data_ptr<int32_t>();
    rp.out = rope_scores.data_ptr<float>();
    rp.q_row_stride = q.stride(2);
    rp.q_batch_stride = q.stride(0);
    rp.page_stride = kh.stride(0);
    rp.row_stride = kh.stride(1);
    rp.head_stride = kh.stride(2);
    rp.block_table_stride = kl.bt_stride;
    rp.num_pages = block_table.has_value() ? kh.size(0) : bs;
    rp.out_stride = rs_stride;
    rp.q_col0 = static_cast<int>(dv);
    rp.page_size = static_cast<int>(kl.page_size);
    rp.max_len = static_cast<int>(kl.capacity);
    rp.bs = static_cast<int>(bs);
    rp.s_q = static_cast<int>(s_q);
    rp.h_q = static_cast<int>(h_q);
    rp.rows = static_cast<int>(rows);
    rp.rope = static_cast<int>(rope);
    rp.f16 = f16;
    check_launch(launch_rope_scores(rp, stream), "rope score launch");
  }

  AttnParams ap{};
  ap.q = reinterpret_cast<const bf16_t*>(q.data_ptr());
  ap.kv = reinterpret_cast<const bf16_t*>(kv.data_ptr());
  ap.block_table = block_table.has_value() ? block_table->data_ptr<int32_t>() : nullptr;
  ap.seqlens = seqlens.data_ptr<int32_t>();
  ap.rope_cs = rope_cs.has_value() ? reinterpret_cast<const bf16_t*>(rope_cs->data_ptr()) : nullptr;
  ap.kpe = kpe.has_value() ? reinterpret_cast<const bf16_t*>(kpe->data_ptr()) : nullptr;
  ap.kpe_row_stride = kpe.has_value() ? kpe->stride(1) : 0;
  ap.kpe_rows = kpe.has_value() ? kpe->size(1) : 0;
  ap.num_pages = block_table.has_value() ? kv.size(0) : bs;
  ap.kpe_batch_stride = kpe.has_value() ? kpe->stride(0) : 0;
  ap.o = reinterpret_cast<bf16_t*>(c.out.data_ptr());
  ap.lse = c.lse.data_ptr<float>();
  ap.o_part = split ? o_part.data_ptr<float>() : nullptr;  // (no part of a no-split plan writes partials)
  ap.lse_part = split ? lse_part.data_ptr<float>() : nullptr;
  ap.plan = plan.data_ptr<int32_t>();
  // a plan made before this call: the lengths as they are now, and a work
  // counter of the call's own (the plan may serve calls on other streams at once)
  // (a captured call takes a pair that stays zeroed from replay to replay: no zeroing launch in the graph)
  at::Tensor counter;
  if (plan_in.has_value() && !c.plan_fresh) {
    ap.live_lens = true;
    if (info.kind == AttnKernel::kHopper) {
      const bool cap = capturing(stream);  // (asked only here: the step's plans are fresh)
      if (!cap) prepare_counter_pool(device);
      ap.counter = cap ? captured_counter_pair(device) : nullptr;
      if (ap.counter == nullptr) {
        counter = at::empty({2}, plan.options());
        ap.counter = counter.data_ptr<int32_t>();
        // (zeroed by a programmatic dependent: at::zeros's fill kernel held the attention's launch back)
        check_launch(launch_zero_pair(ap.counter, sm90_pdl_enabled(), stream), "work counter");
      }
    }
  }
  ap.q_row_stride = q.stride(2);
  ap.q_batch_stride = q.stride(0);
  ap.kv_row_stride = kl.row_stride;
  ap.kv_page_stride = kl.page_stride;
  ap.block_table_stride = kl.bt_stride;
  ap.page_size = static_cast<int>(kl.page_size);
  ap.page_div = make_page_div(ap.page_size);
  ap.max_len = static_cast<int>(kl.capacity);
  ap.bs = static_cast<int>(bs);
  ap.s_q = static_cast<int>(s_q);
  ap.h_q = static_cast<int>(h_q);
  ap.rows = static_cast<int>(rows);
  ap.max_parts = static_cast<int>(max_parts);
  ap.ctas = info.sm_count * info.kernel.blocks_per_sm;
  ap.rope_scores = per_head ? rope_scores.data_ptr<float>() : nullptr;
  ap.rs_stride = rs_stride;
  ap.dv = static_cast<int>(dv);
  ap.rope = static_cast<int>(rope_in_key);
  ap.scale_log2 = scores_factor_log2(c.softmax_scale, c.fp8 ? c.kv_scale : 1.0);
  ap.kv_fp8 = c.fp8;
  ap.o_scale = static_cast<float>(c.fp8 ? c.kv_scale : 1.0);
  ap.causal = c.causal && s_q > 1;
  ap.f16 = f16;
  check_launch(info.kind == AttnKernel::kHopper ? launch_attention_sm90(ap, stream)
                                                : launch_attention_portable(ap, info.kernel.rows_per_block, stream),
               "attention launch");

  if (!split) return;  // every sequence was one part: the attention wrote out and lse itself

  CombineParams cp{};
  cp.o_part = ap.o_part;
  cp.lse_part = ap.lse_part;
  cp.seq_info = ap.plan + kPlanSeqBase;
  cp.skip_single_split = true;
  cp.o = ap.o;
  cp.lse = ap.lse;
  cp.bs = ap.bs;
  cp.s_q = ap.s_q;
  cp.h_q = ap.h_q;
  cp.rows = ap.rows;
  cp.dv = static_cast<int>(dv);
  cp.f16 = f16;
  cp.pdl = info.kind == AttnKernel::kHopper && sm90_pdl_enabled();
  cp.max_warps = info.sm_count * kCombineWarpsPerSm;
  cp.wave_warps = cp.max_warps;
  check_launch(launch_combine(cp, stream), "combine launch");
}

}  // namespace

void attention_out(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& seqlens,
                   const c10::optional<at::Tensor>& block_table, const c10::optional<at::Tensor>& rope_cs,
                   double softmax_scale, bool causal, at::Tensor& out, at::Tensor& lse,
                   const c10::optional<at::Tensor>& kpe, int64_t head_dim_v,
                   const c10::optional<at::Tensor>& kpe_heads, const c10::optional<at::Tensor>& plan,
                   bool split, double kv_scale) {
  attention_out_impl(q, kv, seqlens, block_table, rope_cs, softmax_scale, causal, out, lse, kpe, head_dim_v,
                     kpe_heads, plan, split, false, kv_scale);
}

void attention_step(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& seqlens, const at::Tensor& rope_cs,
                    double softmax_scale, at::Tensor& out, at::Tensor& lse, int64_t head_dim_v, const at::Tensor& plan,
                    bool split) {
  const c10::optional<at::Tensor> none, cs = rope_cs, pl = plan;
  const int64_t bs = q.size(0), h_q = q.size(2), rope = q.size(3) - head_dim_v;
  const KvLayout kl{kv.stride(1), kv.stride(0), kv.size(1), kv.size(1), 0};
  enqueue_attention({.q = q, .kv = kv, .seqlens = seqlens, .block_table = none, .rope_cs = cs, .kpe = none,
                     .kpe_heads = none, .plan_in = pl, .out = out, .lse = lse, .softmax_scale = softmax_scale,
                     .causal = false, .split = split, .plan_fresh = true, .f16 = false, .per_head = false, .bs = bs,
                     .s_q = 1, .h_q = h_q, .dv = head_dim_v, .rope = rope, .rope_in_key = rope, .kl = kl});
}

std::tuple<at::Tensor, at::Tensor> attention(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& seqlens,
                                             const c10::optional<at::Tensor>& block_table,
                                             const c10::optional<at::Tensor>& rope_cs, double softmax_scale,
                                             bool causal, const c10::optional<at::Tensor>& kpe, int64_t head_dim_v,
                                             const c10::optional<at::Tensor>& kpe_heads,
                                             const c10::optional<at::Tensor>& plan, bool split, double kv_scale) {
  if (q.dim() != 4) fail_value("q must have shape [bs, s_q, h_q, d], got " + shape_str(q));
  if (shape_index(head_dim_v, 0) < 0)
    fail_value("unsupported head_dim_v=" + num(head_dim_v) + "; " + kAttnShapesSupported);
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2), head_dim_v}, q.options());
  at::Tensor lse = at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(at::kFloat));
  attention_out(q, kv, seqlens, block_table, rope_cs, softmax_scale, causal, out, lse, kpe, head_dim_v, kpe_heads,
                plan, split, kv_scale);
  return {out, lse};
}

}  // namespace mla::api
