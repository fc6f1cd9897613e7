// Global -> shared copies of 16 bytes. On NVIDIA these are cp.async (they
// bypass registers and overlap with compute); on AMD gfx942 a plain load and
// LDS store (gfx942 has no 16-byte global->LDS path). Both zero-fill when
// `valid` is false, so masked rows never carry garbage (or NaN) into a
// matrix product.
#pragma once

#include "vendor.h"

namespace mla {

MLA_DEVICE void copy16_async(void* smem_dst, const void* gmem_src, bool valid) {
#if MLA_NVIDIA
  uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src),
               "r"(src_bytes));
#else
  using v4 = __attribute__((ext_vector_type(4))) unsigned int;
  v4 v = {0u, 0u, 0u, 0u};
  if (valid) v = *reinterpret_cast<const v4*>(gmem_src);
  *reinterpret_cast<v4*>(smem_dst) = v;
#endif
}

// A hint: fetch the line holding `p` into L2 (NVIDIA; a no-op elsewhere).
MLA_DEVICE void prefetch_l2(const void* p) {
#if MLA_NVIDIA
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
#else
  (void)p;
#endif
}
// A 16-byte load of read-only data (the non-coherent path on NVIDIA), kept
// where it is written in the instruction stream (volatile), so that its
// latency passes under the work issued after it.
MLA_DEVICE uint4 ld_global_nc(const uint4* p) {
#if MLA_NVIDIA
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
#else
  return *p;
#endif
}
// Wait for this thread's global loads issued so far. AMD: s_waitcnt
// vmcnt(0) (gfx9 encoding; the compiler's wait insertion takes it into
// account), so that loads issued before a loop (a kernel's Q fragments) are
// not waited for inside it, where a conservative vmcnt(0) would also wait
// for the loop's own prefetches. NVIDIA: nothing (a load completes at its use).
MLA_DEVICE void wait_global_loads() {
#if MLA_AMD
  __builtin_amdgcn_s_waitcnt(0x0F70);  // vmcnt 0; expcnt 7 and lgkmcnt 15: not waited for
#endif
}

MLA_DEVICE void copy_commit() {
#if MLA_NVIDIA
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Wait until at most `N` committed groups are still in flight.
template <int N>
MLA_DEVICE void copy_wait() {
#if MLA_NVIDIA
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}


// FP8 latent caches (per-tensor scale): e4m3 values widened to bf16 (exact:
// every e4m3 value is a bf16 value), in the platform's format:
// float8_e4m3fn on NVIDIA, float8_e4m3fnuz on AMD gfx942 (its hardware's
// FP8). The attention loads the bytes into registers first and widens them
// on their way into shared memory (attention.cu, fetch_keys / store_keys).
#if MLA_NVIDIA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
// One e4m3fn byte as bf16 bits, decoded from its fields (GPUs before sm_89
// have no e4m3 conversion instruction): bias 7, no infinities, S.1111.111 NaN.
MLA_DEVICE uint32_t e4m3fn_to_bf16_bits(uint32_t b) {
  const uint32_t sign = (b & 0x80u) << 8, e = (b >> 3) & 15u, m = b & 7u;
  if (e == 15u && m == 7u) return sign | 0x7fc0u;
  if (e == 0u) return sign | (__float_as_uint(static_cast<float>(m) * 0.001953125f) >> 16);  // m * 2^-9, exact
  return sign | ((e + 120u) << 7) | (m << 4);
}
#endif

// Four e4m3 values (a 32-bit word, lowest byte first) -> two bf16 pairs.
MLA_DEVICE void fp8x4_to_bf16x4(uint32_t w, uint32_t& lo, uint32_t& hi) {
#if MLA_NVIDIA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
  lo = e4m3fn_to_bf16_bits(w & 0xffu) | (e4m3fn_to_bf16_bits((w >> 8) & 0xffu) << 16);
  hi = e4m3fn_to_bf16_bits((w >> 16) & 0xffu) | (e4m3fn_to_bf16_bits(w >> 24) << 16);
#elif MLA_NVIDIA
  uint32_t h0, h1;  // f16x2 (every e4m3 value is an f16 normal or zero)
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h0) : "h"(static_cast<unsigned short>(w & 0xffffu)));
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h1) : "h"(static_cast<unsigned short>(w >> 16)));
  float f0, f1, f2, f3;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f0) : "h"(static_cast<unsigned short>(h0 & 0xffffu)));
  asm("cvt.f32.f16 %0, %1;" : "=f"(f1) : "h"(static_cast<unsigned short>(h0 >> 16)));
  asm("cvt.f32.f16 %0, %1;" : "=f"(f2) : "h"(static_cast<unsigned short>(h1 & 0xffffu)));
  asm("cvt.f32.f16 %0, %1;" : "=f"(f3) : "h"(static_cast<unsigned short>(h1 >> 16)));
  // (exact in bf16: the upper halves of the floats)
  lo = __byte_perm(__float_as_uint(f0), __float_as_uint(f1), 0x7632);
  hi = __byte_perm(__float_as_uint(f2), __float_as_uint(f3), 0x7632);
#else
#if defined(__gfx950__) || defined(__gfx12__) || defined(__gfx1200__) || defined(__gfx1201__)
#error "fp8 caches: this target's fp8 conversion decodes e4m3fn, the host takes e4m3fnuz on ROCm (gfx94x only)"
#endif
  using v2f = __attribute__((ext_vector_type(2))) float;
  const v2f a = __builtin_amdgcn_cvt_pk_f32_fp8(static_cast<int>(w), false);
  const v2f b = __builtin_amdgcn_cvt_pk_f32_fp8(static_cast<int>(w), true);
  lo = (__builtin_bit_cast(uint32_t, a.x) >> 16) | (__builtin_bit_cast(uint32_t, a.y) & 0xffff0000u);
  hi = (__builtin_bit_cast(uint32_t, b.x) >> 16) | (__builtin_bit_cast(uint32_t, b.y) & 0xffff0000u);
#endif
}

// 8 e4m3 values (v.x: the first four) as 8 bf16 values at smem_dst (16 bytes, aligned).
MLA_DEVICE void store_fp8x8_as_bf16(void* smem_dst, uint2 v) {
  uint4 o;
  fp8x4_to_bf16x4(v.x, o.x, o.y);
  fp8x4_to_bf16x4(v.y, o.z, o.w);
  *reinterpret_cast<uint4*>(smem_dst) = o;
}

}  // namespace mla
