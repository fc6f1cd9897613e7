// Hopper (sm_90a) skinny GEMM: y[m, n] = sum_k x[m, k] W[n, k], bf16 in and
// out, fp32 accumulation, M = the batch (<= 256) and W streamed once.
//
// The weight is the wgmma's A operand (64 rows of W per m64 instruction) and
// x its B operand (N = x's rows padded to 64, 128 or 256), both K-major in
// shared memory as TMA writes them (128-byte swizzle, 64-column boxes; rows
// past the end of x or W and columns past k arrive as zeros). A block owns
// kBN = 128 * kMW rows of W: warpgroup g its kMW 64-row slices; one producer
// warp issues the TMA loads of a `stages`-deep ring (full / empty mbarriers).
//
// Split-K: the blocks of one output tile form a thread-block cluster along x,
// each takes a contiguous share of the k blocks, and at the end block r owns
// a band of x rows of the tile: every block writes its fp32 accumulators of
// the other bands to a global workspace (L2), and after a cluster barrier
// block r sums the S partials of its band (in rank order: the result does not
// depend on which block sums), rounds to bf16 through shared memory and
// writes 16-byte pieces of y. No second launch.
//
// With pdl, the weights of the first `stages` k blocks are requested before
// griddepcontrol.wait: they do not depend on the previous kernel, x does.
#include <algorithm>
#include <array>
#include <cstdlib>
#include <map>
#include <mutex>
#include <tuple>

#include "../../platform/bf16.h"
#include "../../platform/tma_sm90.h"
#include "../../platform/switches.h"
#include "../../platform/vendor.h"
#include "../../platform/wgmma_sm90.h"
#include "gemm.h"

namespace mla {

const char* gemm_sm90_sizes(int m, int k, int batch, int nseg, int n0, int n1) {
  if (m < 1 || m > 256) return "gemm_sm90: x must have 1 to 256 rows";
  if (k < 1 || batch < 1 || batch > 65535) return "gemm_sm90: k >= 1 and batch in [1, 65535] required";
  if (nseg < 1 || nseg > 2) return "gemm_sm90: one or two weights";
  const int ns[2] = {n0, n1};
  for (int i = 0; i < nseg; ++i)
    if (ns[i] < 64 || ns[i] % 8 != 0) return "gemm_sm90: every weight needs a multiple of 8 rows, at least 64";
  return nullptr;
}

#if MLA_NVIDIA
namespace {

struct GemmMaps {
  CUtensorMap x;     // [batch][m][k], boxes 64 x kBM
  CUtensorMap w[2];  // per segment [batch][n][k], boxes 64 x kBN
};

constexpr int kGemmThreads = 288;  // two consumer warpgroups + the producer warp
constexpr int kMaxSplits = 8;      // portable cluster size

template <int kMW, int kBM>
struct GemmTile {
  static constexpr int kBN = 128 * kMW;                   // rows of W per block
  static constexpr int kWBytes = kBN * 128;               // one 64-column k block of W
  static constexpr int kXBytes = kBM * 128;               // ... of x
  static constexpr int kStageBytes = kWBytes + kXBytes;   // a multiple of 1 KB (swizzle atoms)
  static constexpr int kTileBytes = kBM * (kBN + 8) * 2;  // the bf16 output tile (rows padded by 16 bytes)
  static constexpr int64_t kWsBytes = kMW * kBM * 512;    // one block's fp32 accumulators in the workspace
  static_assert(kMW * kBM <= 256, "accumulators: at most 128 floats per thread");
  static_assert(kStageBytes % 1024 == 0, "stages on swizzle-atom boundaries");
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Cluster barrier with release / acquire ordering (the split-K workspace's
// global stores before it are seen by the cluster's loads after it; ptxas
// emits MEMBAR.ALL.GPU for the release, and CCTL.IVALL after the wait).
MLA_DEVICE void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
#endif

// grid: x = split (the cluster), y = tile (segment 0's tiles, then segment 1's), z = batch.
template <int kMW, int kBM>
__global__ void __launch_bounds__(kGemmThreads, 1)
    gemm_sm90_kernel(const GemmParams p, const __grid_constant__ GemmMaps maps, int stages, int group, int region,
                     int tiles0) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = GemmTile<kMW, kBM>;
  constexpr int kBN = T::kBN;
  extern __shared__ __attribute__((aligned(16))) unsigned char smem_raw[];
  unsigned char* smem =
      smem_raw + ((1024 - (static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) & 1023)) & 1023);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + region);
  uint64_t* empty = full + stages;

