// See step_graph.h. Replays of every captured step of a device share one
// memory pool (their intermediates may alias), so the replays of a device are
// kept in one order: a replay on another stream than the last one waits for
// the last one's event. The cache holds at most kMaxGraphs steps, least
// recently used first out.
#include "step_graph.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGraph.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>

#include <memory>
#include <mutex>
#include <optional>

#include "../kernels/attention/attention.h"
#include "../platform/vendor.h"
#include "checks.h"
#include "ops.h"

namespace mla::api {

void StepKey::add(const at::Tensor& t) {
  v.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data_ptr())));
  v.push_back(static_cast<int64_t>(t.scalar_type()));
  v.push_back(t.dim());
  for (int64_t i = 0; i < t.dim(); ++i) {
    v.push_back(t.size(i));
    v.push_back(t.stride(i));
  }
}

namespace {

constexpr size_t kMaxGraphs = 4;

struct Entry {
  StepKey key;
  std::unique_ptr<at::cuda::CUDAGraph> graph;
  graph_exec_t exec = nullptr;
  StepOut out;  // the captured step's y (in the pool), paths and planner launch
  uint64_t used = 0;
};

struct DeviceState {
  bool has_pool = false;
  at::cuda::MempoolId_t pool{0, 0};
  event_t done = nullptr;     // after the last replay and its copy-out
  stream_t last = nullptr;    // the stream of that replay
  std::optional<c10::cuda::CUDAStream> side;  // where this device's steps are captured
  int graphs = 0;             // captured steps alive here (sharing `pool`)
  StepKey last_eager;         // the previous eager call's key
  bool no_graphs = false;     // a capture failed here: eager from then on (warned once)
};

std::mutex mu;
// Leaked on purpose: graphs must not be destroyed after the CUDA runtime at exit.
std::vector<std::unique_ptr<Entry>>& entries = *new std::vector<std::unique_ptr<Entry>>();
std::vector<DeviceState>& devices = *new std::vector<DeviceState>();
uint64_t tick = 0;

bool graphs_off() {
  static const bool off = env_off("MLA_DECODE_STEP_GRAPH");
  return off;
}

DeviceState& device_state(int device) {
  if (device >= static_cast<int>(devices.size())) devices.resize(device + 1);
  return devices[device];
}

void wait_done(DeviceState& ds) {
  if (ds.done != nullptr) (void)MLA_RT(EventSynchronize)(ds.done);
}

StepOut replay(Entry& e, DeviceState& ds, int32_t len, stream_t stream) {
  if (ds.done == nullptr) check_launch(event_create(&ds.done), "decode step graph event");
  if (ds.last != nullptr && ds.last != stream) check_launch(stream_wait_event(stream, ds.done), "decode step graph wait");
  PlanParams pp = e.out.plan;  // the lengths and the split plan, then the graph that reads them
  pp.fill_len = len;
  check_launch(launch_plan(pp, stream), "decode step lengths and plan");
  check_launch(graph_launch(e.exec, stream), "decode step graph launch");
  StepOut out = e.out;
  out.y = at::empty(e.out.y.sizes(), e.out.y.options());
  check_launch(memcpy_d2d_async(out.y.data_ptr(), e.out.y.data_ptr(), e.out.y.nbytes(), stream),
               "decode step output copy");
  check_launch(event_record(ds.done, stream), "decode step graph event");
  ds.last = stream;
  out.ran |= kStepGraph;
  e.used = ++tick;
  return out;
}

// Captures `enqueue` on the device's side stream into the device's pool.
std::unique_ptr<Entry> capture(const StepKey& key, DeviceState& ds, const StepEnqueue& enqueue) {
  const int device = key.device;
  if (!ds.side) {
    ds.side = c10::cuda::getStreamFromPool(false, static_cast<c10::DeviceIndex>(device));
    // the side stream's BLAS handle and workspace exist before any capture on it
    // (made during one, they would come from the graph's pool)
    c10::cuda::CUDAStreamGuard sg(*ds.side);
    (void)at::cuda::getCurrentCUDABlasHandle();
  }
  auto e = std::make_unique<Entry>();
  e->key = key;
  e->graph = std::make_unique<at::cuda::CUDAGraph>();
  bool begun = false;
  try {
    c10::cuda::CUDAStreamGuard sg(*ds.side);
    e->graph->capture_begin(ds.has_pool ? ds.pool : at::cuda::MempoolId_t{0, 0},
                            MLA_RT(StreamCaptureModeThreadLocal));
    begun = true;
    e->out = enqueue(false);
    e->graph->capture_end();  // (instantiates)
  } catch (...) {
    if (begun) {
      try {
        e->graph->capture_end();
      } catch (...) {
      }
    }
    // a graph object whose capture failed is left alone, not destroyed
    // (PyTorch's reset after a failed capture is not safe in every version)
    (void)e->graph.release();
    throw;
  }
  if (!ds.has_pool) {
    ds.pool = e->graph->pool();
    ds.has_pool = true;
  }
  e->exec = e->graph->raw_cuda_graph_exec();
  return e;
}

}  // namespace

StepOut run_step(const StepKey& key, int32_t len, const StepEnqueue& enqueue) {
  const stream_t stream = at::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(key.device)).stream();
  bool capturing = false;
  check_launch(stream_capturing(stream, &capturing), "decode step");
  if (capturing || graphs_off()) return enqueue(true);  // (a caller's capture takes the eager launches)

  std::unique_lock<std::mutex> lock(mu);
  DeviceState& ds = device_state(key.device);
  if (ds.no_graphs) {
    lock.unlock();
    return enqueue(true);
  }
  for (auto& e : entries)
    if (e->key == key) return replay(*e, ds, len, stream);
  if (!(ds.last_eager == key)) {  // a first sight: eager; captured if the next call repeats it
    ds.last_eager = key;
    lock.unlock();
    return enqueue(true);
  }
  ds.last_eager = StepKey{};
  if (entries.size() >= kMaxGraphs) {  // the least recently used step goes, after its replays
    auto lru = entries.begin();
    for (auto it = entries.begin(); it != entries.end(); ++it)
      if ((*it)->used < (*lru)->used) lru = it;
    DeviceState& old = device_state((*lru)->key.device);
    wait_done(old);
    entries.erase(lru);
    if (--old.graphs == 0) old.has_pool = false;  // (PyTorch frees a pool with no graph left: the next capture makes one)
  }
  std::unique_ptr<Entry> e;
  try {
    e = capture(key, ds, enqueue);
  } catch (const c10::Error& err) {  // nothing ran: the step runs eagerly, now and from then on
    ds.no_graphs = true;
    TORCH_WARN_ONCE("mla_decode: the decode step could not be captured into a graph on cuda:", key.device,
                    ", so its launches are made anew on every call there (slower): ", err.what_without_backtrace());
    lock.unlock();
    return enqueue(true);
  }
  entries.push_back(std::move(e));
  ++ds.graphs;
  return replay(*entries.back(), ds, len, stream);
}

void release_step_graphs() {
  std::lock_guard<std::mutex> lock(mu);
  for (DeviceState& ds : devices) wait_done(ds);
  entries.clear();
  for (DeviceState& ds : devices) {
    ds.graphs = 0;
    ds.has_pool = false;
    ds.last_eager = StepKey{};
  }
}

}  // namespace mla::api
