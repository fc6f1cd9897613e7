// One decode step of the layer (custom_kernel's kernel path), checked and
// enqueued from C++ in one call: down-projection, query (with its RoPE and
// the cache append), attention over the cache with the keys' RoPE on the
// fly, W_UV, wo. A call whose operands (addresses and layouts) repeat the
// previous call's replays the step's captured graph (step_graph.h); every
// call, replayed or not, reads the weights, x and the whole cache where they
// lie, so weights updated in place and caches written by anything else are
// read as they are now. Which kernel runs each product is the caller's
// choice (mla_decode/kernel_choice.py, `want`), taken where the operands
// allow it; the return value says what ran.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/TensorImpl.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <climits>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "blas_lt.h"
#include "checks.h"
#include "ops.h"
#include "../kernels/attention/attention.h"
#include "../kernels/attention/plan.h"
#include "../kernels/projections/gemm.h"
#include "../kernels/projections/query.h"
#include "projection_ops.h"
#include "step_graph.h"

namespace mla::api {
namespace {

void check_input(const at::Tensor& t, const char* name, const at::Device& dev, c10::IntArrayRef shape,
                 const char* shape_text, bool contiguous) {
  if (t.device() != dev) fail_value(std::string(name) + " must be on " + dev.str() + " (where x is), got " + t.device().str());
  check_dtype(t, name, at::kBFloat16);
  bool ok = t.dim() == static_cast<int64_t>(shape.size());
  for (size_t i = 0; ok && i < shape.size(); ++i) ok = t.size(i) == shape[i];
  if (!ok)
    fail_value(std::string(name) + " must have shape " + shape_text + " = " + list_str(shape) + ", got " + shape_str(t));
  if (contiguous) {
    if (!t.is_contiguous()) fail_value(std::string(name) + " must be contiguous, got strides " + list_str(t.strides()));
  } else {
    check_last_dim_contiguous(t, name);
  }
}

// A tensor on `base`'s storage, `byte_off` bytes from base's first element,
// with these sizes, strides and dtype, made directly (no dispatcher, no
// allocator): a view, as narrow/view/transpose would make it, for the cost
// of one TensorImpl. The step's eager calls made a dozen views and
// allocations before the attention's launch, each costly when the host
// runs cold (the task's fresh-input calls; docs/decode_step.md).
at::Tensor carve(const at::Tensor& base, int64_t byte_off, c10::IntArrayRef sizes, c10::IntArrayRef strides,
                 at::ScalarType dt) {
  const int64_t item = static_cast<int64_t>(c10::elementSize(dt));
  const int64_t off = base.storage_offset() * static_cast<int64_t>(base.element_size()) + byte_off;
  TORCH_INTERNAL_ASSERT(off % item == 0, "carve: misaligned view");
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(base.storage()), base.key_set(),
                                                          c10::scalarTypeToTypeMeta(dt));
  t.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides, off / item);
  return t;
}

// Byte offsets of the step's intermediates in its one workspace (256-byte
// aligned slots).
struct Slots {
  int64_t bytes = 0;
  int64_t add(int64_t n) {
    const int64_t at = bytes;
    bytes += (n + 255) / 256 * 256;
    return at;
  }
};

// obuf[b, h, :] = o_lat[b, h, :] W_UV[h] for every head (the slots of `ws`
// at byte offsets s_olat, s_obuf; W_UV[h] = w_kvu[h, nope:, :] transposed):
// with `lt`, one strided-batched cuBLASLt product from our plan cache (as
// wo's; its scratch the slot at s_lt), else, or where cuBLASLt declines, and
// on AMD, at::bmm_out.
void w_uv(const at::Tensor& ws, int64_t s_olat, int64_t s_obuf, int64_t s_lt, const at::Tensor& w_kvu, int64_t bs,
          int64_t H, int64_t r, int64_t nope, int64_t v, bool lt) {
  auto* base = static_cast<uint8_t*>(ws.data_ptr());
  if (lt && gemm_nt_lt_batched(base + s_olat, H * r, r, static_cast<const uint8_t*>(w_kvu.data_ptr()) + nope * r * 2,
                               r, (nope + v) * r, base + s_obuf, H * v, v, bs, v, r, H, ws, base + s_lt))
    return;
  at::Tensor obuf_t = carve(ws, s_obuf, {H, bs, v}, {v, H * v, 1}, at::kBFloat16);
  at::bmm_out(obuf_t, carve(ws, s_olat, {H, bs, r}, {r, H * r, 1}, at::kBFloat16),
              carve(w_kvu, nope * r * 2, {H, r, v}, {(nope + v) * r, 1, r}, at::kBFloat16));
}

