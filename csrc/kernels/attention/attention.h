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
};

// The portable kernel (tile-MMA interface; the one AMD builds use), one
// instance per supported shape: value width dv in {64, 128, 256, 512} and
// rope width in {8, 16, 32, 64} inside the key (D = dv + rope), or rope 0:
// per-head rope keys, scores from launch_rope_scores. DeepSeek-V3: 512, 64.
// An unsupported shape returns kAttnShapesSupported in the message.
extern const char* const kAttnShapesSupported;
bool attn_shape_supported(int dv, int rope);
const char* attn_kernel_info_portable(int dv, int rope, AttnKernelInfo* info);
const char* launch_attention_portable(const AttnParams& p, stream_t stream);
const char* launch_rope_scores(const RopeScoreParams& p, stream_t stream);
const char* launch_plan(const PlanParams& p, stream_t stream);
const char* launch_combine(const CombineParams& p, stream_t stream);

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

}  // namespace mla
