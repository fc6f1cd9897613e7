// Hopper (sm_90a) split-KV absorbed MQA decode with the two warpgroups
// working on different key halves ("seesaw" schedule, as described in
// FlashMLA's 2025-04 write-up; written here from that description).
//
// Same contract, planner, partial layout and combine as attention.cu. One
// block = 64 query rows x one planned part; the planner's tile is a PAIR of
// 64-key halves, K0 (keys 0..63 of the pair) and K1 (64..127), each in its own
// shared buffer. Written for value width dv = 128, 256 or 512 (DeepSeek: 512):
// the key is NB = dv / 64 latent column blocks + one rope block. Warpgroup 0
// owns output columns [0, dv/2) (O_L), warpgroup 1 [dv/2, dv) (O_R); a
// running row max m is shared through shared memory. Per pair:
//   WG0: S0 = Q K0^T (all columns), m0 = max(m, rowmax S0), P0 = exp(S0 - m0),
//        O_L = O_L * exp(m - m0) + P0 V0L                         (P0 from registers)
//   WG1: S1 = Q K1^T, m1 = max(m0, rowmax S1), P1 = exp(S1 - m1),
//        O_R = O_R * exp(m - m1) + P1 V1R                         (P1 from registers)
//        O_R += (P0 exp(m0 - m1)) V0R                            (P0 from shared memory)
//   WG0: O_L = O_L * exp(m0 - m1) + P1 V1L                        (P1 from shared memory)
// so one warpgroup's softmax runs while the other's matrix products do, and
// the next pair's S is issued while the last P V is still in flight. ("max"
// above is lazy_max: m moves only when a tile's row max exceeds it by more
// than kLazyMax, so most pairs rescale nothing.)
//
// Shared memory: Q, K0, K1 (64 rows x (NB + 1) 128B-swizzled 64-column
// blocks) and a few hundred bytes. P0 and P1 live in column block NB (the
// rope block) of their own key buffer, which nothing reads between its S and
// its reload. Loads are TMA boxes (a partial last half whole, its rows past
// the length zeroed before P V) where the host made descriptors, else
// cp.async (see load_half), each group completing an mbarrier; the loads of a
// buffer's column blocks are issued by the warpgroup whose matrix product was
// the last to read them (H = NB / 2; at dv 512: H = 4, NB = 8):
//   K0 blocks [0, H)      WG0 (after P0 V0L)   K0 blocks [H, NB]  WG1 (after P0 V0R; block NB held P0)
//   K1 blocks [0, H) + NB WG0 (after P1 V1L)   K1 blocks [H, NB)  WG1 (after P1 V1R)
// Key RoPE (task semantics) rotates block NB of a half in place as soon as
// its load group has landed, while the first group's k-steps of its S are in
// flight, before the rest of the S is issued.
//
// Persistent: one block per resident slot walks work items (part, 64-row
// head block) in the planner's longest-first order, taking the next from an
// atomic counter one pair before its current item ends; the mbarrier phases
// run on across items. Q comes by TMA, the next item's issued as soon as the
// last S of the current item is done; O (or the fp32 partial) goes out
// through shared memory, copied out by every thread in 16-byte stores. The
// planner -> attention -> combine launches are programmatic dependents.
//
// Rope widths below 64 (8, 16, 32): only the first `rope` columns of block
// NB are read from memory, for Q and for the keys; the rest of the block is
// zero-filled, so the scores are exact and the memory traffic is the real
// width's (the S product still spans 64 columns there). On-the-fly RoPE takes
// rope 64 only. dv 64 (one latent block: no even split between the
// warpgroups) runs on the dv 128 instance with latent block 1 zero in shared
// memory and never loaded (the traffic is dv 64's, the matrix work dv 128's).
// Per-head rope keys (kPH): see the kernel.
#include <algorithm>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "../../platform/bf16.h"
#include "../../platform/copy.h"
#include "../../platform/vendor.h"
#include "../../platform/tma_sm90.h"
#include "../../platform/switches.h"
#include "../../platform/wgmma_sm90.h"
#include "attention.h"
#include "part.h"

namespace mla {

#if MLA_NVIDIA
namespace {

// TMA descriptors of the key rows (a __grid_constant__ kernel argument):
// kv as [pages or sequences][rows][d] with boxes of 64 columns x `rows` rows
// (64, or the page size when pages are 8, 16 or 32 rows: then a 64-key half
// is 64 / rows boxes per column block), and the separate rope rows kpe as
// [sequences][rows][64] with 64 x 64 boxes; 128-byte swizzle (the layout the
// cp.async path writes). use = 0: every load is a cp.async.
struct TmaMaps {
  CUtensorMap kv;
  CUtensorMap kpe;
  CUtensorMap q;  // q as [sequences][s_q * h_q rows][d], 64 x 64 boxes (columns past d read as zeros)
  CUtensorMap sc;  // per-head rope keys: rope_scores as [sequences][rows][rs_stride] fp32, 32 keys x rows boxes
  int use;
  int rows;  // rows per kv box
  int use_q;  // Q by TMA (then prefetched for the next work item): rows >= 64
};

constexpr int kBlockBytes = 64 * 128;  // one 64-column (128 B) block of 64 rows, every width

// The instances that add a sequence's last key, where it is alone in its last
// pair, outside the pair loop (bf16 ones: has_tail_key); the planner then
// hangs that pair on the sequence's last part (AttnKernelInfo::one_key_tail).
template <int kDv, bool kPH>
constexpr bool kOneKeyTail = kDv == 512 && !kPH;

// Geometry for value width kDv_ (128, 256 or 512): the key is kNB latent
// column blocks + one rope block (the rope width, up to 64, zero-padded).
template <int kDv_>
struct PairTile {
  static constexpr int kDv = kDv_;
  static constexpr int kRope = 64;                       // the rope block's width (on-the-fly RoPE: all of it)
  static constexpr int kNB = kDv / 64;                   // latent column blocks; block kNB is the rope block
  static constexpr int kHalfNB = kNB / 2;                // latent blocks whose V columns one warpgroup owns
  static constexpr int kN = kDv / 2;                     // output columns per warpgroup (the P V wgmma's N)
  static constexpr int kORegs = kN / 2;                  // O accumulator floats per thread
  static constexpr int kSteps = 4 * (kNB + 1);           // k16 steps of S = Q K^T
  static constexpr int kM = 64;                          // query rows per block
  static constexpr int kHalf = 64;                       // keys per half (per warpgroup)
  static constexpr int kTileKeys = 2 * kHalf;            // the planner's unit
  static constexpr int kThreads = 256;                   // two warpgroups
  static constexpr int kBlocks = kNB + 1;                // 64-column (128 B) blocks
  static constexpr int kBlockBytes = mla::kBlockBytes;
  static constexpr int kMatBytes = kBlocks * kBlockBytes;  // Q, K0 or K1
  // pairs of key buffers in flight: the loads of pair j + kStages are issued
  // during pair j. dv 512 fills shared memory with one (Q + 2 x 72 KB); the
  // narrower keys take two, which hides a whole pair's time of load latency.
  static constexpr int kStages = kDv == 512 ? 1 : 2;
  static constexpr int kIdRing = kStages + 2;            // pairs of block-table ids held in shared memory
  // a work item's last key when it is alone in its pair (see the kernel's tail): its row, its scores
  static constexpr int kTailBytes = kBlocks * 128 + kM * 4;
  static constexpr int kSmem = 1024 /*alignment*/ + (1 + 2 * kStages) * kMatBytes + 3 * kM * 4 /*sM, sL*/ +
                               (4 * kStages + 2) * 8 /*mbarriers*/ + kIdRing * kTileKeys * 4 /*page ids*/ +
                               16 /*next work item*/ + kTailBytes;
  // the epilogue stages O (bf16, or fp32 partials) in the key buffers, rows
  // padded by 8 elements: conflict-free stores, 16-byte aligned rows
  static constexpr int kOutRowBytes(int elt) { return (kDv + 8) * elt; }
  static_assert(kM * (kDv + 8) * 4 <= 2 * kStages * kMatBytes, "the fp32 output tile fits in the key buffers");
  static_assert(kDv == 128 || kDv == 256 || kDv == 512, "the pair kernel takes dv 128, 256 or 512");
  static_assert(kM == kHalf && kRope == 64 && 2 * kHalfNB == kNB && 2 * kORegs == kN && kSteps == 4 * kBlocks,
                "64-row tiles, one 64-wide rope block, the latent blocks split evenly between the warpgroups");
};

// How an instance reads the keys: by cp.async (a dense or paged cache,
// decided at run time), or by TMA from a dense cache or from a paged one
// (the host made descriptors: TmaMaps::use), each with only its own code.
// kKeysFp8Dense / kKeysFp8Paged: an e4m3 cache (dv 512, rope 64, bf16 q and
// out) by TMA, widened in place to fp16 by the warpgroup whose S reads the
// half (fp8_widen), the products in fp16 (kF16), Q converted to fp16 in place
// with a power-of-two factor that keeps it finite (convert_q).
enum KeyPath : int { kKeysCopy = 0, kKeysTmaDense = 1, kKeysTmaPaged = 2, kKeysFp8Dense = 3, kKeysFp8Paged = 4 };
constexpr int kFp8BoxBytes = 64 * 64;  // an e4m3 box: 64 bytes x 64 rows

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Named barriers (0 is __syncthreads).
enum : int { kBarM0 = 1, kBarM1 = 2, kBarP0 = 3, kBarP1 = 4, kBarWg0 = 5 /* 6: warpgroup 1 */ };
// mbarriers of a stage: K0 blocks [0, H), K0 [H, NB], K1 [0, H) + NB, K1 [H, NB)
enum : int { kMbK0a = 0, kMbK0b = 1, kMbK1a = 2, kMbK1b = 3 };

// S k-steps [K0, K1): Q block k/4, 32-byte step k%4, all compile-time; step
// kZeroAt overwrites the accumulator (-1: none does).
template <int K0, int K1, bool kF16, int kZeroAt = 0>
MLA_DEVICE void s_steps(float (&s)[32], uint64_t dq, uint64_t dk) {
#pragma unroll
  for (int k = K0; k < K1; ++k) {
    const uint32_t off = (k >> 2) * kBlockBytes + (k & 3) * 32;
    wg::wgmma_ss_kk<64, kF16>(s, dq + (off >> 4), dk + (off >> 4), k != kZeroAt ? 1 : 0);
  }
}

// O += P V over 64 keys: P from registers (the S accumulator layout is the A layout).
template <int N, bool kF16>
MLA_DEVICE void pv_regs(float (&o)[N / 2], const uint32_t (&pa)[16], uint64_t dv) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const uint32_t a[4] = {pa[4 * kk + 0], pa[4 * kk + 1], pa[4 * kk + 2], pa[4 * kk + 3]};
    wg::wgmma_rs_tb<N, kF16>(o, a, dv + ((kk * 16 * 128) >> 4));
  }
}

// O += P V over 64 keys: P from shared memory (K-major, 128B-swizzled, 64 x 64).
template <int N, bool kF16>
MLA_DEVICE void pv_smem(float (&o)[N / 2], uint64_t dp, uint64_t dv) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) wg::wgmma_ss_tb<N, kF16>(o, dp + ((kk * 32) >> 4), dv + ((kk * 16 * 128) >> 4));
}

template <int R>
MLA_DEVICE void scale_rows(float (&o)[R], float a0, float a1) {
  if (a0 != 1.f || a1 != 1.f) {  // exact: a row whose max did not move has factor 1
#pragma unroll
    for (int i = 0; i < R; ++i) o[i] *= (i & 2) ? a1 : a0;
  }
}

