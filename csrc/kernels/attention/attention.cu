// Split-KV absorbed MQA decode over the latent cache (pipeline step 3).
//
// One block = one head block (kM query rows) x one planned part (a range of
// key tiles of one sequence). Warps form a kWM x kWN grid: warp (wm, wn)
// holds query rows [16 wm, 16 wm + 16) and
//   - for S = Q K^T: the k-range [wn D/kWN, (wn+1) D/kWN) with its Q slice in
//     registers, so Q is read from memory once per block, never per tile;
//     the kWN partial scores are summed through shared memory;
//   - for O += P V: output columns [wn Dv/kWN, (wn+1) Dv/kWN).
// Keys stream through a kStages-deep shared-memory ring; rows past the
// sequence are zero-filled (so NaN in unused cache rows never reaches P V)
// and masked to -inf in the scores. RoPE of the keys is applied in shared
// memory, with the caller's bf16 cos/sin table, exactly as the task rounds it.
//
// Shapes: D = Dv + rope with the rope columns shared by all heads (DeepSeek:
// 512 + 64), or D = Dv with per-head rope keys (MHA2MLA): then the rope part
// of every score, q_pe[h] . k_pe[t, h], is computed by rope_scores_kernel
// beforehand into an fp32 workspace [bs, rows, rs_stride] that streams in
// with the keys and is added to the latent part. D is padded to the k-split
// (16 kWN columns) in registers and shared memory only (zeros, never read
// from memory).
#include <algorithm>

#include "../../platform/bf16.h"
#include "../../platform/copy.h"
#include "../../platform/mma.h"
#include "../../platform/vendor.h"

#include "attention.h"
#include "block_table.h"
#include "part.h"

namespace mla {
namespace {

template <int kD_, int kDv_, int kWM_, int kWN_, int kBN_, int kStages_>
struct AttnTile {
  static constexpr int kD = kD_;
  static constexpr int kDv = kDv_;
  static constexpr int kRope = kD - kDv;           // 0: per-head rope keys (scores from the workspace)
  static constexpr bool kHeadRope = kRope == 0;
  static constexpr int kWM = kWM_, kWN = kWN_, kBN = kBN_, kStages = kStages_;
  static constexpr int kWarps = kWM * kWN;
  static constexpr int kThreads = kWarps * kWarpSize;
  static constexpr int kM = 16 * kWM;
  static constexpr int kDp = (kD + 16 * kWN - 1) / (16 * kWN) * (16 * kWN);  // D padded to the k-split
  static constexpr int kLd = kDp + 8;      // +16 B per row: ldmatrix rows hit distinct banks
  static constexpr int kPLd = kBN + 8;
  static constexpr int kKSteps = kDp / 16 / kWN;
  static constexpr int kNTiles = kDv / 16 / kWN;
  static constexpr int kSTiles = kBN / 16;
  static constexpr int kLanesPerRow = kWarpSize / 16;
  static constexpr int kColsPerLane = kBN / kLanesPerRow;
  static constexpr int kChunksPerRow = kD / 8;  // 16-byte chunks read from memory
  static constexpr int kChunksPadded = kDp / 8;  // ... and zero-filled up to the padded width

  static constexpr int kKvBytes = kStages * kBN * kLd * 2;
  // score rows padded by one float: the softmax reads a column of 16 rows at
  // once (16 rows x kBN floats would put them all in one bank)
  static constexpr int kSLd = kBN + 1;
  static constexpr int kSBytes = kWN * kM * kSLd * 4;
  static constexpr int kPBytes = kWarps * 16 * kPLd * 2;
  static constexpr int kRowBytes = kWarps * 16 * 4;
  static constexpr int kCsBytes = kStages * kBN * kRope * 2;  // RoPE cos|sin rows, prefetched with the keys
  static constexpr int kRsLd = kBN + 4;  // (16-byte rows for cp.async; 4-way instead of 16-way bank conflicts)
  static constexpr int kRsBytes = kHeadRope ? kStages * kM * kRsLd * 4 : 0;  // per-head rope scores, likewise
  static constexpr int kSmem = kKvBytes + kSBytes + kPBytes + kRowBytes + kCsBytes + kRsBytes;