  const int tid = thread_x();
  const int splits = static_cast<int>(gridDim.x), rank = static_cast<int>(blockIdx.x);
  const int tile = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  const bool s1 = tile >= tiles0;
  const int n0 = (s1 ? tile - tiles0 : tile) * kBN;
  const int kt = (p.k + 63) / 64;
  const int kb = static_cast<int>(static_cast<int64_t>(rank) * kt / splits);
  const int nk = static_cast<int>(static_cast<int64_t>(rank + 1) * kt / splits) - kb;

  if (tid == 256) {  // the producer: fetch the tensor maps while the barriers are set up
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(s1 ? &maps.w[1] : &maps.w[0])) : "memory");
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&maps.x)) : "memory");
  }
  if (tid == 0) {
    for (int s = 0; s < stages; ++s) {
      wg::mbar_init(&full[s], 1);
      wg::mbar_init(&empty[s], 2);
    }
    wg::fence_proxy_async();
  }
  sync_threads();

  if (tid >= 256) {  // the producer warp; one lane issues
    if (tid == 256) {
      const CUtensorMap* wm = s1 ? &maps.w[1] : &maps.w[0];
      const int pro = min(stages, nk);
      for (int i = 0; i < pro; ++i) {
        unsigned char* st = smem + i * T::kStageBytes;
        wg::mbar_arrive_expect_tx(&full[i], T::kStageBytes);
        wg::tma_load_3d(st, wm, (kb + i) * 64, n0, b, &full[i]);
      }
      pdl_wait();  // x is the previous kernel's output
      for (int i = 0; i < pro; ++i)
        wg::tma_load_3d(smem + i * T::kStageBytes + T::kWBytes, &maps.x, (kb + i) * 64, 0, b, &full[i]);
      // steady state: wait until `group` slots are free, then request their k
      // blocks back to back. Block j takes slot j % stages; its empty wait's
      // parity is (j / stages - 1) & 1. Both are carried from block to block
      // (no division in the loop: on this one thread, dependent integer
      // divisions by the runtime stage count make a long chain per k block)
      int slot = 0;
      uint32_t par = 0;  // of block j = pro (pro == stages whenever pro < nk)
      for (int i = pro; i < nk; i += group) {
        const int e = min(nk, i + group);
        int sl = slot;
        uint32_t pa = par;
        for (int j = i; j < e; ++j) {
          wg::mbar_wait(&empty[sl], pa);
          if (++sl == stages) sl = 0, pa ^= 1;
        }
        sl = slot;
        for (int j = i; j < e; ++j) {
          wg::mbar_arrive_expect_tx(&full[sl], T::kStageBytes);
          wg::tma_load_3d(smem + sl * T::kStageBytes, wm, (kb + j) * 64, n0, b, &full[sl]);
          if (++sl == stages) sl = 0;
        }
        sl = slot;
        for (int j = i; j < e; ++j) {
          wg::tma_load_3d(smem + sl * T::kStageBytes + T::kWBytes, &maps.x, (kb + j) * 64, 0, b, &full[sl]);
          if (++sl == stages) sl = 0;
        }
        slot = sl;
        par = pa;
      }
    }
  }

  float acc[kMW][kBM / 2];
#pragma unroll
  for (int w = 0; w < kMW; ++w)
