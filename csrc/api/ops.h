// Declarations of the torch-facing ops, for the module (module.cpp), the op
// registration (registration.cpp) and the decode step (step.cpp). Defined in
// attention_ops.cpp (attention, attention_out, plan), combine_op.cpp,
// attention_choice.cpp (plan_target_parts, splits_possible, attention_info),
// step_graph.cpp (release_cached), ops_projections.cpp and step.cpp.
#pragma once

#include <tuple>
#include <utility>
#include <vector>

#include <torch/types.h>

#include "../kernels/attention/plan.h"

namespace mla::api {

void attention_out(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& seqlens,
                   const c10::optional<at::Tensor>& block_table, const c10::optional<at::Tensor>& rope_cs,
                   double softmax_scale, bool causal, at::Tensor& out, at::Tensor& lse,
                   const c10::optional<at::Tensor>& kpe, int64_t head_dim_v,
                   const c10::optional<at::Tensor>& kpe_heads, const c10::optional<at::Tensor>& plan,
                   bool split = true, double kv_scale = 1.0);
// The decode step's attention (step.cpp): attention_out with `plan` made for
// this very call by the step's planner (the kernel reads each part's length
// from it and takes its work from the plan's counter), keys rotated on the
// fly by rope_cs, no block table, s_q 1. The operands are the step's, which
// it has checked (their devices, dtypes, shapes and 16-byte rows) or made
// itself, so no check is repeated here. A plan passed to attention_out
// itself may be of other lengths and shared: the lengths are read from
// seqlens and the work counter is the call's own.
void attention_step(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& seqlens, const at::Tensor& rope_cs,
                    double softmax_scale, at::Tensor& out, at::Tensor& lse, int64_t head_dim_v, const at::Tensor& plan,
                    bool split);

std::tuple<at::Tensor, at::Tensor> attention(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& seqlens,
                                             const c10::optional<at::Tensor>& block_table,
                                             const c10::optional<at::Tensor>& rope_cs, double softmax_scale,
                                             bool causal, const c10::optional<at::Tensor>& kpe, int64_t head_dim_v,
                                             const c10::optional<at::Tensor>& kpe_heads,
                                             const c10::optional<at::Tensor>& plan, bool split = true,
                                             double kv_scale = 1.0);

// The split plan (csrc/kernels/attention/plan.h) the attention op would use
// for these lengths (dv 512, 64 rope columns in the key, used as stored),
// computed on the device: int32 [plan_size(bs, max_parts)]. attention(_out)
// takes it as `plan` in place of planning inside the call, for as many calls
// as the lengths stay the same (the kernel leaves its work counter at 0).
// split false: every sequence one part (int32 [plan_size(bs, bs)]), for
// attention calls with split false, which then launch no combine.
at::Tensor plan(const at::Tensor& seqlens, int64_t s_q, int64_t h_q, int64_t capacity, bool split = true);

// The planner's target parts per head block on `device` for s_q x h_q query
// rows (what plan() plans with).
int64_t plan_target_parts(int64_t device, int64_t s_q, int64_t h_q);
// Whether the planner can split a batch of bs sequences of one length: not
// once bs reaches the target parts (every part size it weighs is then at
// least a sequence's tiles). Where it cannot, split=False plans the same and
// saves the combine's launch (the decode step; mla_decode.splits_possible).
bool splits_possible(int64_t device, int64_t bs, int64_t s_q, int64_t h_q);

// The decode step's split plan (step.cpp): the planner's parameters for bs
// sequences of one length, s_q 1 and h_q heads, with the step's attention
// (dv 512, the keys' RoPE on the fly) on `device`, and the plan's size in
// int32 elements (*plan_elems). The caller sets seqlens = fill_lens (the
// lengths' buffer), plan (the plan's) and fill_len or len_slot, so that one
// launch_plan writes both the lengths and the plan that attention_out then
// takes as `plan`.
PlanParams step_plan_params(int device, int64_t bs, int64_t h_q, int64_t capacity, bool split, int64_t* plan_elems);

std::tuple<at::Tensor, at::Tensor> combine(const at::Tensor& o_part, const at::Tensor& lse_part);
// N partial results of the same queries over disjoint key sets merged by their
// LSE (decode context parallelism): outs [N, b, s_q, h_q, dv] bf16, fp16 or
// fp32, lses [N, b, h_q, s_q] fp32 -> (out in outs' dtype, lse fp32).
std::tuple<at::Tensor, at::Tensor> merge_states(const at::Tensor& outs, const at::Tensor& lses);

// The query's RoPE and the cache append of a decode step in one launch
// (csrc/kernels/projections/rope_append.h); implemented in ops_projections.cpp.
void rope_append(const at::Tensor& q_pe, const at::Tensor& kv_new, const at::Tensor& seqlens,
                 const at::Tensor& rope_cs, at::Tensor& q_out, at::Tensor& cache,
                 const c10::optional<at::Tensor>& kpe_out);

// One read of t's bytes at the device's streaming rate (contiguous, 16-byte
// pieces from a 16-byte boundary); implemented in ops_projections.cpp.
void stream_read(const at::Tensor& t);

// Drop the decode step's captured graphs and its eager-step workspaces
// (their memory returns to the allocator once their last uses are done).
void release_cached();

// What decode_step's `want` asks for and its second result says ran.
// Reported only: kStepGraph, the step was a replay of its captured graph; kStepCaptured, the step
// ran eagerly and was then captured for the next call to replay (step_graph.h); kStepPlanInQuery, the
// fused query wrote the attention's lengths and plan (no planner launch: a batch that is not split, at a
// length known on the host).
enum StepPath : int64_t {
  kStepDownOwn = 1,
  kStepQueryFused = 2,
  kStepWoLt = 4,
  kStepGraph = 8,
  kStepCaptured = 16,
  kStepPlanInQuery = 32
};

// One decode step of the layer (step.cpp): x [bs, 1, dim]; the task's five
// weights; cache [bs, max_seq_len, kv_lora + rope] with the new row going to
// position pos; cfg = [dim, heads, q_lora, kv_lora, nope, rope, v]; rope_cs
// the RoPE table [>= max_seq_len, rope]. Checks every operand before writing
// anything; returns (y [bs, 1, dim], the StepPath bits that ran).
std::tuple<at::Tensor, int64_t> decode_step(const at::Tensor& x, const at::Tensor& w_qd, const at::Tensor& w_kvd,
                                            const at::Tensor& w_qu, const at::Tensor& w_kvu, const at::Tensor& w_o,
                                            const at::Tensor& cache, int64_t pos, const std::vector<int64_t>& cfg,
                                            const at::Tensor& rope_cs, int64_t want);
struct StepKey;
// The same, given the operands' key prefix where the caller has built it
// (step_key_prefix of these operands and cfg: the lean path, step_fast.cpp),
// or nullptr.
std::tuple<at::Tensor, int64_t> decode_step_keyed(const at::Tensor& x, const at::Tensor& w_qd, const at::Tensor& w_kvd,
                                                  const at::Tensor& w_qu, const at::Tensor& w_kvu,
                                                  const at::Tensor& w_o, const at::Tensor& cache, int64_t pos,
                                                  c10::ArrayRef<int64_t> cfg, const at::Tensor& rope_cs, int64_t want,
                                                  const StepKey* prefix);

// The facts of the attention kernel on `device` for value width dv and rope
// width rope inside the key (0: per-head rope keys); Python receives them by
// name (module.cpp), as mla_decode._ext.AttentionInfo.
struct AttentionFacts {
  int64_t rows_per_block, keys_per_tile, threads, smem_bytes, warp_size, blocks_per_sm, sms;
  bool hopper;  // the Hopper wgmma kernel (else the portable tile-MMA one)
};
AttentionFacts attention_info(int64_t device, int64_t dv = 512, int64_t rope = 64);

}  // namespace mla::api