// Row max of this thread's two rows (slots i & 2 == 0: row r0, else r1) after
// masking keys >= lim and scaling to log2 units; reduced over the quad.
MLA_DEVICE void mask_scale_max(float (&s)[32], int key0, int t4, int lim0, int lim1, float scale_log2, float& mx0,
                               float& mx1) {
  mx0 = neg_inf();
  mx1 = neg_inf();
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    const int c = 8 * (i / 4) + 2 * t4 + (i & 1);
    const bool hi = (i & 2) != 0;
    float v = s[i] * scale_log2;
    if (key0 + c >= (hi ? lim1 : lim0)) v = neg_inf();
    s[i] = v;
    if (hi) mx1 = fmaxf(mx1, v); else mx0 = fmaxf(mx0, v);
  }
#pragma unroll
  for (int off = 1; off < 4; off <<= 1) {
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
  }
}

// s <- exp2(s - m) (fp32, kept), pa <- bf16 pairs of it; returns the row sums
// of the fp32 values (as FlashAttention does). With the lazy row reference
// (lazy_max) the largest P of a row is no longer exactly 1, so summing the
// bf16 values would put its rounding (up to 2^-9) into l and the LSE.
template <bool kF16>
MLA_DEVICE void exp_pack(float (&s)[32], uint32_t (&pa)[16], float m0, float m1, float& sum0, float& sum1) {
  const float mu0 = exp2_base(m0), mu1 = exp2_base(m1);
  sum0 = 0.f;
  sum1 = 0.f;
#pragma unroll
  for (int i = 0; i < 32; i += 2) {
    const bool hi = (i & 2) != 0;
    const float mu = hi ? mu1 : mu0;
    s[i] = fast_exp2(s[i] - mu);
    s[i + 1] = fast_exp2(s[i + 1] - mu);
    const uint32_t w2 = Half16<kF16>::pack2(s[i], s[i + 1]);
    const float s2 = s[i] + s[i + 1];  // the fp32 values (see exp_pack's comment)
    if (hi) sum1 += s2; else sum0 += s2;
    pa[i / 2] = w2;
  }
#pragma unroll
  for (int off = 1; off < 4; off <<= 1) {
    sum0 += __shfl_xor_sync(0xffffffffu, sum0, off);
    sum1 += __shfl_xor_sync(0xffffffffu, sum1, off);
  }
}

// The row's reference for exp2 after a tile whose row max is mx: the
// running reference m unless mx exceeds it by more than kLazyMax (log2
// units), then mx. P = exp2(s - ref) stays <= 2^kLazyMax (bf16/fp16 and
// the fp32 sums hold that), and the output and LSE are exact for any
// reference, so O is rescaled only when the maximum jumps (after the first
// tile of a row, rarely), not at every small increase. (-inf - -inf is NaN:
// a row that has seen only masked keys keeps -inf.)
constexpr float kLazyMax = 8.f;
MLA_DEVICE float lazy_max(float m, float mx) { return mx - m > kLazyMax ? mx : m; }

// Factor that moves an accumulation at max `from` to max `to` (to >= from).
// A row that has seen nothing yet (from == -inf) holds zeros: factor 0.
MLA_DEVICE float rescale(float from, float to) { return from == neg_inf() ? 0.f : fast_exp2(from - to); }

// One online-softmax step of a warpgroup: rows moved to maxima n0 / n1; P
// into s (fp32, kept) and pa (bf16), row sums and O rescaled to the new max.
template <bool kF16, int R>
MLA_DEVICE void softmax_step(float (&s)[32], uint32_t (&pa)[16], float (&o)[R], float n0, float n1, float& m_a,
                             float& m_b, float& l_a, float& l_b) {
  const float c0 = rescale(m_a, n0), c1 = rescale(m_b, n1);
  float sum0, sum1;
  exp_pack<kF16>(s, pa, n0, n1, sum0, sum1);
  l_a = l_a * c0 + sum0;
  l_b = l_b * c1 + sum1;
  m_a = n0;
  m_b = n1;
  scale_rows(o, c0, c1);
}

// The task's RoPE on two bf16 lanes: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s),
// every product and the sum rounded to bf16 (x1 = x[j], x2 = x[j + 32]; c, s
// the cos and sin of angle j). Shared by rotate_half and the one-key tail.
// Packed bf16x2 arithmetic gives the task's bits: a product of two bf16
// values is exact in fp32, and the fp32 sum of two bf16 values is exact
// unless their exponents differ by more than 15, where both roundings give
// the larger one, so rounding once equals the reference's fp32-then-bf16.
MLA_DEVICE uint32_t mul_bf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
MLA_DEVICE uint32_t add_bf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("add.rn.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
MLA_DEVICE void rope_rot_bf16x2(uint32_t x1, uint32_t x2, uint32_t c, uint32_t s, uint32_t& y1, uint32_t& y2) {
  y1 = add_bf16x2(mul_bf16x2(x1, c), mul_bf16x2(x2, s ^ 0x80008000u));
  y2 = add_bf16x2(mul_bf16x2(x2, c), mul_bf16x2(x1, s));
}

// P (bf16 pairs in the S accumulator layout) -> 64 x 64 K-major swizzled
// block at `blk`. Row r0 / r1 of this thread; conflict-free (rows differ in
// their swizzle phase across the 8 g's).
MLA_DEVICE void store_p(unsigned char* blk, const uint32_t (&pa)[16], int r0, int r1, int t4) {
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int r = (j & 1) ? r1 : r0;
    *reinterpret_cast<uint32_t*>(blk + r * 128 + (((j >> 1) ^ (r & 7)) << 4) + 4 * t4) = pa[j];
  }
}

// The stages of a work item that need no more than their arguments (the
// others are members of Sm90Block, over the block's state).

// Latent column blocks [nlat, kNB) of Q and of every key buffer to zero (dv
// 64 on the dv 128 instance: set once, never loaded).
template <typename T>
MLA_DEVICE void zero_dead_blocks(unsigned char* q_s, int nlat, int tid) {
  for (int i = tid; i < (1 + 2 * T::kStages) * T::kBlockBytes / 16; i += T::kThreads) {
    const int buf = i / (T::kBlockBytes / 16), off = i % (T::kBlockBytes / 16);
    *reinterpret_cast<uint4*>(q_s + buf * T::kMatBytes + nlat * T::kBlockBytes + off * 16) = make_uint4(0, 0, 0, 0);
  }
  wg::fence_proxy_async();  // (before the next wgmma; the prologue's barrier orders it for every thread)
}

// Per-head rope keys: S += this half's score tile `sb` (the item's kRB = 32
// rows; the wgmma's rows 32-63 are never written out). Swizzled as the boxes land.
template <int kRB>
MLA_DEVICE void add_rope_scores(float (&sacc)[32], const unsigned char* sb, int r0, int r1, int t4) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int r = hh ? r1 : r0;
    if (r < kRB) {
#pragma unroll
      for (int k = 0; k < 8; ++k) {  // columns 8k + 2 t4, + 1
        const int c = 8 * k + 2 * t4, cc = c & 31;
        const float2 v = *reinterpret_cast<const float2*>(sb + (c >> 5) * 32 * 128 + r * 128 +
                                                           (((cc >> 2) ^ (r & 7)) << 4) + (cc & 3) * 4);
        sacc[4 * k + 2 * hh] += v.x;
        sacc[4 * k + 2 * hh + 1] += v.y;
      }
    }
  }
}

// The LSE of this thread's rows r0, r1 of the item (warpgroup 0; rows from
// row_base, kRB of them): into lse (fin), or lse_part at prow for the combine.
template <int kRB>
MLA_DEVICE void store_lse(const AttnParams& p, int wg, int t4, int r0, int r1, int row_base, int b, float l0,
                          float l1, bool fin, int64_t prow, float m_a, float m_b) {
  constexpr float kLn2 = 0.69314718055994531f;
  if (wg == 0 && t4 == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = row_base + (h ? r1 : r0);
      const float l = h ? l1 : l0, m = h ? m_b : m_a;
      const float v = l > 0.f ? (m + fast_log2(l)) * kLn2 : neg_inf();
      if ((h ? r1 : r0) < kRB && r < p.rows) {
        if (fin)
          p.lse[(static_cast<int64_t>(b) * p.h_q + r % p.h_q) * p.s_q + r / p.h_q] = v;
        else
          p.lse_part[prow + r] = v;
      }
    }
  }
}

// O out through shared memory (the key buffers at k_s), then copied out by
// every thread: the item's rows are contiguous in o / o_part.
// stage_o: this thread's O values, normalised, into the padded rows (elt
// bytes each, from column col0); then the stores are visible to every
// thread.
template <typename T, bool kF16>
MLA_DEVICE void stage_o(unsigned char* k_s, int r0, int r1, const float (&o)[T::kORegs], float inv0, float inv1,
                        bool fin, int orow_bytes, int elt, int col0) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float sc = h ? inv1 : inv0;
    unsigned char* srow = k_s + (h ? r1 : r0) * orow_bytes + col0 * elt;
    if (fin) {
#pragma unroll
      for (int jn = 0; jn < T::kN / 8; ++jn)
        *reinterpret_cast<uint32_t*>(srow + 16 * jn) =
            Half16<kF16>::pack2(o[4 * jn + 2 * h] * sc, o[4 * jn + 2 * h + 1] * sc);
    } else {
#pragma unroll
      for (int jn = 0; jn < T::kN / 8; ++jn)
        *reinterpret_cast<float2*>(srow + 32 * jn) = make_float2(o[4 * jn + 2 * h] * sc, o[4 * jn + 2 * h + 1] * sc);
    }
  }
  sync_threads();
}
// copy_out_rows: the item's staged rows (those below p.rows) by every thread,
// 16 bytes each, consecutive threads on consecutive chunks (the rows of an
// item are contiguous in o / o_part; a row is dv 64-512 values of 2 or 4
// bytes: a power of two of 16-byte chunks). Each thread's shared-memory
// reads are done once its global stores issue; the fence orders them before
// the next item's TMA loads into the key buffers (its prologue syncs).
// (Bulk copies of the rows, waited for until the TMA engine had read them,
// held every block's next item about 1 us longer at L 513.)
MLA_DEVICE void copy_out_rows(const AttnParams& p, const unsigned char* k_s, int tid, int nthreads, int kRB, int row_base,
                              int b, int dvm, bool fin, int64_t prow, int elt, int orow_bytes) {
  const int row_bytes = dvm * elt;
  const int sh = __ffs(row_bytes / 16) - 1;  // chunks per row: a power of two
  const int nrows = min(kRB, p.rows - row_base);
  const int total = nrows << sh;
  unsigned char* dst = fin ? reinterpret_cast<unsigned char*>(p.o + (static_cast<int64_t>(b) * p.rows + row_base) * dvm)
                           : reinterpret_cast<unsigned char*>(p.o_part + (prow + row_base) * dvm);
#pragma unroll 4
  for (int i = tid; i < total; i += nthreads) {
    const int r = i >> sh, c = i & ((1 << sh) - 1);
    const uint4 v = *reinterpret_cast<const uint4*>(k_s + r * orow_bytes + 16 * c);
    *reinterpret_cast<uint4*>(dst + static_cast<int64_t>(r) * row_bytes + 16 * c) = v;
  }
  wg::fence_proxy_async();
}

// Every block has taken its last item (thread 0 did every grab): the last
// block to get here resets the work counter ctr (and its done count), so
// that the plan can serve another call with the same lengths (attention(plan=)).
MLA_DEVICE void release_plan(const AttnParams& p, int32_t* ctr, int tid) {
  if (p.ctas > 0 && tid == 0) {
    __threadfence();
    if (atomicAdd(ctr + 1, 1) == static_cast<int>(gridDim.x) - 1) {
      atomicExch(ctr, 0);
      atomicExch(ctr + 1, 0);
    }
  }
}

