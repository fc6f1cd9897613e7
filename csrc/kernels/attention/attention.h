// Host-side entry points of the attention stage (no torch here).
// Each launcher returns nullptr on success or a message describing the failure.
#pragma once

#include "../../platform/vendor.h"
#include "params.h"
#include "plan.h"

namespace mla {

// Compile-time facts of the attention kernel the host needs for planning.
struct AttnKernelInfo {
  int rows_per_block;   // query rows (s_q * h_q flattened) per block
  int tile;             // keys per pipeline tile (the planner's unit)
  int threads;          // block size
  int smem_bytes;       // dynamic shared memory per block
  int warp_size;        // the wave size the kernel was compiled for
  int blocks_per_sm;    // resident blocks per SM/CU (occupancy calculator)
  bool one_key_tail;    // a sequence's last tile holding one key costs next to nothing (the Hopper
                        // kernel's dv 512 bf16 instances add it outside the pair loop): the planner
                        // cuts the tiles before it and hangs it on the last part
};

// The portable kernel (attention.cu; tile-MMA interface, the one AMD builds
// use), one instance per supported shape and head block: value width dv in
// {64, 128, 256, 512} and rope width in {8, 16, 32, 64} inside the key
// (D = dv + rope), or rope 0: per-head rope keys, scores from
// launch_rope_scores (DeepSeek-V3: 512, 64); rows_per_block 16, 32 or 64
// query rows per block (the host picks it from s_q * h_q:
// portable_rows_per_block). An unsupported shape returns
// kAttnShapesSupported in the message.
extern const char* const kAttnShapesSupported;
bool attn_shape_supported(int dv, int rope);
// fp8: the instance that reads an fp8 cache (AttnParams::kv_fp8; kAttnFp8Supported lists its shapes).
const char* attn_kernel_info_portable(int dv, int rope, int rows_per_block, bool fp8, AttnKernelInfo* info);
extern const char* const kAttnFp8Supported;
const char* launch_attention_portable(const AttnParams& p, int rows_per_block, stream_t stream);

// Launched around either attention kernel: the split planner before it
// (plan.cu), the rope scores of per-head rope keys before it
// (rope_scores.cu), the combine of split sequences after it (combine.cu).
const char* launch_plan(const PlanParams& p, stream_t stream);
const char* launch_set_len(int32_t* slot, int v, int step, stream_t stream);  // (plan.cu; PlanParams::len_slot)
// (plan.cu) zeroes a call's work-counter pair (AttnParams::counter) in one
// one-thread launch; with pdl, as a programmatic dependent of the kernel
// before it, so that a dependent attention's prologue is not held back.
const char* launch_zero_pair(int32_t* pair, bool pdl, stream_t stream);
// Work-counter pairs for calls captured in CUDA graphs: prepare_counter_pool
// looks the pool up on device `device` (the current one), outside a capture;
// captured_counter_pair then hands out a zeroed pair that the call keeps for
// the graph's life (the attention leaves it zeroed after every launch), or
// nullptr (pool not prepared or used up, other vendors): the call then zeroes
// a pair of its own.
void prepare_counter_pool(int device);
int32_t* captured_counter_pair(int device);
const char* launch_rope_scores(const RopeScoreParams& p, stream_t stream);
const char* launch_combine(const CombineParams& p, stream_t stream);
// CombineParams::max_warps per SM/CU for the attention's own combine (most
// sequences may be unsplit: a small grid whose warps skip them, not a block
// per row; about one wave of the combine's warps at its register use).
constexpr int kCombineWarpsPerSm = 32;
const char* launch_merge(const MergeParams& p, stream_t stream);  // (combine.cu)

// Hopper variant (attention_sm90.cu, wgmma, the two warpgroups on alternate
// 64-key halves; NVIDIA sm_90a builds only): same contract and planner,
// dv 128, 256 or 512 with rope keys shared by all heads, rope 8-64
// (on-the-fly key RoPE: rope 64). Other shapes: the portable kernel.
bool sm90_shape_supported(int dv, int rope);
// Per-head rope keys (scores precomputed by launch_rope_scores) on the Hopper
// kernel: dv 128, 256 or 512; work items of 32 query rows there.
bool sm90_per_head_supported(int dv);
// Whether the planner -> Hopper attention -> combine launches overlap by
// programmatic dependent launch (on by default; MLA_DECODE_PDL=0 turns it off).
bool sm90_pdl_enabled();
const char* attn_kernel_info_sm90(int dv, bool per_head, AttnKernelInfo* info);
const char* launch_attention_sm90(const AttnParams& p, stream_t stream);
// The fp8 instances (attention_sm90_fp8.cu): an e4m3 cache, dv 512, rope 64
// as stored, bf16 q and out; keys by TMA (dense, or pages of a multiple of 64
// rows). launch_attention_sm90 hands fp8 calls there.
const char* attn_kernel_info_sm90_fp8(int* blocks_per_sm);
const char* launch_attention_sm90_fp8(const AttnParams& p, stream_t stream);

}  // namespace mla
