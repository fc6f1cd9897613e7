// The combine: merges the fp32 partials of every split sequence by their
// LSE into the output (the attention writes unsplit sequences itself).
// Shared by the portable and the Hopper attention kernel. And the merge of N
// whole partial results (decode context parallelism's ranks) by their LSE.
#include "../../platform/bf16.h"
#include "../../platform/vendor.h"

#include "attention.h"

namespace mla {
namespace {

// A task is one (sequence, query row, group of kG chunks of kV x warp-size
// columns): kG is the row's whole width (a warp per row) where the batch has
// rows enough to keep the loads in flight over the GPU, else one chunk (the
// row's chunks on separate warps: a few long rows, many splits). The lanes
// take the LSE maximum and sum a warp's width of splits at a time; the warp
// adds kU splits per step, all their loads in flight (each lane reads a
// split's LSE beside its partial: no load waits on a weight). A whole row
// issues its first step's loads before the maximum's: a row of up to kU splits
// is then one round trip to memory (at a warp per chunk the same measured
// slower: docs/not_kept.md). Up to p.max_warps tasks, a warp per task (a block
// per sequence and kCombineWarps tasks); beyond, p.max_warps warps, each a
// contiguous run of tasks that skips a sequence that was not split (written by
// the attention) with one read, so that a large batch with nothing to merge
// costs a wave of warps, not a block per four rows. (The looped form is slower
// where a warp per task fits: docs/not_kept.md.)
constexpr int kCombineWarps = 4;
constexpr int kCombineUnroll = 8;  // splits per step at most
// Partial floats per lane in flight per step for a whole row; half that for
// a chunk (more warps: the registers for them).
constexpr int kCombineLoadFloats = 64;

template <int kDv, bool kWholeRow>
struct CombineShape {
  static constexpr int kV = kDv / kWarpSize < 4 ? kDv / kWarpSize : 4;  // floats per lane and chunk: 16 bytes at most
  static constexpr int kCols = kV * kWarpSize;                           // a chunk's columns
  static constexpr int kChunks = kDv / kCols;
  static constexpr int kG = kWholeRow ? kChunks : 1;  // chunks per task
  static constexpr int kTasksPerRow = kChunks / kG;
  static constexpr int kLoads = (kWholeRow ? kCombineLoadFloats : kCombineLoadFloats / 2) / (kG * kV);
  static constexpr int kU = kLoads < kCombineUnroll ? kLoads : kCombineUnroll;  // splits per step
  static_assert(kV >= 1 && kDv % kCols == 0, "Dv must be a whole number of warp-wide chunks");
  static_assert(kU >= 1, "a step holds one split's group at least");
};

template <int kV>
MLA_DEVICE void load_floats(const float* src, float (&x)[kV]) {
  if constexpr (kV == 4) {
    const float4 v = *reinterpret_cast<const float4*>(src);
    x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
  } else if constexpr (kV == 2) {
    const float2 v = *reinterpret_cast<const float2*>(src);
    x[0] = v.x, x[1] = v.y;
  } else {
    x[0] = *src;
  }
}

template <int kV, bool kF16>
MLA_DEVICE void store_halves(bf16_t* dst, const float (&x)[kV]) {
  using E = Half16<kF16>;
  if constexpr (kV == 4) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(E::pack2(x[0], x[1]), E::pack2(x[2], x[3]));
  } else if constexpr (kV == 2) {
    *reinterpret_cast<uint32_t*>(dst) = E::pack2(x[0], x[1]);
  } else {
    *dst = E::from_float(x[0]);
  }
}

// Splits s0 .. s0 + kU - 1 of the task's chunks, those below n: partials
// into x, LSEs into l (-inf past n).
template <class C>
MLA_DEVICE void load_step(const float* src, const float* lse_r, int64_t ostride, int64_t lstride, int s0, int n,
                          float (&x)[C::kU][C::kG][C::kV], float (&l)[C::kU]) {
#pragma unroll
  for (int u = 0; u < C::kU; ++u) {
    const int s = s0 + u;
    l[u] = neg_inf();
    if (s < n) {
      l[u] = lse_r[s * lstride];
#pragma unroll
      for (int g = 0; g < C::kG; ++g) load_floats<C::kV>(src + s * ostride + g * C::kCols, x[u][g]);
    }
  }
}

template <int kDv, bool kF16, bool kWholeRow>
MLA_DEVICE void combine_row(const CombineParams& p, int b, int n, int first, int r, int col, int lane) {
  using C = CombineShape<kDv, kWholeRow>;
  const int64_t lstride = p.rows;                              // split s's LSE: lse_r[s * lstride]
  const int64_t ostride = static_cast<int64_t>(p.rows) * kDv;  // split s's chunk: src[s * ostride]
  const float* lse_r = p.lse_part + static_cast<int64_t>(first) * p.rows + r;
  const float* src = p.o_part + (static_cast<int64_t>(first) * p.rows + r) * kDv + col;
  constexpr float kLog2e = 1.4426950408889634f;

  float x[C::kU][C::kG][C::kV], l[C::kU];
  if constexpr (kWholeRow) load_step<C>(src, lse_r, ostride, lstride, 0, n, x, l);
  float mx = neg_inf();
  for (int s = lane; s < n; s += kWarpSize) mx = fmaxf(mx, lse_r[s * lstride]);
#pragma unroll
  for (int off = 1; off < kWarpSize; off <<= 1) mx = fmaxf(mx, shfl_xor(mx, off));
  float acc[C::kG][C::kV];
#pragma unroll
  for (int g = 0; g < C::kG; ++g)
#pragma unroll
    for (int k = 0; k < C::kV; ++k) acc[g][k] = 0.f;
  float lse = neg_inf();
  if (mx != neg_inf()) {
    float sum = 0.f;
    for (int s = lane; s < n; s += kWarpSize) sum += fast_exp2((lse_r[s * lstride] - mx) * kLog2e);
#pragma unroll
    for (int off = 1; off < kWarpSize; off <<= 1) sum += shfl_xor(sum, off);
    lse = mx + fast_log2(sum) / kLog2e;
    for (int s0 = 0; s0 < n; s0 += C::kU) {
      if (!kWholeRow || s0 > 0) load_step<C>(src, lse_r, ostride, lstride, s0, n, x, l);
#pragma unroll
      for (int u = 0; u < C::kU; ++u) {
        const float w = fast_exp2((l[u] - lse) * kLog2e);  // (0 past n)
#pragma unroll
        for (int g = 0; g < C::kG; ++g)
#pragma unroll
          for (int k = 0; k < C::kV; ++k)
            acc[g][k] += w == 0.f ? 0.f : w * x[u][g][k];  // an empty split's partial is never used
      }
    }
  }
  bf16_t* dst = p.o + (static_cast<int64_t>(b) * p.rows + r) * kDv + col;
#pragma unroll
  for (int g = 0; g < C::kG; ++g) store_halves<C::kV, kF16>(dst + g * C::kCols, acc[g]);
  if (col == 0) {
    const int i = r / p.h_q, h = r % p.h_q;
    p.lse[(static_cast<int64_t>(b) * p.h_q + h) * p.s_q + i] = lse;
  }
}

// A sequence's split count, read before pdl_wait: the plan was written by a
// grid that completed before every block of the attention kernel passed its
// own pdl_wait, and a dependent combine launches only once they all have
// (launched in stream order, the wait is a no-op). Through L2, not L1.
MLA_DEVICE int splits_of(const CombineParams& p, int b) {
#if MLA_NVIDIA
  return __ldcg(p.seq_info + 2 * b);
#else
  return p.seq_info[2 * b];
#endif
}

// kRuns false: a block per (sequence, kCombineWarps tasks), grid (bs, blocks
// per sequence), where the batch has at most p.max_warps tasks. kRuns true:
// a grid of p.max_warps warps, each a contiguous run of tasks.
// A warp waits for the attention (pdl_wait) only before its first merge: the
// blocks with nothing to merge (sequences the attention wrote) exit as the
// attention's blocks free their SMs, not after its last one. Block 0 always
// waits, so that this grid completes after the attention grid: the kernels
// after the call (a dependent one too) find its output written.
template <int kDv, bool kF16, bool kRuns, bool kWholeRow>
__global__ void __launch_bounds__(kCombineWarps* kWarpSize) combine_kernel(const CombineParams p) {
  using C = CombineShape<kDv, kWholeRow>;
  const int warp = thread_x() / kWarpSize, lane = thread_x() % kWarpSize;
  const auto merge = [&](int b, int n, int task) {
    combine_row<kDv, kF16, kWholeRow>(p, b, n, p.seq_info[2 * b + 1], task / C::kTasksPerRow,
                                      (task % C::kTasksPerRow) * C::kG * C::kCols + lane * C::kV, lane);
  };
  if constexpr (!kRuns) {
    const int b = block_x();
    const int n = splits_of(p, b);
    const int task = block_y() * kCombineWarps + warp;
    if (!(p.skip_single_split && n == 1) && task < p.rows * C::kTasksPerRow) {
      pdl_wait();  // (the attention kernel's partials are visible from here)
      merge(b, n, task);
    }
  } else {
    // (32-bit: launch_combine_tasks refuses a batch of 2^30 tasks or more)
    const int per_seq = p.rows * C::kTasksPerRow, tasks = per_seq * p.bs;
    const int per_warp = (tasks + p.max_warps - 1) / p.max_warps;
    const int w = block_x() * kCombineWarps + warp;
    const int end = min(tasks, (w + 1) * per_warp);
    int b = -1, n = 0;  // (a warp's run rarely spans two sequences: their count read once each)
#pragma unroll 1
    for (int t = w * per_warp; t < end;) {
      if (t / per_seq != b) {
        b = t / per_seq;
        n = splits_of(p, b);
      }
      if (p.skip_single_split && n == 1) {
        t = (b + 1) * per_seq;
        continue;
      }
      pdl_wait();  // (returns at once after the first time)
      merge(b, n, t - b * per_seq);
      ++t;
    }
  }
  if (block_x() == 0 && block_y() == 0) pdl_wait();
}

// The merge: thread i takes piece i % per_row of row i / per_row, a piece
// being kV elements (16 bytes, or one element where the rows are not
// 16-byte pieces); the row's weights come from its n LSEs (read by every
// thread of the row: n floats from L1).
constexpr int kMergeThreads = 256;

template <int kType>
MLA_DEVICE float load_elt(const void* base, int64_t i) {
  if constexpr (kType == 2) return static_cast<const float*>(base)[i];
  return Half16<kType == 1>::lo(static_cast<const uint16_t*>(base)[i]);  // (the low half of a word)
}

template <int kType, bool kVec>
__global__ void __launch_bounds__(kMergeThreads) merge_kernel(const MergeParams p) {
  constexpr int kV = !kVec ? 1 : kType == 2 ? 4 : 8;
  const int per_row = p.dv / kV;
  const int64_t rows = static_cast<int64_t>(p.bs) * p.s_q * p.h_q;
  const int64_t i = static_cast<int64_t>(block_x()) * kMergeThreads + thread_x();
  if (i >= rows * per_row) return;
  const int64_t row = i / per_row;
  const int piece = static_cast<int>(i % per_row);
  const int h = static_cast<int>(row % p.h_q);
  const int64_t bs_ = row / p.h_q;  // b * s_q + s
  const int s = static_cast<int>(bs_ % p.s_q);
  const int64_t b = bs_ / p.s_q;
  const int64_t lrow = (b * p.h_q + h) * p.s_q + s;  // the row's LSE index in [bs, h_q, s_q]
  const int64_t lstride = rows;
  constexpr float kLog2e = 1.4426950408889634f;
  float mx = neg_inf();
  for (int r = 0; r < p.n; ++r) mx = fmaxf(mx, p.lses[r * lstride + lrow]);
  float acc[kV];
#pragma unroll
  for (int k = 0; k < kV; ++k) acc[k] = 0.f;
  float lse = neg_inf();
  if (mx != neg_inf()) {
    float sum = 0.f;
    for (int r = 0; r < p.n; ++r) sum += fast_exp2((p.lses[r * lstride + lrow] - mx) * kLog2e);
    lse = mx + fast_log2(sum) / kLog2e;
    for (int r = 0; r < p.n; ++r) {
      const float w = fast_exp2((p.lses[r * lstride + lrow] - lse) * kLog2e);
      if (w == 0.f) continue;  // a partial that saw no key is never read
      const int64_t e0 = (r * rows + row) * p.dv + static_cast<int64_t>(piece) * kV;
      if constexpr (kVec) {
        const uint4 v = *reinterpret_cast<const uint4*>(static_cast<const char*>(p.outs) +
                                                        e0 * (kType == 2 ? 4 : 2));
        const uint32_t wd[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          if constexpr (kType == 2) {
            acc[k] += w * __builtin_bit_cast(float, wd[k]);
          } else {
            acc[2 * k] += w * Half16<kType == 1>::lo(wd[k]);
            acc[2 * k + 1] += w * Half16<kType == 1>::hi(wd[k]);
          }
        }
      } else {
        acc[0] += w * load_elt<kType>(p.outs, e0);
      }
    }
  }
  const int64_t o0 = row * p.dv + static_cast<int64_t>(piece) * kV;
  if constexpr (kType == 2) {
#pragma unroll
    for (int k = 0; k < kV; ++k) static_cast<float*>(p.out)[o0 + k] = acc[k];
  } else if constexpr (kVec) {
    uint4 v;
    v.x = Half16<kType == 1>::pack2(acc[0], acc[1]);
    v.y = Half16<kType == 1>::pack2(acc[2], acc[3]);
    v.z = Half16<kType == 1>::pack2(acc[4], acc[5]);
    v.w = Half16<kType == 1>::pack2(acc[6], acc[7]);
    *reinterpret_cast<uint4*>(static_cast<char*>(p.out) + o0 * 2) = v;
  } else {
    static_cast<bf16_t*>(p.out)[o0] = Half16<kType == 1>::from_float(acc[0]);
  }
  if (piece == 0) p.lse[lrow] = lse;
}

}  // namespace