#pragma unroll
    for (int j = 0; j < kBM / 2; ++j) acc[w][j] = 0.f;
  // warpgroup index, warp-uniform for the compiler
  const int g = __shfl_sync(0xffffffffu, tid / 128, 0);
  if (tid < 256) {
    int sl = 0, prev = 0;
    uint32_t par = 0;  // slot i % stages and parity (i / stages) & 1 of block i, carried
    for (int i = 0; i < nk; ++i) {
      const unsigned char* st = smem + sl * T::kStageBytes;
      wg::mbar_wait(&full[sl], par);
      const uint64_t da = wg::desc_sw128(st + g * kMW * 64 * 128, 16, 1024);
      const uint64_t db = wg::desc_sw128(st + T::kWBytes, 16, 1024);
      wg::fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int w = 0; w < kMW; ++w)
          wg::wgmma_ss_kk<kBM, false>(acc[w], da + ((w * 64 * 128 + kk * 32) >> 4), db + ((kk * 32) >> 4), 1);
      wg::commit();
      wg::wait<1>();  // the previous k block's products are done: its stage is free
      if (i > 0 && (tid & 127) == 0) wg::mbar_arrive(&empty[prev]);
      prev = sl;
      if (++sl == stages) sl = 0, par ^= 1;
    }
    wg::wait<0>();
  }
  pdl_trigger();

  // The split-K reduction. A consumer thread's accumulators are kMW * kBM / 8
  // float4 pieces, piece (w, jj) holding x rows (columns of the m64 tile) 8 jj
  // + 2 (lane & 3) + {0, 1} at W rows r0 and r0 + 8 (r0 from the warp and
  // lane). Block `rank` of the cluster owns the pieces jj in [jlo, jhi), that
  // is x rows [8 jlo, 8 jhi) of the tile. Every block writes all its pieces
  // to the workspace in this layout (thread-contiguous float4: coalesced);
  // after the cluster barrier (release / acquire: the stores are seen) each
  // thread reads the S partials of two owned pieces at a time, all 2 S loads
  // issued before the first sum, and adds them in rank order: the sum does
  // not depend on which block makes it. (Summing from the registers for the
  // own partial and loading the others one piece and split at a time would
  // leave ~S x pieces dependent L2 round trips per thread; a sum through
  // distributed shared memory costs a large share of the kernel.)
  constexpr int kJJ = kBM / 8;  // pieces per 64-row slice
  const int jlo = rank * kJJ / splits, jhi = (rank + 1) * kJJ / splits;
  const int lane = tid & 31, warp = (tid & 127) >> 5;
  const int64_t blk = (static_cast<int64_t>(b) * gridDim.y + tile) * splits;  // the cluster's first block
  constexpr int kPieces = kMW * kJJ;
  float4* ws = reinterpret_cast<float4*>(p.ws);
  if (splits > 1) {
    pdl_wait();  // the workspace may still be read by the previous kernel (no-op once waited)
    if (tid < 256) {
#pragma unroll
      for (int w = 0; w < kMW; ++w)
#pragma unroll
        for (int jj = 0; jj < kJJ; ++jj) {
          __stcg(ws + ((blk + rank) * kPieces + w * kJJ + jj) * 256 + tid,
                 make_float4(acc[w][4 * jj], acc[w][4 * jj + 1], acc[w][4 * jj + 2], acc[w][4 * jj + 3]));
        }
    }
    cluster_sync();
  }
  // every load has landed and been read: the ring becomes the bf16 tile of
  // the owned rows, [8 (jhi - jlo)][kBN + 8]
  sync_threads();
  constexpr int kTileStride = kBN + 8;  // bf16; rows 16 bytes apart modulo 128: conflict-free 16-byte reads
  bf16_t* tile_s = reinterpret_cast<bf16_t*>(smem);
  auto put = [&](int w, int jj, float4 v) {
    const int r0 = (g * kMW + w) * 64 + warp * 16 + (lane >> 2);
    const int c = 8 * (jj - jlo) + 2 * (lane & 3);
    tile_s[c * kTileStride + r0] = float_to_bf16(v.x);
    tile_s[(c + 1) * kTileStride + r0] = float_to_bf16(v.y);
    tile_s[c * kTileStride + r0 + 8] = float_to_bf16(v.z);
    tile_s[(c + 1) * kTileStride + r0 + 8] = float_to_bf16(v.w);
  };
  if (tid < 256) {
    if (splits > 1) {
      const int nb = jhi - jlo, np = kMW * nb;
      for (int pi = 0; pi < np; pi += 2) {
        float4 u[2][kMaxSplits];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int pc = min(pi + h, np - 1);
          const int64_t base = (blk * kPieces + (pc / nb) * kJJ + jlo + pc % nb) * 256 + tid;
#pragma unroll
          for (int q = 0; q < kMaxSplits; ++q)
            if (q < splits) u[h][q] = __ldcg(ws + base + static_cast<int64_t>(q) * kPieces * 256);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (pi + h >= np) break;
          float4 v = u[h][0];
#pragma unroll
          for (int q = 1; q < kMaxSplits; ++q)
            if (q < splits) v.x += u[h][q].x, v.y += u[h][q].y, v.z += u[h][q].z, v.w += u[h][q].w;
          put((pi + h) / nb, jlo + (pi + h) % nb, v);
        }
      }
    } else {
      // (+ 0.f: converting the accumulators straight to bf16 made ptxas
      // serialize every wgmma of the k loop, C7514; an add keeps it from that)
#pragma unroll
      for (int w = 0; w < kMW; ++w)
#pragma unroll
        for (int jj = 0; jj < kJJ; ++jj)
          put(w, jj, make_float4(acc[w][4 * jj] + 0.f, acc[w][4 * jj + 1] + 0.f, acc[w][4 * jj + 2] + 0.f,
                                 acc[w][4 * jj + 3] + 0.f));
    }
  }

  sync_threads();

  pdl_wait();  // (a no-op by now; y may be read by the previous kernel)
  const GemmSeg& sg0 = p.seg[0];
  const GemmSeg& sg1 = p.seg[1];
  bf16_t* y = s1 ? sg1.y : sg0.y;
  const int64_t y_rs = s1 ? sg1.y_row_stride : sg0.y_row_stride;
  const int64_t y_bs = s1 ? sg1.y_batch_stride : sg0.y_batch_stride;
  const int32_t* row_pos = s1 ? sg1.row_pos : sg0.row_pos;
  const int64_t y_ps = s1 ? sg1.y_pos_stride : sg0.y_pos_stride;
  const int pos_limit = s1 ? sg1.pos_limit : sg0.pos_limit;
  const int n = s1 ? sg1.n : sg0.n;
  const int mb = 8 * jlo, me = min(p.m, 8 * jhi);
  constexpr int kOct = kBN / 8;
  // one 16-byte piece (8 columns of y) per thread and step
  for (int idx = tid; idx < (me - mb) * kOct; idx += kGemmThreads) {
    const int m = mb + idx / kOct, c = (idx % kOct) * 8;
    if (n0 + c >= n) continue;
    int64_t off = static_cast<int64_t>(b) * y_bs + static_cast<int64_t>(m) * y_rs + n0 + c;
    if (row_pos != nullptr) {
      const int pos = row_pos[m] - 1;
      if (pos < 0 || pos >= pos_limit) continue;
      off += static_cast<int64_t>(pos) * y_ps;
    }
    *reinterpret_cast<uint4*>(y + off) = *reinterpret_cast<const uint4*>(tile_s + (m - mb) * kTileStride + c);
  }