// One block of attention_sm90_kernel past its setup: the state of its work
// items and the stages that run them, as member functions (run: the
// work-item loop). Its members are the setup's values (shared-memory
// carve-up, thread indices) and the item state; everything is inlined into
// the kernel.
template <bool kF16, int kDv, bool kPH, int kKeys>
struct Sm90Block {
  static constexpr bool kTma = kKeys != kKeysCopy;
  static constexpr bool kFp8 = kKeys == kKeysFp8Dense || kKeys == kKeysFp8Paged;
  static_assert(!kFp8 || (kF16 && kDv == 512 && !kPH), "fp8 instances: dv 512, fp16 products, shared rope keys");
  static constexpr bool kOutF16 = kF16 && !kFp8;  // the output's type (fp8 instances write bf16)
  using T = PairTile<kDv>;
  static constexpr int kNB = T::kNB, kHB = T::kHalfNB;
  using E = Half16<kF16>;
  static constexpr int kStages = T::kStages;
  const AttnParams& p;
  const TmaMaps& maps;
  unsigned char* const q_s;
  unsigned char* const k_s;
  float* const s_m;
  float* const s_l;
  uint64_t* const mb;
  uint64_t* const qbar;
  int32_t* const ids_s;
  int* const s_next;
  unsigned char* const tail_s;
  float* const s_t;
  const int tid, wg, t, warp, lane, g, t4, r0, r1;
  const int dvm, nlat;

  // ==== The work item's state, and the helpers the stages use: pair stages and
  // buffers, page ids, key-half loads, key RoPE, descriptors, S issue, per-head scores

  // Work items: item w = (part w / hblocks, head block w % hblocks). A block
  // starts with item blockIdx.x; persistent launches (p.ctas > 0: one block
  // per resident slot) take further items from the plan's work counter, one
  // pair before the current item ends. The item's state, read by the stages:
  static constexpr int kRB = kPH ? 32 : T::kM;  // query rows of a work item
  const int hblocks = (p.rows + kRB - 1) / kRB;
  Part pt{};
  int b = 0, L = 0, npairs = 0, row_base = 0;
  int gbase = 0;  // pairs of this block's earlier items: the mbarrier phases run on across items
  // the sequence of work item w, or -1 past the plan
  MLA_DEVICE int item_seq(int w) {
    return w >= 0 && w / hblocks < p.plan[0] ? p.plan[plan_part_base(p.bs) + kPartInts * (w / hblocks)] : -1;
  }
  // Q of rows [rb, rb + 64) of sequence qb by TMA (thread 0 of warpgroup 0),
  // completing qbar's next phase
  MLA_DEVICE void issue_q(int qb, int rb) {
    wg::mbar_arrive_expect_tx(qbar, (nlat + 1) * T::kBlockBytes);
    for (int i = 0; i < nlat; ++i) wg::tma_load_3d(q_s + i * T::kBlockBytes, &maps.q, 64 * i, rb, qb, qbar);
    wg::tma_load_3d(q_s + kNB * T::kBlockBytes, &maps.q, dvm, rb, qb, qbar);  // the rope block
  }
  int nitem = 0;        // work items this block has started (Q's mbarrier parity)
  bool q_ready = false;  // the current item's Q was issued during the previous item
  // the work counter and done count: the call's own, or the plan's (read-only but for them)
  int32_t* const ctr = p.counter != nullptr ? p.counter : const_cast<int32_t*>(p.plan) + plan_counter(p.bs, p.max_parts);
  MLA_DEVICE int grab() {
    return p.ctas > 0 ? atomicAdd(ctr, 1) +
                            static_cast<int>(gridDim.x)
                      : -1;
  }
  // pair jp's stage: its key buffers, mbarriers (completing once per use:
  // parity ((gbase + jp) / kStages) & 1) and the byte offset of its buffers
  MLA_DEVICE int stage(int jp) { return kStages == 1 ? 0 : (gbase + jp) % kStages; }
  MLA_DEVICE unsigned char* kbuf(int jp) { return k_s + stage(jp) * 2 * T::kMatBytes; }
  MLA_DEVICE uint64_t* mbar(int jp, int which) { return &mb[4 * stage(jp) + which]; }
  MLA_DEVICE uint64_t soff(int jp) { return static_cast<uint64_t>(stage(jp) * 2 * T::kMatBytes) >> 4; }  // descriptor units

