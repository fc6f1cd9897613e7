// Hopper (sm_90a) variant of the split-KV absorbed MQA decode: warpgroup MMA.
//
// Same contract, planner, partial layout and combine as attention.cu; only the
// block's inner loop differs. One block = 64 query rows x one planned part,
// two warpgroups (256 threads):
//   S = Q K^T  each warpgroup multiplies half of the 576-wide k-range (alternate k-steps)
//              (wgmma m64n32k16, Q and K from shared memory, 128B-swizzled);
//              the two fp32 partials are summed through shared memory;
//   softmax    redundantly in both warpgroups, in registers (each thread owns
//              rows g and g+8 of its warp's 16), P stays in registers;
//   O += P V   warpgroup w owns output columns [256 w, 256 w + 256)
//              (wgmma m64n256k16, P from registers, V = the same key tile read
//              MN-major through a transposed descriptor: no second copy).
// Keys stream through a 3-deep cp.async ring; RoPE of the keys is applied in
// shared memory one tile ahead of its use (no barrier of its own).
#include "../../platform/bf16.h"
#include "../../platform/copy.h"
#include "../../platform/vendor.h"
#include "../../platform/wgmma_sm90.h"
#include "attention.h"
#include "part.h"

namespace mla {

#if MLA_NVIDIA
namespace {

struct Sm90Tile {
  static constexpr int kD = 576, kDv = 512, kRope = 64;
  static constexpr int kM = 64;          // query rows per block
  static constexpr int kBN = 32;         // keys per tile
  static constexpr int kStages = 3;
  static constexpr int kThreads = 256;   // two warpgroups
  static constexpr int kBlocks = kD / 64;              // 64-wide (128 B) column blocks
  static constexpr int kQBlockBytes = kM * 128;         // one column block of Q
  static constexpr int kKBlockBytes = kBN * 128;        // one column block of a key tile
  static constexpr int kQBytes = kBlocks * kQBlockBytes;
  static constexpr int kKStageBytes = kBlocks * kKBlockBytes;
  static constexpr int kSBytes = 2 * kM * kBN * 4;
  static constexpr int kCsStageBytes = kBN * kRope * 2;
  static constexpr int kSmem = 1024 /*alignment slack*/ + kQBytes + kStages * kKStageBytes + kSBytes +
                               kStages * kCsStageBytes;
  static constexpr int kKSteps = kD / 16;               // 36, 18 per warpgroup
  static_assert(kD % 64 == 0 && kRope == 64 && kBN == 32 && kThreads == 8 * kBN,
                "the sm90 tile is written for 576/512/64, 32 keys, 8 loader threads per key row");
};


// S partial of one warpgroup: k-steps 2k + wg (k = 0..17), interleaved so
// that every descriptor offset is a compile-time constant plus the
// warpgroup's 32 bytes, folded into the base descriptors once. (A runtime
// warpgroup index in the offsets cost ~30 instructions per wgmma; a branch
// per warpgroup made ptxas serialize the wgmmas, C7520.)
MLA_DEVICE void s_partial(float (&sacc)[16], uint64_t dq_wg, uint64_t dk_wg) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = Sm90Tile;
#pragma unroll
  for (int k = 0; k < T::kKSteps / 2; ++k) {
    const uint32_t off_q = (k >> 1) * T::kQBlockBytes + ((2 * k) & 3) * 32;
    const uint32_t off_k = (k >> 1) * T::kKBlockBytes + ((2 * k) & 3) * 32;
    wg::wgmma_m64n32k16_ss(sacc, dq_wg + (off_q >> 4), dk_wg + (off_k >> 4), k > 0 ? 1 : 0);
  }
#endif
}

__global__ void __launch_bounds__(Sm90Tile::kThreads, 1) attention_sm90_kernel(const AttnParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = Sm90Tile;
  extern __shared__ __attribute__((aligned(16))) unsigned char smem_raw[];
  unsigned char* smem = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~static_cast<uintptr_t>(1023));  // swizzle atoms: 1 KB
  unsigned char* q_s = smem;
  unsigned char* k_s = q_s + T::kQBytes;
  float* s_s = reinterpret_cast<float*>(k_s + T::kStages * T::kKStageBytes);
  bf16_t* cs_s = reinterpret_cast<bf16_t*>(reinterpret_cast<unsigned char*>(s_s) + T::kSBytes);

  Part pt;
  if (!read_part(p, block_y(), pt)) return;
  const int b = pt.b, tile_begin = pt.tile_begin, tile_end = pt.tile_end, split = pt.split;
  const int nsplit = pt.nsplit, first_part = pt.first_part, L = pt.L;

  const int tid = thread_x();
  const int wg = tid / 128;                 // warpgroup
  const int warp = (tid % 128) / 32;        // warp within the warpgroup: rows 16 warp ..
  const int lane = tid % 32, g = lane / 4, t4 = lane % 4;
  const int row_base = block_x() * T::kM;
  const int ntiles = tile_end - tile_begin;

