// The bounded TMA-map registry of the Hopper attention: tables of TMA maps
// whose row extent is cut to every length, built once per cache layout
// (attention_bounded_register) and looked up by the attention op.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <mutex>
#include <string>
#include <vector>

#include "attention_internal.h"
#include "checks.h"
#include "ops.h"
#include "step_graph.h"

namespace mla::api {
namespace {

// Registered bounded-map tables (attention_bounded_register): the layouts
// they serve, most recently used first, at most kBoundedTables per device
// (2 x 128 bytes per cache row each; a device's least recently used goes).
// A table depends on nothing but the layout (addresses, sizes, strides), so
// any call whose cache and kpe have exactly a registered layout may use it.
// It is built on the registering stream with no host wait: a use on another
// stream waits for `built` and records the stream with the caching
// allocator, so a dropped table's memory is reused only after every such
// use. Calls made while their stream captures
// a graph use no table (a graph would keep its address past a drop).
constexpr size_t kBoundedTables = 4;
struct BoundedEntry {
  int device;
  BoundedLayout layout;
  at::Tensor table;
  stream_t stream;  // where it was built
  event_t built;    // recorded there after the build; destroyed with the entry (never at exit)
};
std::mutex bounded_mu;
// never destroyed: nothing CUDA-related runs during static destruction at exit
std::vector<BoundedEntry>& bounded_tables = *new std::vector<BoundedEntry>();

}  // namespace

namespace detail {

bool capturing(stream_t stream) {
  bool c = false;
  check_launch(stream_capturing(stream, &c), "stream capture query");
  return c;
}

at::Tensor bounded_table_for(int device, const BoundedLayout& l, stream_t stream) {
  std::lock_guard<std::mutex> lock(bounded_mu);
  for (auto it = bounded_tables.begin(); it != bounded_tables.end(); ++it)
    if (it->device == device && it->layout == l) {
      if (it->stream != stream) {
        check_launch(stream_wait_event(stream, it->built), "bounded TMA map table");
        c10::cuda::CUDACachingAllocator::recordStream(
            it->table.storage().data_ptr(), at::cuda::getStreamFromExternal(stream, static_cast<c10::DeviceIndex>(device)));
      }
      std::rotate(bounded_tables.begin(), it, it + 1);  // (most recently used first)
      return bounded_tables.front().table;
    }
  return at::Tensor();
}

}  // namespace detail

at::Tensor attention_bounded_register(const at::Tensor& kv, const c10::optional<at::Tensor>& kpe, int64_t dv) {
  if (!kv.is_cuda()) fail_value("attention_bounded_register: kv must be on a GPU, got " + kv.device().str());
  check_shape(kv, "kv", {-1, -1, -1}, "[bs, max_seq_len, d]");
  check_last_dim_contiguous(kv, "kv");
  const int64_t rope = kpe.has_value() ? kpe->size(-1) : kv.size(2) - dv;
  if (kpe.has_value()) {
    check_device(*kpe, "kpe", kv.device());
    check_dtype(*kpe, "kpe (the same dtype as kv)", kv.scalar_type());
    check_last_dim_contiguous(*kpe, "kpe");
    check_shape(*kpe, "kpe", {kv.size(0), -1, rope}, "[bs, >= max_seq_len, rope]");
  }
  if (dv < 1 || rope < 1 || dv + rope > kv.size(2))
    fail_value("attention_bounded_register: dv " + num(dv) + " and rope " + num(rope) + " do not fit kv rows of " +
               num(kv.size(2)));
  if (kv.element_size() != 2) fail_value("attention_bounded_register: kv must hold bf16 or fp16, got " + std::string(c10::toString(kv.scalar_type())));
  const int device = kv.device().index();
  c10::cuda::CUDAGuard guard(kv.device());
  // only where the call would run the Hopper kernel (the only user of the
  // table) and TMA can describe the rows (16-byte aligned base and strides)
  if (detail::device_attn_info(device, dv, rope).kind != detail::AttnKernel::kHopper) return at::Tensor();
  if (!rows_aligned16(kv) || (kpe.has_value() && !rows_aligned16(*kpe))) return at::Tensor();
  const stream_t stream = at::cuda::getCurrentCUDAStream(device).stream();
  if (detail::capturing(stream)) return at::Tensor();  // (built, and used, outside captures only)
  const BoundedLayout bl{kv.data_ptr(),  kv.stride(1), kv.stride(0), kv.size(1), kv.size(0), dv + rope,
                         kpe.has_value() ? kpe->data_ptr() : nullptr,
                         kpe.has_value() ? kpe->stride(1) : 0, kpe.has_value() ? kpe->stride(0) : 0,
                         kpe.has_value() ? kpe->size(1) : 0, rope};
  return detail::bounded_table_or_build(device, bl, kv.options(), stream);
}

namespace detail {

at::Tensor bounded_table_or_build(int device, const BoundedLayout& bl, const at::TensorOptions& like, stream_t stream) {
  if (at::Tensor known = bounded_table_for(device, bl, stream); known.defined()) return known;
  at::Tensor table = at::empty({(bl.rows + 1) * 256}, like.dtype(at::kByte));
  check_launch(build_bounded_maps_sm90(bl, table.data_ptr(), stream), "bounded TMA map table");
  event_t built{};
  check_launch(event_create(&built), "bounded TMA map table");
  if (const char* e = event_record(built, stream)) {
    event_destroy(built);
    fail(std::string("bounded TMA map table failed: ") + e);
  }
  std::lock_guard<std::mutex> lock(bounded_mu);
  bounded_tables.insert(bounded_tables.begin(), BoundedEntry{device, bl, table, stream, built});
  // this device's least recently used goes: its memory returns to the
  // allocator once the streams that used it are past those uses (recordStream
  // above)
  size_t here = 0;
  for (auto it = bounded_tables.begin(); it != bounded_tables.end(); ++it)
    if (it->device == device && ++here > kBoundedTables) {
      event_destroy(it->built);
      bounded_tables.erase(it);
      break;
    }
  return table;
}

}  // namespace detail

void release_cached() {
  release_step_graphs();
  release_step_workspaces();
  std::lock_guard<std::mutex> lock(bounded_mu);
  for (const BoundedEntry& e : bounded_tables) event_destroy(e.built);
  bounded_tables.clear();
}

}  // namespace mla::api