  // ---- loads. Thread (lr, lc) of a warpgroup copies rows lr + 16 i of a
  // half, 16-byte chunk lc of each column block it is given: per instruction a
  // warp reads 4 rows x 128 contiguous bytes.
  const int lr = t / 8, lc = t % 8;
  const uint32_t lsmem = lr * 128 + ((lc ^ (lr & 7)) << 4);  // + 16 i rows (same swizzle phase)
  // Paged caches: the page ids of a pair's keys sit in a shared-memory ring
  // slot (entry e = key / page_size - first key of the pair / page_size),
  // read from the block table by warpgroup 0 one pair before its loads are
  // issued (kStages + 1 pairs ahead), so the load path of a pair never waits
  // on a global read (block-1 pages: one id per row). fetch_id/store_id:
  // entry i of pair jp, in two steps so that the global read's latency
  // passes under other work: fetch_id returns the raw entry, store_id holds
  // it to the cache (held_page_id): held at the read, the compare sat right
  // after the load in the SASS, so warp 0 waited for the read there.
  const bool paged = kKeys == kKeysTmaPaged || kKeys == kKeysFp8Paged || (kKeys == kKeysCopy && p.block_table != nullptr);
  MLA_DEVICE int32_t fetch_id(int jp, int i) {
    if (!paged || jp >= npairs) return 0;
    const int key0 = (pt.tile_begin + jp) * T::kTileKeys, e0 = p.page_div.div(key0);
    const int last = p.page_div.div(min(key0 + T::kTileKeys, L) - 1);  // no entry past the length is read
    return e0 + i <= last ? p.block_table[b * p.block_table_stride + e0 + i] : 0;
  }
  MLA_DEVICE void store_id(int jp, int i, int32_t id) {
    if (paged && jp < npairs) ids_s[(jp % T::kIdRing) * T::kTileKeys + i] = held_page_id(id, p.num_pages);
  }
  MLA_DEVICE const bf16_t* key_row(int jp, int key) {
    if (!paged) return p.kv + b * p.kv_page_stride + static_cast<int64_t>(key) * p.kv_row_stride;
    const int e = p.page_div.div(key) - p.page_div.div((pt.tile_begin + jp) * T::kTileKeys);
    return p.kv + static_cast<int64_t>(ids_s[(jp % T::kIdRing) * T::kTileKeys + e]) * p.kv_page_stride +
           static_cast<int64_t>(p.page_div.mod(key)) * p.kv_row_stride;
  }
  // A TMA box's origin for key k of pair jp: the page (the sequence when dense) and the row in it.
  MLA_DEVICE void box_origin(int jp, int k, int& page, int& row) {
    row = k;
    page = b;
    if (paged) {
      const int e = p.page_div.div(k) - p.page_div.div((pt.tile_begin + jp) * T::kTileKeys);
      page = ids_s[(jp % T::kIdRing) * T::kTileKeys + e];
      row = p.page_div.mod(k);
    }
  }
  const int rope_chunks = p.rope / 8;  // 16-byte chunks of the rope block read from memory
  // Column blocks [blo, bhi) (+ the rope block kNB if with8) of half h of
  // pair jp, completing mbarrier `bar` when they have landed. TMA instances
  // (the host made descriptors): thread 0 arms the barrier and issues one box
  // per column block (8 KB; 64 / rows boxes of `rows` keys each for pages of
  // 8-32 rows), the other 127 threads arrive; a half holding the length is
  // loaded whole (its rows past the length are zeroed before its P V:
  // zero_past_len), an empty half loads nothing. The other instances load by
  // cp.async, which zero-fills the rows past the length.
  // (Thread 0 issues the boxes of small pages too: spreading them over threads
  // helps small pages but slows the common 64-row path; docs/not_kept.md.)
  MLA_DEVICE void load_half(int jp, int h, int blo, int bhi, bool with8, int bar) {
    const int key0 = (pt.tile_begin + jp) * T::kTileKeys + h * T::kHalf;
    if constexpr (kTma) {
      uint64_t* mbp = mbar(jp, bar);
      if (key0 >= L) {  // an empty half: nothing reads its buffer (S and P V skip it); keep the phase
        wg::mbar_arrive(mbp);
        return;
      }
      if (t == 0) {
        const int bend = min(bhi, nlat);  // (dv 64 on the dv 128 kernel: latent block 1 stays zero)
        if constexpr (kFp8) {  // e4m3 boxes of 64 bytes x 64 rows (one page of 64k rows, or dense), where fp8_widen expects them
          unsigned char* dst = kbuf(jp) + h * T::kMatBytes;
          wg::mbar_arrive_expect_tx(mbp, (bend - blo + (with8 ? 1 : 0)) * kFp8BoxBytes);
          int page, row;
          box_origin(jp, key0, page, row);
          for (int bk = blo; bk < bend; ++bk)
            wg::tma_load_3d_hint(dst + fp8_box(h, bk), &maps.kv, 64 * bk, row, page, mbp, wg::l2_evict_first_policy());
          if (with8) wg::tma_load_3d_hint(dst + fp8_box(h, kNB), &maps.kv, dvm, row, page, mbp, wg::l2_evict_first_policy());
        } else {
        wg::mbar_arrive_expect_tx(mbp, max(bend - blo, 0) * T::kBlockBytes + (with8 ? T::kBlockBytes : 0));
        unsigned char* dst = kbuf(jp) + h * T::kMatBytes;
        if constexpr (kPH) {
          if (with8)
            for (int kk = 0; kk < 2; ++kk)
              wg::tma_load_3d(dst + kNB * T::kBlockBytes + kk * 32 * 128, &maps.sc, key0 + 32 * kk, row_base, b, mbp);
        } else if (with8 && p.kpe != nullptr) {
          wg::tma_load_3d_hint(dst + kNB * T::kBlockBytes, &maps.kpe, 0, key0, b, mbp, wg::l2_evict_first_policy());
        }
        for (int k = key0; k < key0 + T::kHalf; k += maps.rows) {  // one box of `rows` keys per column block
          int page, row;
          box_origin(jp, k, page, row);
          unsigned char* d = dst + (k - key0) * 128;  // a multiple of 8 rows: the swizzle phase is unchanged
          for (int bk = blo; bk < bend; ++bk)
            wg::tma_load_3d_hint(d + bk * T::kBlockBytes, &maps.kv, 64 * bk, row, page, mbp, wg::l2_evict_first_policy());
          if (!kPH && with8 && p.kpe == nullptr)
            wg::tma_load_3d_hint(d + kNB * T::kBlockBytes, &maps.kv, dvm, row, page, mbp, wg::l2_evict_first_policy());
        }
        }  // (not kFp8)
      } else {
        wg::mbar_arrive(mbp);
      }
      // Thread 0's issue branch ends here for the whole warp. Without this
      // point ptxas cannot prove the pair loops converged: it keeps their
      // wgmma descriptors in vector registers and moves them to uniform ones
      // (R2UR) before every wgmma, and the kernel runs 5-6% slower
      // (docs/attention.md, "Why the kernel is built this way").
      __syncwarp();
      return;
    }
    if (key0 >= L) {  // an empty half (a short last pair): nothing reads its buffer (S and P V skip it); keep the phase
      wg::cp_async_arrive(mbar(jp, bar));
      return;
    }
    unsigned char* dst = kbuf(jp) + h * T::kMatBytes + lsmem;
    const int key_base = key0 + lr;
    const bf16_t* srcs[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int key = key_base + 16 * i;
      srcs[i] = key < L ? key_row(jp, key) + lc * 8 : nullptr;  // rows past the length are zero-filled
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const bool valid = srcs[i] != nullptr;  // (the cache may hold NaN past the length)
      const bf16_t* src = valid ? srcs[i] : p.kv;
      unsigned char* d = dst + i * 16 * 128;
      for (int bk = blo; bk < min(bhi, nlat); ++bk)
        copy16_async(d + bk * T::kBlockBytes, valid ? src + bk * 64 : src, valid);
      if (!kPH && with8) {  // the rope block: from the cache, or from the separate (rotated) k_pe rows
        const bool in_rope = valid && lc < rope_chunks;  // (columns past the rope width: zeros)
        const bf16_t* src8 = p.kpe == nullptr ? src + dvm
                                              : p.kpe + b * p.kpe_batch_stride +
                                                    static_cast<int64_t>(key_base + 16 * i) * p.kpe_row_stride + lc * 8;
        copy16_async(d + kNB * T::kBlockBytes, in_rope ? src8 : p.kv, in_rope);
      }
    }
    if (kPH && with8) {  // the score tile (within the workspace: its rows reach the key tiles)
      unsigned char* sb = kbuf(jp) + h * T::kMatBytes + kNB * T::kBlockBytes;
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // 2 x 32 rows x 8 chunks of 16 bytes over 128 threads
        const int idx = t + 128 * i, kk = idx / 256, r = (idx / 8) % 32, c = idx % 8;
        const bool valid = row_base + r < p.rows;  // (rows past the last: zeros)
        const float* src = p.rope_scores + (static_cast<int64_t>(b) * p.rows + row_base + r) * p.rs_stride + key0 +
                           32 * kk + 4 * c;
        copy16_async(sb + kk * 32 * 128 + r * 128 + ((c ^ (r & 7)) << 4), valid ? src : p.rope_scores, valid);
      }
    }
    wg::cp_async_arrive(mbar(jp, bar));
  }

  // Block-table entries of pair jp into L2 ahead of their use (paged caches),
  // so that fetch_id (one pair later) finds them there: a pair's 128 entries
  // are 4 lines for one-row pages. Threads 0-3 of warpgroup 0, 32 keys each.
  MLA_DEVICE void prefetch_pages(int jp) {
    if (!paged || wg != 0 || t >= 4 || jp >= npairs) return;
    const int key = (pt.tile_begin + jp) * T::kTileKeys + 32 * t;
    if (key < L) prefetch_l2(p.block_table + b * p.block_table_stride + p.page_div.div(key));
  }

  // ---- key RoPE of half h of pair jp, in place in its rope block: thread
  // (row t/2, hh = t%2) rotates pairs (j, j + 32) for j in [16 hh, 16 hh + 16).
  const bool rope = !kF16 && p.rope_cs != nullptr;  // (the host refuses rope_cs with fp16)
  // The cos | sin values thread (row t/2, hh = t%2) needs for its key of
  // half h of pair jp: [cos, sin] of pairs 16 hh .. 16 hh + 7, then of
  // 16 hh + 8 .. 16 hh + 15. Loaded at the start of the half's S, so that
  // their latency passes under the first group's wait and k-steps.
  MLA_DEVICE void load_cs(int jp, int h, uint4 (&cs)[4]) {
    const int row = t / 2, hh = t % 2;
    const int key = (pt.tile_begin + jp) * T::kTileKeys + h * T::kHalf + row;
    if (rope && key < L) {
      const uint4* src = reinterpret_cast<const uint4*>(p.rope_cs + static_cast<int64_t>(key) * T::kRope);
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        cs[2 * c] = ld_global_nc(src + 2 * hh + c);
        cs[2 * c + 1] = ld_global_nc(src + 4 + 2 * hh + c);
      }
    }
  }
  MLA_DEVICE void rotate_half(int jp, int h, const uint4 (&cs)[4]) {
    const int row = t / 2, hh = t % 2;
    const int key = (pt.tile_begin + jp) * T::kTileKeys + h * T::kHalf + row;
    if (key < L) {
      unsigned char* blk = kbuf(jp) + h * T::kMatBytes + kNB * T::kBlockBytes + row * 128;
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        uint4* p1 = reinterpret_cast<uint4*>(blk + (((2 * hh + c) ^ (row & 7)) << 4));
        uint4* p2 = reinterpret_cast<uint4*>(blk + (((4 + 2 * hh + c) ^ (row & 7)) << 4));
        uint4 x1 = *p1, x2 = *p2;
        uint32_t* a1 = reinterpret_cast<uint32_t*>(&x1);
        uint32_t* a2 = reinterpret_cast<uint32_t*>(&x2);
        const uint32_t* cc = reinterpret_cast<const uint32_t*>(&cs[2 * c]);
        const uint32_t* ss = reinterpret_cast<const uint32_t*>(&cs[2 * c + 1]);
#pragma unroll
        for (int w = 0; w < 4; ++w) rope_rot_bf16x2(a1[w], a2[w], cc[w], ss[w], a1[w], a2[w]);
        *p1 = x1;
        *p2 = x2;
      }
    }
    wg::fence_proxy_async();
    wg::named_sync(kBarWg0 + wg, 128);
  }

  // Descriptors of stage 0 (+ soff(jp) for pair jp). Those of the key and
  // value halves and of P are made from the warpgroup as a compile-time
  // constant (kW1: W0{} / W1{} in each warpgroup's own code): made from the
  // runtime `wg`, ptxas advanced warpgroup 0's S descriptors with a split
  // 32-bit add, a carry and a reload of the constant high half per wgmma
  // (twice warpgroup 1's instructions per wgmma; docs/attention.md). Q's gets a
  // zero that ptxas cannot see through (h_q >> 30: a q with 2^30 heads would
  // not fit in memory), so that it stays one 64-bit value advanced by one
  // add per k-step instead of being split the same way.
  const uint64_t dq = wg::desc_sw128(q_s, 16, 1024) + (static_cast<uint64_t>(static_cast<uint32_t>(p.h_q) >> 30) << 32);
  // the warpgroup's key half (S's B operand)
  template <class W>
  MLA_DEVICE uint64_t dk_of(W kW1) { return wg::desc_sw128(k_s + (decltype(kW1)::value ? T::kMatBytes : 0), 16, 1024); }
  // V halves: the warpgroup's kN columns of K0 / K1, read MN-major
  template <class W>
  MLA_DEVICE uint64_t dv0_of(W kW1) {
    return wg::desc_sw128(k_s + (decltype(kW1)::value ? kHB : 0) * T::kBlockBytes, T::kBlockBytes, 1024);
  }
  template <class W>
  MLA_DEVICE uint64_t dv1_of(W kW1) {
    return wg::desc_sw128(k_s + T::kMatBytes + (decltype(kW1)::value ? kHB : 0) * T::kBlockBytes, T::kBlockBytes, 1024);
  }
  // P of the OTHER warpgroup's half: the rope block of K1 (for WG0) / K0 (for WG1)
  MLA_DEVICE unsigned char* p_mine(int jp) { return kbuf(jp) + wg * T::kMatBytes + kNB * T::kBlockBytes; }
  template <class W>
  MLA_DEVICE uint64_t dp_other_of(W kW1) {
    return wg::desc_sw128(k_s + (decltype(kW1)::value ? 0 : T::kMatBytes) + kNB * T::kBlockBytes, 16, 1024);
  }

  // a half whose first key is past the length (the second half of a short
  // last tile): no S, no P V for it (same answer for every thread of the block)
  MLA_DEVICE bool half_empty(int jp, int h) { return (pt.tile_begin + jp) * T::kTileKeys + h * T::kHalf >= L; }

  // TMA instances load a half holding the length whole: its rows past the
  // length hold whatever the cache holds there (the S products mask those
  // keys, but P V multiplies them by P = 0, and NaN survives that). Before
  // its P V, each warpgroup zeroes those rows in the V blocks [blo, bhi) it
  // reads (its own columns; the S products that read them are done by then),
  // whole 128-byte rows, so the swizzle does not matter.
  MLA_DEVICE bool half_partial(int jp, int h) {
    const int key0 = (pt.tile_begin + jp) * T::kTileKeys + h * T::kHalf;
    return kTma && key0 < L && key0 + T::kHalf > L;
  }
  MLA_DEVICE void zero_past_len(int jp, int h, int blo, int bhi) {
    const int n = L - ((pt.tile_begin + jp) * T::kTileKeys + h * T::kHalf);  // rows below the length
    unsigned char* base = kbuf(jp) + h * T::kMatBytes + n * 128;
    const int chunks = (T::kHalf - n) * 8;  // 16-byte chunks past the length, per block
    wg::fence_proxy_async();  // (after the TMA's writes, which the S products' waits acquired)
#pragma unroll 1  // (rare: a few instructions in the pair loops, not hundreds)
    for (int bk = blo; bk < bhi; ++bk) {
#pragma unroll 1
      for (int i = t; i < chunks; i += 128) *reinterpret_cast<uint4*>(base + bk * T::kBlockBytes + 16 * i) = make_uint4(0, 0, 0, 0);
    }
    wg::fence_proxy_async();  // the zeros -> the P V wgmma (async proxy)
    wg::named_sync(kBarWg0 + wg, 128);
  }

  // ---- fp8 instances. A half's e4m3 bytes land in boxes of 64 bytes x 64
  // rows (4 KB) inside the fp16 blocks of the same load group (so a group's
  // refill point, where its blocks are free, is unchanged), in the group's
  // upper part: K0 blocks 0-3 and K1 blocks 0-3 at 16-32 KB, K0 blocks 4-8 at
  // 52-72 KB, K1 blocks 4-7 at 48-64 KB, K1's rope block (loaded with blocks
  // 0-3) in its own upper 4 KB. fp8_widen writes blocks whose fp16 rows lie
  // below every box of the group as it reads them (0, 1, 4, 5), reads the
  // other boxes into registers, waits for the warpgroup, then writes those.
  MLA_DEVICE static constexpr int fp8_box(int h, int bk) {
    return bk < 4 ? 16384 + 4096 * bk : h == 0 ? 53248 + 4096 * (bk - 4) : bk < 8 ? 49152 + 4096 * (bk - 4) : 69632;
  }
  // box bytes [16 c, 16 c + 16) of row r (c < 4) -> fp16 chunks 2c, 2c + 1 of row r of the block
  MLA_DEVICE static void widen_chunk(unsigned char* blk, int r, int c, uint4 v) {
    uint4 lo, hi;
    const uint32_t* w = reinterpret_cast<const uint32_t*>(&v);
    uint32_t hh[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(hh[2 * i]) : "h"(static_cast<unsigned short>(w[i] & 0xffffu)));
      asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(hh[2 * i + 1]) : "h"(static_cast<unsigned short>(w[i] >> 16)));
    }
    lo = make_uint4(hh[0], hh[1], hh[2], hh[3]);
    hi = make_uint4(hh[4], hh[5], hh[6], hh[7]);
    *reinterpret_cast<uint4*>(blk + r * 128 + (((2 * c) ^ (r & 7)) << 4)) = lo;
    *reinterpret_cast<uint4*>(blk + r * 128 + (((2 * c + 1) ^ (r & 7)) << 4)) = hi;
  }
  // Group `grp` of half h of pair jp (grp 0: blocks [0, kHB) (+ the rope block
  // for K1); grp 1: blocks [kHB, kNB) (+ the rope block for K0)) widened in
  // place by this warpgroup, then visible to the wgmma of both warpgroups
  // (fenced here; the other warpgroup reads it after a named barrier that
  // follows this warpgroup's S). An empty half is not widened (nothing reads it).
  MLA_DEVICE void fp8_widen(int jp, int h, int grp) {
    if (half_empty(jp, h)) return;
    unsigned char* base = kbuf(jp) + h * T::kMatBytes;
    const int b0 = grp == 0 ? 0 : kHB;  // the group's first block; it and the next one are streamed
    const bool rope8 = (grp == 0) == (h == 1);  // the rope block is in this group
    const int nstage = rope8 ? 3 : 2;          // boxes held in registers: blocks b0 + 2, b0 + 3 (+ 8)
#pragma unroll
    for (int i = 0; i < 2; ++i) {  // blocks b0, b0 + 1: their rows lie below every box of the group
      const int bk = b0 + i;
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int c = t + 128 * u, r = c >> 2;
        const uint4 v = *reinterpret_cast<const uint4*>(base + fp8_box(h, bk) + 16 * c);
        widen_chunk(base + bk * T::kBlockBytes, r, c & 3, v);
      }
    }
    uint4 v[3][2];
