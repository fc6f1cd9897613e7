// The combine: merges the fp32 partials of every split sequence by their
// LSE into the output (the attention writes unsplit sequences itself).
// Shared by the portable and the Hopper attention kernel.
#include "../../platform/bf16.h"
#include "../../platform/vendor.h"

#include "attention.h"

namespace mla {
namespace {

// One warp per query row: merge the splits by their LSE.
constexpr int kCombineWarps = 4;

template <int kDv, bool kF16>
__global__ void __launch_bounds__(kCombineWarps* kWarpSize) combine_kernel(const CombineParams p) {
  pdl_wait();  // (a dependent launch: the attention kernel's partials are visible from here)
  const int b = block_x();
  const int n = p.seq_info[2 * b];
  if (p.skip_single_split && n == 1) return;
  const int first = p.seq_info[2 * b + 1];
  const int warp = thread_x() / kWarpSize, lane = thread_x() % kWarpSize;
  const int r = block_y() * kCombineWarps + warp;
  if (r >= p.rows) return;
  constexpr int kPer = kDv / kWarpSize;
  static_assert(kDv % kWarpSize == 0, "Dv must be a multiple of the warp size");

  float mx = neg_inf();
  for (int s = 0; s < n; ++s) mx = fmaxf(mx, p.lse_part[static_cast<int64_t>(first + s) * p.rows + r]);
  float acc[kPer];
#pragma unroll
  for (int k = 0; k < kPer; ++k) acc[k] = 0.f;
  constexpr float kLog2e = 1.4426950408889634f;
  float lse = neg_inf();
  if (mx != neg_inf()) {
    float sum = 0.f;
    for (int s = 0; s < n; ++s)
      sum += fast_exp2((p.lse_part[static_cast<int64_t>(first + s) * p.rows + r] - mx) * kLog2e);
    lse = mx + fast_log2(sum) / kLog2e;
    for (int s = 0; s < n; ++s) {
      const int64_t pr = static_cast<int64_t>(first + s) * p.rows + r;
      const float w = fast_exp2((p.lse_part[pr] - lse) * kLog2e);
      if (w == 0.f) continue;  // an empty split's partial is never read
      const float* src = p.o_part + pr * kDv;
#pragma unroll
      for (int k = 0; k < kPer; ++k) acc[k] += w * src[k * kWarpSize + lane];
    }
  }
  bf16_t* dst = p.o + (static_cast<int64_t>(b) * p.rows + r) * kDv;
#pragma unroll
  for (int k = 0; k < kPer; ++k) dst[k * kWarpSize + lane] = Half16<kF16>::from_float(acc[k]);
  if (lane == 0) {
    const int i = r / p.h_q, h = r % p.h_q;
    p.lse[(static_cast<int64_t>(b) * p.h_q + h) * p.s_q + i] = lse;
  }
}

}  // namespace

// As a programmatic dependent launch where p.pdl (NVIDIA), else a plain
// one. The launch call's own error, or nullptr (then last_launch_error).
template <int kDv, bool kF16>
const char* launch_combine_as(dim3 grid, const CombineParams& p, stream_t stream) {
#if MLA_NVIDIA
  if (p.pdl) return launch_ex(combine_kernel<kDv, kF16>, grid, dim3(kCombineWarps * kWarpSize), 0, stream, true, dim3(1), p);
#endif
  combine_kernel<kDv, kF16><<<grid, kCombineWarps * kWarpSize, 0, stream>>>(p);
  return nullptr;
}

const char* launch_combine(const CombineParams& p, stream_t stream) {
  dim3 grid(p.bs, (p.rows + kCombineWarps - 1) / kCombineWarps);
  switch (p.dv * 2 + (p.f16 ? 1 : 0)) {
#define MLA_CASE(DV)                                         \
  case 2 * DV:                                               \
    if (const char* e = launch_combine_as<DV, false>(grid, p, stream)) return e; \
    break;                                                   \
  case 2 * DV + 1:                                           \
    if (const char* e = launch_combine_as<DV, true>(grid, p, stream)) return e; \
    break;
    MLA_CASE(64) MLA_CASE(128) MLA_CASE(256) MLA_CASE(512)
#undef MLA_CASE
    default:
      return "launch_combine: unsupported value width (supported: 64, 128, 256, 512)";
  }
  return last_launch_error();
}

}  // namespace mla