// The layer's sizes as the step takes them: cfg = [dim, heads, q_lora,
// kv_lora, nope, rope, v], the order of mla_decode.validate.CONFIG_DIMS.
// The one place that knows the order.
struct StepDims {
  int64_t dim, heads, q_lora, kv_lora, nope, rope, v;
};

StepDims step_dims(c10::ArrayRef<int64_t> cfg) {
  if (cfg.size() != 7) fail_value("decode_step: cfg must be [dim, heads, q_lora, kv_lora, nope, rope, v]");
  return {cfg[0], cfg[1], cfg[2], cfg[3], cfg[4], cfg[5], cfg[6]};
}

// What a step's sizes alone decide (the device, the layer's sizes, the
// batch, the cache's capacity and the wished paths), worked out at a shape's
// first call and looked up by the later ones in one search: whether the
// attention splits sequences, the planner's parameters and the plan's size,
// the down GEMM's configuration, the workspace's slots (byte offsets,
// 256-byte aligned). Each part is what the lookups it replaces give for
// these sizes on this device, which never changes in a process.
struct StepShape {
  int device = -1;
  int64_t bs = 0, max_len = 0, want = 0;
  std::array<int64_t, 7> cfg{};
  bool split = false;
  PlanParams pp{};
  int64_t plan_elems = 0;
  bool down_ok = false;  // our GEMM takes the down stage at these sizes (alignment is the call's to check)
  GemmConfig down{};
  int64_t s_down = 0, s_lens = 0, s_plan = 0, s_qlora = 0, s_kvnew = 0, s_q = 0, s_olat = 0, s_lse = 0, s_obuf = 0,
          s_lt = 0, bytes = 0;
};

StepShape make_step_shape(int device, int64_t bs, int64_t max_len, c10::ArrayRef<int64_t> cfg, int64_t want) {
  StepShape s;
  s.device = device;
  s.bs = bs;
  s.max_len = max_len;
  s.want = want;
  std::copy(cfg.begin(), cfg.end(), s.cfg.begin());
  const StepDims sizes = step_dims(cfg);
  const int64_t dim = sizes.dim, H = sizes.heads, q_lora = sizes.q_lora, r = sizes.kv_lora, rope = sizes.rope,
                v = sizes.v, d = r + rope;
  s.split = splits_possible(device, bs, 1, H);  // (else one part per sequence, and no combine)
  s.pp = step_plan_params(device, bs, H, max_len, s.split, &s.plan_elems);
  s.down_ok = (want & kStepDownOwn) && bs <= 256 &&
              gemm_sm90_config_for(static_cast<int>(bs), static_cast<int>(dim), 1, static_cast<int>(q_lora),
                                   static_cast<int>(d), &s.down) == nullptr;
  Slots sl;
  s.s_down = sl.add(s.down_ok ? s.down.ws_bytes : 0);
  s.s_lens = sl.add(bs * 4);
  s.s_plan = sl.add(s.plan_elems * 4);
  s.s_qlora = sl.add(bs * q_lora * 2);
  s.s_kvnew = sl.add(bs * d * 2);
  s.s_q = sl.add(H * bs * d * 2);
  s.s_olat = sl.add(bs * H * r * 2);
  s.s_lse = sl.add(bs * H * 4);
  s.s_obuf = sl.add(bs * H * v * 2);
  s.s_lt = sl.add((want & kStepWoLt) ? kLtScratchBytes : 0);  // (cuBLASLt's, for W_UV and then wo)
  s.bytes = sl.bytes;
  return s;
}