  static_assert(kDv % (16 * kWN) == 0, "Dv must split over kWN warps");
  static_assert(kD % 8 == 0 && kRope % 8 == 0 && kRope >= 0, "bad D / rope");
  static_assert(kBN % 16 == 0 && kColsPerLane % 2 == 0, "bad key tile");
  static_assert(kStages >= 2, "need at least double buffering");
};

// The tile configuration per vendor.
#if MLA_AMD
// MI300X: 64 KB LDS per CU, wave64. Q and O live in VGPRs/AGPRs (72 + 128
// per lane), the LDS holds a 2 x 16-key ring (49 KB with the RoPE rows).
template <int kD, int kDv>
using TileFor = AttnTile<kD, kDv, 4, 1, 16, 2>;
#else
// H100/H200 (when the Hopper kernel is not used): 8 warps, Q slice 72 + O 128
// registers per thread, one block per SM by registers, a 3 x 32-key ring
// (a 2-deep ring, 16 warps and 64-key tiles were slower: docs/not_kept.md).
template <int kD, int kDv>
using TileFor = AttnTile<kD, kDv, 4, 2, 32, 3>;
#endif

template <typename T>
MLA_DEVICE const bf16_t* kv_row(const AttnParams& p, int b, int t) {
  if (p.block_table == nullptr) return p.kv + b * p.kv_page_stride + t * p.kv_row_stride;
  const int page = page_id(p.block_table, b * p.block_table_stride + t / p.page_size, p.num_pages);
  return p.kv + page * p.kv_page_stride + (t % p.page_size) * p.kv_row_stride;
}

// kF16: q, kv and o hold fp16 (else bf16).
template <typename T, bool kF16>
__global__ void __launch_bounds__(T::kThreads, 1) attention_kernel(const AttnParams p) {
  using E = Half16<kF16>;
  extern __shared__ __attribute__((aligned(16))) unsigned char smem[];
  bf16_t* kv_s = reinterpret_cast<bf16_t*>(smem);
  float* s_s = reinterpret_cast<float*>(smem + T::kKvBytes);
  bf16_t* p_s = reinterpret_cast<bf16_t*>(smem + T::kKvBytes + T::kSBytes);
  float* row_s = reinterpret_cast<float*>(smem + T::kKvBytes + T::kSBytes + T::kPBytes);
  bf16_t* cs_s = reinterpret_cast<bf16_t*>(smem + T::kKvBytes + T::kSBytes + T::kPBytes + T::kRowBytes);
  float* rs_s = reinterpret_cast<float*>(smem + T::kKvBytes + T::kSBytes + T::kPBytes + T::kRowBytes + T::kCsBytes);

  Part pt;
  if (!read_part(p, block_y(), pt, T::kBN)) return;
  const int b = pt.b, tile_begin = pt.tile_begin, tile_end = pt.tile_end, split = pt.split;
  const int nsplit = pt.nsplit, first_part = pt.first_part, L = pt.L;

  const int tid = thread_x();
  const int warp = tid / kWarpSize, lane = tid % kWarpSize;
  const int wm = warp % T::kWM, wn = warp / T::kWM;
  const int row0 = block_x() * T::kM + wm * 16;  // first query row of this warp

  // ---- keys: issue the first tiles before anything else
  const int ntiles = tile_end - tile_begin;
  auto load_tile = [&](int j) {
    bf16_t* dst = kv_s + (j % T::kStages) * T::kBN * T::kLd;
    const int tile = tile_begin + j;
    for (int c = tid; c < T::kBN * T::kChunksPadded; c += T::kThreads) {
      const int r = c / T::kChunksPadded, ch = c % T::kChunksPadded;
      const int t = tile * T::kBN + r;
      const bool valid = t < L && ch < T::kChunksPerRow;  // (padding columns: zeros)
      constexpr int kRopeChunk = T::kDv / 8;  // the first chunk of the rope columns
      const bf16_t* src = !valid                                 ? p.kv
                          : (p.kpe != nullptr && ch >= kRopeChunk) ? p.kpe + b * p.kpe_batch_stride +
                                                                       static_cast<int64_t>(t) * p.kpe_row_stride +
                                                                       (ch - kRopeChunk) * 8
                                                                 : kv_row<T>(p, b, t) + ch * 8;
      copy16_async(dst + r * T::kLd + ch * 8, src, valid);
    }
    if constexpr (T::kHeadRope) {  // the rope scores of this block's rows for these keys (4 per chunk)
      constexpr int kRsChunks = T::kBN / 4;
      float* rdst = rs_s + (j % T::kStages) * T::kM * T::kRsLd;
      for (int c = tid; c < T::kM * kRsChunks; c += T::kThreads) {
        const int r = c / kRsChunks, t = tile * T::kBN + 4 * (c % kRsChunks), row = block_x() * T::kM + r;
        const bool valid = row < p.rows && t < L;  // (t + 1..3 >= L lie inside the workspace; masked later)
        copy16_async(rdst + r * T::kRsLd + 4 * (c % kRsChunks), valid ? p.rope_scores + (static_cast<int64_t>(b) * p.rows + row) * p.rs_stride + t
                                         : p.rope_scores, valid);
      }
    } else if (p.rope_cs != nullptr) {  // the keys' cos|sin rows travel with them
      constexpr int kCsChunks = T::kRope / 8;
      bf16_t* cdst = cs_s + (j % T::kStages) * T::kBN * T::kRope;
      for (int c = tid; c < T::kBN * kCsChunks; c += T::kThreads) {
        const int r = c / kCsChunks, t = tile * T::kBN + r;
        const bool valid = t < L;
        copy16_async(cdst + c * 8, valid ? p.rope_cs + static_cast<int64_t>(t) * T::kRope + (c % kCsChunks) * 8 : p.rope_cs,
                     valid);
      }
    }
  };
#pragma unroll
  for (int j = 0; j < T::kStages - 1; ++j) {
    if (j < ntiles) load_tile(j);
    copy_commit();
  }

  // ---- this warp's Q slice, straight into registers
  mma::FragA qf[T::kKSteps];
  {
    const bf16_t* qp = p.q + b * p.q_batch_stride + row0 * p.q_row_stride + wn * T::kKSteps * 16;
    const int rows_valid = p.rows - row0;
#pragma unroll
    for (int ks = 0; ks < T::kKSteps; ++ks)
      mma::load_a_global(qf[ks], qp + ks * 16, p.q_row_stride, rows_valid, T::kD - (wn * T::kKSteps + ks) * 16);
  }

  mma::FragC o[T::kNTiles];
#pragma unroll
  for (int n = 0; n < T::kNTiles; ++n) mma::zero(o[n]);

  // softmax state: lane holds row srow, columns [spart * kColsPerLane, ...)
  const int srow = lane / T::kLanesPerRow, spart = lane % T::kLanesPerRow;
  int limit = L;  // causal: query i of s_q sees positions < L - (s_q - 1 - i)
  if (p.causal) limit = L - (p.s_q - 1 - (row0 + srow) / p.h_q);
  float m_run = neg_inf(), l_run = 0.f;

  bf16_t* p_w = p_s + warp * 16 * T::kPLd;
  float* row_w = row_s + warp * 16;

  for (int j = 0; j < ntiles; ++j) {
    copy_wait<T::kStages - 2>();
    sync_threads();  // tile j landed for everyone; tile j-1's buffer is free
    if (j + T::kStages - 1 < ntiles) load_tile(j + T::kStages - 1);
    copy_commit();

    bf16_t* kt = kv_s + (j % T::kStages) * T::kBN * T::kLd;
    const int key0 = (tile_begin + j) * T::kBN;
    if constexpr (!T::kHeadRope) if (!kF16 && p.rope_cs != nullptr) {  // (bf16 only; the host refuses it with fp16)
      // rot(x, t) = x cos + cat(-x2, x1) sin, every product and sum rounded to bf16
      constexpr int kHalf = T::kRope / 2;
      for (int e = tid; e < T::kBN * kHalf; e += T::kThreads) {
        const int r = e / kHalf, jj = e % kHalf, t = key0 + r;
        if (t < L) {
          bf16_t* x = kt + r * T::kLd + (T::kD - T::kRope);
          const bf16_t* cs = cs_s + ((j % T::kStages) * T::kBN + r) * T::kRope;
          const float c = bf16_to_float(cs[jj]);
          const float s = bf16_to_float(cs[kHalf + jj]);
          const float x1 = bf16_to_float(x[jj]), x2 = bf16_to_float(x[kHalf + jj]);
          x[jj] = float_to_bf16(round_bf16(x1 * c) + round_bf16(-x2 * s));
          x[kHalf + jj] = float_to_bf16(round_bf16(x2 * c) + round_bf16(x1 * s));
        }
      }
      sync_threads();
    }

    // ---- partial scores over this warp's k-range
    {
      mma::FragC sacc[T::kSTiles];
#pragma unroll
      for (int n = 0; n < T::kSTiles; ++n) mma::zero(sacc[n]);
      const bf16_t* kb = kt + wn * T::kKSteps * 16;
#pragma unroll
      for (int ks = 0; ks < T::kKSteps; ++ks) {
#pragma unroll
        for (int n = 0; n < T::kSTiles; ++n) {
          mma::FragB bfr;
          mma::load_b_nk(bfr, kb + n * 16 * T::kLd + ks * 16, T::kLd);
          mma::mma<kF16>(sacc[n], qf[ks], bfr);
        }
      }
      float* sw = s_s + (wn * T::kM + wm * 16) * T::kSLd;
#pragma unroll
      for (int n = 0; n < T::kSTiles; ++n)
#pragma unroll
        for (int i = 0; i < mma::kCElems; ++i)
          sw[mma::c_row(lane, i) * T::kSLd + n * 16 + mma::c_col(lane, i)] = sacc[n].v[i];
    }
    sync_threads();

    // ---- online softmax for the warp's 16 rows (redundant across wn)
    {
      float sv[T::kColsPerLane];
      float mx = neg_inf();
      const int c0 = spart * T::kColsPerLane;
      const float* rs_row = rs_s + ((j % T::kStages) * T::kM + wm * 16 + srow) * T::kRsLd + c0;
#pragma unroll
      for (int c = 0; c < T::kColsPerLane; ++c) {
        float v = T::kHeadRope ? rs_row[c] : 0.f;
#pragma unroll
        for (int w = 0; w < T::kWN; ++w) v += s_s[(w * T::kM + wm * 16 + srow) * T::kSLd + c0 + c];
        v *= p.scale_log2;
        if (key0 + c0 + c >= limit) v = neg_inf();
        sv[c] = v;
        mx = fmaxf(mx, v);
      }
#pragma unroll
      for (int off = 1; off < T::kLanesPerRow; off <<= 1) mx = fmaxf(mx, shfl_xor(mx, off));
      const float m_new = fmaxf(m_run, mx);
      const float m_use = m_new == neg_inf() ? 0.f : m_new;
      const float alpha = fast_exp2(m_run - m_use);
      float sum = 0.f;
      uint32_t* pw = reinterpret_cast<uint32_t*>(p_w + srow * T::kPLd + c0);
#pragma unroll
      for (int c = 0; c < T::kColsPerLane; c += 2) {
        const uint32_t w2 = E::pack2(fast_exp2(sv[c] - m_use), fast_exp2(sv[c + 1] - m_use));
        sum += E::lo(w2) + E::hi(w2);  // the sum of what P V multiplies
        pw[c / 2] = w2;
      }
#pragma unroll
      for (int off = 1; off < T::kLanesPerRow; off <<= 1) sum += shfl_xor(sum, off);
      l_run = l_run * alpha + sum;
      m_run = m_new;
      if (spart == 0) row_w[srow] = alpha;
      sync_warp();
    }

    // ---- O = alpha O + P V over this warp's columns
#pragma unroll
    for (int i = 0; i < mma::kCElems; ++i) {
      const float a = row_w[mma::c_row(lane, i)];
#pragma unroll
      for (int n = 0; n < T::kNTiles; ++n) o[n].v[i] *= a;
    }
    const bf16_t* vb = kt + wn * T::kNTiles * 16;
#pragma unroll
    for (int kk = 0; kk < T::kBN / 16; ++kk) {
      mma::FragA pa;
      mma::load_a(pa, p_w + kk * 16, T::kPLd);
#pragma unroll
      for (int n = 0; n < T::kNTiles; ++n) {
        mma::FragB vf;
        mma::load_b_kn(vf, vb + kk * 16 * T::kLd + n * 16, T::kLd);
        mma::mma<kF16>(o[n], pa, vf);
      }
    }
    sync_warp();  // P and alpha of this warp are overwritten next tile
  }
  copy_wait<0>();

  // ---- normalise and write: bf16 output directly, or an fp32 partial + LSE
  sync_warp();
  constexpr float kLn2 = 0.69314718055994531f;
  const float inv_l = l_run > 0.f ? 1.f / l_run : 0.f;
  const float lse = l_run > 0.f ? (m_run + fast_log2(l_run)) * kLn2 : neg_inf();
  if (spart == 0) row_w[srow] = inv_l;
  sync_warp();
  const int col0 = wn * T::kNTiles * 16;
  if (nsplit == 1) {
    if (wn == 0 && spart == 0 && row0 + srow < p.rows) {
      const int r = row0 + srow, i = r / p.h_q, h = r % p.h_q;
      p.lse[(static_cast<int64_t>(b) * p.h_q + h) * p.s_q + i] = lse;
    }
#pragma unroll
    for (int i = 0; i < mma::kCElems; i += (mma::kCPairedCols ? 2 : 1)) {
      const int r = row0 + mma::c_row(lane, i);
      if (r >= p.rows) continue;
      const float sc = row_w[mma::c_row(lane, i)];
      bf16_t* orow = p.o + (static_cast<int64_t>(b) * p.rows + r) * T::kDv + col0;
#pragma unroll
      for (int n = 0; n < T::kNTiles; ++n) {
        const int c = n * 16 + mma::c_col(lane, i);
        if constexpr (mma::kCPairedCols) {
          *reinterpret_cast<uint32_t*>(orow + c) = E::pack2(o[n].v[i] * sc, o[n].v[i + 1] * sc);
        } else {
          orow[c] = E::from_float(o[n].v[i] * sc);
        }
      }
    }
  } else {
    const int64_t prow = static_cast<int64_t>(first_part + split) * p.rows;
    if (wn == 0 && spart == 0 && row0 + srow < p.rows) p.lse_part[prow + row0 + srow] = lse;
#pragma unroll
    for (int i = 0; i < mma::kCElems; ++i) {
      const int r = row0 + mma::c_row(lane, i);
      if (r >= p.rows) continue;
      const float sc = row_w[mma::c_row(lane, i)];
      float* orow = p.o_part + (prow + r) * T::kDv + col0;
#pragma unroll
      for (int n = 0; n < T::kNTiles; ++n) orow[n * 16 + mma::c_col(lane, i)] = o[n].v[i] * sc;
    }
  }
}

}  // namespace

// The supported shapes: X(dv, rope inside the key; 0 = per-head rope keys).
#define MLA_ATTN_SHAPES(X)                                          \
  X(64, 0) X(64, 8) X(64, 16) X(64, 32) X(64, 64)                   \
  X(128, 0) X(128, 8) X(128, 16) X(128, 32) X(128, 64)              \
  X(256, 0) X(256, 8) X(256, 16) X(256, 32) X(256, 64)              \
  X(512, 0) X(512, 8) X(512, 16) X(512, 32) X(512, 64)

const char* const kAttnShapesSupported =
    "supported: value width dv in {64, 128, 256, 512} with rope width in {8, 16, 32, 64}, the rope keys either "
    "the last `rope` columns of the shared latent row (head dim d = dv + rope) or per-head rope keys "
    "[..., h_q, rope] beside a dv-wide latent cache";

bool attn_shape_supported(int dv, int rope) {
  switch (dv * 1000 + rope) {
#define MLA_CASE(DV, R) case DV * 1000 + R:
    MLA_ATTN_SHAPES(MLA_CASE)
#undef MLA_CASE
    return true;
    default:
      return false;
  }
}

template <typename T>
const char* kernel_info(AttnKernelInfo* info) {
  if (const char* e = set_max_dynamic_smem(attention_kernel<T, false>, T::kSmem)) return e;
  if (const char* e = set_max_dynamic_smem(attention_kernel<T, true>, T::kSmem)) return e;
  info->rows_per_block = T::kM;
  info->tile = T::kBN;
  info->threads = T::kThreads;
  info->smem_bytes = T::kSmem;
  info->warp_size = kWarpSize;
  info->blocks_per_sm = std::min(max_active_blocks(attention_kernel<T, false>, T::kThreads, T::kSmem),
                                 max_active_blocks(attention_kernel<T, true>, T::kThreads, T::kSmem));
  if (info->blocks_per_sm <= 0) return "attention kernel cannot be resident on this device (occupancy 0)";
  return nullptr;
}

const char* attn_kernel_info_portable(int dv, int rope, AttnKernelInfo* info) {
  switch (dv * 1000 + rope) {
#define MLA_CASE(DV, R) \
  case DV * 1000 + R:   \
    return kernel_info<TileFor<DV + R, DV>>(info);
    MLA_ATTN_SHAPES(MLA_CASE)
#undef MLA_CASE
    default:
      return kAttnShapesSupported;
  }
}

template <typename T>
const char* launch_tile(const AttnParams& p, stream_t stream) {
  if (p.rope != T::kRope || p.dv != T::kDv || (T::kHeadRope != (p.rope_scores != nullptr)))
    return "launch_attention: parameters do not match the kernel instance (dv, rope, rope scores)";
  if (p.f16 && p.rope_cs != nullptr) return "launch_attention: on-the-fly key RoPE is bf16 only";
  const int head_blocks = (p.rows + T::kM - 1) / T::kM;
  dim3 grid(head_blocks, p.max_parts);
  if (p.f16)
    attention_kernel<T, true><<<grid, T::kThreads, T::kSmem, stream>>>(p);
  else
    attention_kernel<T, false><<<grid, T::kThreads, T::kSmem, stream>>>(p);
  return last_launch_error();
}

const char* launch_attention_portable(const AttnParams& p, stream_t stream) {
  switch (p.dv * 1000 + p.rope) {
#define MLA_CASE(DV, R) \
  case DV * 1000 + R:   \
    return launch_tile<TileFor<DV + R, DV>>(p, stream);
    MLA_ATTN_SHAPES(MLA_CASE)
#undef MLA_CASE
    default:
      return kAttnShapesSupported;
  }
}

}  // namespace mla