  // Key tile loads: thread tid owns row tid / 8 of the 32-key tile and the
  // 16-byte chunks (tid % 8) + 8 i, i = 0..8: per i a warp reads 4 rows x
  // 128 contiguous bytes, and every offset is a per-thread constant plus a
  // compile-time one (the first layout spent ~35% of all instructions here).
  const int lr = tid / 8, lc = tid % 8;                           // row, chunk within a 128 B block
  const uint32_t lsmem = lr * 128 + ((lc ^ (lr & 7)) << 4);      // swizzled, + i * kKBlockBytes
  auto load_tile = [&](int j) {
    unsigned char* dst = k_s + (j % T::kStages) * T::kKStageBytes + lsmem;
    const int t = (tile_begin + j) * T::kBN + lr;
    const bool valid = t < L;
    const bf16_t* src = p.kv;
    if (valid) {
      src = p.block_table == nullptr
                ? p.kv + b * p.kv_page_stride + static_cast<int64_t>(t) * p.kv_row_stride
                : p.kv + static_cast<int64_t>(p.block_table[b * p.block_table_stride + t / p.page_size]) * p.kv_page_stride +
                      static_cast<int64_t>(t % p.page_size) * p.kv_row_stride;
      src += lc * 8;
    }
#pragma unroll
    for (int i = 0; i < T::kBlocks; ++i) copy16_async(dst + i * T::kKBlockBytes, valid ? src + i * 64 : src, valid);
    if (p.rope_cs != nullptr) {  // 32 rows x 8 chunks of cos|sin: one per thread, the same row
      bf16_t* cdst = cs_s + (j % T::kStages) * T::kBN * T::kRope + lr * T::kRope + lc * 8;
      copy16_async(cdst, valid ? p.rope_cs + static_cast<int64_t>(t) * T::kRope + lc * 8 : p.rope_cs, valid);
    }
  };

  // Q (64 rows x 576) once, then the first key tiles
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = lr + 32 * h;
    const bool valid = row_base + r < p.rows;
    const bf16_t* src = valid ? p.q + b * p.q_batch_stride + (row_base + r) * p.q_row_stride + lc * 8 : p.q;
#pragma unroll
    for (int i = 0; i < T::kBlocks; ++i)
      copy16_async(q_s + i * T::kQBlockBytes + r * 128 + ((lc ^ (r & 7)) << 4), valid ? src + i * 64 : src, valid);
  }
  copy_commit();