// As a programmatic dependent launch where p.pdl (NVIDIA), else a plain
// one. The launch call's own error, or nullptr (then last_launch_error).
template <int kDv, bool kF16, bool kRuns, bool kWholeRow>
const char* launch_combine_as(dim3 grid, const CombineParams& p, stream_t stream) {
  const auto kernel = combine_kernel<kDv, kF16, kRuns, kWholeRow>;
#if MLA_NVIDIA
  if (p.pdl) return launch_ex(kernel, grid, dim3(kCombineWarps * kWarpSize), 0, stream, true, dim3(1), p);
#endif
  kernel<<<grid, kCombineWarps * kWarpSize, 0, stream>>>(p);
  return nullptr;
}

template <int kDv, bool kRuns, bool kWholeRow>
const char* launch_combine_grid(dim3 grid, const CombineParams& p, stream_t stream) {
  if (const char* e = p.f16 ? launch_combine_as<kDv, true, kRuns, kWholeRow>(grid, p, stream)
                            : launch_combine_as<kDv, false, kRuns, kWholeRow>(grid, p, stream))
    return e;
  return last_launch_error();
}

template <int kDv, bool kWholeRow>
const char* launch_combine_tasks(const CombineParams& p, stream_t stream) {
  const int64_t per_seq = static_cast<int64_t>(p.rows) * CombineShape<kDv, kWholeRow>::kTasksPerRow;
  const int64_t tasks = per_seq * p.bs;
  if (tasks <= p.max_warps) {  // a warp per task
    const int64_t blocks = (per_seq + kCombineWarps - 1) / kCombineWarps;
    if (blocks > 65535) return "launch_combine: too many query rows per sequence (s_q * h_q)";
    return launch_combine_grid<kDv, false, kWholeRow>(dim3(p.bs, static_cast<unsigned>(blocks)), p, stream);
  }
  if (tasks >= (int64_t{1} << 30)) return "launch_combine: 2^30 (sequence, row, chunks) tasks or more";
  const int64_t blocks = (static_cast<int64_t>(p.max_warps) + kCombineWarps - 1) / kCombineWarps;
  return launch_combine_grid<kDv, true, kWholeRow>(dim3(static_cast<unsigned>(blocks)), p, stream);
}

