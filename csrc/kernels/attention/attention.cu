// Split-KV absorbed MQA decode over the latent cache: the portable kernel,
// written on the tile-MMA interface (mma.sync on NVIDIA, MFMA on AMD gfx942).
//
// One block = one head block (kM query rows) x one planned part (a range of
// key tiles of one sequence). Keys stream through a kStages-deep ring in
// shared memory; rows past the sequence are zero-filled (so NaN in unused
// cache rows never reaches P V) and masked to -inf in the scores. Per key
// tile, three stages (device functions below) separated by block barriers:
//   scores   S = Q K^T. Warps form a kSMW x kSDW grid over (rows, D): warp
//            (sm, sd) keeps its Q slice, rows [kSM sm, +kSM) x columns
//            [kSD sd, +kSD), in registers for the whole part (Q is read from
//            memory once per block) and writes fp32 partial scores.
//   softmax  every thread owns kSmCols keys of one row: it sums the kSDW
//            partials, keeps the row's running max and sum, and writes P
//            (bf16/fp16) and the row's rescale factor.
//   P V      warps form a kPMW x kPNW grid over (rows, Dv): warp (pm, pn)
//            keeps O rows [kPM pm, +kPM) x columns [kPN pn, +kPN) in fp32
//            registers.
// The two grids differ because the two products want different shapes: a
// warp reads from shared memory every key fragment it multiplies, so the
// more rows a warp covers, the fewer times a key tile is read (the limit of
// a tile-MMA kernel is shared-memory bandwidth: docs/portable.md). Rows per
// warp are bounded by registers: Q slice plus O must fit beside the
// fragments in flight. The head block kM follows s_q * h_q (16, 32 or 64
// rows; the host picks the instance), so that few heads do not pay for
// padding rows.
//
// Shapes: D = Dv + rope with the rope columns shared by all heads (DeepSeek:
// 512 + 64), or D = Dv with per-head rope keys (MHA2MLA): then the rope part
// of every score, q_pe[h] . k_pe[t, h], is computed by rope_scores_kernel
// beforehand into an fp32 workspace [bs, rows, rs_stride] that streams in
// with the keys and is added in the softmax. D is padded to the k-split
// (16 kSDW columns) in registers and shared memory only (zeros, never read
// from memory). RoPE of the keys, when asked for, is applied in shared
// memory with the caller's bf16 cos/sin table, exactly as the task rounds it.
#include <algorithm>
#include <type_traits>

#include "../../platform/bf16.h"
#include "../../platform/copy.h"
#include "../../platform/mma.h"
#include "../../platform/vendor.h"

#include "attention.h"
#include "block_table.h"
#include "part.h"

namespace mla {
namespace {

// Test builds that run gfx942's loads or read-ahead on NVIDIA (-DMLA_PORTABLE_REG_LOADS,
// -DMLA_PORTABLE_PREFETCH) keep its padded key rows too (AttnTile::kSwizK).
#if defined(MLA_PORTABLE_REG_LOADS) || defined(MLA_PORTABLE_PREFETCH)
constexpr bool kSwizKeys = false;
#else
constexpr bool kSwizKeys = true;
#endif

// kM rows per block; scores on a kSMW x kSDW warp grid, P V on kPMW x
// (warps / kPMW); kBN keys per tile, kStages tiles in the ring; kMinBlocks
// blocks per SM/CU the register allocation must allow.
template <int kD_, int kDv_, int kM_, int kSMW_, int kSDW_, int kPMW_, int kBN_, int kStages_, int kMinBlocks_>
struct AttnTile {
  static constexpr int kD = kD_;
  static constexpr int kDv = kDv_;
  static constexpr int kRope = kD - kDv;  // 0: per-head rope keys (scores from the workspace)
  static constexpr bool kHeadRope = kRope == 0;
  static constexpr int kM = kM_, kBN = kBN_, kStages = kStages_, kMinBlocks = kMinBlocks_;
  static constexpr int kWarps = kSMW_ * kSDW_;
  static constexpr int kThreads = kWarps * kWarpSize;
  // scores: warp grid, rows and k-steps per warp
  static constexpr int kSMW = kSMW_, kSDW = kSDW_;
  static constexpr int kSM = kM / kSMW, kSMT = kSM / 16;
  static constexpr int kSKS = (kD + 16 * kSDW - 1) / (16 * kSDW);
  static constexpr int kSD = 16 * kSKS;
  static constexpr int kDp = kSD * kSDW;  // D padded to the k-split
  // P V: warp grid, rows and columns per warp
  static constexpr int kPMW = kPMW_, kPNW = kWarps / kPMW;
  static constexpr int kPM = kM / kPMW, kPMT = kPM / 16;
  static constexpr int kPN = kDv / kPNW, kPNT = kPN / 16;
  // loads: kLdTpr threads per key row, 16 bytes each per step
  static constexpr int kLdTpr = kThreads / kBN;
  static constexpr int kChunksPerRow = kD / 8;   // 16-byte chunks read from memory
  static constexpr int kChunksPadded = kDp / 8;  // ... and zero-filled up to the padded width
  static constexpr int kLdSteps = (kChunksPadded + kLdTpr - 1) / kLdTpr;
  // softmax: kSmLanes threads per row (adjacent lanes of one warp), kSmCols keys each
  static constexpr int kSmLanes = kThreads / kM, kSmCols = kBN / kSmLanes;

  // key rows (bf16). kSwizK (NVIDIA tiles of 8 or 4 copying threads per row): unpadded rows, a multiple of 128
  // bytes, each 16-byte chunk c of row r stored at c XOR key_xor(r) within its 128 bytes (key_off), and the
  // warps' D and Dv slices interleaved in 16-column steps (k-step i of score warp sd: columns 16 (kSDW i + sd);
  // P V warp pn's tile n: 16 (kPNW n + pn)), so that a row's copies fill whole 128-byte lines of shared
  // memory, ldmatrix's 8 rows still fall on 8 distinct bank groups, and every fragment's address is a lane's
  // base plus a constant. Else rows padded by 16 bytes (ldmatrix's rows on distinct banks), which split each
  // row's cp.async stores over two lines and multiply their shared-memory wavefronts (docs/portable.md).
  static constexpr bool kSwizK =
      kSwizKeys && mma::kCPairedCols && (kLdTpr == 8 || kLdTpr == 4) && kSDW >= 4 && kPNW >= 4;
  static constexpr int kLd = kSwizK ? kDp : kDp + 8;
  // partial-score rows (fp32), 16-byte aligned for vector reads. With mma.sync's paired C columns and 8 keys
  // per softmax thread (kSmSplit: see sm_row), 40 floats: the scores' 8-byte stores (a half-warp: 4 rows x 32 B)
  // then fall on 4 distinct 8-bank groups, and the softmax's reads on distinct banks too; else 36 floats
  static constexpr bool kSmSplit = mma::kCPairedCols && kSmLanes == 4 && kSmCols == 8;
  static constexpr int kSLd = kSmSplit ? kBN + 8 : kBN + 4;
  static constexpr int kPLd = kBN + 8;  // P rows (bf16)
  static constexpr int kRsLd = kBN + 4;  // per-head rope-score rows (fp32, 16-byte rows for the copies)

  static constexpr int kKvBytes = kStages * kBN * kLd * 2;
  static constexpr int kSBytes = kSDW * kM * kSLd * 4;
  static constexpr int kPBytes = kM * kPLd * 2;
  static constexpr int kRowBytes = kM * 4;
  static constexpr int kCsBytes = kStages * kBN * kRope * 2;  // RoPE cos|sin rows, prefetched with the keys
  static constexpr int kRsBytes = kHeadRope ? kStages * kM * kRsLd * 4 : 0;  // per-head rope scores, likewise
  static constexpr int kSmem = kKvBytes + kSBytes + kPBytes + kRowBytes + kCsBytes + kRsBytes;