#pragma unroll
  for (int j = 0; j < T::kStages - 1; ++j) {
    if (j < ntiles) load_tile(j);
    copy_commit();
  }

  // Key RoPE in shared memory, one tile ahead: tile jj is rotated while tile
  // jj - 1 is being multiplied, so no barrier of its own is needed (the next
  // iteration's barrier publishes it).
  auto rotate_tile = [&](int jj) {
      // rot(x, t) = x cos + cat(-x2, x1) sin, every product and sum rounded to
      // bf16. Thread (lr, lc) rotates 4 of the 32 pairs (j, j + 32) of its row:
      // words 2 (lc >> 2) .. + 1 of chunks (lc & 3) and (lc & 3) + 4.
      if ((tile_begin + jj) * T::kBN + lr < L) {
        const int c1 = lc & 3, w0 = 2 * (lc >> 2);
        unsigned char* blk = k_s + (jj % T::kStages) * T::kKStageBytes + (T::kBlocks - 1) * T::kKBlockBytes + lr * 128;
        uint2* p1 = reinterpret_cast<uint2*>(blk + ((c1 ^ (lr & 7)) << 4) + 4 * w0);
        uint2* p2 = reinterpret_cast<uint2*>(blk + (((c1 + 4) ^ (lr & 7)) << 4) + 4 * w0);
        const uint32_t* csr = reinterpret_cast<const uint32_t*>(cs_s + ((jj % T::kStages) * T::kBN + lr) * T::kRope);
        const uint2 cw = *reinterpret_cast<const uint2*>(csr + 4 * c1 + w0);
        const uint2 sw = *reinterpret_cast<const uint2*>(csr + 16 + 4 * c1 + w0);
        uint2 x1 = *p1, x2 = *p2;
        uint32_t* a1 = reinterpret_cast<uint32_t*>(&x1);
        uint32_t* a2 = reinterpret_cast<uint32_t*>(&x2);
        const uint32_t cc[2] = {cw.x, cw.y}, ss[2] = {sw.x, sw.y};
#pragma unroll
        for (int w = 0; w < 2; ++w) {
          const float u1l = bf16_lo(a1[w]), u1h = bf16_hi(a1[w]), u2l = bf16_lo(a2[w]), u2h = bf16_hi(a2[w]);
          const float cl = bf16_lo(cc[w]), ch = bf16_hi(cc[w]), sl = bf16_lo(ss[w]), sh = bf16_hi(ss[w]);
          a1[w] = pack_bf16x2(round_bf16(u1l * cl) + round_bf16(-u2l * sl), round_bf16(u1h * ch) + round_bf16(-u2h * sh));
          a2[w] = pack_bf16x2(round_bf16(u2l * cl) + round_bf16(u1l * sl), round_bf16(u2h * ch) + round_bf16(u1h * sh));
        }
        *p1 = x1;
        *p2 = x2;
      }
  };

  // this thread's rows (within the block) and their causal limits
  const int r0 = warp * 16 + g, r1 = r0 + 8;
  int lim0 = L, lim1 = L;
  if (p.causal) {
    lim0 = L - (p.s_q - 1 - (row_base + r0) / p.h_q);
    lim1 = L - (p.s_q - 1 - (row_base + r1) / p.h_q);
  }
  float m0 = neg_inf(), m1 = neg_inf(), l0 = 0.f, l1 = 0.f;
  // descriptors once; per k-step only the start address (16-byte units, low
  // bits) moves, which never carries out of its 14-bit field (< 256 KB)
  const uint64_t dq = wg::desc_sw128(q_s, 16, 1024);
  const uint64_t dk = wg::desc_sw128(k_s, 16, 1024);
  const uint64_t dv = wg::desc_sw128(k_s + (4 * wg) * T::kKBlockBytes, T::kKBlockBytes, 1024);
  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;

  const bool rope = p.rope_cs != nullptr;
  if (rope && ntiles > 0) {
    copy_wait<0>();
    sync_threads();
    rotate_tile(0);
  }
  for (int j = 0; j < ntiles; ++j) {
    if (rope)
      copy_wait<0>();  // tile j + 1 too: it is rotated during this tile
    else
      copy_wait<T::kStages - 2>();
    wg::fence_proxy_async();
    sync_threads();  // tile j (and Q) landed and rotated for everyone; tile j-1's buffer is free
    if (j + T::kStages - 1 < ntiles) load_tile(j + T::kStages - 1);
    copy_commit();
    if (rope && j + 1 < ntiles) rotate_tile(j + 1);

    const int key0 = (tile_begin + j) * T::kBN;
    // ---- S partial over this warpgroup's 18 k-steps
    float sacc[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) sacc[i] = 0.f;
    const uint32_t stage_off = (j % T::kStages) * T::kKStageBytes;
    wg::fence();
    s_partial(sacc, dq + 2 * wg, dk + 2 * wg + (stage_off >> 4));  // + 32 bytes for warpgroup 1
    wg::commit();
    wg::wait<0>();
    // exchange the partials: slot i of this thread is row (i & 2 ? r1 : r0), col 8 (i / 4) + 2 t4 + (i & 1)
    // the partner thread (same index in the other warpgroup) holds the same
    // (row, col) slots: exchange through a [slot][thread] array, conflict-free
    {
      float* mine = s_s + wg * 16 * 128 + (tid % 128);
#pragma unroll
      for (int i = 0; i < 16; ++i) mine[i * 128] = sacc[i];
    }
    sync_threads();
    {
      const float* other = s_s + (1 - wg) * 16 * 128 + (tid % 128);
#pragma unroll
      for (int i = 0; i < 16; ++i) sacc[i] += other[i * 128];  // a + b == b + a: both see identical P
    }

    // ---- online softmax in registers (rows r0: slots i&2==0, r1: i&2)
    float mx0 = neg_inf(), mx1 = neg_inf();
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int c = 8 * (i / 4) + 2 * t4 + (i & 1);
      const bool hi = (i & 2) != 0;
      float v = sacc[i] * p.scale_log2;
      if (key0 + c >= (hi ? lim1 : lim0)) v = neg_inf();
      sacc[i] = v;
      if (hi) mx1 = fmaxf(mx1, v); else mx0 = fmaxf(mx0, v);
    }
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
    }
    const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
    const float mu0 = mn0 == neg_inf() ? 0.f : mn0, mu1 = mn1 == neg_inf() ? 0.f : mn1;
    const float a0 = fast_exp2(m0 - mu0), a1 = fast_exp2(m1 - mu1);
    uint32_t pa[8];
    float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
    for (int i = 0; i < 16; i += 2) {
      const bool hi = (i & 2) != 0;
      const float mu = hi ? mu1 : mu0;
      const uint32_t w2 = pack_bf16x2(fast_exp2(sacc[i] - mu), fast_exp2(sacc[i + 1] - mu));
      const float s2 = bf16_lo(w2) + bf16_hi(w2);  // the sum of what P V multiplies
      if (hi) sum1 += s2; else sum0 += s2;
      pa[i / 2] = w2;
    }
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
      sum0 += __shfl_xor_sync(0xffffffffu, sum0, off);
      sum1 += __shfl_xor_sync(0xffffffffu, sum1, off);
    }
    l0 = l0 * a0 + sum0;
    l1 = l1 * a1 + sum1;
    m0 = mn0;
    m1 = mn1;
    if (a0 != 1.f || a1 != 1.f) {  // exact: a row whose max did not move has alpha == 1
#pragma unroll
      for (int i = 0; i < 128; ++i) o[i] *= (i & 2) ? a1 : a0;
    }

    // ---- O += P V over this warpgroup's 256 columns (2 k-steps of 16 keys)
    wg::fence();
