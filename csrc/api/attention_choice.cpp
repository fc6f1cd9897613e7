// Which attention kernel runs for a device and shape, and the per-device
// facts the planner sizes its plan with (read once per device and shape).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "../platform/switches.h"
#include "attention_internal.h"
#include "checks.h"
#include "ops.h"

#ifndef MLA_BUILD_ARCHS
#define MLA_BUILD_ARCHS "unknown"
#endif

namespace mla::api {
namespace detail {
namespace {

constexpr int kShapes = 20;  // shape_index's range

// The attention kernel for `device` and the shape: the Hopper (wgmma) kernel
// where this build carries sm_90a code, the device is compute capability 9.x
// and dv is 128, 256 or 512 with the rope keys shared (any rope width;
// on-the-fly RoPE only at width 64), else the portable tile-MMA kernel.
// MLA_DECODE_ATTN_KERNEL=portable|hopper overrides (for measurements and
// tests; read once); `hopper` applies to those shapes only. An fp8 cache:
// the portable kernel (its fp8 instance) on every device.
// rope_in_key 0: per-head rope keys.
bool hopper_shape(int64_t dv, int64_t rope_in_key, bool rope_on_the_fly) {
  if (rope_in_key == 0) return !rope_on_the_fly && sm90_per_head_supported(static_cast<int>(dv));
  return sm90_shape_supported(static_cast<int>(dv), static_cast<int>(rope_in_key)) &&
         (!rope_on_the_fly || rope_in_key == kRope);
}

AttnKernel attn_kernel_for(int device, int64_t dv, int64_t rope, bool rope_on_the_fly, bool fp8, bool fp8_tma) {
  if (fp8 && !(fp8_tma && dv == 512 && rope == 64 && !rope_on_the_fly)) return AttnKernel::kPortable;
  if (!hopper_shape(dv, rope, rope_on_the_fly)) return AttnKernel::kPortable;
  static const int forced = [] {
    const std::string& v = switches().attn_kernel;
    if (v.empty()) return -1;
    if (v == "portable") return 0;
    if (v == "hopper") return 1;
    fail_value("MLA_DECODE_ATTN_KERNEL must be 'portable' or 'hopper', got '" + v + "'");
  }();
  if (forced >= 0) return static_cast<AttnKernel>(forced);
  const bool has_sm90a = std::string(MLA_BUILD_ARCHS).find("sm_90a") != std::string::npos;
  return has_sm90a && at::cuda::getDeviceProperties(device)->major == 9 ? AttnKernel::kHopper : AttnKernel::kPortable;
}

}  // namespace

int portable_rows_per_block(int64_t rows) {
  static const int cap = [] {
    const int v = switches().portable_rows;
    if (v != 0 && v != 16 && v != 32 && v != 64)
      fail_value("MLA_DECODE_PORTABLE_ROWS must be 16, 32 or 64, got " + num(int64_t{v}));
    return v == 0 ? 64 : v;
  }();
  const int want = rows <= 16 ? 16 : rows <= 32 ? 32 : 64;
  return std::min(want, cap);
}

int shape_index(int64_t dv, int64_t rope) {
  static constexpr int64_t kDvs[] = {64, 128, 256, 512}, kRopes[] = {0, 8, 16, 32, 64};
  int i = -1, j = -1;
  for (int k = 0; k < 4; ++k) i = kDvs[k] == dv ? k : i;
  for (int k = 0; k < 5; ++k) j = kRopes[k] == rope ? k : j;
  return i < 0 || j < 0 ? -1 : i * 5 + j;
}

const DeviceAttnInfo& device_attn_info(int device, int64_t dv, int64_t rope, bool rope_on_the_fly, int64_t rows,
                                       bool fp8, bool fp8_tma) {
  static std::mutex mu;
  // per device: shape x RoPE on the fly x the portable head block (16, 32, 64 rows) x fp8 cache
  static std::array<std::array<DeviceAttnInfo, 18 * kShapes>, 64> cache{};
  static std::array<std::array<bool, 18 * kShapes>, 64> ready{};
  if (device < 0 || device >= 64) fail_value("device index out of range: " + num(int64_t{device}));
  const int shape = shape_index(dv, rope);
  if (shape < 0)
    fail_value("unsupported attention shape dv=" + num(dv) + ", rope=" + num(rope) + "; " + kAttnShapesSupported);
  if (rows <= 0) fail_value("attention: query rows per sequence must be positive, got " + num(rows));
  const int block_rows = portable_rows_per_block(rows);
  const int si = 18 * shape + 6 * (fp8 ? (fp8_tma ? 2 : 1) : 0) + 3 * (rope_on_the_fly ? 1 : 0) +
                 (block_rows == 16 ? 0 : block_rows == 32 ? 1 : 2);
  std::lock_guard<std::mutex> lock(mu);
  if (!ready[device][si]) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    const auto* props = at::cuda::getDeviceProperties(device);
    DeviceAttnInfo info;
    info.kind = attn_kernel_for(device, dv, rope, rope_on_the_fly, fp8, fp8_tma);
    check_launch(info.kind == AttnKernel::kHopper
                     ? attn_kernel_info_sm90(static_cast<int>(dv), rope == 0, &info.kernel)
                     : attn_kernel_info_portable(static_cast<int>(dv), static_cast<int>(rope), block_rows, fp8,
                                                 &info.kernel),
                 "attention kernel setup");
    if (props->warpSize != info.kernel.warp_size)
      fail("the attention kernel was compiled for warp size " + num(int64_t{info.kernel.warp_size}) + " but device " +
           num(int64_t{device}) + " runs warp size " + num(int64_t{props->warpSize}));
    info.sm_count = props->multiProcessorCount;
    cache[device][si] = info;
    ready[device][si] = true;
  }
  return cache[device][si];
}

std::pair<int64_t, int64_t> plan_parts(int64_t bs, int64_t s_q, int64_t h_q, const DeviceAttnInfo& info, bool split) {
  const int64_t rows = s_q * h_q;
  const int64_t head_blocks = (rows + info.kernel.rows_per_block - 1) / info.kernel.rows_per_block;
  const int64_t target_parts =
      std::max<int64_t>(1, static_cast<int64_t>(info.sm_count) * info.kernel.blocks_per_sm / head_blocks);
  const int64_t max_parts = split ? target_parts + bs : bs;
  if (max_parts > 65535) fail("too many parts for one launch: " + num(max_parts));
  return {target_parts, max_parts};
}

}  // namespace detail

int64_t plan_target_parts(int64_t device, int64_t s_q, int64_t h_q) {
  if (s_q <= 0 || h_q <= 0) fail_value("plan_target_parts: s_q and h_q must be positive, got " + num(s_q) + ", " + num(h_q));
  return detail::plan_parts(1, s_q, h_q,
                            detail::device_attn_info(static_cast<int>(device), detail::kDv, detail::kRope, false, s_q * h_q))
      .first;
}

bool splits_possible(int64_t device, int64_t bs, int64_t s_q, int64_t h_q) {
  return bs < plan_target_parts(device, s_q, h_q);
}

AttentionFacts attention_info(int64_t device, int64_t dv, int64_t rope) {
  const detail::DeviceAttnInfo& i = detail::device_attn_info(static_cast<int>(device), dv, rope);
  return {.rows_per_block = i.kernel.rows_per_block,
          .keys_per_tile = i.kernel.tile,
          .threads = i.kernel.threads,
          .smem_bytes = i.kernel.smem_bytes,
          .warp_size = i.kernel.warp_size,
          .blocks_per_sm = i.kernel.blocks_per_sm,
          .sms = i.sm_count,
          .hopper = i.kind == detail::AttnKernel::kHopper};
}

}  // namespace mla::api
