// Tile-MMA implementation for NVIDIA: mma.sync.m16n8k16 (two per 16x16 tile),
// fragments loaded with ldmatrix. Layouts are PTX's (ISA "Matrix fragments
// for mma.m16n8k16"): lane = 4*g + t holds C rows g and g+8, columns 2t, 2t+1.
#pragma once

#include "bf16.h"
#include "vendor.h"

namespace mla::mma {

constexpr int kCElems = 8;
// slots 2j and 2j+1 hold adjacent columns of one row (paired stores)
constexpr bool kCPairedCols = true;

struct FragA { uint32_t r[4]; };
struct FragB { uint32_t r[4]; };  // r[0..1]: n 0..7, r[2..3]: n 8..15
struct FragC { float v[8]; };      // v[0..3]: n 0..7, v[4..7]: n 8..15

MLA_DEVICE int c_row(int lane, int i) { return (lane >> 2) + 8 * ((i >> 1) & 1); }
MLA_DEVICE int c_col(int lane, int i) { return 2 * (lane & 3) + (i & 1) + 8 * (i >> 2); }

MLA_DEVICE uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

MLA_DEVICE void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
MLA_DEVICE void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

MLA_DEVICE void load_a(FragA& a, const bf16_t* p, int ld) {
  const int lane = thread_x() & 31;
  ldmatrix_x4(a.r, p + (lane & 15) * ld + 8 * (lane >> 4));
}

// A 16x16 tile from global memory: rows >= rows_valid and columns >= cols_valid
// (a multiple of 8) read as zero.
MLA_DEVICE void load_a_global(FragA& a, const bf16_t* p, int64_t ld, int rows_valid, int cols_valid = 16) {
  const int lane = thread_x() & 31;
  const int g = lane >> 2, t = lane & 3;
  const bool c0 = cols_valid > 0, c1 = cols_valid > 8;
  const bool v0 = g < rows_valid, v1 = g + 8 < rows_valid;
  if (!c0) {
    a.r[0] = a.r[1] = a.r[2] = a.r[3] = 0u;
    return;
  }
  const uint32_t* r0 = reinterpret_cast<const uint32_t*>(p + g * ld + 2 * t);
  const uint32_t* r1 = reinterpret_cast<const uint32_t*>(p + (g + 8) * ld + 2 * t);
  a.r[0] = v0 ? r0[0] : 0u;
  a.r[1] = v1 ? r1[0] : 0u;
  a.r[2] = v0 && c1 ? r0[4] : 0u;
  a.r[3] = v1 && c1 ? r1[4] : 0u;
}

MLA_DEVICE void load_b_nk(FragB& b, const bf16_t* p, int ld) {
  const int lane = thread_x() & 31;
  ldmatrix_x4(b.r, p + ((lane & 7) + 8 * (lane >> 4)) * ld + 8 * ((lane >> 3) & 1));
}

MLA_DEVICE void load_b_kn(FragB& b, const bf16_t* p, int ld) {
  const int lane = thread_x() & 31;
  ldmatrix_x4_trans(b.r, p + (lane & 15) * ld + 8 * (lane >> 4));
}

// The same fragments from each lane's own row address, for layouts the caller swizzles: lane l gives the
// row load_b_nk / load_b_kn would (rows (l & 7) + 8 (l >> 4), 8 columns from 8 ((l >> 3) & 1); rows l & 15,
// 8 columns from 8 (l >> 4)).
MLA_DEVICE void load_b_lane(FragB& b, const bf16_t* p) { ldmatrix_x4(b.r, p); }
MLA_DEVICE void load_b_trans_lane(FragB& b, const bf16_t* p) { ldmatrix_x4_trans(b.r, p); }

using FragBKn = FragB;
MLA_DEVICE void load_b_kn_parts(FragBKn& b, const bf16_t* p, int ld) { load_b_kn(b, p, ld); }
MLA_DEVICE const FragB& b_of(const FragBKn& b) { return b; }

#define MLA_MMA_SYNC_M16N8K16(TYPE, c0, c1, c2, c3, b0, b1)                                      \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE ".f32 "                   \
               "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                          \
               : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3)                                         \
               : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b0), "r"(b1))

// C += A * B; kF16: the fragments hold fp16, else bf16.
template <bool kF16 = false>
MLA_DEVICE void mma(FragC& c, const FragA& a, const FragB& b) {
  if constexpr (kF16) {
    MLA_MMA_SYNC_M16N8K16("f16", c.v[0], c.v[1], c.v[2], c.v[3], b.r[0], b.r[1]);
    MLA_MMA_SYNC_M16N8K16("f16", c.v[4], c.v[5], c.v[6], c.v[7], b.r[2], b.r[3]);
  } else {
    MLA_MMA_SYNC_M16N8K16("bf16", c.v[0], c.v[1], c.v[2], c.v[3], b.r[0], b.r[1]);
    MLA_MMA_SYNC_M16N8K16("bf16", c.v[4], c.v[5], c.v[6], c.v[7], b.r[2], b.r[3]);
  }
}
#undef MLA_MMA_SYNC_M16N8K16

}  // namespace mla::mma