// A warp per whole row where a row is several chunks and a chunk per warp
// would take more than a wave of warps (rows enough to fill the GPU), else
// a warp per chunk.
template <int kDv>
const char* launch_combine_dv(const CombineParams& p, stream_t stream) {
  if (p.max_warps <= 0 || p.wave_warps <= 0) return "launch_combine: max_warps and wave_warps must be positive";
  using C = CombineShape<kDv, false>;
  if constexpr (C::kChunks > 1) {
    if (static_cast<int64_t>(p.rows) * p.bs * C::kTasksPerRow > p.wave_warps)
      return launch_combine_tasks<kDv, true>(p, stream);
  }
  return launch_combine_tasks<kDv, false>(p, stream);
}

const char* launch_combine(const CombineParams& p, stream_t stream) {
  if (p.bs <= 0 || p.rows <= 0) return "launch_combine: empty sizes";
  switch (p.dv) {
    case 64: return launch_combine_dv<64>(p, stream);
    case 128: return launch_combine_dv<128>(p, stream);
    case 256: return launch_combine_dv<256>(p, stream);
    case 512: return launch_combine_dv<512>(p, stream);
    default: return "launch_combine: unsupported value width (supported: 64, 128, 256, 512)";
  }
}

const char* launch_merge(const MergeParams& p, stream_t stream) {
  if (p.n <= 0 || p.bs <= 0 || p.s_q <= 0 || p.h_q <= 0 || p.dv <= 0) return "launch_merge: empty sizes";
  const int v = !p.vec ? 1 : p.type == 2 ? 4 : 8;
  if (p.dv % v != 0) return "launch_merge: dv is not a whole number of 16-byte pieces";
  const int64_t threads = static_cast<int64_t>(p.bs) * p.s_q * p.h_q * (p.dv / v);
  const int64_t blocks = (threads + kMergeThreads - 1) / kMergeThreads;
  if (blocks > 0x7fffffff) return "launch_merge: too many rows";
  const dim3 grid(static_cast<unsigned>(blocks));
  switch (p.type * 2 + (p.vec ? 1 : 0)) {
#define MLA_CASE(T)                                                               \
  case 2 * T:                                                                     \
    merge_kernel<T, false><<<grid, kMergeThreads, 0, stream>>>(p);                \
    break;                                                                        \
  case 2 * T + 1:                                                                 \
    merge_kernel<T, true><<<grid, kMergeThreads, 0, stream>>>(p);                 \
    break;
    MLA_CASE(0) MLA_CASE(1) MLA_CASE(2)
#undef MLA_CASE
    default:
      return "launch_merge: unsupported element type (bf16, fp16 or fp32)";
  }
  return last_launch_error();
}

}  // namespace mla