StepShape step_shape(int device, int64_t bs, int64_t max_len, c10::ArrayRef<int64_t> cfg, int64_t want) {
  static std::mutex mu;
  // never destroyed (nothing of it needs a destructor at exit); a process
  // runs few shapes, so a short list searched in order
  static std::vector<StepShape>& shapes = *new std::vector<StepShape>();
  constexpr size_t kShapes = 16;
  const auto same = [&](const StepShape& s) {
    return s.device == device && s.bs == bs && s.max_len == max_len && s.want == want &&
           std::equal(cfg.begin(), cfg.end(), s.cfg.begin());
  };
  {
    std::lock_guard<std::mutex> lock(mu);
    for (const StepShape& s : shapes)
      if (same(s)) return s;
  }
  StepShape s = make_step_shape(device, bs, max_len, cfg, want);
  std::lock_guard<std::mutex> lock(mu);
  if (shapes.size() >= kShapes) shapes.erase(shapes.begin());
  shapes.push_back(s);
  return s;
}

// The eager steps' workspaces, one per device and stream (at most
// kWorkspaces per device, that device's least recently used first to go, so
// that a process driving several GPUs keeps one on each): an eager call takes its
// stream's, made once, instead of a new allocation (on a host whose caches
// are cold, as in the task's fresh-input calls, the caching allocator's path
// delays the first launch). Every use of one is
// on its stream, so the stream orders one call's kernels after the last's;
// its lock is held while a call enqueues, so that two threads on one stream
// do not interleave their launches over it (a thread that finds it held
// takes a new allocation instead; calls from Python hold the GIL while they
// enqueue, so this guards callers from C++). Calls made while the stream captures take
// a new allocation (from the graph's pool), as before.
struct StepWorkspace {
  int device = -1;
  stream_t stream{};
  at::Tensor ws;
  std::unique_ptr<std::mutex> busy = std::make_unique<std::mutex>();
  uint64_t used = 0;
};
constexpr size_t kWorkspaces = 4;
std::mutex workspaces_mu;
// never destroyed (tensors freed at exit would call into a torn-down runtime)
std::vector<StepWorkspace>& workspaces = *new std::vector<StepWorkspace>();

struct WorkspaceLease {
  at::Tensor ws;
  std::unique_lock<std::mutex> hold;  // (empty for a new allocation)
};

WorkspaceLease step_workspace(int device, stream_t stream, int64_t bytes, const at::TensorOptions& opt, bool capturing) {
  const auto fresh = [&] { return WorkspaceLease{at::empty({bytes}, opt), {}}; };
  if (capturing) return fresh();
  static uint64_t tick = 0;
  std::lock_guard<std::mutex> lock(workspaces_mu);
  StepWorkspace* e = nullptr;
  for (StepWorkspace& w : workspaces)
    if (w.device == device && w.stream == stream) e = &w;
  if (e == nullptr) {
    size_t on_device = 0;
    for (const StepWorkspace& w : workspaces) on_device += w.device == device ? 1 : 0;
    if (on_device >= kWorkspaces) {  // this device's least recently used one not in use goes
      auto old = workspaces.end();
      for (auto it = workspaces.begin(); it != workspaces.end(); ++it) {
        if (it->device != device) continue;
        std::unique_lock<std::mutex> probe(*it->busy, std::try_to_lock);
        if (probe.owns_lock() && (old == workspaces.end() || it->used < old->used)) old = it;
      }
      if (old == workspaces.end()) return fresh();
      workspaces.erase(old);  // (its memory was used on its stream alone: the allocator may reuse it there)
    }
    workspaces.emplace_back();
    e = &workspaces.back();
    e->device = device;
    e->stream = stream;
  }
  std::unique_lock<std::mutex> hold(*e->busy, std::try_to_lock);
  if (!hold.owns_lock()) return fresh();
  if (!e->ws.defined() || e->ws.numel() < bytes) {
    e->ws = at::Tensor();  // (stream-ordered: its last use was on this stream)
    e->ws = at::empty({bytes}, opt);
  }
  e->used = ++tick;
  return WorkspaceLease{e->ws, std::move(hold)};
}

// t's first element (plus `off` bytes) as a T*.
template <typename T>
T* ptr_of(const at::Tensor& t, int64_t off = 0) {
  return reinterpret_cast<T*>(static_cast<uint8_t*>(t.data_ptr()) + off);
}