#pragma unroll
    for (int i = 0; i < 3; ++i) {
      if (i < nstage) {
        const int bk = i < 2 ? b0 + 2 + i : kNB;
#pragma unroll
        for (int u = 0; u < 2; ++u) v[i][u] = *reinterpret_cast<const uint4*>(base + fp8_box(h, bk) + 16 * (t + 128 * u));
      }
    }
    wg::named_sync(kBarWg0 + wg, 128);  // every box of the group read (streamed or held)
#pragma unroll
    for (int i = 0; i < 3; ++i) {
      if (i < nstage) {
        const int bk = i < 2 ? b0 + 2 + i : kNB;
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int c = t + 128 * u;
          widen_chunk(base + bk * T::kBlockBytes, c >> 2, c & 3, v[i][u]);
        }
      }
    }
    wg::fence_proxy_async();  // the fp16 rows -> the wgmma (async proxy)
    wg::named_sync(kBarWg0 + wg, 128);
  }
  // Q (bf16, landed in q_s) -> fp16 in place, times 2^-e where e keeps every
  // value within 2^15 (e = 0 unless |q| > 32768); the scores' factor, times
  // 2^e, goes to s_t[8] (s_t: the one-key tail's scores, which fp16 products
  // never use), read by mask_scale_max's callers.
  MLA_DEVICE void convert_q() {
    constexpr int kChunks = T::kMatBytes / 16;
    if (!maps.use_q) sync_threads();  // (Q by cp.async: each thread waited for its own copies only)
    float mx = 0.f;
    for (int i = tid; i < kChunks; i += T::kThreads) {
      const uint4 v = *reinterpret_cast<const uint4*>(q_s + 16 * i);
      const uint32_t* w = reinterpret_cast<const uint32_t*>(&v);
#pragma unroll
      for (int k = 0; k < 4; ++k) mx = fmaxf(mx, fmaxf(fabsf(bf16_lo(w[k])), fabsf(bf16_hi(w[k]))));
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    if (lane == 0) s_t[tid / 32] = mx;
    sync_threads();
#pragma unroll
    for (int w = 0; w < T::kThreads / 32; ++w) mx = fmaxf(mx, s_t[w]);
    int e = 0;
    if (mx > 32768.f && mx <= 3.0e38f) e = static_cast<int>(ceilf(log2f(mx))) - 15;
    const float f = __int_as_float((127 - e) << 23);  // 2^-e, exact
    if (tid == 0) s_t[8] = p.scale_log2 * __int_as_float((127 + e) << 23);  // the item's scores' factor (sync_threads below)
    for (int i = tid; i < kChunks; i += T::kThreads) {
      uint4 v = *reinterpret_cast<const uint4*>(q_s + 16 * i);
      uint32_t* w = reinterpret_cast<uint32_t*>(&v);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        uint32_t h2;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(h2) : "f"(bf16_hi(w[k]) * f), "f"(bf16_lo(w[k]) * f));
        w[k] = h2;
      }
      *reinterpret_cast<uint4*>(q_s + 16 * i) = v;
    }
    wg::fence_proxy_async();  // the fp16 Q -> the S wgmma (the prologue's barrier follows)
  }

  // S of this warpgroup's half of pair jp: its two groups of latent blocks as
  // they land, the rope block (in the second group) with them. With key RoPE
  // the rope block is rotated as soon as the second group has landed, before
  // its k-steps are issued: the rotation's shared-memory reads then wait
  // behind the first group's products only (issued after the second group's,
  // they queued behind those operand reads too, and the rope k-steps behind
  // the rotation; docs/attention.md). `between` runs after the first group
  // is issued (warpgroup 0 releases K1 there).
  // kW1: the calling warpgroup is warpgroup 1 (a compile-time constant, so
  // that no branch on the warpgroup sits between the wgmmas).
  template <class W, class F>
  MLA_DEVICE void issue_s(W kW1, float (&s)[32], int jp, F between) {
    constexpr bool w1 = decltype(kW1)::value;
    const uint32_t par = ((gbase + jp) / kStages) & 1;
    const uint64_t dkj = dk_of(kW1) + soff(jp);
    uint4 cs[4];
    if constexpr (!kPH) load_cs(jp, wg, cs);
    if (half_empty(jp, wg)) {  // nothing to multiply: the mask makes S -inf; keep the barrier phases
      wg::mbar_wait(mbar(jp, wg == 0 ? kMbK0a : kMbK1a), par);
      between();
      wg::mbar_wait(mbar(jp, wg == 0 ? kMbK0b : kMbK1b), par);
      return;
    }
    // First the blocks the loading warpgroup released after its FIRST P V of
    // the previous pair (loaded early), then the rest: warpgroup 0 reads K0
    // blocks [0, kHB) first, warpgroup 1 K1 blocks [kHB, kNB) first (in block
    // order warpgroup 1 would start on K1's late-loaded part and wait for it).
    wg::mbar_wait(mbar(jp, w1 ? kMbK1b : kMbK0a), par);
    wg::fence_proxy_async();
    if constexpr (kFp8) fp8_widen(jp, w1 ? 1 : 0, w1 ? 1 : 0);
    wg::fence();
    if constexpr (w1)
      s_steps<4 * kHB, 4 * kNB, kF16, 4 * kHB>(s, dq, dkj);
    else
      s_steps<0, 4 * kHB, kF16, 0>(s, dq, dkj);
    wg::commit();
    between();
    wg::mbar_wait(mbar(jp, w1 ? kMbK1a : kMbK0b), par);
    wg::fence_proxy_async();
    if constexpr (kFp8) fp8_widen(jp, w1 ? 1 : 0, w1 ? 0 : 1);
    if constexpr (!kPH) {
      if (rope) rotate_half(jp, wg, cs);
    }
    wg::fence();  // after the (per-thread) wait loop: else ptxas inserts one and serializes
    if constexpr (w1)
      s_steps<0, 4 * kHB, kF16, -1>(s, dq, dkj);
    else
      s_steps<4 * kHB, 4 * kNB, kF16, -1>(s, dq, dkj);
    if constexpr (!kPH) s_steps<4 * kNB, T::kSteps, kF16, -1>(s, dq, dkj);  // the rope block's k-steps
    wg::commit();
  }


  // ==== The stages of a work item, in the order the work-item loop (run)
  // runs them (all inlined). The item's per-thread state, declared in the
  // loop, goes in and out as parameters and return values, not as block
  // state: a loop variable held by reference reaches registers later in
  // nvcc's optimisation, which changes the register assignment.

  // Item `item`: its part, sequence, length and head rows into the item
  // state. False past the plan.
  MLA_DEVICE bool start_item(int item) {
    if (!read_part(p, item / hblocks, pt, T::kTileKeys)) return false;
    b = pt.b;
    L = pt.L;
    npairs = pt.tile_end - pt.tile_begin;
    row_base = (item % hblocks) * kRB;
    return true;
  }

  // The tail: a last pair holding ONE key (L mod 128 = 1: every task length)
  // is not run through the pair loop, whose matrix products, loads and
  // barriers cost a full pair's time for it. Its row is read in the
  // prologue, warpgroup 1 computes its scores there (Q is in shared memory
  // until the last pair prefetches the next item's), and after the loop
  // both warpgroups add it to their O columns on the CUDA cores: one more
  // online-softmax step of one key, with the same lazy max and rounding.
  // (dv 512, bf16, shared rope keys: the task's paths.)
  // True for such an item, whose last pair then leaves npairs.
  MLA_DEVICE bool has_tail_key() {
    const bool tail = kOneKeyTail<kDv, kPH> && !kF16 && npairs > 0 &&
                      L - (pt.tile_begin + npairs - 1) * T::kTileKeys == 1;
    if (tail) --npairs;
    return tail;
  }

  // Q (by TMA: issued here or prefetched during the previous item's last pair;
  // else all threads by cp.async, the previous item's S products done)
  MLA_DEVICE void load_q() {
    if (maps.use_q) {
      if (!q_ready && tid == 0) issue_q(b, row_base);
    } else {
      const int qr = tid / 8, qc = tid % 8;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = qr + 32 * h;
        const bool valid = r < kRB && row_base + r < p.rows;
        const bf16_t* src = valid ? p.q + b * p.q_batch_stride + (row_base + r) * p.q_row_stride + qc * 8 : p.q;
#pragma unroll
        for (int i = 0; i < T::kBlocks; ++i) {
          const bool rope_blk = i == T::kBlocks - 1;
          const bool v = valid && (rope_blk ? qc < rope_chunks : i < nlat);  // (dv 64: block 1 zero)
          copy16_async(q_s + i * T::kBlockBytes + r * 128 + ((qc ^ (r & 7)) << 4),
                       v ? src + (rope_blk ? dvm : i * 64) : p.q, v);
        }
      }
      copy_commit();
    }
  }

  // The page ids of pairs 0..kStages, then the loads of the first kStages
  // pairs (each warpgroup its column blocks, as in the pair loops).
  MLA_DEVICE void prologue_loads() {
    // page ids of pairs 0..kStages (even pairs: warpgroup 0, odd: warpgroup 1)
    for (int j = wg; j <= kStages; j += 2) store_id(j, t, fetch_id(j, t));
    prefetch_pages(kStages + 1);
    sync_threads();  // mbarriers initialised, page ids of pairs 0..kStages stored
    for (int j = 0; j < kStages && j < npairs; ++j) {
      if (wg == 0) {
        load_half(j, 0, 0, kHB, false, kMbK0a);
        load_half(j, 1, 0, kHB, true, kMbK1a);
      } else {
        load_half(j, 0, kHB, kNB, true, kMbK0b);
        load_half(j, 1, kHB, kNB, false, kMbK1b);
      }
    }
  }

  // Q has landed (the TMA's mbarrier phase of item `nitem`, or the cp.async group).
  MLA_DEVICE void wait_q(int nitem) {
    if (maps.use_q)
      wg::mbar_wait(qbar, nitem & 1);
    else
      copy_wait<0>();  // Q (the committed group)
  }

  // causal limits of this thread's rows (keys >= lim are masked)
  MLA_DEVICE void causal_limits(int& lim0, int& lim1) {
    if (p.causal) {
      lim0 = min(L, L - (p.s_q - 1 - (row_base + r0) / p.h_q));
      lim1 = min(L, L - (p.s_q - 1 - (row_base + r1) / p.h_q));
    }
  }

  using W0 = std::integral_constant<bool, false>;
  using W1 = std::integral_constant<bool, true>;
  // At dv 512 each warpgroup's loop starts at jp = -1, which only issues
  // pair 0's S: one copy of the S code per warpgroup serves every pair, so
  // no separate first-S code is fetched cold at every work item. At dv
  // 128/256 the shared loop costs registers and time, so they keep the
  // separate first S.
  static constexpr bool kLoopS = kDv == 512;
  static constexpr int kFirst = kLoopS ? -1 : 0;

  // Warpgroup 0's pair loop: per pair, the softmax of S0, O_L += P0 V0L, P0
  // rescaled to warpgroup 1's max into shared memory, O_L += P1 V1L, the next
  // S0 under the last product; its loads of K0 [0, H) and K1 [0, H) + NB. It
  // returns the next work item it took and whether that item's Q is on its way.
  struct NextItem {
    int item;
    bool q_pref;
  };
  MLA_DEVICE NextItem pairs_wg0(float (&s)[32], uint32_t (&pa)[16], float (&o)[T::kORegs], float& m_a, float& m_b, float& l_a,
                                float& l_b, int lim0, int lim1, int next_item, int next_b, bool q_pref) {
    if (!kLoopS && npairs > 0) {
      issue_s(W0{}, s, 0, [] {});
      wg::wait<0>();
    }
#pragma unroll 1
    for (int jp = kFirst; jp < npairs; ++jp) {
      const bool more = jp + 1 < npairs;              // a next pair: its S is issued at the end of this one
      const bool refill = jp >= 0 && jp + kStages < npairs;  // pair jp + kStages loads into this pair's buffers
      if (kLoopS) wg::wait<0>();  // (nothing in flight; ptxas needs to see it at the top of the loop, else C7515)
      if (jp >= 0) {
      // Taking the next item early and prefetching its Q: at dv 512 only (at
      // dv 128/256 the extra code in the loop costs more than it hides; they
      // take the next item in the epilogue and Q in the prologue)
      if (kDv == 512 && t == 0) {  // (the atomic's and the read's latencies pass under a pair)
        if (jp == max(npairs - 2, 0)) next_item = grab();
        if (!more) next_b = item_seq(next_item);
      }
      const uint64_t so = soff(jp);
      // pair jp + kStages's loads are issued during this pair; the page ids
      // of pair jp + kStages + 1 are read now and stored before the kBarM1
      // barrier below, which orders them before every reader (warpgroup 0
      // after it, warpgroup 1 after kBarM0 of the next pair); their slot was
      // last read for the loads of pair jp - 1, issued before warpgroup 1
      // arrived at kBarM1 of pair jp - 1 (in the prologue for jp - 1 < kStages).
      const int32_t next_id = fetch_id(jp + kStages + 1, t);
      prefetch_pages(jp + kStages + 2);
      // softmax of S0 against the running max
      float mx0, mx1;
      if constexpr (kPH) add_rope_scores<kRB>(s, p_mine(jp), r0, r1, t4);
      mask_scale_max(s, (pt.tile_begin + jp) * T::kTileKeys, t4, lim0, lim1, kFp8 ? s_t[8] : p.scale_log2, mx0, mx1);
      const float n0 = lazy_max(m_a, mx0), n1 = lazy_max(m_b, mx1);
      if (t4 == 0) {
        s_m[r0] = n0;
        s_m[r1] = n1;
      }
      softmax_step<kF16>(s, pa, o, n0, n1, m_a, m_b, l_a, l_b);
      wg::named_arrive(kBarM0, 256);
      // O_L += P0 V0L
      if (half_partial(jp, 0)) zero_past_len(jp, 0, 0, kHB);
      wg::fence();
      pv_regs<T::kN, kF16>(o, pa, dv0_of(W0{}) + so);
      wg::commit();
      wg::wait<0>();
      store_id(jp + kStages + 1, t, next_id);
      // warpgroup 1's max -> P0 rescaled for it
      wg::named_sync(kBarM1, 256);
      // K0 blocks [0, kHB): read by nothing else now (issued after warpgroup 1's
      // max, as FlashMLA issues it: measured faster than right after P0 V0L)
      if (refill) load_half(jp + kStages, 0, 0, kHB, false, kMbK0a);
      // last pair: both warpgroups' S products are done, Q is free -> the next item's
      if (kDv == 512 && !more && t == 0 && maps.use_q && next_b >= 0) {
        issue_q(next_b, (next_item % hblocks) * kRB);
        q_pref = true;
      }
      const float f0 = s_m[r0], f1 = s_m[r1];
      const float d0 = rescale(m_a, f0), d1 = rescale(m_b, f1);
#pragma unroll
      for (int i = 0; i < 32; i += 2) {
        const float d = (i & 2) ? d1 : d0;
        pa[i / 2] = E::pack2(s[i] * d, s[i + 1] * d);
      }
      store_p(p_mine(jp), pa, r0, r1, t4);
      wg::fence_proxy_async();
      wg::named_arrive(kBarP0, 256);
      l_a *= d0;
      l_b *= d1;
      m_a = f0;
      m_b = f1;
      // O_L = O_L * d + P1 V1L (P1 from warpgroup 1, in K1 block 8)
      wg::named_sync(kBarP1, 256);
      scale_rows(o, d0, d1);
      if (!half_empty(jp, 1)) {  // P1 == 0 otherwise
        if (half_partial(jp, 1)) zero_past_len(jp, 1, 0, kHB);  // (warpgroup 1's S1 is done: kBarP1)
        wg::fence();
        pv_smem<T::kN, kF16>(o, dp_other_of(W0{}) + so, dv1_of(W0{}) + so);
        wg::commit();
      }
      }  // jp >= 0
      if (more) {
        issue_s(W0{}, s, jp + 1, [&] {
          wg::wait<1>();  // P1 V1L done: K1 blocks [0, kHB) and the rope block are free
          if (refill) load_half(jp + kStages, 1, 0, kHB, true, kMbK1a);
        });
      }
      wg::wait<0>();
    }
    return NextItem{next_item, q_pref};
  }

  // Warpgroup 1's pair loop: per pair, the softmax of S1 against warpgroup 0's
  // max, P1 into shared memory, O_R += P1 V1R + P0 V0R, the next S1; its loads
  // of K1 [H, NB) and K0 [H, NB].
  MLA_DEVICE void pairs_wg1(float (&s)[32], uint32_t (&pa)[16], float (&o)[T::kORegs], float& m_a, float& m_b, float& l_a,
                            float& l_b, int lim0, int lim1) {
    if (!kLoopS && npairs > 0) {
      issue_s(W1{}, s, 0, [] {});
      wg::wait<0>();
    }
#pragma unroll 1
    for (int jp = kFirst; jp < npairs; ++jp) {
      const bool more = jp + 1 < npairs, refill = jp + kStages < npairs;
      if (kLoopS) wg::wait<0>();  // (as in warpgroup 0's loop)
      if (jp >= 0) {
      const uint64_t so = soff(jp);
      float mx0, mx1;
      if constexpr (kPH) add_rope_scores<kRB>(s, p_mine(jp), r0, r1, t4);
      mask_scale_max(s, (pt.tile_begin + jp) * T::kTileKeys + T::kHalf, t4, lim0, lim1, kFp8 ? s_t[8] : p.scale_log2,
                     mx0, mx1);
      wg::named_sync(kBarM0, 256);  // warpgroup 0's max of this pair
      const float n0 = lazy_max(s_m[r0], mx0), n1 = lazy_max(s_m[r1], mx1);
      if (t4 == 0) {
        s_m[r0] = n0;
        s_m[r1] = n1;
      }
      wg::named_arrive(kBarM1, 256);
      // Nothing is in flight here (the last wait was wait<0>), but without
      // this ptxas (CUDA 13.0) cannot see it across the work-item loop and
      // serializes every wgmma of the kernel (C7515). (Here rather than at the
      // top of the pair: the faster of the two places.)
      wg::wait<0>();
      softmax_step<kF16>(s, pa, o, n0, n1, m_a, m_b, l_a, l_b);
      store_p(p_mine(jp), pa, r0, r1, t4);
      wg::fence_proxy_async();
      // O_R += P1 V1R, then += P0' V0R once warpgroup 0 has stored P0'
      if (!half_empty(jp, 1)) {  // P1 == 0 otherwise
        if (half_partial(jp, 1)) zero_past_len(jp, 1, kHB, kNB);
        wg::fence();
        pv_regs<T::kN, kF16>(o, pa, dv1_of(W1{}) + so);
        wg::commit();
      }
      wg::named_sync(kBarP0, 256);
      if (half_partial(jp, 0)) zero_past_len(jp, 0, kHB, kNB);  // (warpgroup 0's S0 is done: kBarP0)
      wg::fence();
      pv_smem<T::kN, kF16>(o, dp_other_of(W1{}) + so, dv0_of(W1{}) + so);
      wg::commit();
      // P1 stored, and both of this warpgroup's P V products issued before
      // warpgroup 0 issues its P1 V1L and the next S0 (FlashMLA's order)
      wg::named_arrive(kBarP1, 256);
      wg::wait<1>();  // P1 V1R done: K1 blocks [kHB, kNB) are free
      if (refill) load_half(jp + kStages, 1, kHB, kNB, false, kMbK1b);
      wg::wait<0>();  // P0 V0R done: K0 blocks [kHB, kNB] (the rope block held P0) are free
      if (refill) load_half(jp + kStages, 0, kHB, kNB, true, kMbK0b);
      }  // jp >= 0
      if (more) {
        issue_s(W1{}, s, jp + 1, [] {});
        wg::wait<0>();
      }
    }
  }

  // Both warpgroups hold O and l at the same final max: their row sums meet in
  // shared memory, and warpgroup 0's thread 0 publishes the block's next work
  // item (taken in the pair loop at dv 512, else now) and whether its Q is on its way.
  MLA_DEVICE void sum_rows(float l_a, float l_b, int next_item, bool q_pref) {
    if (t4 == 0) {
      s_l[wg * T::kM + r0] = l_a;
      s_l[wg * T::kM + r1] = l_b;
    }
    if (wg == 0 && t == 0) {
      s_next[0] = npairs > 0 && kDv == 512 ? next_item : grab();
      s_next[1] = q_pref ? 1 : 0;
    }
    sync_threads();  // (also: every matrix product of the item is done, the key buffers are free)
    q_ready = s_next[1] != 0;
  }

  // ==== The work items of this block: per item, the stages above in order
  MLA_DEVICE void run() {
    for (int item = block_x();;) {
      if (!start_item(item)) break;
      const bool tail = has_tail_key();
      // The tail key's three steps (its row here, its scores after the prologue, its
      // P V after the pair loops) stay in the loop: as member or device functions
      // (each of the three alone) they change the SASS of the dv 512 bf16 kernel (more
      // registers; nvcc then folds the tail row's shared address otherwise).
      uint4 tail_chunk = make_uint4(0, 0, 0, 0);  // warpgroup 0's threads 0..kBlocks*8-1: one 16-byte chunk of the row
      if (tail && wg == 0 && t < T::kBlocks * 8) {
        const int key = L - 1;
        const bf16_t* row = paged ? p.kv + static_cast<int64_t>(page_id(p.block_table, b * p.block_table_stride + p.page_div.div(key), p.num_pages)) *
                                               p.kv_page_stride +
                                        static_cast<int64_t>(p.page_div.mod(key)) * p.kv_row_stride
                                  : p.kv + b * p.kv_page_stride + static_cast<int64_t>(key) * p.kv_row_stride;
        if (t < kNB * 8) {
          tail_chunk = *reinterpret_cast<const uint4*>(row + 8 * t);
        } else if (t - kNB * 8 < rope_chunks) {  // (columns past the rope width: zeros, as in the key buffers)
          const int c = t - kNB * 8;
          if (rope) {  // rotated here as rotate_half rotates a key buffer: chunk c pairs with chunk c ^ 4
            const int j = c & 3;
            const uint4 x1 = *reinterpret_cast<const uint4*>(row + dvm + 8 * j);
            const uint4 x2 = *reinterpret_cast<const uint4*>(row + dvm + 8 * (j + 4));
            const uint4* cs = reinterpret_cast<const uint4*>(p.rope_cs + static_cast<int64_t>(key) * T::kRope);
            const uint4 cw = cs[j], sw = cs[4 + j];
            const uint32_t* a1 = reinterpret_cast<const uint32_t*>(&x1);
            const uint32_t* a2 = reinterpret_cast<const uint32_t*>(&x2);
            const uint32_t* cc = reinterpret_cast<const uint32_t*>(&cw);
            const uint32_t* ss = reinterpret_cast<const uint32_t*>(&sw);
            uint32_t* out = reinterpret_cast<uint32_t*>(&tail_chunk);
  #pragma unroll
            for (int w = 0; w < 4; ++w) {
              uint32_t y1, y2;
              rope_rot_bf16x2(a1[w], a2[w], cc[w], ss[w], y1, y2);
              out[w] = c < 4 ? y1 : y2;
            }
          } else {
            const bf16_t* src = p.kpe == nullptr ? row + dvm + 8 * c
                                                 : p.kpe + b * p.kpe_batch_stride + static_cast<int64_t>(key) * p.kpe_row_stride + 8 * c;
            tail_chunk = *reinterpret_cast<const uint4*>(src);
          }
        }
      }

      // ---- Q and the first pairs' loads (the prologue)
      load_q();
      prologue_loads();
      wait_q(nitem);
      if constexpr (kFp8) convert_q();
      // the tail row -> shared memory, for warpgroup 1's scores and both warpgroups' P V
      if (tail && wg == 0 && t < T::kBlocks * 8) *reinterpret_cast<uint4*>(tail_s + 16 * t) = tail_chunk;
      wg::fence_proxy_async();
      sync_threads();

      int lim0 = L, lim1 = L;  // causal limits of rows r0, r1 (keys >= lim are masked)
      causal_limits(lim0, lim1);
      if (tail && wg == 1) {  // the tail key's scores (log2 units, masked), rows r0 / r1; a quad splits the 72 chunks
        float a0 = 0.f, a1 = 0.f;
  #pragma unroll 2
        for (int u = 0; u < T::kBlocks * 2; ++u) {
          const int j = t4 + 4 * u, blk = j / 8, c = j % 8;
          const uint4 kw = *reinterpret_cast<const uint4*>(tail_s + 16 * j);
          const uint4 qw0 = *reinterpret_cast<const uint4*>(q_s + blk * T::kBlockBytes + r0 * 128 + ((c ^ (r0 & 7)) << 4));
          const uint4 qw1 = *reinterpret_cast<const uint4*>(q_s + blk * T::kBlockBytes + r1 * 128 + ((c ^ (r1 & 7)) << 4));
          const uint32_t* k32 = reinterpret_cast<const uint32_t*>(&kw);
          const uint32_t* q0 = reinterpret_cast<const uint32_t*>(&qw0);
          const uint32_t* q1 = reinterpret_cast<const uint32_t*>(&qw1);
  #pragma unroll
          for (int w = 0; w < 4; ++w) {
            const float kl = bf16_lo(k32[w]), kh = bf16_hi(k32[w]);
            a0 = fmaf(bf16_lo(q0[w]), kl, fmaf(bf16_hi(q0[w]), kh, a0));
            a1 = fmaf(bf16_lo(q1[w]), kl, fmaf(bf16_hi(q1[w]), kh, a1));
          }
        }
  #pragma unroll
        for (int off = 1; off < 4; off <<= 1) {
          a0 += __shfl_xor_sync(0xffffffffu, a0, off);
          a1 += __shfl_xor_sync(0xffffffffu, a1, off);
        }
        if (t4 == 0) {
          s_t[r0] = L - 1 >= lim0 ? neg_inf() : a0 * p.scale_log2;
          s_t[r1] = L - 1 >= lim1 ? neg_inf() : a1 * p.scale_log2;
        }
      }

      // ---- the pair loops: O, the row maxima and sums of this warpgroup's view
      float o[T::kORegs];
  #pragma unroll
      for (int i = 0; i < T::kORegs; ++i) o[i] = 0.f;
      float m_a = neg_inf(), m_b = neg_inf(), l_a = 0.f, l_b = 0.f;  // rows r0, r1: this warpgroup's view
      float s[32];
      uint32_t pa[16];
      // warpgroup 0's thread 0: the block's next work item (taken one pair before
      // the last), its sequence, and whether its Q is on its way
      int next_item = -1, next_b = -1;
      bool q_pref = false;
      if (wg == 0) {
        const NextItem nx = pairs_wg0(s, pa, o, m_a, m_b, l_a, l_b, lim0, lim1, next_item, next_b, q_pref);
        next_item = nx.item;
        q_pref = nx.q_pref;
      } else {
        pairs_wg1(s, pa, o, m_a, m_b, l_a, l_b, lim0, lim1);
      }

      if (tail) {  // the tail key (see above): one more online-softmax step, on the CUDA cores
        sync_threads();  // its scores (warpgroup 1, prologue) -> warpgroup 0
        const float v0 = s_t[r0], v1 = s_t[r1];
        const float n0 = lazy_max(m_a, v0), n1 = lazy_max(m_b, v1);
        const float c0 = rescale(m_a, n0), c1 = rescale(m_b, n1);
        const float e0 = fast_exp2(v0 - exp2_base(n0)), e1 = fast_exp2(v1 - exp2_base(n1));
        // every row sum covers both warpgroups' keys once: warpgroup 0 adds this one
        l_a = l_a * c0 + (wg == 0 ? e0 : 0.f);
        l_b = l_b * c1 + (wg == 0 ? e1 : 0.f);
        m_a = n0;
        m_b = n1;
        scale_rows(o, c0, c1);
        const float pb0 = round_bf16(e0), pb1 = round_bf16(e1);  // P in bf16, as the P V products take it
        const unsigned char* vrow = tail_s + (T::kN * wg + 2 * t4) * 2;
  #pragma unroll
        for (int jn = 0; jn < T::kN / 8; ++jn) {
          const uint32_t w = *reinterpret_cast<const uint32_t*>(vrow + 16 * jn);
          const float x0 = bf16_lo(w), x1 = bf16_hi(w);
          o[4 * jn] = fmaf(pb0, x0, o[4 * jn]);
          o[4 * jn + 1] = fmaf(pb0, x1, o[4 * jn + 1]);
          o[4 * jn + 2] = fmaf(pb1, x0, o[4 * jn + 2]);
          o[4 * jn + 3] = fmaf(pb1, x1, o[4 * jn + 3]);
        }
      }

      // ---- epilogue: the row sums, the LSE, O out
      sum_rows(l_a, l_b, next_item, q_pref);
      const float l0 = s_l[r0] + s_l[T::kM + r0], l1 = s_l[r1] + s_l[T::kM + r1];
      const float osc = kFp8 ? p.o_scale : 1.f;  // (fp8: the cache's per-tensor scale)
      const float inv0 = l0 > 0.f ? osc / l0 : 0.f, inv1 = l1 > 0.f ? osc / l1 : 0.f;
      const bool fin = pt.nsplit == 1;  // the final output (bf16/fp16), else fp32 partials for the combine
      const int64_t prow = fin ? 0 : static_cast<int64_t>(pt.first_part + pt.split) * p.rows;
      store_lse<kRB>(p, wg, t4, r0, r1, row_base, b, l0, l1, fin, prow, m_a, m_b);
      const int col0 = T::kN * wg + 2 * t4;
      const int elt = fin ? 2 : 4;
      const int orow_bytes = T::kOutRowBytes(elt);
      stage_o<T, kOutF16>(k_s, r0, r1, o, inv0, inv1, fin, orow_bytes, elt, col0);
      copy_out_rows(p, k_s, tid, T::kThreads, kRB, row_base, b, dvm, fin, prow, elt, orow_bytes);
      // The combine may launch once every block has issued its first item's
      // output: triggered at the row sums it ran slower where it merges many
      // splits (docs/attention.md, "When the combine may launch")
      pdl_trigger();
      if (nlat < kNB) {  // the staged output covered the dead latent blocks
        sync_threads();   // (every thread has read it)
        zero_dead_blocks<T>(q_s, nlat, tid);
      }
      gbase += npairs;
      ++nitem;
      item = s_next[0];
      if (item < 0) break;
    }  // work items
    release_plan(p, ctr, tid);
  }
};
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// kF16: q, kv and o hold fp16 (else bf16; on-the-fly key RoPE only then).
// kDv: value width (128, 256, 512).
// kPH: per-head rope keys (MHA2MLA): the key is the dv latent columns alone;
// the rope part of every score comes precomputed (p.rope_scores,
// launch_rope_scores) and is added to S. A work item then covers 32 query
// rows (the wgmma's other 32 rows compute nothing that is kept), so that the
// score tile of a half (32 rows x 64 keys fp32: two 128B-swizzled boxes of 32
// keys, 8 KB) fits the rope block, where that half's P is stored after the
// softmax.
// The body: the setup (shared-memory carve-up, thread indices, mbarriers),
// then Sm90Block's work-item loop.
// kKeys: how the keys are read (KeyPath).
template <bool kF16, int kDv, bool kPH, int kKeys>
__global__ void __launch_bounds__(PairTile<kDv>::kThreads, 1)
    attention_sm90_kernel(const AttnParams p, const __grid_constant__ TmaMaps maps) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = PairTile<kDv>;
  constexpr int kNB = T::kNB;
  // ==== Setup: the shared-memory carve-up, thread indices, mbarriers, and the
  // latent blocks dv 64 leaves zero
  extern __shared__ __attribute__((aligned(16))) unsigned char smem_raw[];
  // 1 KB aligned (swizzle atoms), by an offset from the shared array so that
  // the compiler keeps the address space (shared loads/stores, not generic)
  unsigned char* smem =
      smem_raw + ((1024 - (static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) & 1023)) & 1023);
  unsigned char* q_s = smem;
  constexpr int kStages = T::kStages;
  unsigned char* k_s = q_s + T::kMatBytes;  // per stage: K0, then K1
  float* s_m = reinterpret_cast<float*>(k_s + 2 * kStages * T::kMatBytes);  // shared running max [64]
  float* s_l = s_m + T::kM;                                                   // row sums of both warpgroups [2][64]
  uint64_t* mb = reinterpret_cast<uint64_t*>(s_l + 2 * T::kM);                // [kStages][4], then Q's
  uint64_t* qbar = mb + 4 * kStages;
  int32_t* ids_s = reinterpret_cast<int32_t*>(mb + 4 * kStages + 2);  // [kIdRing][kTileKeys] page ids, slot = pair % kIdRing
  int* s_next = reinterpret_cast<int*>(ids_s + T::kIdRing * T::kTileKeys);  // the block's next work item
  unsigned char* tail_s = reinterpret_cast<unsigned char*>(s_next + 4);  // the tail key's row (16-byte aligned)
  float* s_t = reinterpret_cast<float*>(tail_s + T::kBlocks * 128);        // its scores, per row [64]

  const int tid = thread_x();
  // warpgroup index, made visibly warp-uniform for the compiler (a per-thread
  // value would make every branch on it divergent and serialize the wgmmas)
  const int wg = __shfl_sync(0xffffffffu, tid / 128, 0), t = tid % 128;
  const int warp = t / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  const int r0 = warp * 16 + g, r1 = r0 + 8;  // this thread's rows in the S / O layouts

  if (tid == 0) {
#pragma unroll
    for (int i = 0; i < 4 * kStages; ++i) wg::mbar_init(&mb[i], 128);
    wg::mbar_init(qbar, 1);
    wg::fence_proxy_async();  // the initialised barriers -> the TMA unit (thread 0 may issue Q before the first barrier)
  }
  // Latent column blocks read from memory: kNB, or 1 for dv 64, which runs
  // on the dv 128 instance with latent block 1 of Q and of every key buffer
  // zero (set once here, never loaded): the scores and warpgroup 0's
  // columns are exact, warpgroup 1's columns are zeros and never written
  // out, and the memory read is dv 64's.
  // (The epilogue stages O in the key buffers, so it zeroes them again.)
  const int dvm = kDv == 128 ? p.dv : kDv;  // value width in memory (compile-time but for the dv 128 instance)
  const int nlat = dvm / 64;
  if (nlat < kNB) zero_dead_blocks<T>(q_s, nlat, tid);
  pdl_wait();  // launched as a dependent of the planner: its plan is visible from here
  Sm90Block<kF16, kDv, kPH, kKeys>{p, maps, q_s, k_s, s_m, s_l, mb, qbar, ids_s, s_next, tail_s, s_t,
                            tid, wg, t, warp, lane, g, t4, r0, r1, dvm, nlat}
      .run();
