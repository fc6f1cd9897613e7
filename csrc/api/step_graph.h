// The decode step's replay cache: a step is captured once into a CUDA/HIP
// graph and replayed from then on when its operands (addresses and layouts)
// are new while fewer than four steps are captured, or come back soon
// (within four other new ones on that GPU) once they are all taken. The
// sequences' length is the graph's one per-call argument: the graph's first
// node, the planner, reads it from a device slot and advances it by the
// slot's step for the next replay (1 while a cache grows a row per call, 0
// while fresh caches come at one length), so a replay at the length that
// pattern expects is one graph launch; any other length is written into the
// slot by one small launch first. A replay reads the weights, x and the cache where they lie,
// as an eager call does; it saves the host work of the launches, which the
// GPU otherwise waits for at the start of every step.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <vector>

namespace mla::api {

// What a captured step depends on besides the length: the device, every
// operand's address, dtype, sizes and strides, the layer's sizes and the
// wished paths.
struct StepKey {
  int device = -1;
  std::vector<int64_t> v;
  void add(const at::Tensor& t);
  void add(int64_t x) { v.push_back(x); }
  bool operator==(const StepKey& o) const { return device == o.device && v == o.v; }
};

// A step's key begins with its operands and sizes: the device (x's), x, the
// five weights, the cache and the layer's seven sizes, in that order; the
// RoPE table and the wished paths follow (decode_step).
StepKey step_key_prefix(const at::Tensor& x, std::initializer_list<const at::Tensor*> weights,
                        const at::Tensor& cache, c10::ArrayRef<int64_t> cfg);

// One step enqueued on the current stream: y and the paths taken. With a
// null `len_slot` the length is the call's own (written to the device by the
// planner's launch, or, for a batch that is not split, by the fused query
// with the plan); otherwise (a captured step) the step starts with the
// planner's launch, which reads the length from *len_slot and advances it
// (PlanParams::len_slot).
struct StepOut {
  at::Tensor y;
  int64_t ran = 0;
  at::Tensor keep;  // what a captured graph reads besides its key's operands (the RoPE table): held by the entry
};
// `capturing`: whether the stream is capturing a graph as the step is
// enqueued (the caller's capture, or the step's own).
using StepEnqueue = std::function<StepOut(int32_t* len_slot, bool capturing)>;

// Runs the step on the current stream of the current device: replays the
// graph captured for `key` at length `len`, y copied out into a new tensor
// (ran | kStepGraph); otherwise runs `enqueue` eagerly and, after those
// launches (while the GPU runs them), captures the step for the next call to
// replay (ran | kStepCaptured) when this is the device's first step, when
// fewer than kMaxGraphs steps are captured, or when `key` is among the last
// kRecent keys seen on this device and the least recently replayed captured
// step has not run since that sight (it then makes room). Always eager while
// the stream is itself capturing or with MLA_DECODE_STEP_GRAPH=0.
StepOut run_step(const StepKey& key, int32_t len, const StepEnqueue& enqueue);

// The lean replay (step_fast.cpp): replays, on the current stream of
// prefix.device, the captured step whose key starts with `prefix` (the
// operands and sizes; the RoPE table and the wished paths are the entry's)
// at length `len`, and sets *out. False, with nothing done, where none
// matches, while that stream is capturing, or with MLA_DECODE_STEP_GRAPH=0:
// the caller then takes the checked path (run_step), which captures.
bool replay_captured(const StepKey& prefix, int32_t len, StepOut* out);

// Drops every captured step (after their last replays have finished).
void release_step_graphs();
// Drops the eager steps' workspaces (step.cpp; each waits for a call that
// is enqueueing on it to finish doing so).
void release_step_workspaces();

// Diagnostics on stderr, MLA_DECODE_STEP_GRAPH_TRACE: 1, one line per
// capture with its host time by phase; 2, also one line per eager step with
// the host time from the call's entry (fast_step's or decode_step's) to each
// of its marks (the checks, each launch). A StepMarksScope opens a call's
// marks where none are open on this thread (nothing below level 2) and
// closes them when it ends; step_mark notes one; step_marks_print prints an
// eager step's.
int step_trace_level();
bool step_marks_begin();
void step_marks_close();
void step_mark(const char* what);
void step_marks_print(int device, int64_t ran);
struct StepMarksScope {
  bool opened;
  StepMarksScope() : opened(step_marks_begin()) {}
  ~StepMarksScope() {
    if (opened) step_marks_close();
  }
  StepMarksScope(const StepMarksScope&) = delete;
  StepMarksScope& operator=(const StepMarksScope&) = delete;
};

}  // namespace mla::api