// The stages on the current stream. The operands were checked by
// decode_step_keyed (devices, dtypes, shapes, contiguity, the cache's
// 16-byte rows), so the kernels' parameters are made here directly from
// them and from the workspace's slots, without the ops' checks again (each
// costly on a host whose caches are cold, as they are in the task's
// fresh-input calls); what depends on addresses (the 16-byte
// alignment our GEMM and fused query need of the weights) is checked per
// call, and a product they do not take goes to the vendor BLAS. Every
// intermediate is a slot of one workspace, the stream's kept one
// (step_workspace) or, while the stream captures, one from the caching
// allocator (the graph's pool), y a tensor of its own. `capturing`: whether the stream
// captures (the caller's graph, or the step's own capture).
StepOut enqueue_step(const at::Tensor& x, const at::Tensor& w_qd, const at::Tensor& w_kvd, const at::Tensor& w_qu,
                     const at::Tensor& w_kvu, const at::Tensor& w_o, const at::Tensor& cache, const at::Tensor& rope_cs,
                     c10::ArrayRef<int64_t> cfg, int64_t pos, int64_t want, int32_t* len_slot, bool capturing) {
  step_mark("enqueue");
  const StepDims sizes = step_dims(cfg);
  const int64_t dim = sizes.dim, H = sizes.heads, q_lora = sizes.q_lora, r = sizes.kv_lora, nope = sizes.nope,
                rope = sizes.rope, v = sizes.v;
  const int64_t bs = x.size(0), d = r + rope, max_len = cache.size(1);
  const int device = x.get_device();
  constexpr auto bf16 = at::kBFloat16;
  const stream_t stream = at::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  const StepShape sh = step_shape(device, bs, max_len, cfg, want);

  // ---- the workspace: every sequence's length and the attention's split
  // plan, q_lora and the new latent row, the query, the attention's output
  // and LSE, the per-head W_UV output (and the down GEMM's split-K partials)
  const WorkspaceLease lease = step_workspace(device, stream, sh.bytes, x.options().dtype(at::kByte), capturing);
  const at::Tensor& ws = lease.ws;
  step_mark("workspace");
  PlanParams pp = sh.pp;
  pp.seqlens = pp.fill_lens = ptr_of<int32_t>(ws, sh.s_lens);
  pp.plan = ptr_of<int32_t>(ws, sh.s_plan);
  pp.fill_len = static_cast<int32_t>(pos + 1);  // (a captured step reads it from *len_slot)
  pp.len_slot = len_slot;
  const at::Tensor seqlens = carve(ws, sh.s_lens, {bs}, {1}, at::kInt);
  bf16_t* const q_lora_p = ptr_of<bf16_t>(ws, sh.s_qlora);
  bf16_t* const kv_new_p = ptr_of<bf16_t>(ws, sh.s_kvnew);

  // the fused query's parameters, made before any launch: whether it takes
  // the call decides who makes the attention's lengths and plan
  RopeAppendParams ra{};  // the append (q_pe rotated as it is stored: ra's q_pe / q_out unused)
  ra.kv_new = kv_new_p;
  ra.kv_b_stride = d;
  ra.seqlens = pp.seqlens;
  ra.bs = static_cast<int>(bs);
  ra.heads = static_cast<int>(H);
  ra.rope = static_cast<int>(rope);
  set_append_target(ra, cache, rope_cs);
  // A batch that is not split, at a length known here (not a captured
  // step's, which the planner reads and advances on the device): the fused
  // query writes the lengths and the one-part-per-sequence plan itself, so no
  // planner launch comes before the down GEMM (a launch less on the host's
  // path to the attention in every fresh-input call)
  const bool plan_wished = (want & kStepQueryFused) && !sh.split && len_slot == nullptr;
  // (the query's [H, bs, d] rows: q_abs the first r columns, q_pe the rope columns after them; W_UK[h] = w_kvu
  // rows h * (nope + v) ... + nope)
  const QueryParams qp = query_params({.q_lora = q_lora_p,
                                       .q_lora_stride = q_lora,
                                       .w_qu = ptr_of<const bf16_t>(w_qu),
                                       .w_qu_stride = q_lora,
                                       .w_uk = ptr_of<const bf16_t>(w_kvu),
                                       .w_uk_row_stride = r,
                                       .w_uk_head_stride = (nope + v) * r,
                                       .q_abs = ptr_of<bf16_t>(ws, sh.s_q),
                                       .qa_head_stride = bs * d,
                                       .qa_row_stride = d,
                                       .q_pe = ptr_of<bf16_t>(ws, sh.s_q + r * 2),
                                       .qp_row_stride = d,
                                       .qp_head_stride = bs * d,
                                       .m = static_cast<int>(bs),
                                       .k = static_cast<int>(q_lora),
                                       .heads = static_cast<int>(H),
                                       .nope = static_cast<int>(nope),
                                       .rope = static_cast<int>(rope),
                                       .r = static_cast<int>(r)},
                                      ra, plan_wished ? pp : PlanParams{}, true);
  const bool query_ok = (want & kStepQueryFused) && query_sm90_check(qp) == nullptr;
  const bool plan_in_query = plan_wished && query_ok;
  if (!plan_in_query) {
    check_launch(launch_plan(pp, stream), "decode step lengths and plan");
    step_mark("plan");
  }

  // ---- 1-2. down-projections: q_lora and the new latent row (the host
  // prepares the rest while they run)
  int64_t ran = 0;
  bool own_down = false;
  if (sh.down_ok) {
    GemmParams p{};
    p.x = ptr_of<const bf16_t>(x);
    p.x_row_stride = dim;
    p.m = static_cast<int>(bs);
    p.k = static_cast<int>(dim);
    p.batch = 1;
    p.nseg = 2;
    p.pdl = !plan_in_query;  // (as the step's first kernel it waits for all before it)
    p.seg[0] = gemm_seg(w_qd, "w_qd", q_lora_p, q_lora, 0);
    p.seg[1] = gemm_seg(w_kvd, "w_kvd", kv_new_p, d, 0);
    p.ws = ptr_of<float>(ws, sh.s_down);
    p.ws_bytes = sh.down.ws_bytes;
    if (gemm_sm90_aligned(p) == nullptr) {  // (the configuration for these sizes is sh.down)
      check_launch(launch_gemm_sm90(p, sh.down, stream), "down-projection launch");
      own_down = true;
      ran |= kStepDownOwn;
    }
  }
  // (the vendor paths' views of the slots)
  const auto q_lora_view = [&] { return carve(ws, sh.s_qlora, {bs, q_lora}, {q_lora, 1}, bf16); };
  const auto kv_new_view = [&] { return carve(ws, sh.s_kvnew, {bs, d}, {d, 1}, bf16); };
  if (!own_down) {
    const at::Tensor x2 = carve(x, 0, {bs, dim}, {dim, 1}, bf16);
    at::Tensor q_lora_t = q_lora_view(), kv_new = kv_new_view();
    at::mm_out(q_lora_t, x2, w_qd.t());
    at::mm_out(kv_new, x2, w_kvd.t());
  }
  step_mark("down");
  // ---- 3-4. query: up-projection, W_UK absorption, RoPE of q_pe, the cache append
  // (the attention's query, head-major [H, bs, d]: q_abs its first r columns, q_rot [bs, H, rope] the rest rotated)
  bool fused = false;
  if (query_ok) {
    check_launch(launch_query_sm90(qp, stream), "fused query launch");
    fused = true;
    ran |= kStepQueryFused | (plan_in_query ? kStepPlanInQuery : 0);
  }
  if (!fused) {
    const at::Tensor w_uk = carve(w_kvu, 0, {H, nope, r}, {(nope + v) * r, r, 1}, bf16);
    at::Tensor q_abs = carve(ws, sh.s_q, {H, bs, r}, {bs * d, d, 1}, bf16);
    at::Tensor q_rot = carve(ws, sh.s_q + r * 2, {bs, H, rope}, {d, bs * d, 1}, bf16);
    at::Tensor q = at::empty({bs, H, nope + rope}, x.options());
    at::Tensor q2 = q.view({bs, H * (nope + rope)});
    at::mm_out(q2, q_lora_view(), w_qu.t());
    at::bmm_out(q_abs, q.narrow(2, 0, nope).transpose(0, 1), w_uk);
    rope_append(q.narrow(2, nope, rope), kv_new_view(), seqlens, rope_cs, q_rot, const_cast<at::Tensor&>(cache),
                c10::nullopt);
  }
  step_mark("query");
  // ---- 5. attention over the cache, the keys rotated on the fly, with the plan made at step 0
  const at::Tensor q_att = carve(ws, sh.s_q, {bs, 1, H, d}, {d, H * bs * d, bs * d, 1}, bf16);
  at::Tensor o_lat = carve(ws, sh.s_olat, {bs, 1, H, r}, {H * r, H * r, r, 1}, bf16);
  at::Tensor lse = carve(ws, sh.s_lse, {bs, H, 1}, {H, 1, 1}, at::kFloat);
  const at::Tensor plan = carve(ws, sh.s_plan, {sh.plan_elems}, {1}, at::kInt);
  attention_step(q_att, cache, seqlens, rope_cs, 1.0 / std::sqrt(static_cast<double>(nope + rope)), o_lat, lse, r,
                 plan, sh.split);
  step_mark("attention");
  // ---- 6. W_UV per head ([H, bs, r] x [H, r, v] into obuf [bs, H, v] seen head-major), then wo
  const bool lt = want & kStepWoLt;
  w_uv(ws, sh.s_olat, sh.s_obuf, sh.s_lt, w_kvu, bs, H, r, nope, v, lt);
  step_mark("w_uv");
  at::Tensor y = at::empty({bs, 1, dim}, x.options());
  if (lt && gemm_nt_lt_batched(ptr_of<const void>(ws, sh.s_obuf), H * v, 0, w_o.data_ptr(), H * v, 0, y.data_ptr(),
                               dim, 0, bs, dim, H * v, 1, ws, ptr_of<void>(ws, sh.s_lt))) {
    ran |= kStepWoLt;
  } else {
    at::Tensor y2 = carve(y, 0, {bs, dim}, {dim, 1}, bf16);
    at::mm_out(y2, carve(ws, sh.s_obuf, {bs, H * v}, {H * v, 1}, bf16), w_o.t());
  }
  step_mark("wo");
  StepOut out;
  out.y = y;
  out.ran = ran;
  out.keep = rope_cs;  // (a captured step reads the table where it lies: the entry keeps it alive)
  return out;
}

}  // namespace