#endif
}

using KernelFn = void (*)(GemmParams, GemmMaps, int, int, int, int);

struct Choice {
  KernelFn fn;
  int mw, bm, stage_bytes, tile_bytes;
  int64_t ws_bytes;  // per block, with splits > 1
};

template <int kMW, int kBM>
Choice choice() {
  using T = GemmTile<kMW, kBM>;
  return {gemm_sm90_kernel<kMW, kBM>, kMW, kBM, T::kStageBytes, T::kTileBytes, T::kWsBytes};
}

Choice pick_kernel(int mw, int bm) {
  if (mw == 2 && bm == 64) return choice<2, 64>();
  if (mw == 2 && bm == 128) return choice<2, 128>();
  if (mw == 1 && bm == 64) return choice<1, 64>();
  if (mw == 1 && bm == 128) return choice<1, 128>();
  if (mw == 1 && bm == 256) return choice<1, 256>();
  return {nullptr, mw, bm, 0, 0, 0};
}

// Clusters of `splits` blocks that fit on the device at once (occupancy
// calculator, cached per device, kernel, cluster size and shared memory).
int active_clusters(KernelFn fn, int splits, int smem) {
  static std::mutex mu;
  static std::map<std::tuple<int, KernelFn, int, int>, int> cache;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  const auto key = std::make_tuple(dev, fn, splits, smem);
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  if (set_max_dynamic_smem(fn, smem) != nullptr) return 0;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(splits, 1, 1);
  cfg.blockDim = dim3(kGemmThreads);
  cfg.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = splits;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, fn, &cfg) != cudaSuccess) {
    (void)cudaGetLastError();
    n = 0;
  }
  std::lock_guard<std::mutex> lock(mu);
  cache[key] = n;
  return n;
}

bool aligned16(const void* ptr, int64_t s1, int64_t s2) {
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && s1 % 8 == 0 && s2 % 8 == 0;
}

struct Plan {
  GemmConfig cfg;
  Choice k;
  int tiles0;
};

