// A bf16 storage type of our own, with explicit conversions, so that the same
// kernel source compiles against CUDA 13 and the HIP 5.2 headers (which have
// no hip_bf16.h). Round-to-nearest-even, NaN kept quiet, like PyTorch.
//
// The attention kernels move 16-bit elements as bf16_t storage whatever they
// hold; where they compute on them, Half16<kF16> says how (bf16 or fp16).
#pragma once

#include "vendor.h"

namespace mla {

struct alignas(2) bf16_t {
  uint16_t bits;
};

MLA_HOST_DEVICE float bf16_to_float(bf16_t v) {
  uint32_t u = static_cast<uint32_t>(v.bits) << 16;
  return __builtin_bit_cast(float, u);
}

MLA_HOST_DEVICE bf16_t float_to_bf16(float f) {
  uint32_t u = __builtin_bit_cast(uint32_t, f);
  bf16_t r;
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep it a quiet NaN
    r.bits = static_cast<uint16_t>((u >> 16) | 0x0040u);
    return r;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  r.bits = static_cast<uint16_t>(u >> 16);
  return r;
}

// Round a float to the nearest bf16 value and back (the semantics of one
// bf16 operation in PyTorch: compute in fp32, round the result). One
// instruction on NVIDIA devices; the bit-exact software rounding elsewhere.
MLA_HOST_DEVICE float round_bf16(float f) {
#if MLA_NVIDIA && defined(__CUDA_ARCH__)
  unsigned short h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return __builtin_bit_cast(float, static_cast<uint32_t>(h) << 16);
#else
  return bf16_to_float(float_to_bf16(f));
#endif
}

// Two floats into one 32-bit word of two bf16 (lo in the low half).
MLA_DEVICE uint32_t pack_bf16x2(float lo, float hi) {
#if MLA_NVIDIA
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return static_cast<uint32_t>(float_to_bf16(lo).bits) |
         (static_cast<uint32_t>(float_to_bf16(hi).bits) << 16);
#endif
}

MLA_DEVICE float bf16_lo(uint32_t w) { return __builtin_bit_cast(float, w << 16); }
MLA_DEVICE float bf16_hi(uint32_t w) { return __builtin_bit_cast(float, w & 0xffff0000u); }

// ---- fp16 (IEEE binary16), round-to-nearest-even (device only)
MLA_DEVICE uint32_t pack_f16x2(float lo, float hi) {
#if MLA_NVIDIA
  uint32_t r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#else
  using h2 = __attribute__((ext_vector_type(2))) _Float16;
  const h2 v = {static_cast<_Float16>(lo), static_cast<_Float16>(hi)};
  return __builtin_bit_cast(uint32_t, v);
#endif
}

MLA_DEVICE float f16_bits_to_float(uint16_t h) {
#if MLA_NVIDIA
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#else
  return static_cast<float>(__builtin_bit_cast(_Float16, h));
#endif
}

MLA_DEVICE float f16_lo(uint32_t w) { return f16_bits_to_float(static_cast<uint16_t>(w & 0xffffu)); }
MLA_DEVICE float f16_hi(uint32_t w) { return f16_bits_to_float(static_cast<uint16_t>(w >> 16)); }

// Element arithmetic of the 16-bit type a kernel instance holds.
template <bool kF16>
struct Half16;

template <>
struct Half16<false> {  // bf16
  static MLA_DEVICE uint32_t pack2(float lo, float hi) { return pack_bf16x2(lo, hi); }
  static MLA_DEVICE float lo(uint32_t w) { return bf16_lo(w); }
  static MLA_DEVICE float hi(uint32_t w) { return bf16_hi(w); }
  static MLA_DEVICE bf16_t from_float(float f) { return float_to_bf16(f); }
};

template <>
struct Half16<true> {  // fp16, stored in bf16_t
  static MLA_DEVICE uint32_t pack2(float lo, float hi) { return pack_f16x2(lo, hi); }
  static MLA_DEVICE float lo(uint32_t w) { return f16_lo(w); }
  static MLA_DEVICE float hi(uint32_t w) { return f16_hi(w); }
  static MLA_DEVICE bf16_t from_float(float f) {
    bf16_t r;
    r.bits = static_cast<uint16_t>(pack_f16x2(f, 0.f) & 0xffffu);
    return r;
  }
};

}  // namespace mla
