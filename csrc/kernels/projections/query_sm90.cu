// Hopper (sm_90a) query stage, one block per head (see query.h).
//
// Phase 1: q_h[m, 192] = q_lora W_qu[h]^T. q_lora is the wgmma's A operand
// (64 rows of the batch per consumer warpgroup, K-major), W_qu[h]'s 192 rows
// its B operand (K-major): an n128 product for the nope columns and an n64
// one for the rope columns, over 64-column k blocks that one producer warp
// streams through a `stages`-deep ring (TMA, 128-byte swizzle; columns past
// k, and rows of q_lora past m up to a multiple of 8, arrive as zeros; the
// slot's rows beyond hold stale data and reach only output rows >= m, which
// are not stored). A slot holds W_qu[h]'s k block (24 KB)
// and q_lora's, 64 rows per warpgroup with rows (8 or 16 KB): the ring is as
// deep as shared memory allows: a block streams its weights only as fast as
// its ring's depth lets it.
// Phase 2: the nope accumulators, rounded to bf16, are packed in registers as
// the A operand of q_abs[m, r] = q_nope W_UK[h] (the accumulator layout is the
// A layout, as in attention's P V), and W_UK[h] streams through the same ring
// after the last k block, 128 columns of r per slot (MN-major B). Each
// 128-column piece of q_abs is rounded into a shared-memory tile of its
// warpgroup and written as 16-byte pieces: every block stores at the same
// time, at the end, and at large batches the accumulators' 4-byte pairs
// stored straight to memory would be the kernel's cost. The tiles lie in
// the one slot phase 2 never fills (load nl's slot) when the ring has more
// slots than phase 2 takes, else after the ring.
// With pdl, the weights of the first `stages` slots are requested before
// griddepcontrol.wait: they do not depend on the previous kernel, q_lora does.
// With append (query.h), q_pe is rotated as it is stored, and a tenth warp
// writes the new cache rows (append_rows).
#include <algorithm>

#include "../../platform/bf16.h"
#include "../../platform/tma_sm90.h"
#include "../../platform/vendor.h"
#include "../../platform/wgmma_sm90.h"
#include "gemm.h"
#include "query.h"

