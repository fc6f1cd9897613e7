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

}  // namespace mla