// The sizes' part of plan() (the alignment checked there).
const char* plan_sizes(int m, int k, int batch, int nseg, int n0, int n1, Plan* out) {
  if (const char* e = gemm_sm90_sizes(m, k, batch, nseg, n0, n1)) return e;
  const int ns[2] = {n0, n1};
  bool wide = true;
  for (int i = 0; i < nseg; ++i)
    if (ns[i] < 256) wide = false;
  // the choice depends on the device and the sizes alone: made once per
  // device and sizes (the search below asks the occupancy calculator per
  // candidate, which a cold host would pay on every launch)
  static std::mutex memo_mu;
  static std::map<std::array<int, 7>, Plan> memo;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return "gemm_sm90: cannot query the device";
  }
  const std::array<int, 7> memo_key{dev, m, k, batch, nseg, n0, nseg == 2 ? n1 : 0};
  {
    std::lock_guard<std::mutex> lock(memo_mu);
    auto it = memo.find(memo_key);
    if (it != memo.end()) {
      *out = it->second;
      return nullptr;
    }
  }
  int sms = 0, smem_max = 0;
  if (!sm90_device_limits(&sms, &smem_max)) return "gemm_sm90: cannot query the device";
  const int bm = m <= 64 ? 64 : m <= 128 ? 128 : 256;
  const int kt = (k + 63) / 64;
  // measurement switches (benchmarks; unset in normal use): force the tile
  // width (MLA_DECODE_GEMM_MW = 1 or 2), the split count and the load group
  const int force_mw = switches().gemm_mw, force_s = switches().gemm_splits;
  const int force_group = switches().gemm_group;
  double best = -1.0;
  for (int mw : {2, 1}) {
    const bool two_ok = bm <= 128 && wide;
    if (mw == 2 && !two_ok) continue;
    if (force_mw > 0 && mw != force_mw && (force_mw == 1 || two_ok)) continue;
    const Choice ch = pick_kernel(mw, bm);
    if (ch.fn == nullptr) continue;
    const int sb = ch.stage_bytes, rb = ch.tile_bytes;
    const int stages = std::min(8, (smem_max - 1024 - 16 * 8) / sb);
    if (stages < 2) continue;
    const int region = std::max(stages * sb, rb);
    const int smem = 1024 + region + 2 * stages * 8;
    if (smem > smem_max) continue;
    const int bn = 128 * mw;
    int tiles0 = (n0 + bn - 1) / bn, tiles = tiles0;
    if (nseg == 2) tiles += (n1 + bn - 1) / bn;
    const int64_t units = static_cast<int64_t>(tiles) * batch;
    if (units > 65535 * static_cast<int64_t>(batch)) return "gemm_sm90: too many tiles";
    for (int s = 1; s <= std::min(kMaxSplits, kt); ++s) {
      if (force_s > 0 && s != force_s) continue;
      if (force_s <= 0 && s > 1 && units * s > 2 * static_cast<int64_t>(sms)) break;
      const int act = active_clusters(ch.fn, s, smem);
      if (act < 1) continue;
      const int64_t waves = (units + act - 1) / act;
      // the share of SM time that holds a block (one block per SM), less a
      // little per extra wave; ties go to the narrower tile (its smaller
      // stages make a deeper pipeline), then to fewer splits
      const double score = static_cast<double>(units * s) / static_cast<double>(waves * sms) -
                           0.05 * static_cast<double>(waves - 1) - (mw == 2 ? 0.01 : 0.0) - 0.001 * s;
      if (score > best) {
        best = score;
        out->k = ch;
        out->tiles0 = tiles0;
        // at most stages - 1: the slot being read is released only after the next one is
        const int group = std::min(stages - 1, force_group > 0 ? force_group : (stages >= 6 ? 2 : 1));
        out->cfg = GemmConfig{bn, bm, s, stages, static_cast<int>(units * s), smem, group,
                               s > 1 ? units * s * ch.ws_bytes : 0};
      }
    }
  }
  if (best < 0) return "gemm_sm90: no configuration fits this device's shared memory";
  std::lock_guard<std::mutex> lock(memo_mu);
  memo.emplace(memo_key, *out);
  return nullptr;
}

const char* alignment(const GemmParams& p) {
  if (!aligned16(p.x, p.x_row_stride, p.x_batch_stride))
    return "gemm_sm90: x needs a 16-byte aligned base and row/batch strides that are multiples of 8 elements";
  for (int i = 0; i < p.nseg; ++i) {
    const GemmSeg& s = p.seg[i];
    if (!aligned16(s.w, s.w_row_stride, s.w_batch_stride))
      return "gemm_sm90: weights need a 16-byte aligned base and row/batch strides that are multiples of 8 elements";
    if (!aligned16(s.y, s.y_row_stride, s.y_batch_stride) || (s.row_pos != nullptr && s.y_pos_stride % 8 != 0))
      return "gemm_sm90: outputs need a 16-byte aligned base and strides that are multiples of 8 elements";
  }
  return nullptr;
}