namespace mla {
namespace {
constexpr int kNope = 128, kRope = 64;  // the head's column split the kernel is written for
constexpr int kUkCols = 128;            // columns of r per phase-2 slot
}  // namespace

const char* query_sm90_sizes(int m, int k, int heads, int nope, int rope, int r) {
  if (nope != kNope || rope != kRope) return "query_sm90: the fused query takes heads of 128 nope + 64 rope columns";
  if (r < kUkCols || r % kUkCols != 0) return "query_sm90: the latent width r must be a multiple of 128";
  if (m < 1 || m > 128) return "query_sm90: q_lora must have 1 to 128 rows";
  if (k < 1 || heads < 1 || heads > 65535) return "query_sm90: k >= 1 and heads in [1, 65535] required";
  return nullptr;
}

#if MLA_NVIDIA
namespace {

constexpr int kQThreads = 320;  // two consumer warpgroups (64 rows of q_lora each), the producer warp, the append warp
constexpr int kHeadRows = kNope + kRope;
constexpr int kWBytes = kHeadRows * 128;      // one 64-column k block of W_qu[h]
constexpr int kXBytes = 64 * 128;             // ... of 64 rows of q_lora (one warpgroup's)
constexpr int kUkBoxBytes = kNope * 128;        // one 64-column box of W_uk[h] (nope rows)
constexpr int kUkBytes = 2 * kUkBoxBytes;       // a phase-2 slot: 128 columns
constexpr int kOutStride = kUkCols + 8;         // bf16 per row of a staging tile (16-byte aligned, conflict-free)
constexpr int kOutBytes = 64 * kOutStride * 2;  // one warpgroup's staging tile: 64 rows of q_abs, 128 columns
static_assert(kRope / 2 <= 32, "the append warp rotates one k_pe pair per lane");
static_assert(kWBytes % 1024 == 0 && kXBytes % 1024 == 0 && kUkBytes <= kWBytes + kXBytes,
              "ring slots on swizzle-atom boundaries; a slot holds a phase-2 piece");

struct QueryMaps {
  CUtensorMap x;   // q_lora [m][k], boxes 64 x 128
  CUtensorMap w;   // W_qu [heads * 192][k], boxes 64 x 192
  CUtensorMap uk;  // W_uk [heads][nope][r], boxes 64 (r) x 128 (nope)
};

// rope_append's cache rows for sequences b0, b0 + step, ... (one warp,
// `lane` 0-31): cache[b, pos] = kv_new[b] and kpe_out[b, pos] =
// rot(kv_new[b, width - rope:]), pos = seqlens[b] - 1, or fill_len - 1 for
// every b where fill_len >= 0 (none outside the
// cache). Each lane's loads are issued before its stores: 16-byte pieces
// where the rows allow, in a warp of its own (a one-element-per-lane loop of
// dependent loads and stores in the producer's warp starves its TMA lane).
MLA_DEVICE void append_rows(const RopeAppendParams& ra, int b0, int step, int lane, int fill_len) {
  pdl_wait();  // kv_new is the previous kernel's output
  constexpr int half = kRope / 2;
  const int lim = min(ra.max_len, ra.positions);
  for (int b = b0; b < ra.bs; b += step) {
    const int pos = (fill_len >= 0 ? fill_len : ra.seqlens[b]) - 1;
    if (pos < 0 || pos >= lim) continue;
    const bf16_t* src = ra.kv_new + b * ra.kv_b_stride;
    bf16_t* dst = ra.cache + b * ra.c_b_stride + static_cast<int64_t>(pos) * ra.c_row_stride;
    const bf16_t* cs = ra.rope_cs + static_cast<int64_t>(pos) * kRope;
    const bf16_t* kp = src + ra.width - kRope;
    float k1 = 0.f, k2 = 0.f, c = 0.f, sn = 0.f;
    if (ra.kpe_out != nullptr && lane < half)
      k1 = bf16_to_float(kp[lane]), k2 = bf16_to_float(kp[lane + half]), c = bf16_to_float(cs[lane]),
      sn = bf16_to_float(cs[half + lane]);
    if (ra.width % 8 == 0 && ((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) & 15) == 0) {
      const uint4* s4 = reinterpret_cast<const uint4*>(src);
      uint4* d4 = reinterpret_cast<uint4*>(dst);
      for (int i0 = 0; i0 < ra.width / 8; i0 += 4 * 32) {
        uint4 v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u)
          if (i0 + lane + 32 * u < ra.width / 8) v[u] = s4[i0 + lane + 32 * u];
#pragma unroll
        for (int u = 0; u < 4; ++u)
          if (i0 + lane + 32 * u < ra.width / 8) d4[i0 + lane + 32 * u] = v[u];
      }
    } else {
      for (int i = lane; i < ra.width; i += 32) dst[i] = src[i];
    }
    if (ra.kpe_out != nullptr && lane < half) {
      bf16_t* ko = ra.kpe_out + b * ra.k_b_stride + static_cast<int64_t>(pos) * ra.k_row_stride;
      rope_pair(k1, k2, c, sn, &ko[lane], &ko[lane + half]);
    }
  }
}

__global__ void __launch_bounds__(kQThreads, 1)
    query_sm90_kernel(const QueryParams p, const __grid_constant__ QueryMaps maps, int stages, int stage_bytes,
                      int out_off, int bar_off, int tx_bytes) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ __attribute__((aligned(16))) unsigned char smem_raw[];
  unsigned char* smem =
      smem_raw + ((1024 - (static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) & 1023)) & 1023);
  bf16_t* out_s = reinterpret_cast<bf16_t*>(smem + out_off);  // [warpgroups][64][kOutStride]
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + bar_off);
  uint64_t* empty = full + stages;

  const int tid = thread_x();
  const int h = static_cast<int>(blockIdx.x);
  const int kt = (p.k + 63) / 64;   // phase-1 slots
  const int nl = kt + p.r / kUkCols;  // every slot the producer fills
  const int nwg = (p.m + 63) / 64;  // consumer warpgroups with rows (1 or 2)

  if (tid == 256) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&maps.w)) : "memory");
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&maps.uk)) : "memory");
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&maps.x)) : "memory");
  }
  if (tid == 0) {
    for (int s = 0; s < stages; ++s) {
      wg::mbar_init(&full[s], 1);
      wg::mbar_init(&empty[s], nwg);
    }
    wg::fence_proxy_async();
  }
  sync_threads();  // the last block-wide barrier: the roles part here

  if (tid >= 288) {  // the append warp: with append, the new cache rows (and their rotated k_pe) of
                     // sequences h, h + heads, ..., once kv_new has landed
    if (p.ra.seqlens != nullptr) {
      const bool planned = p.plan.plan != nullptr;
      append_rows(p.ra, h, static_cast<int>(gridDim.x), tid - 288, planned ? p.plan.fill_len : -1);
      // (after append_rows's pdl_wait: the previous kernels are done with this memory)
      if (planned && h == 0) write_uniform_plan(p.plan, tid - 288, 32);
    }
    return;
  }
  if (tid >= 256) {  // the producer warp; one lane issues
    if (tid != 256) return;
    // slot j's weights: W_qu[h]'s k block j, or (j >= kt) 128 columns of W_uk[h]
    auto load_w = [&](int j, unsigned char* st, uint64_t* bar) {
      if (j < kt) {
        wg::mbar_arrive_expect_tx(bar, tx_bytes);  // W_qu[h]'s box and q_lora's (its rows rounded up to 8)
        wg::tma_load_3d(st, &maps.w, j * 64, h * kHeadRows, 0, bar);
      } else {
        const int c = (j - kt) * kUkCols;
        wg::mbar_arrive_expect_tx(bar, kUkBytes);
        wg::tma_load_3d(st, &maps.uk, c, 0, h, bar);
        wg::tma_load_3d(st + kUkBoxBytes, &maps.uk, c + 64, 0, h, bar);
      }
    };
    const int pro = min(stages, nl);
    for (int j = 0; j < pro; ++j) load_w(j, smem + j * stage_bytes, &full[j]);
    pdl_wait();  // q_lora is the previous kernel's output
    for (int j = 0; j < min(pro, kt); ++j)
      wg::tma_load_3d(smem + j * stage_bytes + kWBytes, &maps.x, j * 64, 0, 0, &full[j]);
    // slot j % stages, its empty wait's parity (j / stages - 1) & 1: carried
    int sl = 0;
    uint32_t par = 0;
    for (int j = pro; j < nl; ++j) {
      wg::mbar_wait(&empty[sl], par);
      unsigned char* st = smem + sl * stage_bytes;
      load_w(j, st, &full[sl]);
      if (j < kt) wg::tma_load_3d(st + kWBytes, &maps.x, j * 64, 0, 0, &full[sl]);
      if (++sl == stages) sl = 0, par ^= 1;
    }
    return;
  }

  const int g = __shfl_sync(0xffffffffu, tid / 128, 0);  // warpgroup, warp-uniform for the compiler
  if (g >= nwg) return;  // no rows of q_lora here (m <= 64)
  const bool leader = (tid & 127) == 0;
  float an[kNope / 2], ar[kRope / 2];  // q_h's nope and rope columns, 64 rows of this warpgroup