  static_assert(kM % kSMW == 0 && kSM % 16 == 0, "score warps must hold whole 16-row tiles");
  static_assert(kWarps % kPMW == 0 && kM % kPMW == 0 && kPM % 16 == 0, "P V warps must hold whole 16-row tiles");
  static_assert(kDv % kPNW == 0 && kPN % 16 == 0, "Dv must split into 16-column tiles over the P V warps");
  static_assert(kD % 8 == 0 && kRope % 8 == 0 && kRope >= 0, "bad D / rope");
  static_assert(kBN % 16 == 0 && kThreads % kBN == 0, "bad key tile");
  static_assert(kThreads % kM == 0 && kSmLanes <= kWarpSize && (kSmLanes & (kSmLanes - 1)) == 0 &&
                    kBN % kSmLanes == 0 && kSmCols % 2 == 0,
                "softmax: a row's lanes must be a power of two within a warp, with an even count of keys each");
  static_assert(kStages >= 2, "need at least double buffering");
  static_assert(!kSwizK || (kDp % 64 == 0 && kDv % (16 * kPNW) == 0), "swizzled keys: whole 128-byte rows");
};

// The tile configurations per vendor and head block (kM = 16, 32 or 64 rows).
#if MLA_AMD
// MI300X: 64 KB LDS per CU, wave64, 512 VGPRs (with AGPRs) per lane. A wave
// holds 16 score rows over all of D (Q slice 72 VGPRs) and P V's 64 rows x
// 128 columns (O 128): no partial scores to add at 64 rows. The LDS holds a
// 2 x 16-key ring (37 KB) beside the scores, P and the RoPE rows.
template <int kD, int kDv, int kM>
struct TileChoice;
template <int kD, int kDv>
struct TileChoice<kD, kDv, 64> { using type = AttnTile<kD, kDv, 64, 4, 1, 1, 16, 2, 1>; };
template <int kD, int kDv>
struct TileChoice<kD, kDv, 32> { using type = AttnTile<kD, kDv, 32, 2, 2, 1, 16, 2, 1>; };
template <int kD, int kDv>
struct TileChoice<kD, kDv, 16> { using type = AttnTile<kD, kDv, 16, 1, 2, 1, 16, 2, 1>; };
#else
// NVIDIA (when the Hopper kernel is not used): 64 rows on 8 warps, scores on
// 2 x 4 (32 rows x 144 columns: Q slice 72 registers), P V on 1 x 8 (64 rows x
// 64 columns: O 128), one block per SM, a 3 x 32-key ring (a tile's copies
// issued at the top of the tile before it); 32 rows on 4 warps
// (scores 1 x 4, P V 1 x 4), two blocks per SM; 16 rows (dv 512) on 8 warps
// (scores 1 x 8 over D padded to 640, P V 1 x 8: 120 registers), two blocks
// per SM, each a 2 x 32-key ring. The choices and the ones measured slower:
// docs/portable.md.
template <int kD, int kDv, int kM>
struct TileChoice;
template <int kD, int kDv>
struct TileChoice<kD, kDv, 64> { using type = AttnTile<kD, kDv, 64, 2, 4, (kDv >= 128 ? 1 : 2), 32, 3, 1>; };
template <int kD, int kDv>
struct TileChoice<kD, kDv, 32> { using type = AttnTile<kD, kDv, 32, 1, 4, 1, 32, 2, 2>; };
template <int kD, int kDv>
struct TileChoice<kD, kDv, 16> {
  using type = std::conditional_t<(kDv >= 512), AttnTile<kD, kDv, 16, 1, 8, 1, 32, 2, 2>,
                                  AttnTile<kD, kDv, 16, 1, 4, 1, 32, 2, 2>>;
};
#endif
template <int kD, int kDv, int kM>
using TileFor = typename TileChoice<kD, kDv, kM>::type;

// The shared-memory carve-up of one block.
template <typename T>
struct Smem {
  bf16_t* kv;   // [kStages][kBN][kLd] key ring
  float* s;     // [kSDW][kM][kSLd] partial scores
  bf16_t* p;    // [kM][kPLd] P of the current tile
  float* row;   // [kM] the rows' rescale factors, then 1 / sum
  bf16_t* cs;   // [kStages][kBN][kRope] the keys' cos|sin rows
  float* rs;    // [kStages][kM][kRsLd] per-head rope scores
  MLA_DEVICE explicit Smem(unsigned char* base)
      : kv(reinterpret_cast<bf16_t*>(base)),
        s(reinterpret_cast<float*>(base + T::kKvBytes)),
        p(reinterpret_cast<bf16_t*>(base + T::kKvBytes + T::kSBytes)),
        row(reinterpret_cast<float*>(base + T::kKvBytes + T::kSBytes + T::kPBytes)),
        cs(reinterpret_cast<bf16_t*>(base + T::kKvBytes + T::kSBytes + T::kPBytes + T::kRowBytes)),
        rs(reinterpret_cast<float*>(base + T::kKvBytes + T::kSBytes + T::kPBytes + T::kRowBytes + T::kCsBytes)) {}
};

MLA_DEVICE const bf16_t* kv_row(const AttnParams& p, int b, int t) {
  if (p.block_table == nullptr) return p.kv + b * p.kv_page_stride + t * p.kv_row_stride;
  const int page = page_id(p.block_table, b * p.block_table_stride + p.page_div.div(t), p.num_pages);
  return p.kv + page * p.kv_page_stride + p.page_div.mod(t) * p.kv_row_stride;
}

// Per-head rope scores of tile j into its slot (copy16_async; the register path's companion).
template <typename T>
MLA_DEVICE void load_rope_scores(const AttnParams& p, const Part& pt, int j, const Smem<T>& sm, int tid) {
  if constexpr (T::kHeadRope) {
    constexpr int kRsChunks = T::kBN / 4;
    const int slot = j % T::kStages, tile = pt.tile_begin + j;
    float* rdst = sm.rs + slot * T::kM * T::kRsLd;
    for (int c = tid; c < T::kM * kRsChunks; c += T::kThreads) {
      const int r = c / kRsChunks, t = tile * T::kBN + 4 * (c % kRsChunks), row = block_x() * T::kM + r;
      const bool valid = row < p.rows && t < pt.L;  // (t + 1..3 >= L lie inside the workspace; masked later)
      copy16_async(rdst + r * T::kRsLd + 4 * (c % kRsChunks),
                   valid ? p.rope_scores + (static_cast<int64_t>(pt.b) * p.rows + row) * p.rs_stride + t
                         : p.rope_scores,
                   valid);
    }
  }
}

// Chunk k of a thread's kLdSteps 16-byte chunks of its key row (lr: its place
// among the row's kLdTpr threads): its index, whether it lies inside the row
// (else a padding column: zeros) and whether it holds rope columns (read from
// kpe where given). Both are known from k alone wherever kLdTpr divides the
// boundaries (the 576/512 shape at every tile), so that each chunk's address is
// its row's base plus a constant: no select and no address register per
// chunk. (With a select per chunk, at 255 registers ptxas kept one address pair
// for all of a tile's copies, each waiting for the one before to read it.)
struct KeyChunk {
  int ch;
  bool in_row, rope;
};

template <typename T>
MLA_DEVICE KeyChunk key_chunk(int k, int lr) {
  constexpr int kRopeChunk = T::kDv / 8;  // the first chunk of the rope columns
  const int ch = lr + k * T::kLdTpr;
  const bool in_row = (k + 1) * T::kLdTpr <= T::kChunksPerRow || ch < T::kChunksPerRow;
  const bool rope = kRopeChunk % T::kLdTpr == 0 ? k >= kRopeChunk / T::kLdTpr : ch >= kRopeChunk;
  return {ch, in_row, rope};
}

// The cp.async key path: each thread copies kLdSteps chunks of one key row of
// tile j into its ring slot (one page lookup per row and tile). KeyRow: one
// thread's key row of tile j, its source (the latent row and the rope
// columns' base) and its ring-slot row.
struct KeyRow {
  const bf16_t* row;
  const bf16_t* rope;
  bf16_t* dst;
  bool ok;  // the row lies before the length
  int lr;   // the thread's place among the row's kLdTpr threads
  int odd;  // kSwizK with 4 threads per row: added to dst at the odd steps (key_shift)
};

// The 16-byte chunk of key row r that its chunk 8 g + i lies at: 8 g + (i ^ key_xor(r)). Every 8 consecutive
// rows take 8 distinct values (ldmatrix's 8 rows on 8 bank groups). With 4 copying threads per row, a
// quarter-warp copies half a group of rows r and r + 1 (r even), so their values also differ in bit 2 (the
// halves on distinct banks).
template <typename T>
MLA_DEVICE int key_xor(int r) {
  return T::kLdTpr == 4 ? (r & 7) ^ ((r & 1) << 2) : r & 7;
}

// kSwizK: a copying thread's destination shift. Chunk lr + kLdTpr k of ring row kr lies at dst + 8 (lr +
// kLdTpr k) with dst = the row's base + 8 ((lr ^ x) - lr), x = key_xor(kr): at 8 threads per row exactly;
// at 4, plus `odd` elements at odd k (-64 where lr ^ x has bit 2 set, else 0).
struct KeyShift {
  int dst, odd;
};
template <typename T>
MLA_DEVICE KeyShift key_shift(int kr, int lr) {
  if constexpr (!T::kSwizK) {
    return {0, 0};
  } else {
    const int c = lr ^ key_xor<T>(kr);
    return {8 * (c - lr), T::kLdTpr == 4 && (c & 4) ? -64 : 0};
  }
}

template <typename T>
MLA_DEVICE KeyRow key_row(const AttnParams& p, const Part& pt, int j, const Smem<T>& sm, int tid) {
  const int slot = j % T::kStages, r = tid / T::kLdTpr, t = (pt.tile_begin + j) * T::kBN + r;
  const bool ok = t < pt.L;
  const bf16_t* row = ok ? kv_row(p, pt.b, t) : p.kv;
  const bf16_t* rope = ok && p.kpe != nullptr
                           ? p.kpe + pt.b * p.kpe_batch_stride + static_cast<int64_t>(t) * p.kpe_row_stride
                           : row + T::kDv;
  const int lr = tid % T::kLdTpr, kr = slot * T::kBN + r;
  const KeyShift sh = key_shift<T>(kr, lr);
  return {row, rope, sm.kv + kr * T::kLd + sh.dst, ok, lr, sh.odd};
}

// Chunks [kFrom, kTo) of the thread's kLdSteps (a chunk of a row past the length, or a padding column, copies
// 0 bytes: zeros, its address not read).
template <typename T, int kFrom, int kTo>
MLA_DEVICE void copy_chunks(const KeyRow& kr) {
#pragma unroll
  for (int k = kFrom; k < kTo; ++k) {
    const KeyChunk c = key_chunk<T>(k, kr.lr);
    if (T::kChunksPadded % T::kLdTpr != 0 && c.ch >= T::kChunksPadded) break;
    copy16_async(kr.dst + c.ch * 8 + (T::kLdTpr == 4 && (k & 1) ? kr.odd : 0),
                 c.rope ? kr.rope + (c.ch - T::kDv / 8) * 8 : kr.row + c.ch * 8, kr.ok && c.in_row);
  }
}

// The cos|sin rows or per-head rope scores of tile j.
template <typename T>
MLA_DEVICE void load_tile_extras(const AttnParams& p, const Part& pt, int j, const Smem<T>& sm, int tid) {
  const int slot = j % T::kStages, tile = pt.tile_begin + j;
  if constexpr (T::kHeadRope) {  // the rope scores of this block's rows for these keys (4 per chunk)
    load_rope_scores<T>(p, pt, j, sm, tid);
  } else if (p.rope_cs != nullptr) {  // the keys' cos|sin rows travel with them
    constexpr int kCsChunks = T::kRope / 8;
    bf16_t* cdst = sm.cs + slot * T::kBN * T::kRope;
    for (int c = tid; c < T::kBN * kCsChunks; c += T::kThreads) {
      const int t = tile * T::kBN + c / kCsChunks;
      const bool valid = t < pt.L;
      copy16_async(cdst + c * 8, valid ? p.rope_cs + static_cast<int64_t>(t) * T::kRope + (c % kCsChunks) * 8 : p.rope_cs,
                   valid);
    }
  }
}

// All of tile j's copies.
template <typename T>
MLA_DEVICE void load_tile(const AttnParams& p, const Part& pt, int j, const Smem<T>& sm, int tid) {
  copy_chunks<T, 0, T::kLdSteps>(key_row<T>(p, pt, j, sm, tid));
  load_tile_extras<T>(p, pt, j, sm, tid);
}

// Register-staged key loads: each thread reads its chunks of tile j into
// registers (fetch_keys: all loads issued together, rows past the length
// and padding columns 0, the load predicated instead of branched around),
// and writes them to the tile's ring slot (store_keys): after the current
// tile's P V, or, with two barriers per tile (the kernel's loop), after the
// next tile's scores. Used for fp8 caches (the bytes widened to bf16 on the way
// in) and, for every cache, on AMD, where a 16-byte global-to-LDS copy is a load and an LDS store: issued
// one chunk at a time, behind branches, each waited for its own memory round
// trip before the tile's products began. NVIDIA builds with
// -DMLA_PORTABLE_REG_LOADS take this path too (to test it); otherwise they
// copy with cp.async (load_tile). The cos|sin rows of on-the-fly RoPE travel
// the same way; per-head rope scores stay on copy16_async.
#if MLA_AMD || defined(MLA_PORTABLE_REG_LOADS)
constexpr bool kRegLoads = true;
#else
constexpr bool kRegLoads = false;
#endif

template <typename T, bool kFp8>
struct KeyChunks {
  using V = std::conditional_t<kFp8, uint2, uint4>;  // 8 elements: e4m3 bytes or 16-bit values
  static constexpr int kCsChunks = T::kRope / 8;
  // (fp8 caches take no on-the-fly RoPE)
  static constexpr int kCsSteps = T::kHeadRope || kFp8 ? 0 : (T::kBN * kCsChunks + T::kThreads - 1) / T::kThreads;
  V v[T::kLdSteps];
  uint4 cs[kCsSteps > 0 ? kCsSteps : 1];
};

template <typename V>
MLA_DEVICE V load_chunk(const void* src, bool valid) {
  V v = *reinterpret_cast<const V*>(src);  // (src is a readable address either way: the cache's first row)
  return valid ? v : V{};
}

// The block-table entry of this thread's key row of tile j (paged caches;
// 0 past the length or without a table), read a tile ahead of fetch_keys and
// checked only there, so that the read's latency passes under a tile's work.
template <typename T>
MLA_DEVICE int32_t key_page_entry(const AttnParams& p, const Part& pt, int j, int tid) {
  const int t = (pt.tile_begin + j) * T::kBN + tid / T::kLdTpr;
  return p.block_table != nullptr && t < pt.L ? p.block_table[pt.b * p.block_table_stride + p.page_div.div(t)] : 0;
}

template <typename T, bool kFp8>
MLA_DEVICE void fetch_keys(const AttnParams& p, const Part& pt, int j, int32_t entry, KeyChunks<T, kFp8>& kc,
                           int tid) {
  using V = typename KeyChunks<T, kFp8>::V;
  constexpr int kE = kFp8 ? 1 : 2;  // bytes per cache element (strides are in elements)
  const int tile = pt.tile_begin + j;
  const int r = tid / T::kLdTpr, lr = tid % T::kLdTpr, t = tile * T::kBN + r;
  const bool row_ok = t < pt.L;
  // (a row past the length reads the cache's first row, and a padding column the row's start, in place of
  // theirs: readable addresses, the values replaced by zeros)
  const unsigned char* base = reinterpret_cast<const unsigned char*>(p.kv);
  const unsigned char* row = base;
  const unsigned char* rope = base + T::kDv * kE;  // the rope columns' base
  if (row_ok) {
    // (an id outside the cache reads page 0, as page_id)
    const int64_t page = p.block_table == nullptr ? pt.b : held_page_id(entry, p.num_pages);
    row = base + (page * p.kv_page_stride + (p.block_table == nullptr ? t : p.page_div.mod(t)) * p.kv_row_stride) * kE;
    rope = !kFp8 && p.kpe != nullptr
               ? reinterpret_cast<const unsigned char*>(p.kpe + pt.b * p.kpe_batch_stride +
                                                        static_cast<int64_t>(t) * p.kpe_row_stride)
               : row + T::kDv * kE;
  }
#pragma unroll
  for (int k = 0; k < T::kLdSteps; ++k) {
    const KeyChunk c = key_chunk<T>(k, lr);
    const unsigned char* src = !c.in_row ? row : c.rope ? rope + (c.ch - T::kDv / 8) * 8 * kE : row + c.ch * 8 * kE;
    kc.v[k] = load_chunk<V>(src, row_ok && c.in_row);
  }
  if constexpr (KeyChunks<T, kFp8>::kCsSteps > 0) {
    if (p.rope_cs != nullptr) {
      constexpr int kCsChunks = KeyChunks<T, kFp8>::kCsChunks;
#pragma unroll
      for (int s = 0; s < KeyChunks<T, kFp8>::kCsSteps; ++s) {
        const int c = tid + s * T::kThreads, tc = tile * T::kBN + c / kCsChunks;
        const bool valid = c < T::kBN * kCsChunks && tc < pt.L;
        kc.cs[s] = load_chunk<uint4>(
            valid ? p.rope_cs + static_cast<int64_t>(tc) * T::kRope + (c % kCsChunks) * 8 : p.rope_cs, valid);
      }
    }
  }
}

template <typename T, bool kFp8>
MLA_DEVICE void store_keys(const AttnParams& p, const Smem<T>& sm, int j, const KeyChunks<T, kFp8>& kc, int tid) {
  const int slot = j % T::kStages, r = tid / T::kLdTpr, lr = tid % T::kLdTpr, kr = slot * T::kBN + r;
  const KeyShift sh = key_shift<T>(kr, lr);  // (as key_row)
  bf16_t* dst = sm.kv + kr * T::kLd + sh.dst;
#pragma unroll
  for (int k = 0; k < T::kLdSteps; ++k) {
    const int ch = lr + k * T::kLdTpr;
    if (T::kChunksPadded % T::kLdTpr != 0 && ch >= T::kChunksPadded) break;
    bf16_t* d = dst + ch * 8 + (T::kLdTpr == 4 && (k & 1) ? sh.odd : 0);
    if constexpr (kFp8)
      store_fp8x8_as_bf16(d, kc.v[k]);
    else
      *reinterpret_cast<uint4*>(d) = kc.v[k];
  }
  if constexpr (KeyChunks<T, kFp8>::kCsSteps > 0) {
    if (p.rope_cs != nullptr) {
      bf16_t* cdst = sm.cs + slot * T::kBN * T::kRope;
#pragma unroll
      for (int s = 0; s < KeyChunks<T, kFp8>::kCsSteps; ++s) {
        const int c = tid + s * T::kThreads;
        if (c < T::kBN * KeyChunks<T, kFp8>::kCsChunks) *reinterpret_cast<uint4*>(cdst + c * 8) = kc.cs[s];
      }
    }
  }
}

// A refill's loads into registers: tile j's key chunks (its block-table entry read a tile before, in
// `entry`, which then takes tile j + 1's) and its per-head rope scores.
template <typename T, bool kFp8>
MLA_DEVICE void fetch_refill(const AttnParams& p, const Part& pt, int j, int32_t& entry, KeyChunks<T, kFp8>& kc,
                             const Smem<T>& sm, int tid) {
  fetch_keys<T, kFp8>(p, pt, j, entry, kc, tid);
  load_rope_scores<T>(p, pt, j, sm, tid);
  entry = key_page_entry<T>(p, pt, j + 1, tid);  // (past the length: none read)
}

// The first column of score warp sd's k-step ks (AttnTile::kSwizK: interleaved), and of P V warp pn's
// 16-column tile n.
template <typename T>
MLA_DEVICE constexpr int score_col(int sd, int ks) {
  return T::kSwizK ? 16 * (T::kSDW * ks + sd) : sd * T::kSD + 16 * ks;
}
template <typename T>
MLA_DEVICE constexpr int pv_col(int pn, int n) {
  return T::kSwizK ? 16 * (T::kPNW * n + pn) : pn * T::kPN + 16 * n;
}

// This warp's Q slice of the scores grid, straight from memory into registers.
template <typename T>
MLA_DEVICE void load_q(const AttnParams& p, int b, int warp, mma::FragA (&qf)[T::kSMT][T::kSKS]) {
  const int sm_w = warp % T::kSMW, sd_w = warp / T::kSMW;
  const int row0 = block_x() * T::kM + sm_w * T::kSM;
  const int col0 = score_col<T>(sd_w, 0), step = score_col<T>(0, 1);
  const bf16_t* qp = p.q + b * p.q_batch_stride + row0 * p.q_row_stride + col0;
#pragma unroll
  for (int mt = 0; mt < T::kSMT; ++mt)
#pragma unroll
    for (int ks = 0; ks < T::kSKS; ++ks)
      mma::load_a_global(qf[mt][ks], qp + mt * 16 * p.q_row_stride + ks * step, p.q_row_stride,
                         p.rows - row0 - mt * 16, T::kD - col0 - ks * step);
}

// Element offset of column c of row r of the key ring (AttnTile::kSwizK's layout, or padded rows).
template <typename T>
MLA_DEVICE int key_off(int r, int c) {
  if constexpr (T::kSwizK)
    return r * T::kLd + (((c >> 3) ^ key_xor<T>(r)) << 3) + (c & 7);
  else
    return r * T::kLd + c;
}

// rot(x, t) = x cos + cat(-x2, x1) sin on the tile's rope columns in shared
// memory, every product and sum rounded to bf16 (the task's semantics). Each
// thread takes 4 adjacent pairs of a row with 8-byte accesses: one round at
// the NVIDIA 64-row tile, where one pair per thread took four, each a chain of
// loads, roundings and stores between the tile's barriers (docs/portable.md).
template <typename T>
MLA_DEVICE void rope_tile(bf16_t* kt, const bf16_t* cs_tile, int key0, int L, int tid) {
  constexpr int kHalf = T::kRope / 2, kItems = kHalf / 4;  // items per row
  static_assert(kHalf % 4 == 0, "rope: 4 pairs per item");
  for (int e = tid; e < T::kBN * kItems; e += T::kThreads) {
    const int r = e / kItems, jj = 4 * (e % kItems);
    if (key0 + r < L) {
      // (a slot holds whole groups of 8 rows: r mod 8 is the ring row's; 4 columns lie within a 16-byte chunk)
      uint2* x1p = reinterpret_cast<uint2*>(kt + key_off<T>(r, T::kD - T::kRope + jj));
      uint2* x2p = reinterpret_cast<uint2*>(kt + key_off<T>(r, T::kD - T::kRope + kHalf + jj));
      const bf16_t* cs = cs_tile + r * T::kRope;
      const uint2 cw = *reinterpret_cast<const uint2*>(cs + jj), sw = *reinterpret_cast<const uint2*>(cs + kHalf + jj);
      const uint2 x1w = *x1p, x2w = *x2p;
      const uint32_t cv[2] = {cw.x, cw.y}, sv[2] = {sw.x, sw.y}, x1v[2] = {x1w.x, x1w.y}, x2v[2] = {x2w.x, x2w.y};
      uint32_t y1[2], y2[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint32_t a = 0, b = 0;
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          const float c = q ? bf16_hi(cv[h]) : bf16_lo(cv[h]), s = q ? bf16_hi(sv[h]) : bf16_lo(sv[h]);
          const float x1 = q ? bf16_hi(x1v[h]) : bf16_lo(x1v[h]), x2 = q ? bf16_hi(x2v[h]) : bf16_lo(x2v[h]);
          a |= static_cast<uint32_t>(float_to_bf16(round_bf16(x1 * c) + round_bf16(-x2 * s)).bits) << (16 * q);
          b |= static_cast<uint32_t>(float_to_bf16(round_bf16(x2 * c) + round_bf16(x1 * s)).bits) << (16 * q);
        }
        y1[h] = a;
        y2[h] = b;
      }
      *x1p = make_uint2(y1[0], y1[1]);
      *x2p = make_uint2(y2[0], y2[1]);
    }
  }
}

// Store a C fragment (16 x 16 fp32) at row-major dst with row stride ld.
MLA_DEVICE void store_c(const mma::FragC& c, float* dst, int ld, int lane) {
#pragma unroll
  for (int i = 0; i < mma::kCElems; i += (mma::kCPairedCols ? 2 : 1)) {
    float* d = dst + mma::c_row(lane, i) * ld + mma::c_col(lane, i);
    if constexpr (mma::kCPairedCols)
      *reinterpret_cast<float2*>(d) = make_float2(c.v[i], c.v[i + 1]);
    else
      *d = c.v[i];
  }
}

#if MLA_AMD || defined(MLA_PORTABLE_PREFETCH)
// Steps 0..kSteps-1 of a product, each step's B fragment (as read: Frag)
// read kAhead steps before its MFMAs: load(i, frag) reads step i's, use(i,
// frag) multiplies.
// On AMD the schedule is pinned to that order (kFirstReads LDS reads, then
// per step the kReads of step i + kAhead and the kMfmas of step i): LLVM's
// own, with or without iglp_opt, read each fragment right before its MFMAs
// and waited for it, an LDS round trip per step (scores at 64 rows, P V at 16
// and 32). NVIDIA keeps the plain loops (this source changes their SASS;
// -DMLA_PORTABLE_PREFETCH builds it there, to test it, with gfx942's padded
// key rows: kSwizKeys).
template <int kSteps, int kFirstReads, int kReads, int kMfmas, typename Frag, typename Load, typename Use>
MLA_DEVICE void steps_read_ahead(Load load, Use use) {
  constexpr int kAhead = kSteps < 4 ? kSteps : 4;
  Frag f[kAhead];
#pragma unroll
  for (int i = 0; i < kAhead; ++i) load(i, f[i]);
#pragma unroll
  for (int i = 0; i < kSteps; ++i) {
    const Frag cur = f[i % kAhead];
    if (i + kAhead < kSteps) load(i + kAhead, f[i % kAhead]);
    use(i, cur);
  }
#if MLA_AMD
  __builtin_amdgcn_sched_group_barrier(0x100, kFirstReads + kReads * kAhead, 0);  // the first reads
#pragma unroll
  for (int i = 0; i < kSteps; ++i) {
    if (i + kAhead < kSteps) __builtin_amdgcn_sched_group_barrier(0x100, kReads, 0);  // step i + kAhead's reads
    __builtin_amdgcn_sched_group_barrier(0x008, kMfmas, 0);                         // step i's MFMAs
  }
#endif
}
#endif

// Stage 1: this warp's partial scores over its D slice, for every key of the
// tile, into s_s[sd][row][key].
template <typename T, bool kF16>
MLA_DEVICE void scores(const mma::FragA (&qf)[T::kSMT][T::kSKS], const bf16_t* kt, float* s_s, int warp, int lane) {
  const int sm_w = warp % T::kSMW, sd_w = warp / T::kSMW;
  const bf16_t* kb = kt + sd_w * T::kSD;
  float* sw = s_s + (sd_w * T::kM + sm_w * T::kSM) * T::kSLd;
#pragma unroll
  for (int n = 0; n < T::kBN / 16; ++n) {
    mma::FragC acc[T::kSMT];
#pragma unroll
    for (int mt = 0; mt < T::kSMT; ++mt) mma::zero(acc[mt]);
#if !MLA_AMD
    if constexpr (T::kSwizK) {
      // this lane's ldmatrix row ((lane & 7) + 8 (lane >> 4), as mma::load_b_nk) at its chunk of k-step 0
      // (column 16 sd + 8 ((lane >> 3) & 1)), swizzled; k-step ks lies 16 kSDW ks columns on (whole 128 bytes)
      const int u = 2 * sd_w + ((lane >> 3) & 1);
      const bf16_t* kl =
          kt + ((lane & 7) + 8 * (lane >> 4)) * T::kLd + 8 * ((u & ~7) + ((u & 7) ^ key_xor<T>(lane)));
#pragma unroll
      for (int ks = 0; ks < T::kSKS; ++ks) {
        mma::FragB kf;
        mma::load_b_lane(kf, kl + n * 16 * T::kLd + 16 * T::kSDW * ks);
#pragma unroll
        for (int mt = 0; mt < T::kSMT; ++mt) mma::mma<kF16>(acc[mt], qf[mt][ks], kf);
      }
    } else
#endif
    {
#if MLA_AMD || defined(MLA_PORTABLE_PREFETCH)
    // (one LDS read per key fragment)
    steps_read_ahead<T::kSKS, 0, 1, T::kSMT, mma::FragB>(
        [&](int ks, mma::FragB& f) { mma::load_b_nk(f, kb + n * 16 * T::kLd + ks * 16, T::kLd); },
        [&](int ks, const mma::FragB& f) {
#pragma unroll
          for (int mt = 0; mt < T::kSMT; ++mt) mma::mma<kF16>(acc[mt], qf[mt][ks], f);
        });
#else
#pragma unroll
    for (int ks = 0; ks < T::kSKS; ++ks) {
      mma::FragB kf;
      mma::load_b_nk(kf, kb + n * 16 * T::kLd + ks * 16, T::kLd);
#pragma unroll
      for (int mt = 0; mt < T::kSMT; ++mt) mma::mma<kF16>(acc[mt], qf[mt][ks], kf);
    }
#endif
    }
#pragma unroll
    for (int mt = 0; mt < T::kSMT; ++mt) store_c(acc[mt], sw + mt * 16 * T::kSLd + n * 16, T::kSLd, lane);
  }
}

// A softmax thread's row: its reference max (log2 domain, scaled) and the sum of P over the thread's own keys.
struct RowState {
  float m, l;
};

// Lazy rescale: a row's reference max moves only when a tile's max exceeds
// it by more than kPortableLazyMax (log2 units), as in the Hopper kernel, so
// after a row's first tile its rescale factor is almost always exactly 1, and
// P V skips the rescale of O where a warp's factors all are (on gfx942, where
// O lives in AGPRs, a read, a multiply and a write back per element; on
// NVIDIA 128 multiplies per thread and tile: docs/portable.md). P =
// exp2(s - ref) stays <= 2^kPortableLazyMax; O, the sums and the LSE are
// exact for any reference, and the row sums add the fp32 P (the sums of the
// bf16-rounded P, with the row's largest P rounded too, failed LSE checks).
constexpr float kPortableLazyMax = 8.f;

// The softmax's threads: kSmLanes adjacent lanes per row, kSmCols keys each. With AttnTile::kSmSplit the
// keys of part p are 4p..4p+3 and 16+4p..16+4p+3, and the two rows of a quarter-warp lie 2 apart, so that
// its 16-byte reads of a partial-score row (64 bytes of each of two rows 80 floats apart) hit distinct
// banks; else kSmCols adjacent keys and rows in lane order.
template <typename T>
MLA_DEVICE int sm_row(int tid) {
  const int g = tid / T::kSmLanes;
  if constexpr (T::kSmSplit)
    return (g & ~3) | ((g & 1) << 1) | ((g >> 1) & 1);
  else
    return g;
}
template <typename T>
MLA_DEVICE constexpr int sm_key(int part, int c) {
  if constexpr (T::kSmSplit)
    return (c < 4 ? 0 : 16) + 4 * part + (c & 3);
  else
    return part * T::kSmCols + c;
}

// Stage 2: online softmax of this thread's kSmCols keys of row r: the scores
// (partials summed, plus the per-head rope scores), P into p_s, the row's
// rescale factor into row_s. Keys at or past `limit` are masked.
template <typename T, bool kF16>
MLA_DEVICE void softmax(const float* s_s, const float* rs_tile, float scale_log2, int key0, int limit, RowState& st,
                        bf16_t* p_s, float* row_s, int tid) {
  using E = Half16<kF16>;
  const int r = sm_row<T>(tid), part = tid % T::kSmLanes;
  float v[T::kSmCols];
#pragma unroll
  for (int c = 0; c < T::kSmCols; ++c) v[c] = T::kHeadRope ? rs_tile[r * T::kRsLd + sm_key<T>(part, c)] : 0.f;
#pragma unroll
  for (int sd = 0; sd < T::kSDW; ++sd) {
    const float* src = s_s + (sd * T::kM + r) * T::kSLd;
    if constexpr (T::kSmCols % 4 == 0) {
#pragma unroll
      for (int c = 0; c < T::kSmCols; c += 4) {  // (4 adjacent keys)
        const float4 x = *reinterpret_cast<const float4*>(src + sm_key<T>(part, c));
        v[c] += x.x;
        v[c + 1] += x.y;
        v[c + 2] += x.z;
        v[c + 3] += x.w;
      }
    } else {
#pragma unroll
      for (int c = 0; c < T::kSmCols; ++c) v[c] += src[sm_key<T>(part, c)];
    }
  }
  float mx = neg_inf();
#pragma unroll
  for (int c = 0; c < T::kSmCols; ++c) {
    v[c] = key0 + sm_key<T>(part, c) < limit ? v[c] * scale_log2 : neg_inf();
    mx = fmaxf(mx, v[c]);
  }
  // Where no lane's keys exceed its row's reference by more than kPortableLazyMax, no row of the warp moves
  // it (alpha 1) and the row maxima are not needed: the usual case after a row's first tile. (-inf - -inf is
  // NaN, which fails the test: a row that has seen only masked keys takes the exchange and keeps -inf.)
  float m_new = st.m, alpha = 1.f;
  if (!warp_all(mx - st.m <= kPortableLazyMax)) {
#pragma unroll
    for (int off = 1; off < T::kSmLanes; off <<= 1) mx = fmaxf(mx, shfl_xor(mx, off));
    m_new = mx - st.m > kPortableLazyMax ? mx : st.m;
    alpha = fast_exp2(st.m - (m_new == neg_inf() ? 0.f : m_new));
  }
  const float m_use = m_new == neg_inf() ? 0.f : m_new;
  uint32_t w[T::kSmCols / 2];
  float sum = 0.f;
#pragma unroll
  for (int c = 0; c < T::kSmCols; c += 2) {
    const float p0 = fast_exp2(v[c] - m_use), p1 = fast_exp2(v[c + 1] - m_use);
    w[c / 2] = E::pack2(p0, p1);
    sum += p0 + p1;  // (the fp32 P: see kPortableLazyMax)
  }
  uint32_t* dst = reinterpret_cast<uint32_t*>(p_s + r * T::kPLd + sm_key<T>(part, 0));
  if constexpr (T::kSmSplit) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
    *reinterpret_cast<uint2*>(dst + 8) = make_uint2(w[2], w[3]);  // (keys 16 on)
  } else if constexpr (T::kSmCols % 8 == 0) {
#pragma unroll
    for (int c = 0; c < T::kSmCols / 2; c += 4)
      *reinterpret_cast<uint4*>(dst + c) = make_uint4(w[c], w[c + 1], w[c + 2], w[c + 3]);
  } else {
#pragma unroll
    for (int c = 0; c < T::kSmCols / 2; ++c) dst[c] = w[c];
  }
  st.l = st.l * alpha + sum;  // (this thread's keys only: the row's lanes add theirs after the last tile)
  st.m = m_new;
  if (part == 0) row_s[r] = alpha;
}

