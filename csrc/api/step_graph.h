// The decode step's replay cache: a step whose operands (addresses and
// layouts) are the same as the previous call's is captured once into a
// CUDA/HIP graph and replayed from then on, with the sequences' length as the
// graph's one per-call argument (written, with the attention's split plan, by
// one planner launch ahead of the graph's). A replay reads the weights, x and the cache
// where they lie, as an eager call does; it saves the host work of the
// launches, which the GPU otherwise waits for at the start of every step.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "../kernels/attention/plan.h"

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

// One step enqueued on the current stream: y, the paths taken, and the
// planner's launch that writes the step's lengths (plan.fill_lens, all
// plan.fill_len) and its attention's split plan. With launch_planner false the
// step leaves that launch to its caller (a captured step: every replay makes
// it with the call's length before the graph's launch).
struct StepOut {
  at::Tensor y;
  int64_t ran = 0;
  PlanParams plan{};
};
using StepEnqueue = std::function<StepOut(bool launch_planner)>;

// Runs the step on the current stream of the current device: replays the
// graph captured for `key` after filling its lengths with `len`, y copied out
// into a new tensor (ran | kStepGraph); captures that graph first when the
// previous call on this device had the same key; otherwise, and whenever the
// stream is itself capturing or MLA_DECODE_STEP_GRAPH=0, runs `enqueue`.
StepOut run_step(const StepKey& key, int32_t len, const StepEnqueue& enqueue);

// Drops every captured step (after their last replays have finished).
void release_step_graphs();

}  // namespace mla::api