const char* plan(const GemmParams& p, Plan* out) {
  if (p.nseg < 1 || p.nseg > 2) return "gemm_sm90: one or two weights";
  if (const char* e = plan_sizes(p.m, p.k, p.batch, p.nseg, p.seg[0].n, p.nseg == 2 ? p.seg[1].n : 0, out)) return e;
  return alignment(p);
}

}  // namespace

// The current device's SM count and opt-in shared memory per block, queried
// once per device (plan() runs on every launch).
bool sm90_device_limits(int* sms, int* smem_max) {
  static std::mutex mu;
  static std::map<int, std::pair<int, int>> cache;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(dev);
    if (it != cache.end()) {
      *sms = it->second.first;
      *smem_max = it->second.second;
      return true;
    }
  }
  if (cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(smem_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  std::lock_guard<std::mutex> lock(mu);
  cache[dev] = {*sms, *smem_max};
  return true;
}

const char* gemm_sm90_config_for(int m, int k, int batch, int n0, int n1, GemmConfig* cfg) {
  Plan pl{};
  if (const char* e = plan_sizes(m, k, batch, n1 > 0 ? 2 : 1, n0, n1, &pl)) return e;
  *cfg = pl.cfg;
  return nullptr;
}

const char* gemm_sm90_config(const GemmParams& p, GemmConfig* cfg) {
  Plan pl{};
  if (const char* e = plan(p, &pl)) return e;
  *cfg = pl.cfg;
  return nullptr;
}

const char* gemm_sm90_aligned(const GemmParams& p) {
  if (p.nseg < 1 || p.nseg > 2) return "gemm_sm90: one or two weights";
  return alignment(p);
}

const char* launch_gemm_sm90(const GemmParams& p, const GemmConfig& c, stream_t stream) {
  const Choice k = pick_kernel(c.bn / 128, c.bm);
  if (k.fn == nullptr || c.bn % 128 != 0 || c.splits < 1 || c.splits > kMaxSplits || c.blocks % (c.splits * p.batch) != 0)
    return "gemm_sm90: not a configuration of gemm_sm90_config";
  const int tiles0 = (p.seg[0].n + c.bn - 1) / c.bn;
  GemmMaps maps{};
  if (!encode_rows(&maps.x, p.x, p.k, p.m, p.batch, p.x_row_stride, p.x_batch_stride, c.bm, true))
    return "gemm_sm90: TMA cannot describe x";
  for (int i = 0; i < p.nseg; ++i) {
    const GemmSeg& s = p.seg[i];
    if (!encode_rows(&maps.w[i], s.w, p.k, s.n, p.batch, s.w_row_stride, s.w_batch_stride, c.bn, true))
      return "gemm_sm90: TMA cannot describe a weight";
  }
  if (c.ws_bytes > 0 && (p.ws == nullptr || p.ws_bytes < c.ws_bytes || reinterpret_cast<uintptr_t>(p.ws) % 16 != 0))
    return "gemm_sm90: the split-K workspace is missing, misaligned or smaller than gemm_sm90_config's ws_bytes";
  if (const char* e = set_max_dynamic_smem(k.fn, c.smem)) return e;
  const int tiles = c.blocks / (c.splits * p.batch);
  const int region = c.smem - 1024 - 2 * c.stages * 8;
  return launch_ex(k.fn, dim3(c.splits, tiles, p.batch), dim3(kGemmThreads), c.smem, stream, p.pdl, dim3(c.splits, 1, 1), p, maps,
                   c.stages, c.group, region, tiles0);
}

#else  // AMD: the projections use the vendor BLAS there

const char* gemm_sm90_config(const GemmParams&, GemmConfig*) { return "the sm90 GEMM is NVIDIA-only"; }
const char* gemm_sm90_config_for(int, int, int, int, int, GemmConfig*) { return "the sm90 GEMM is NVIDIA-only"; }
const char* gemm_sm90_aligned(const GemmParams&) { return "the sm90 GEMM is NVIDIA-only"; }
const char* launch_gemm_sm90(const GemmParams&, const GemmConfig&, stream_t) { return "the sm90 GEMM is NVIDIA-only"; }

#endif

}  // namespace mla