void release_step_workspaces() {
  std::lock_guard<std::mutex> lock(workspaces_mu);
  for (StepWorkspace& w : workspaces) std::lock_guard<std::mutex> wait(*w.busy);  // (no call enqueueing on it)
  workspaces.clear();
}

std::tuple<at::Tensor, int64_t> decode_step(const at::Tensor& x, const at::Tensor& w_qd, const at::Tensor& w_kvd,
                                            const at::Tensor& w_qu, const at::Tensor& w_kvu, const at::Tensor& w_o,
                                            const at::Tensor& cache, int64_t pos, const std::vector<int64_t>& cfg,
                                            const at::Tensor& rope_cs, int64_t want) {
  return decode_step_keyed(x, w_qd, w_kvd, w_qu, w_kvu, w_o, cache, pos, cfg, rope_cs, want, nullptr);
}

std::tuple<at::Tensor, int64_t> decode_step_keyed(const at::Tensor& x, const at::Tensor& w_qd, const at::Tensor& w_kvd,
                                                  const at::Tensor& w_qu, const at::Tensor& w_kvu,
                                                  const at::Tensor& w_o, const at::Tensor& cache, int64_t pos,
                                                  c10::ArrayRef<int64_t> cfg, const at::Tensor& rope_cs, int64_t want,
                                                  const StepKey* prefix) {
  StepMarksScope marks;  // (MLA_DECODE_STEP_GRAPH_TRACE=2)
  // ---- checks, in the order device, dtype, layout, shape; nothing is written before they pass
  const StepDims sizes = step_dims(cfg);
  const int64_t dim = sizes.dim, H = sizes.heads, q_lora = sizes.q_lora, r = sizes.kv_lora, nope = sizes.nope,
                rope = sizes.rope, v = sizes.v;
  if (!x.is_cuda()) fail_value("x must be on a GPU for the kernels, got " + x.device().str());
  const at::Device dev = x.device();
  check_dtype(x, "x", at::kBFloat16);
  if (x.dim() != 3 || x.size(1) != 1 || x.size(2) != dim || x.size(0) < 1)
    fail_value("x must have shape [bs, 1, " + num(dim) + "], got " + shape_str(x));
  if (!x.is_contiguous()) fail_value("x must be contiguous, got strides " + list_str(x.strides()));
  const int64_t bs = x.size(0);
  if (r != 512 || rope != 64 || nope < 1 || v < 1 || H < 1 || q_lora < 1)
    fail_value("decode_step: the kernels take kv_lora_rank 512 and qk_rope_head_dim 64, got " + num(r) + " and " +
               num(rope));
  if (cache.dim() != 3)
    fail_value("kv_cache.data must have shape [bs, max_seq_len, " + num(r + rope) + "], got " + shape_str(cache));
  if (cache.size(0) != bs)  // (the words of mla_decode/validate.py)
    fail_value("x's batch (" + num(bs) + ") differs from kv_cache.data's (" + num(cache.size(0)) + "): x [bs, 1, " +
               num(dim) + "] and kv_cache.data [bs, max_seq_len, " + num(r + rope) +
               "] must have the same bs (one new token per cached sequence), got x " + shape_str(x) +
               " and kv_cache.data " + shape_str(cache));
  const int64_t max_len = cache.size(1);
  check_input(cache, "kv_cache.data", dev, {bs, max_len, r + rope},
              "[bs, max_seq_len, kv_lora_rank + rope]", false);
  if (elements_overlap(cache))
    fail_value("kv_cache.data must give every sequence and row memory of its own (the step writes a row per "
               "sequence), got strides " + list_str(cache.strides()) + " for shape " + shape_str(cache) +
               " (an expanded tensor?)");
  if (!rows_aligned16(cache))
    fail_value("kv_cache.data rows must be 16-byte aligned for the kernels (base address and strides multiples of 8 "
               "elements), got strides " + list_str(cache.strides()) + " at byte offset " +
               num(static_cast<int64_t>(reinterpret_cast<uintptr_t>(cache.data_ptr()) % 16)) +
               " (a slice of a wider buffer?): pass a cache whose rows start on 16-byte boundaries");
  if (pos < 0 || pos >= max_len)
    fail_value("kv_cache is full or seq_len is out of range: seq_len " + num(pos) + ", max_seq_len " + num(max_len) +
               "; nothing was written");
  check_input(w_qd, "config.Q_proj_down_weight", dev, {q_lora, dim}, "[q_lora_rank, dim]", true);
  check_input(w_kvd, "config.KV_proj_down_weight", dev, {r + rope, dim}, "[kv_lora_rank + rope, dim]", true);
  check_input(w_qu, "config.Q_proj_up_weight", dev, {H * (nope + rope), q_lora},
              "[n_heads * (nope + rope), q_lora_rank]", true);
  check_input(w_kvu, "config.KV_proj_up_weight", dev, {H * (nope + v), r}, "[n_heads * (nope + v), kv_lora_rank]",
              true);
  check_input(w_o, "config.wo_weight", dev, {dim, H * v}, "[dim, n_heads * v]", true);
  if (rope_cs.device() != dev || rope_cs.scalar_type() != at::kBFloat16 || rope_cs.dim() != 2 ||
      rope_cs.size(0) < max_len || rope_cs.size(1) != rope || !rope_cs.is_contiguous() ||
      reinterpret_cast<uintptr_t>(rope_cs.data_ptr()) % 16 != 0)
    fail_value("decode_step: rope_cs must be a contiguous bf16 [>= max_seq_len, rope] table with a 16-byte aligned "
               "base on " + dev.str() + ", got " + shape_str(rope_cs));

  step_mark("checks");
  c10::cuda::CUDAGuard guard(dev);
  // no autograd on the way (weights may be nn.Parameters): outputs are plain
  // tensors (inference tensors under torch.inference_mode, as any op's)
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  // (the operands and sizes first, then the table and the wished paths: the
  // lean replay, step_fast.cpp, matches the first part alone)
  StepKey key = prefix != nullptr ? *prefix : step_key_prefix(x, {&w_qd, &w_kvd, &w_qu, &w_kvu, &w_o}, cache, cfg);
  key.add(rope_cs);
  key.add(want);
  step_mark("key");
  const StepOut out = run_step(key, static_cast<int32_t>(pos + 1), [&](int32_t* len_slot, bool capturing) -> StepOut {
    return enqueue_step(x, w_qd, w_kvd, w_qu, w_kvu, w_o, cache, rope_cs, cfg, pos, want, len_slot, capturing);
  });
  step_marks_print(dev.index(), out.ran);
  return {out.y, out.ran};
}

}  // namespace mla::api