// Stage 3: O = alpha O + P V over this warp's rows and columns.
template <typename T, bool kF16>
MLA_DEVICE void pv(mma::FragC (&o)[T::kPMT][T::kPNT], const bf16_t* p_s, const float* row_s, const bf16_t* kt,
                   int warp, int lane) {
  const int pm_w = warp % T::kPMW, pn_w = warp / T::kPMW;
  float a[T::kPMT][mma::kCElems];
  bool unit = true;
#pragma unroll
  for (int mt = 0; mt < T::kPMT; ++mt)
#pragma unroll
    for (int i = 0; i < mma::kCElems; ++i) {
      a[mt][i] = row_s[pm_w * T::kPM + mt * 16 + mma::c_row(lane, i)];
      unit = unit && a[mt][i] == 1.f;
    }
  if (!warp_all(unit)) {  // (uniform: the whole warp skips or rescales)
#pragma unroll
    for (int mt = 0; mt < T::kPMT; ++mt)
#pragma unroll
      for (int i = 0; i < mma::kCElems; ++i)
#pragma unroll
        for (int n = 0; n < T::kPNT; ++n) o[mt][n].v[i] *= a[mt][i];
  }
  const bf16_t* vb = kt + pn_w * T::kPN;
  const bf16_t* pb = p_s + pm_w * T::kPM * T::kPLd;
#pragma unroll
  for (int kk = 0; kk < T::kBN / 16; ++kk) {
    mma::FragA pa[T::kPMT];
#pragma unroll
    for (int mt = 0; mt < T::kPMT; ++mt) mma::load_a(pa[mt], pb + mt * 16 * T::kPLd + kk * 16, T::kPLd);
#if !MLA_AMD
    if constexpr (T::kSwizK) {
      // this lane's ldmatrix.trans row (lane & 15, as mma::load_b_kn) at its chunk of tile 0 (column 16 pn +
      // 8 (lane >> 4)), swizzled; tile n lies 16 kPNW n columns on (whole 128 bytes)
      const int u = 2 * pn_w + (lane >> 4);
      const bf16_t* vl = kt + (lane & 15) * T::kLd + 8 * ((u & ~7) + ((u & 7) ^ key_xor<T>(lane)));
#pragma unroll
      for (int n = 0; n < T::kPNT; ++n) {
        mma::FragB vf;
        mma::load_b_trans_lane(vf, vl + kk * 16 * T::kLd + 16 * T::kPNW * n);
#pragma unroll
        for (int mt = 0; mt < T::kPMT; ++mt) mma::mma<kF16>(o[mt][n], pa[mt], vf);
      }
    } else
#endif
    {
#if MLA_AMD || defined(MLA_PORTABLE_PREFETCH)
    // (P's fragments first; four 2-byte LDS reads per value fragment on AMD,
    // packed at their use, so that no read is waited for steps early)
    steps_read_ahead<T::kPNT, T::kPMT, 4, T::kPMT, mma::FragBKn>(
        [&](int n, mma::FragBKn& f) { mma::load_b_kn_parts(f, vb + kk * 16 * T::kLd + n * 16, T::kLd); },
        [&](int n, const mma::FragBKn& f) {
          const mma::FragB vf = mma::b_of(f);
#pragma unroll
          for (int mt = 0; mt < T::kPMT; ++mt) mma::mma<kF16>(o[mt][n], pa[mt], vf);
        });
#else
#pragma unroll
    for (int n = 0; n < T::kPNT; ++n) {
      mma::FragB vf;
      mma::load_b_kn(vf, vb + kk * 16 * T::kLd + n * 16, T::kLd);
#pragma unroll
      for (int mt = 0; mt < T::kPMT; ++mt) mma::mma<kF16>(o[mt][n], pa[mt], vf);
    }
#endif
    }
  }
}