#pragma unroll
  for (int i = 0; i < kNope / 2; ++i) an[i] = 0.f;
#pragma unroll
  for (int i = 0; i < kRope / 2; ++i) ar[i] = 0.f;
  int sl = 0, prev = 0;
  uint32_t par = 0;  // slot and full-wait parity of slot i, carried
  for (int i = 0; i < kt; ++i) {
    const unsigned char* st = smem + sl * stage_bytes;
    wg::mbar_wait(&full[sl], par);
    const uint64_t da = wg::desc_sw128(st + kWBytes + g * 64 * 128, 16, 1024);
    const uint64_t dn = wg::desc_sw128(st, 16, 1024);
    const uint64_t dr = wg::desc_sw128(st + kNope * 128, 16, 1024);
    wg::fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      wg::wgmma_ss_kk<kNope, false>(an, da + ((kk * 32) >> 4), dn + ((kk * 32) >> 4), 1);
      wg::wgmma_ss_kk<kRope, false>(ar, da + ((kk * 32) >> 4), dr + ((kk * 32) >> 4), 1);
    }
    wg::commit();
    wg::wait<1>();  // the previous k block's products are done: its slot is free
    if (i > 0 && leader) wg::mbar_arrive(&empty[prev]);
    prev = sl;
    if (++sl == stages) sl = 0, par ^= 1;
  }
  wg::wait<0>();
  if (kt > 0 && leader) wg::mbar_arrive(&empty[prev]);
  // both warpgroups' products of the last k blocks are done: the output tiles
  // may lie in the slot of k block nl - stages (see layout)
  wg::named_sync(3, nwg * 128);

  // accumulator slot i: row r0 (i & 2 == 0) or r0 + 8, column 8 (i / 4) + 2 t4 + (i & 1)
  const int lane = tid & 31, t4 = lane & 3;
  const int r0 = g * 64 + ((tid & 127) >> 5) * 16 + (lane >> 2), r1 = r0 + 8;
  pdl_wait();  // (a no-op by now: q_lora has landed) the outputs may still be read by the previous kernel
  // q_pe, un-rotated, or with append rotated at its sequence's position:
  // column j < rope/2 (slot i) pairs with j + rope/2 (slot i + 16), both
  // this thread's; the rotation takes q_pe rounded to bf16, as rope_append
  // reads it from memory
  bf16_t* qp = p.q_pe + static_cast<int64_t>(h) * p.qp_head_stride + 2 * t4;
  if (p.ra.seqlens == nullptr) {
#pragma unroll
    for (int jn = 0; jn < kRope / 8; ++jn) {
      if (r0 < p.m)
        *reinterpret_cast<uint32_t*>(qp + r0 * p.qp_row_stride + 8 * jn) = pack_bf16x2(ar[4 * jn], ar[4 * jn + 1]);
      if (r1 < p.m)
        *reinterpret_cast<uint32_t*>(qp + r1 * p.qp_row_stride + 8 * jn) =
            pack_bf16x2(ar[4 * jn + 2], ar[4 * jn + 3]);
    }
  } else {
    const int lim = min(p.ra.max_len, p.ra.positions);
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int row = r0 + 8 * hr;
      if (row >= p.m) continue;
      const int pos = (p.plan.plan != nullptr ? p.plan.fill_len : p.ra.seqlens[row]) - 1;
      if (pos < 0 || pos >= lim) continue;  // (rope_append writes nothing for such a sequence either)
      const bf16_t* cs = p.ra.rope_cs + static_cast<int64_t>(pos) * kRope + 2 * t4;
      bf16_t* o = qp + row * p.qp_row_stride;
#pragma unroll
      for (int jn = 0; jn < kRope / 16; ++jn) {
        const uint32_t c2 = *reinterpret_cast<const uint32_t*>(cs + 8 * jn);
        const uint32_t s2 = *reinterpret_cast<const uint32_t*>(cs + kRope / 2 + 8 * jn);
        bf16_t y[4];
#pragma unroll
        for (int e = 0; e < 2; ++e)
          rope_pair(round_bf16(ar[4 * jn + 2 * hr + e]), round_bf16(ar[4 * (jn + kRope / 16) + 2 * hr + e]),
                    e ? bf16_hi(c2) : bf16_lo(c2), e ? bf16_hi(s2) : bf16_lo(s2), &y[e], &y[2 + e]);
        *reinterpret_cast<uint32_t*>(o + 8 * jn) = y[0].bits | (static_cast<uint32_t>(y[1].bits) << 16);
        *reinterpret_cast<uint32_t*>(o + kRope / 2 + 8 * jn) = y[2].bits | (static_cast<uint32_t>(y[3].bits) << 16);
      }
    }
  }
  // q_nope rounded to bf16, packed as the A operand of phase 2 (k16 step kk: pa[4 kk .. 4 kk + 3])
  uint32_t pa[kNope / 4];