#else
  __trap();  // built without sm_90a: the host never selects this kernel then
#endif
}

// f(kernel) for every instance of (kDv, kPH): fp16 or bf16, each key path;
// the first error, or nullptr.
template <int kDv, bool kPH, typename F>
const char* for_each_instance(F&& f) {
  const char* e = nullptr;
  auto one = [&](auto kernel) { if (e == nullptr) e = f(kernel); };
  one(attention_sm90_kernel<false, kDv, kPH, kKeysCopy>);
  one(attention_sm90_kernel<true, kDv, kPH, kKeysCopy>);
  one(attention_sm90_kernel<false, kDv, kPH, kKeysTmaDense>);
  one(attention_sm90_kernel<true, kDv, kPH, kKeysTmaDense>);
  one(attention_sm90_kernel<false, kDv, kPH, kKeysTmaPaged>);
  one(attention_sm90_kernel<true, kDv, kPH, kKeysTmaPaged>);
  return e;
}

template <int kDv, bool kPH>
const char* kernel_info_as(AttnKernelInfo* info) {
  using T = PairTile<kDv>;
  const char* e = for_each_instance<kDv, kPH>([&](auto kernel) { return set_max_dynamic_smem(kernel, T::kSmem); });
  if (e != nullptr) return e;
  info->rows_per_block = kPH ? 32 : T::kM;
  info->tile = T::kTileKeys;
  info->threads = T::kThreads;
  info->smem_bytes = T::kSmem;
  info->warp_size = kWarpSize;
  int blocks = 0x7fffffff;
  for_each_instance<kDv, kPH>([&](auto kernel) -> const char* {
    blocks = std::min(blocks, max_active_blocks(kernel, T::kThreads, T::kSmem));
    return nullptr;
  });
  info->blocks_per_sm = blocks;
  info->one_key_tail = kOneKeyTail<kDv, kPH>;  // (an fp16 call, unknown here, runs that pair as any other: still right)
  if (info->blocks_per_sm <= 0) return "sm90 attention kernel cannot be resident on this device (occupancy 0)";
  return nullptr;
}