#pragma unroll
    for (int kk = 0; kk < T::kBN / 16; ++kk) {
      // A fragment for keys 16 kk ..: slots 8 kk .. 8 kk + 7 of S are exactly the mma A layout
      const uint32_t a[4] = {pa[4 * kk + 0], pa[4 * kk + 1], pa[4 * kk + 2], pa[4 * kk + 3]};
      wg::wgmma_m64n256k16_rs_tb(o, a, dv + ((stage_off + kk * 16 * 128) >> 4));
    }
    wg::commit();
    wg::wait<0>();
  }
  copy_wait<0>();

  // ---- normalise and write
  constexpr float kLn2 = 0.69314718055994531f;
  const float inv0 = l0 > 0.f ? 1.f / l0 : 0.f, inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
  const int col0 = 256 * wg + 2 * t4;
  if (nsplit == 1) {
    if (wg == 0 && t4 == 0) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = row_base + (h ? r1 : r0);
        const float l = h ? l1 : l0, m = h ? m1 : m0;
        if (r < p.rows)
          p.lse[(static_cast<int64_t>(b) * p.h_q + r % p.h_q) * p.s_q + r / p.h_q] =
              l > 0.f ? (m + fast_log2(l)) * kLn2 : neg_inf();
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = row_base + (h ? r1 : r0);
      if (r >= p.rows) continue;
      const float sc = h ? inv1 : inv0;
      bf16_t* orow = p.o + (static_cast<int64_t>(b) * p.rows + r) * T::kDv + col0;
#pragma unroll
      for (int jn = 0; jn < 32; ++jn)
        *reinterpret_cast<uint32_t*>(orow + 8 * jn) = pack_bf16x2(o[4 * jn + 2 * h] * sc, o[4 * jn + 2 * h + 1] * sc);
    }
  } else {
    const int64_t prow = static_cast<int64_t>(first_part + split) * p.rows;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = row_base + (h ? r1 : r0);
      if (r >= p.rows) continue;
      const float l = h ? l1 : l0, m = h ? m1 : m0, sc = h ? inv1 : inv0;
      if (wg == 0 && t4 == 0) p.lse_part[prow + r] = l > 0.f ? (m + fast_log2(l)) * kLn2 : neg_inf();
      float* orow = p.o_part + (prow + r) * T::kDv + col0;
#pragma unroll
      for (int jn = 0; jn < 32; ++jn)
        *reinterpret_cast<float2*>(orow + 8 * jn) = make_float2(o[4 * jn + 2 * h] * sc, o[4 * jn + 2 * h + 1] * sc);
    }
  }
#else
  __trap();  // built without sm_90a: the host never selects this kernel then
#endif
}

}  // namespace

const char* attn_kernel_info_sm90(AttnKernelInfo* info) {
  using T = Sm90Tile;
  if (const char* e = set_max_dynamic_smem(attention_sm90_kernel, T::kSmem)) return e;
  info->rows_per_block = T::kM;
  info->tile = T::kBN;
  info->threads = T::kThreads;
  info->smem_bytes = T::kSmem;
  info->warp_size = kWarpSize;
  info->blocks_per_sm = max_active_blocks(attention_sm90_kernel, T::kThreads, T::kSmem);
  if (info->blocks_per_sm <= 0) return "sm90 attention kernel cannot be resident on this device (occupancy 0)";
  return nullptr;
}

const char* launch_attention_sm90(const AttnParams& p, stream_t stream) {
  using T = Sm90Tile;
  if (p.rope != T::kRope) return "launch_attention_sm90: rope width must be 64";
  dim3 grid((p.rows + T::kM - 1) / T::kM, p.max_parts);
  attention_sm90_kernel<<<grid, T::kThreads, T::kSmem, stream>>>(p);
  return last_launch_error();
}

#else  // AMD: the Hopper kernel does not exist there

const char* attn_kernel_info_sm90(AttnKernelInfo*) { return "the sm90 attention kernel is NVIDIA-only"; }
const char* launch_attention_sm90(const AttnParams&, stream_t) { return "the sm90 attention kernel is NVIDIA-only"; }

#endif

}  // namespace mla