#pragma unroll
  for (int i = 0; i < kNope / 2; i += 2) pa[i / 2] = pack_bf16x2(an[i], an[i + 1]);

  bf16_t* qa = p.q_abs + static_cast<int64_t>(h) * p.qa_head_stride;
  bf16_t* tile = out_s + g * 64 * kOutStride;
  const int tr0 = r0 - g * 64;  // this thread's rows in the tile
  const int wtid = tid & 127;
  for (int j = kt; j < nl; ++j) {
    const unsigned char* st = smem + sl * stage_bytes;
    wg::mbar_wait(&full[sl], par);
    const uint64_t dv = wg::desc_sw128(st, kUkBoxBytes, 1024);
    float ao[kUkCols / 2];
#pragma unroll
    for (int i = 0; i < kUkCols / 2; ++i) ao[i] = 0.f;
    wg::fence();
#pragma unroll
    for (int kk = 0; kk < kNope / 16; ++kk) {
      const uint32_t a[4] = {pa[4 * kk], pa[4 * kk + 1], pa[4 * kk + 2], pa[4 * kk + 3]};
      wg::wgmma_rs_tb<kUkCols, false>(ao, a, dv + ((kk * 16 * 128) >> 4));
    }
    wg::commit();
    wg::wait<0>();
    if (leader) wg::mbar_arrive(&empty[sl]);
    if (++sl == stages) sl = 0, par ^= 1;
    if (j > kt) wg::named_sync(1 + g, 128);  // the previous piece has been read out of the tile
#pragma unroll
    for (int jn = 0; jn < kUkCols / 8; ++jn) {
      const int c = 8 * jn + 2 * t4;
      *reinterpret_cast<uint32_t*>(tile + tr0 * kOutStride + c) = pack_bf16x2(ao[4 * jn], ao[4 * jn + 1]);
      *reinterpret_cast<uint32_t*>(tile + (tr0 + 8) * kOutStride + c) = pack_bf16x2(ao[4 * jn + 2], ao[4 * jn + 3]);
    }
    wg::named_sync(1 + g, 128);
    bf16_t* q0 = qa + (j - kt) * kUkCols;
    constexpr int kPieces = kUkCols / 8;  // 16-byte pieces per row
#pragma unroll
    for (int i = 0; i < 64 * kPieces / 128; ++i) {
      const int idx = wtid + 128 * i, row = idx / kPieces, pc = idx % kPieces;
      if (g * 64 + row < p.m)
        *reinterpret_cast<uint4*>(q0 + static_cast<int64_t>(g * 64 + row) * p.qa_row_stride + 8 * pc) =
            *reinterpret_cast<const uint4*>(tile + row * kOutStride + 8 * pc);
    }
  }
  pdl_trigger();