template <int kDv>
const char* kernel_info(bool per_head, AttnKernelInfo* info) {
  return per_head ? kernel_info_as<kDv, true>(info) : kernel_info_as<kDv, false>(info);
}

// rope_scores [bs][rows][rs_stride] fp32 as TMA boxes of 32 keys x 32 rows
// (128 bytes wide, 128-byte swizzle; rows past the last read as zeros). False
// if TMA cannot describe it (then every score tile loads by cp.async).
bool encode_scores(CUtensorMap* map, const AttnParams& p) {
  const PFN_cuTensorMapEncodeTiled_v12000 enc = tensor_map_encoder();
  if (enc == nullptr || reinterpret_cast<uintptr_t>(p.rope_scores) % 16 != 0 || (p.rs_stride * 4) % 16 != 0 ||
      p.rows < 32)
    return false;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(p.rs_stride), static_cast<cuuint64_t>(p.rows),
                              static_cast<cuuint64_t>(p.bs)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(p.rs_stride * 4),
                                 static_cast<cuuint64_t>(p.rs_stride * 4 * p.rows)};
  const cuuint32_t box[3] = {32, 32, 1}, elem[3] = {1, 1, 1};
  return enc(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 3, const_cast<float*>(p.rope_scores), dims, strides, box, elem,
             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// TMA loads where they apply. Keys: pages (if any) of 8, 16, 32 or a
// multiple of 64 rows (a box must start on an 8-row swizzle phase), 16-byte
// aligned rows and pages; every rope width (the maps end at column d = dv +
// rope, so the rope block's columns past the width land as zeros, as the S
// product needs). Q: 64 query rows or more. MLA_DECODE_TMA=0 turns them off
// (cp.async for every load; measurements and tests).
TmaMaps make_maps(const AttnParams& p) {
  TmaMaps m{};
  if (!switches().tma) return m;
  // Q: rows of 64 query rows; columns past d (rope < 64) read as zeros, as the kernel needs
  m.use_q = p.rows >= 64 && encode_rows(&m.q, p.q, p.dv + p.rope, p.rows, p.bs, p.q_row_stride, p.q_batch_stride, 64)
                ? 1
                : 0;
  const bool paged = p.block_table != nullptr;
  const int ps = p.page_size;
  if (paged && !(ps % 64 == 0 || ps == 8 || ps == 16 || ps == 32)) return m;
  const int64_t d = p.dv + p.rope;
  m.rows = paged && ps < 64 ? ps : 64;
  if (p.kv_fp8) {  // bytes, unswizzled 64 x 64 boxes (fp8 instances: dense, or pages of a multiple of 64 rows)
    if (paged && ps % 64 != 0) return m;
    m.use = encode_rows(&m.kv, p.kv, d, paged ? ps : p.max_len, p.num_pages, p.kv_row_stride, p.kv_page_stride, 64,
                        !paged, 1)
                ? 1
                : 0;
    return m;
  }
  bool ok = encode_rows(&m.kv, p.kv, d, paged ? ps : p.max_len, p.num_pages, p.kv_row_stride, p.kv_page_stride, m.rows);
  if (ok && p.kpe != nullptr)
    ok = encode_rows(&m.kpe, p.kpe, p.rope, p.kpe_rows, p.bs, p.kpe_row_stride, p.kpe_batch_stride, 64);
  if (ok && p.rope_scores != nullptr) ok = encode_scores(&m.sc, p);
  m.use = ok ? 1 : 0;
  return m;
}

// Persistent launch (one block per resident slot, items from the work
// counter) unless MLA_DECODE_PERSIST=0 (one block per item: measurements).
// As a programmatic dependent of the planner unless MLA_DECODE_PDL=0.
template <int kDv, bool kPH>
const char* launch(const AttnParams& p_in, stream_t stream) {
  using T = PairTile<kDv>;
  const int cap = switches().attn_ctas;  // (measurements: fewer persistent blocks)
  AttnParams p = p_in;
  if (!switches().persist) p.ctas = 0;
  if (cap > 0 && p.ctas > cap) p.ctas = cap;
  constexpr int kRB = kPH ? 32 : T::kM;
  const int64_t items = static_cast<int64_t>(p.max_parts) * ((p.rows + kRB - 1) / kRB);
  const int64_t blocks = p.ctas > 0 ? std::min<int64_t>(p.ctas, items) : items;
  if (blocks <= 0 || blocks > 0x7fffffff) return "launch_attention_sm90: bad number of work items";
  const TmaMaps maps = make_maps(p);
  const dim3 grid(static_cast<unsigned>(blocks));
  const bool pdl = sm90_pdl_enabled();
  auto go = [&](auto kernel) { return launch_ex(kernel, grid, dim3(T::kThreads), T::kSmem, stream, pdl, dim3(1), p, maps); };
  const bool paged = p.block_table != nullptr;
  if (maps.use && paged)
    return p.f16 ? go(attention_sm90_kernel<true, kDv, kPH, kKeysTmaPaged>)
                 : go(attention_sm90_kernel<false, kDv, kPH, kKeysTmaPaged>);
  if (maps.use)
    return p.f16 ? go(attention_sm90_kernel<true, kDv, kPH, kKeysTmaDense>)
                 : go(attention_sm90_kernel<false, kDv, kPH, kKeysTmaDense>);
  return p.f16 ? go(attention_sm90_kernel<true, kDv, kPH, kKeysCopy>) : go(attention_sm90_kernel<false, kDv, kPH, kKeysCopy>);
}

constexpr const char* kSm90Shapes =
    "the Hopper kernel takes dv 64, 128, 256 or 512 with rope 8, 16, 32 or 64 shared by all heads, or with "
    "per-head rope keys (their scores precomputed)";

}  // namespace