// Normalise and write this warp's O: the final output (one part) or the
// fp32 partial of a split sequence. row_s holds 1 / sum per row.
template <typename T, bool kF16>
MLA_DEVICE void write_out(const AttnParams& p, const Part& pt, const mma::FragC (&o)[T::kPMT][T::kPNT],
                          const float* row_s, int warp, int lane) {
  using E = Half16<kF16>;
  const int pm_w = warp % T::kPMW, pn_w = warp / T::kPMW;
  const int col0 = pv_col<T>(pn_w, 0), step = pv_col<T>(0, 1);
  const int64_t prow = static_cast<int64_t>(pt.first_part + pt.split) * p.rows;
#pragma unroll
  for (int mt = 0; mt < T::kPMT; ++mt)
#pragma unroll
    for (int i = 0; i < mma::kCElems; i += (mma::kCPairedCols ? 2 : 1)) {
      const int rl = pm_w * T::kPM + mt * 16 + mma::c_row(lane, i);
      const int r = block_x() * T::kM + rl;
      if (r >= p.rows) continue;
      const float sc = row_s[rl];
      if (pt.nsplit == 1) {
        bf16_t* orow = p.o + (static_cast<int64_t>(pt.b) * p.rows + r) * T::kDv + col0;
#pragma unroll
        for (int n = 0; n < T::kPNT; ++n) {
          const int c = n * step + mma::c_col(lane, i);
          if constexpr (mma::kCPairedCols)
            *reinterpret_cast<uint32_t*>(orow + c) = E::pack2(o[mt][n].v[i] * sc, o[mt][n].v[i + 1] * sc);
          else
            orow[c] = E::from_float(o[mt][n].v[i] * sc);
        }
      } else {
        float* orow = p.o_part + (prow + r) * T::kDv + col0;
#pragma unroll
        for (int n = 0; n < T::kPNT; ++n) {
          const int c = n * step + mma::c_col(lane, i);
          if constexpr (mma::kCPairedCols)
            *reinterpret_cast<float2*>(orow + c) = make_float2(o[mt][n].v[i] * sc, o[mt][n].v[i + 1] * sc);
          else
            orow[c] = o[mt][n].v[i] * sc;
        }
      }
    }
}