#endif
}

bool aligned_rows(const void* ptr, int64_t s1, int64_t s2) {
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && s1 % 8 == 0 && s2 % 8 == 0;
}

// The shared-memory layout for m rows, k columns of q_lora and latent width
// r: ring slots, the output tiles and the mbarriers (byte offsets from the
// 1 KB-aligned base) and the total to ask for; stages < 2: it does not fit.
struct Layout {
  int stages, stage_bytes, out_off, bar_off, smem;
};
Layout layout(int m, int k, int r, int smem_max) {
  Layout l{};
  const int nwg = (m + 63) / 64, pieces = r / kUkCols, avail = smem_max - 1024 - 16 * 8;
  l.stage_bytes = kWBytes + nwg * kXBytes;
  l.stages = std::min(8, avail / l.stage_bytes);
  if (l.stages > pieces && nwg * kOutBytes <= l.stage_bytes) {
    // load nl's slot: its last load (nl - stages < kt) is a phase-1 k block, done before phase 2
    const int nl = (k + 63) / 64 + pieces;
    l.out_off = (nl % l.stages) * l.stage_bytes;
    l.bar_off = l.stages * l.stage_bytes;
  } else {
    l.stages = std::min(8, (avail - nwg * kOutBytes) / l.stage_bytes);
    l.out_off = l.stages * l.stage_bytes;
    l.bar_off = l.out_off + nwg * kOutBytes;
  }
  l.smem = 1024 + l.bar_off + 2 * l.stages * 8;
  return l;
}

}  // namespace

