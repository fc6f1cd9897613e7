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

// The portable kernel (tile-MMA interface; the one AMD builds use),
// D = 576 (512 latent + 64 rope), Dv = 512: the DeepSeek-V3 shapes.
const char* attn_kernel_info_576_512(AttnKernelInfo* info);
const char* launch_plan(const PlanParams& p, stream_t stream);
const char* launch_attention_576_512(const AttnParams& p, stream_t stream);
const char* launch_combine(const CombineParams& p, stream_t stream);

// Hopper variant (attention_sm90.cu, wgmma, the two warpgroups on alternate
// 64-key halves; NVIDIA sm_90a builds only): same contract and planner.
const char* attn_kernel_info_sm90(AttnKernelInfo* info);
const char* launch_attention_sm90(const AttnParams& p, stream_t stream);

}  // namespace mla
