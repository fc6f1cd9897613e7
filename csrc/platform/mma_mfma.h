// Tile-MMA implementation for AMD gfx942: v_mfma_f32_16x16x16bf16_1k (or f16), wave64.
// Layouts (CDNA3 ISA, matrix instruction calculator): lane l holds
//   A[l%16][4*(l/16) + 0..3], B[4*(l/16) + 0..3][l%16], C[4*(l/16) + 0..3][l%16].
#pragma once

#include "bf16.h"
#include "vendor.h"

namespace mla::mma {

constexpr int kCElems = 4;
// slots of one lane are one column, four rows: no paired stores
constexpr bool kCPairedCols = false;

using short4_t = __attribute__((ext_vector_type(4))) short;
using float4_t = __attribute__((ext_vector_type(4))) float;

struct FragA { short4_t r; };
struct FragB { short4_t r; };
struct FragC { float v[4]; };

MLA_DEVICE int c_row(int lane, int i) { return 4 * (lane >> 4) + i; }
MLA_DEVICE int c_col(int lane, int i) { return lane & 15; }

MLA_DEVICE void load_a(FragA& a, const bf16_t* p, int ld) {
  const int lane = thread_x() & 63;
  a.r = *reinterpret_cast<const short4_t*>(p + (lane & 15) * ld + 4 * (lane >> 4));
}

// A 16x16 tile from global memory: rows >= rows_valid and columns >= cols_valid
// (a multiple of 8) read as zero.
MLA_DEVICE void load_a_global(FragA& a, const bf16_t* p, int64_t ld, int rows_valid, int cols_valid = 16) {
  const int lane = thread_x() & 63;
  const int row = lane & 15, col = 4 * (lane >> 4);
  short4_t z = {0, 0, 0, 0};
  a.r = row < rows_valid && col < cols_valid ? *reinterpret_cast<const short4_t*>(p + row * ld + col) : z;
}

MLA_DEVICE void load_b_nk(FragB& b, const bf16_t* p, int ld) {
  const int lane = thread_x() & 63;
  b.r = *reinterpret_cast<const short4_t*>(p + (lane & 15) * ld + 4 * (lane >> 4));
}

MLA_DEVICE void load_b_kn(FragB& b, const bf16_t* p, int ld) {
  const int lane = thread_x() & 63;
  const uint16_t* q = reinterpret_cast<const uint16_t*>(p) + 4 * (lane >> 4) * ld + (lane & 15);
  b.r[0] = static_cast<short>(q[0]);
  b.r[1] = static_cast<short>(q[ld]);
  b.r[2] = static_cast<short>(q[2 * ld]);
  b.r[3] = static_cast<short>(q[3 * ld]);
}

// load_b_kn in two steps: the four 2-byte reads (zero-extended, one VGPR
// each), then the fragment packed from them.
struct FragBKn { uint32_t h[4]; };
MLA_DEVICE void load_b_kn_parts(FragBKn& b, const bf16_t* p, int ld) {
  const int lane = thread_x() & 63;
  const uint16_t* q = reinterpret_cast<const uint16_t*>(p) + 4 * (lane >> 4) * ld + (lane & 15);
  b.h[0] = q[0];
  b.h[1] = q[ld];
  b.h[2] = q[2 * ld];
  b.h[3] = q[3 * ld];
}
MLA_DEVICE FragB b_of(const FragBKn& b) {
  FragB f;
  f.r[0] = static_cast<short>(b.h[0]);
  f.r[1] = static_cast<short>(b.h[1]);
  f.r[2] = static_cast<short>(b.h[2]);
  f.r[3] = static_cast<short>(b.h[3]);
  return f;
}

using half4_t = __attribute__((ext_vector_type(4))) _Float16;

// C += A * B; kF16: the fragments hold fp16 (v_mfma_f32_16x16x16f16), else bf16.
template <bool kF16 = false>
MLA_DEVICE void mma(FragC& c, const FragA& a, const FragB& b) {
  float4_t acc = {c.v[0], c.v[1], c.v[2], c.v[3]};
  if constexpr (kF16)
    acc = __builtin_amdgcn_mfma_f32_16x16x16f16(__builtin_bit_cast(half4_t, a.r), __builtin_bit_cast(half4_t, b.r),
                                                acc, 0, 0, 0);
  else
    acc = __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(a.r, b.r, acc, 0, 0, 0);
  c.v[0] = acc[0];
  c.v[1] = acc[1];
  c.v[2] = acc[2];
  c.v[3] = acc[3];
}

}  // namespace mla::mma
