// The tile-MMA interface: one 16x16x16 bf16 (or fp16) -> fp32 warp tile.
// Kernel bodies use only what is declared here:
//
//   FragA, FragB, FragC          register fragments of A[16][16], B[16][16], C[16][16]
//   load_a(FragA&, p, ld)        A row-major in shared memory (rows m, cols k)
//   load_a_global(FragA&, p, ld, rows_valid[, cols_valid])  same from global memory, rows >= rows_valid
//                                and columns >= cols_valid (a multiple of 8) read as 0
//   load_b_nk(FragB&, p, ld)     B given as [n][k] in shared memory (a K tile: keys are rows)
//   load_b_kn(FragB&, p, ld)     B given as [k][n] in shared memory (a V tile)
//   FragBKn, load_b_kn_parts(FragBKn&, p, ld), b_of(FragBKn)  the same in two steps: the reads, then
//                                the fragment made of them (AMD: four 2-byte reads, packed at b_of;
//                                NVIDIA: one ldmatrix, b_of is the identity), so that a read issued
//                                steps ahead is not packed (and waited for) until its use
//   mma<kF16>(FragC&, FragA, FragB)  C += A * B (bf16, or fp16 with kF16)
//   kCElems, c_row(lane, i), c_col(lane, i)   which C element lane holds in slot i
//
// `ld` is the row stride in elements. Two implementations live beside this
// header: mma.sync (NVIDIA sm_80+, used on sm_90) and MFMA (AMD gfx942).
#pragma once

#include "bf16.h"
#include "vendor.h"

#if MLA_AMD
#include "mma_mfma.h"
#else
#include "mma_sync.h"
#endif

namespace mla::mma {

MLA_DEVICE void zero(FragC& c) {
#pragma unroll
  for (int i = 0; i < kCElems; ++i) c.v[i] = 0.f;
}

}  // namespace mla::mma
