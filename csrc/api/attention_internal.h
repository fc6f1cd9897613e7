// Shared by the attention stage's torch glue (attention_choice.cpp,
// attention_ops.cpp, combine_op.cpp) and nothing else: which kernel runs and
// its per-device facts, the planner's sizes, and the stream-capture query.
// The module's interface is ops.h.
#pragma once

#include <cstdint>
#include <utility>

#include <torch/types.h>

#include "../kernels/attention/attention.h"

namespace mla::api::detail {

// DeepSeek-V3: the shape device_attn_info defaults to (the one the plan op
// plans for).
constexpr int64_t kDv = 512, kRope = 64;

// The shapes the portable kernel is built for (attention.h): index of (dv, rope) or -1.
int shape_index(int64_t dv, int64_t rope);

enum class AttnKernel { kPortable = 0, kHopper = 1 };

struct DeviceAttnInfo {
  AttnKernelInfo kernel{};
  int sm_count = 0;
  AttnKernel kind = AttnKernel::kPortable;
};

// Kernel facts and the SM/CU count, read once per device, shape (and
// whether the keys' RoPE runs on the fly: it decides the kernel at rope < 64)
// and head block: the portable kernel's instance follows the query rows per
// sequence, rows = s_q * h_q (portable_rows_per_block); the Hopper kernel's
// does not. fp8: an fp8 cache; fp8_tma: one the Hopper kernel's fp8
// instances can read by TMA (dense, or pages of a multiple of 64 rows; dv 512,
// rope 64 as stored), which run it where the Hopper kernel runs; the portable
// kernel's fp8 instances read the others.
const DeviceAttnInfo& device_attn_info(int device, int64_t dv = kDv, int64_t rope = kRope,
                                       bool rope_on_the_fly = false, int64_t rows = 128, bool fp8 = false,
                                       bool fp8_tma = false);

// The portable kernel's head block for s_q * h_q query rows per sequence:
// 16, 32 or 64 rows, the smallest that holds them (few heads pay for no
// padding rows). MLA_DECODE_PORTABLE_ROWS=16|32|64 caps it (measurements;
// read once).
int portable_rows_per_block(int64_t rows);

// Parts wanted for one head block (from the SM count and the kernel's
// residency) and the plan's capacity in parts, for bs sequences of s_q x h_q
// rows: target_parts + bs, or bs for a plan that splits nothing (`split`
// false; the two sizes differ, so the attention op tells the kinds apart).
std::pair<int64_t, int64_t> plan_parts(int64_t bs, int64_t s_q, int64_t h_q, const DeviceAttnInfo& info,
                                       bool split = true);

// Whether `stream` is capturing a graph.
bool capturing(stream_t stream);

}  // namespace mla::api::detail