// kF16: q, kv and o hold fp16 (else bf16).
// kFp8: kv holds e4m3 (copy.h's format), q bf16; its per-tensor scale is
// in p.scale_log2 (scores) and p.o_scale (the output).
template <typename T, bool kF16, bool kFp8>
__global__ void __launch_bounds__(T::kThreads, T::kMinBlocks) attention_kernel(const AttnParams p) {
  static_assert(!kFp8 || (!kF16 && !T::kHeadRope), "fp8 caches: bf16 q and the rope keys in the latent row");
  extern __shared__ __attribute__((aligned(128))) unsigned char smem[];  // (kSwizK: 128-byte rows)
  const Smem<T> sm(smem);

  Part pt;
  if (!read_part(p, block_y(), pt, T::kBN)) return;
  const int tid = thread_x();
  const int warp = tid / kWarpSize, lane = tid % kWarpSize;
  const int ntiles = pt.tile_end - pt.tile_begin;

  // keys first: the first tiles are in flight while Q is read
  constexpr bool kRegs = kFp8 || kRegLoads;  // register-staged key loads (fetch_keys / store_keys)
  // Two block barriers per tile (kTwo), or three. Per tile j, with two: scores(j) | A | softmax(j) | B | P V(j),
  // then straight on to scores(j + 1). A certifies the partial scores, and that every warp left P V(j - 1): P
  // and the rescale factors are free for the softmax, and the slot of tile j - 1 for a refill. B certifies P,
  // and that tile j + 1 is in its slot. Register path: tile j + kStages - 1 stored after A (into the slot of
  // tile j - 1), fetched into registers after B of the tile before. cp.async path (a ring of 3 or more): tile
  // j + 1's copies issued at the top of tile j, into the slot of tile j - 2 (free since A of tile j - 1), and
  // waited for before B: the copies' issue lies in front of the scores, off the softmax's path between A and B
  // (with 2 tiles, the slot is not free until A(j), and the memory's latency would lie exposed before B(j)).
  // With three (NVIDIA's 2-tile rings: 16 and 32 rows), a barrier at the top of the tile (tile j landed, the
  // slot of tile j - 1 free), A and B; the refill (tile j + 1) is copied at the top, or (register path) loaded
  // into registers at the top and stored after P V. AMD's register path takes two at every ring; on NVIDIA the
  // fp8 register path keeps three at 2-tile rings, where two measured slower (docs/portable.md).
  constexpr bool kTwo = kRegLoads || T::kStages >= 3;
  constexpr bool kCopyNext = kTwo && !kRegs;  // (cp.async, two barriers: tile j + 1 copied at the top of tile j)
  KeyChunks<T, kFp8> kc_next;  // register path, two barriers: a refill's chunks from one tile to the next
#pragma unroll
  for (int j = 0; j < (kCopyNext ? 1 : T::kStages - 1); ++j) {
    if constexpr (kRegs) {
      KeyChunks<T, kFp8> kc;
      if (j < ntiles) {
        fetch_keys<T, kFp8>(p, pt, j, key_page_entry<T>(p, pt, j, tid), kc, tid);
        load_rope_scores<T>(p, pt, j, sm, tid);
        store_keys<T, kFp8>(p, sm, j, kc, tid);
      }
    } else {
      if (j < ntiles) load_tile<T>(p, pt, j, sm, tid);
    }
    copy_commit();
  }
  int32_t next_entry = kRegs ? key_page_entry<T>(p, pt, T::kStages - 1, tid) : 0;  // (the first refill's)
  if constexpr (kRegs && kTwo) {  // (the first refill's loads, stored at the first tile's A)
    if (T::kStages - 1 < ntiles) fetch_refill<T, kFp8>(p, pt, T::kStages - 1, next_entry, kc_next, sm, tid);
    copy_commit();
  }
  mma::FragA qf[T::kSMT][T::kSKS];
  load_q<T>(p, pt.b, warp, qf);
  if constexpr (kRegs) wait_global_loads();  // (Q here, not at its first use in the loop: see copy.h)
  mma::FragC o[T::kPMT][T::kPNT];
#pragma unroll
  for (int mt = 0; mt < T::kPMT; ++mt)
#pragma unroll
    for (int n = 0; n < T::kPNT; ++n) mma::zero(o[mt][n]);

  // the softmax row of this thread; causal: query i of s_q sees positions < L - (s_q - 1 - i)
  const int srow = sm_row<T>(tid);
  const int limit = p.causal ? pt.L - (p.s_q - 1 - (block_x() * T::kM + srow) / p.h_q) : pt.L;
  RowState st{neg_inf(), 0.f};

  if constexpr (kTwo) {
    copy_wait<kRegs ? T::kStages - 1 : 0>();
    sync_threads_lds();  // tile 0 in its slot
  }
  for (int j = 0; j < ntiles; ++j) {
    const bool refill = j + T::kStages - 1 < ntiles;
    const int slot = j % T::kStages, key0 = (pt.tile_begin + j) * T::kBN;
    bf16_t* kt = sm.kv + slot * T::kBN * T::kLd;
    KeyChunks<T, kFp8> kc_tile;  // (register path, three barriers: the refill's chunks, within the tile)
    KeyChunks<T, kFp8>& kc = kTwo ? kc_next : kc_tile;
    if constexpr (!kTwo) {
      copy_wait<T::kStages - 2>();
      sync_threads_lds();  // tile j landed for everyone; the slot of tile j - 1 is free
      if (refill) {
        if constexpr (kRegs) {
          fetch_refill<T, kFp8>(p, pt, j + T::kStages - 1, next_entry, kc, sm, tid);
        } else {
          load_tile<T>(p, pt, j + T::kStages - 1, sm, tid);
        }
      }
      copy_commit();
    } else if constexpr (kCopyNext) {
      if (j + 1 < ntiles) load_tile<T>(p, pt, j + 1, sm, tid);
      copy_commit();
    }

    if constexpr (!T::kHeadRope && !kF16) {  // (bf16 only; the host refuses it with fp16)
      if (p.rope_cs != nullptr) {
        rope_tile<T>(kt, sm.cs + slot * T::kBN * T::kRope, key0, pt.L, tid);
        sync_threads_lds();
      }
    }
    scores<T, kF16>(qf, kt, sm.s, warp, lane);
    // (register path: tile j's per-head rope scores, copied at B of tile j - kStages or before the loop, landed)
    if constexpr (kRegs && kTwo) copy_wait<T::kStages - 1>();
    sync_threads_lds();  // A
    if constexpr (kTwo && kRegs) {
      if (refill) store_keys<T, kFp8>(p, sm, j + T::kStages - 1, kc, tid);
    }
    softmax<T, kF16>(sm.s, sm.rs + slot * T::kM * T::kRsLd, p.scale_log2, key0, limit, st, sm.p, sm.row, tid);
    if constexpr (kCopyNext) copy_wait<0>();  // (tile j + 1 landed: the last group committed)
    sync_threads_lds();  // B
    if constexpr (kTwo && kRegs) {
      if (j + T::kStages < ntiles) fetch_refill<T, kFp8>(p, pt, j + T::kStages, next_entry, kc, sm, tid);
      copy_commit();
    }
    pv<T, kF16>(o, sm.p, sm.row, kt, warp, lane);
    // three barriers, register path: the refill's stores after P V, the most work between its loads and their
    // use (the slot of tile j - 1: free since this tile's first barrier)
    if constexpr (!kTwo && kRegs) {
      if (refill) store_keys<T, kFp8>(p, sm, j + T::kStages - 1, kc, tid);
    }
  }
  copy_wait<0>();
  sync_threads_lds();  // (the last P V read the rescale factors)

  // per row: the sum over the row's lanes, 1 / sum for the writers, the LSE to memory
#pragma unroll
  for (int off = 1; off < T::kSmLanes; off <<= 1) st.l += shfl_xor(st.l, off);
  if (tid % T::kSmLanes == 0) {
    constexpr float kLn2 = 0.69314718055994531f;
    const float lse = st.l > 0.f ? (st.m + fast_log2(st.l)) * kLn2 : neg_inf();
    sm.row[srow] = st.l > 0.f ? (kFp8 ? p.o_scale : 1.f) / st.l : 0.f;  // (fp8: the output's share of the scale)
    const int r = block_x() * T::kM + srow;
    if (r < p.rows) {
      if (pt.nsplit == 1)
        p.lse[(static_cast<int64_t>(pt.b) * p.h_q + r % p.h_q) * p.s_q + r / p.h_q] = lse;
      else
        p.lse_part[static_cast<int64_t>(pt.first_part + pt.split) * p.rows + r] = lse;
    }
  }
  sync_threads_lds();
  write_out<T, kF16>(p, pt, o, sm.row, warp, lane);
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

const char* const kAttnFp8Supported =
    "fp8 caches: dv 512 with the 64 rope columns in the latent row (d 576), bf16 q";

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

namespace {

// The fp8 instances: bf16 q, the 576-wide key of dv 512 with its rope.
template <typename T>
constexpr bool kFp8Instance = T::kD == 576 && T::kDv == 512;

template <typename T>
const char* kernel_info(AttnKernelInfo* info, bool fp8) {
  info->rows_per_block = T::kM;
  info->tile = T::kBN;
  info->threads = T::kThreads;
  info->smem_bytes = T::kSmem;
  info->warp_size = kWarpSize;
  info->one_key_tail = false;  // (a last tile of one key runs as a tile)
  if (fp8) {
    if constexpr (kFp8Instance<T>) {
      if (const char* e = set_max_dynamic_smem(attention_kernel<T, false, true>, T::kSmem)) return e;
      info->blocks_per_sm = max_active_blocks(attention_kernel<T, false, true>, T::kThreads, T::kSmem);
    } else {
      return kAttnFp8Supported;
    }
  } else {
    if (const char* e = set_max_dynamic_smem(attention_kernel<T, false, false>, T::kSmem)) return e;
    if (const char* e = set_max_dynamic_smem(attention_kernel<T, true, false>, T::kSmem)) return e;
    info->blocks_per_sm = std::min(max_active_blocks(attention_kernel<T, false, false>, T::kThreads, T::kSmem),
                                   max_active_blocks(attention_kernel<T, true, false>, T::kThreads, T::kSmem));
  }
  if (info->blocks_per_sm <= 0) return "attention kernel cannot be resident on this device (occupancy 0)";
  return nullptr;
}

template <typename T>
const char* launch_tile(const AttnParams& p, stream_t stream) {
  if (p.rope != T::kRope || p.dv != T::kDv || (T::kHeadRope != (p.rope_scores != nullptr)))
    return "launch_attention: parameters do not match the kernel instance (dv, rope, rope scores)";
  if (p.f16 && p.rope_cs != nullptr) return "launch_attention: on-the-fly key RoPE is bf16 only";
  const int head_blocks = (p.rows + T::kM - 1) / T::kM;
  dim3 grid(head_blocks, p.max_parts);
  if (p.kv_fp8) {
    if constexpr (kFp8Instance<T>) {
      if (p.f16 || p.rope_cs != nullptr || p.kpe != nullptr)
        return "launch_attention: fp8 caches take bf16 q, without on-the-fly RoPE or separate rope keys";
      attention_kernel<T, false, true><<<grid, T::kThreads, T::kSmem, stream>>>(p);
      return last_launch_error();
    }
    return kAttnFp8Supported;
  }
  if (p.f16)
    attention_kernel<T, true, false><<<grid, T::kThreads, T::kSmem, stream>>>(p);
  else
    attention_kernel<T, false, false><<<grid, T::kThreads, T::kSmem, stream>>>(p);
  return last_launch_error();
}

template <int kD, int kDv>
const char* info_rows(int rows_per_block, bool fp8, AttnKernelInfo* info) {
  switch (rows_per_block) {
    case 16: return kernel_info<TileFor<kD, kDv, 16>>(info, fp8);
    case 32: return kernel_info<TileFor<kD, kDv, 32>>(info, fp8);
    case 64: return kernel_info<TileFor<kD, kDv, 64>>(info, fp8);
    default: return "attention: the portable kernel's head block is 16, 32 or 64 rows";
  }
}

template <int kD, int kDv>
const char* launch_rows(const AttnParams& p, int rows_per_block, stream_t stream) {
  switch (rows_per_block) {
    case 16: return launch_tile<TileFor<kD, kDv, 16>>(p, stream);
    case 32: return launch_tile<TileFor<kD, kDv, 32>>(p, stream);
    case 64: return launch_tile<TileFor<kD, kDv, 64>>(p, stream);
    default: return "launch_attention: the portable kernel's head block is 16, 32 or 64 rows";
  }
}

}  // namespace

const char* attn_kernel_info_portable(int dv, int rope, int rows_per_block, bool fp8, AttnKernelInfo* info) {
  switch (dv * 1000 + rope) {
#define MLA_CASE(DV, R) \
  case DV * 1000 + R:   \
    return info_rows<DV + R, DV>(rows_per_block, fp8, info);
    MLA_ATTN_SHAPES(MLA_CASE)
#undef MLA_CASE
    default:
      return kAttnShapesSupported;
  }
}

const char* launch_attention_portable(const AttnParams& p, int rows_per_block, stream_t stream) {
  switch (p.dv * 1000 + p.rope) {
#define MLA_CASE(DV, R) \
  case DV * 1000 + R:   \
    return launch_rows<DV + R, DV>(p, rows_per_block, stream);
    MLA_ATTN_SHAPES(MLA_CASE)
#undef MLA_CASE
    default:
      return kAttnShapesSupported;
  }
}

}  // namespace mla