#ifndef MLA_SM90_FP8_TU  // (the fp8 instances' unit: attention_sm90_fp8.cu)
bool sm90_pdl_enabled() { return switches().pdl; }

// The one list of value widths: dv 64 runs on the dv 128 instance (see the kernel).
static bool sm90_dv_supported(int dv) { return dv == 64 || dv == 128 || dv == 256 || dv == 512; }

bool sm90_shape_supported(int dv, int rope) {
  return sm90_dv_supported(dv) && (rope == 8 || rope == 16 || rope == 32 || rope == 64);
}

bool sm90_per_head_supported(int dv) { return sm90_dv_supported(dv); }

namespace {
// f(std::integral_constant<int, kDv>) for the kernel instance of a
// supported dv (instance width kDv >= dv: dv 64 runs on the dv 128 instance,
// see the kernel); the shape message otherwise.
template <typename F>
const char* on_dv_instance(int dv, F&& f) {
  switch (dv) {
    case 64:
    case 128: return f(std::integral_constant<int, 128>{});
    case 256: return f(std::integral_constant<int, 256>{});
    case 512: return f(std::integral_constant<int, 512>{});
    default: return kSm90Shapes;
  }
}

template <bool kPH>
const char* launch_dv(const AttnParams& p, stream_t stream) {
  return on_dv_instance(p.dv, [&](auto k) { return launch<decltype(k)::value, kPH>(p, stream); });
}
}  // namespace

const char* attn_kernel_info_sm90(int dv, bool per_head, AttnKernelInfo* info) {
  const char* e = on_dv_instance(dv, [&](auto k) { return kernel_info<decltype(k)::value>(per_head, info); });
  if (e == nullptr && dv == 512 && !per_head) {  // the fp8 instances: same tile, their own occupancy
    int b = 0;
    e = attn_kernel_info_sm90_fp8(&b);
    if (e == nullptr) info->blocks_per_sm = std::min(info->blocks_per_sm, b);
  }
  return e;
}

const char* launch_attention_sm90(const AttnParams& p, stream_t stream) {
  if (p.rope_scores != nullptr) {
    if (p.rope != 0 || p.rope_cs != nullptr || p.kpe != nullptr) return kSm90Shapes;
    return launch_dv<true>(p, stream);
  }
  if (!sm90_shape_supported(p.dv, p.rope)) return kSm90Shapes;
  if (p.rope_cs != nullptr && p.rope != 64) return "launch_attention_sm90: on-the-fly key RoPE needs rope 64";
  if (p.f16 && p.rope_cs != nullptr) return "launch_attention_sm90: on-the-fly key RoPE is bf16 only";
  if (p.kv_fp8) return launch_attention_sm90_fp8(p, stream);
  return launch_dv<false>(p, stream);
}

#endif  // MLA_SM90_FP8_TU
#else  // AMD: the Hopper kernel does not exist there
#ifndef MLA_SM90_FP8_TU

bool sm90_pdl_enabled() { return false; }
bool sm90_shape_supported(int, int) { return false; }
bool sm90_per_head_supported(int) { return false; }
const char* attn_kernel_info_sm90(int, bool, AttnKernelInfo*) { return "the sm90 attention kernel is NVIDIA-only"; }
const char* launch_attention_sm90(const AttnParams&, stream_t) { return "the sm90 attention kernel is NVIDIA-only"; }
#endif  // MLA_SM90_FP8_TU

#endif

}  // namespace mla