const char* query_sm90_check(const QueryParams& p) {
  if (const char* e = query_sm90_sizes(p.m, p.k, p.heads, p.nope, p.rope, p.r)) return e;
  if (!aligned_rows(p.q_lora, p.q_lora_stride, 0) || !aligned_rows(p.w_qu, p.w_qu_stride, 0) ||
      !aligned_rows(p.w_uk, p.w_uk_row_stride, p.w_uk_head_stride))
    return "query_sm90: q_lora, W_qu and W_uk need 16-byte aligned bases and strides that are multiples of 8 "
           "elements";
  if (!aligned_rows(p.q_abs, p.qa_head_stride, p.qa_row_stride))
    return "query_sm90: q_abs needs a 16-byte aligned base and strides that are multiples of 8 elements";
  if (reinterpret_cast<uintptr_t>(p.q_pe) % 4 != 0 || p.qp_row_stride % 2 != 0 || p.qp_head_stride % 2 != 0)
    return "query_sm90: q_pe needs a 4-byte aligned base and even strides";
  if (p.plan.plan != nullptr &&
      (p.ra.seqlens == nullptr || p.plan.fill_lens == nullptr || p.plan.no_split != 1 || p.plan.bs != p.m ||
       p.plan.max_parts != p.plan.bs || p.plan.tile < 1 || p.plan.fill_len < 1 || p.plan.max_len < 0 ||
       reinterpret_cast<uintptr_t>(p.plan.plan) % 32 != 0))
    return "query_sm90: the plan it writes needs the append, a lengths buffer, a length >= 1 and a 32-byte aligned "
           "no-split plan of one part per row of q_lora";
  int sms = 0, smem_max = 0;
  if (!sm90_device_limits(&sms, &smem_max)) return "query_sm90: cannot query the device";
  if (layout(p.m, p.k, p.r, smem_max).stages < 2)
    return "query_sm90: two ring slots and the output tiles do not fit this device's shared memory";
  return nullptr;
}

const char* launch_query_sm90(const QueryParams& p, stream_t stream) {  // p as query_sm90_check accepted it
  int sms = 0, smem_max = 0;
  if (!sm90_device_limits(&sms, &smem_max)) return "query_sm90: cannot query the device";
  const Layout l = layout(p.m, p.k, p.r, smem_max);
  QueryMaps maps{};
  // q_lora's box: its rows rounded up to 8 (a swizzle atom), not the slot's 64 per warpgroup: rows in between
  // hold whatever the slot held and only reach output rows >= m, which are not stored (at small batches a box
  // of the slot's rows would be nearly all zero fill, and the fill is not free)
  const int xrows = (p.m + 7) / 8 * 8;
  if (!encode_rows(&maps.x, p.q_lora, p.k, p.m, 1, p.q_lora_stride, p.q_lora_stride * p.m, xrows, true))
    return "query_sm90: TMA cannot describe q_lora";
  const int64_t wrows = static_cast<int64_t>(p.heads) * kHeadRows;
  if (!encode_rows(&maps.w, p.w_qu, p.k, wrows, 1, p.w_qu_stride, p.w_qu_stride * wrows, kHeadRows))
    return "query_sm90: TMA cannot describe W_qu";
  if (!encode_rows(&maps.uk, p.w_uk, p.r, kNope, p.heads, p.w_uk_row_stride, p.w_uk_head_stride, kNope))
    return "query_sm90: TMA cannot describe W_uk";
  if (const char* e = set_max_dynamic_smem(query_sm90_kernel, l.smem)) return e;
  return launch_ex(query_sm90_kernel, dim3(p.heads), dim3(kQThreads), l.smem, stream, p.pdl, dim3(1, 1, 1), p, maps,
                   l.stages, l.stage_bytes, l.out_off, l.bar_off, kWBytes + xrows * 128);
}

#else  // AMD: the query stage keeps the vendor BLAS there

const char* query_sm90_check(const QueryParams&) { return "the fused query is NVIDIA-only"; }
const char* launch_query_sm90(const QueryParams&, stream_t) { return "the fused query is NVIDIA-only"; }

#endif

}  // namespace mla
