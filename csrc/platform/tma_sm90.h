// Host side of Hopper TMA: the driver's tensor-map encoder (through the
// runtime, so nothing links -lcuda) and the one map shape the kernels use, a
// 3-D tensor of 16-bit elements read in 128-byte-swizzled boxes 64 elements
// wide. Shared by the attention and the projection kernels.
#pragma once

#include "vendor.h"

#if MLA_NVIDIA
#include <cuda.h>
#include <cudaTypedefs.h>

namespace mla {

// cuTensorMapEncodeTiled, looked up once; nullptr if the driver lacks it.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      f = nullptr;
    (void)cudaGetLastError();
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// A [d2][d1][d0] tensor of 16-bit elements (strides s1, s2 in elements) as
// boxes of 64 x box_rows x 1, 128-byte swizzle; box elements past d0 (or d1)
// read as zeros. False if TMA cannot describe it (base or a stride not
// 16-byte aligned, box_rows outside [1, 256], no encoder) or, unless
// box_past_end, box_rows > d1.
// The maps a thread encoded last are kept (a map is plain data describing
// addresses and sizes, the same on every device), so repeated calls on the
// same tensors skip the driver's encoder.
// elem_bytes 1: a tensor of bytes (e4m3 caches) read in unswizzled boxes of
// 64 bytes x box_rows (each box lands row-major, 64 bytes a row).
inline bool encode_rows(CUtensorMap* map, const void* base, int64_t d0, int64_t d1, int64_t d2, int64_t s1,
                        int64_t s2, int box_rows, bool box_past_end = false, int elem_bytes = 2) {
  const PFN_cuTensorMapEncodeTiled_v12000 enc = tensor_map_encoder();
  if (enc == nullptr || reinterpret_cast<uintptr_t>(base) % 16 != 0 || (s1 * elem_bytes) % 16 != 0 ||
      (s2 * elem_bytes) % 16 != 0 || (elem_bytes != 1 && elem_bytes != 2) ||
      d0 < 1 || d1 < 1 || box_rows < 1 || box_rows > 256 || (d1 < box_rows && !box_past_end) || d2 < 1)
    return false;
  struct Key {
    const void* base;
    int64_t d0, d1, d2, s1, s2;
    int box_rows, elem_bytes;
    bool operator==(const Key& o) const {
      return base == o.base && d0 == o.d0 && d1 == o.d1 && d2 == o.d2 && s1 == o.s1 && s2 == o.s2 &&
             box_rows == o.box_rows && elem_bytes == o.elem_bytes;
    }
  };
  constexpr int kKept = 16;
  thread_local Key keys[kKept];
  thread_local CUtensorMap maps[kKept];
  thread_local int kept = 0, next = 0;
  const Key key{base, d0, d1, d2, s1, s2, box_rows, elem_bytes};
  for (int i = 0; i < kept; ++i)
    if (keys[i] == key) {
      *map = maps[i];
      return true;
    }
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(d0), static_cast<cuuint64_t>(d1), static_cast<cuuint64_t>(d2)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(s1 * elem_bytes), static_cast<cuuint64_t>(s2 * elem_bytes)};
  const cuuint32_t box[3] = {64, static_cast<cuuint32_t>(box_rows), 1}, elem[3] = {1, 1, 1};
  if (enc(map, elem_bytes == 1 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_UINT16, 3,
          const_cast<void*>(base), dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
          elem_bytes == 1 ? CU_TENSOR_MAP_SWIZZLE_NONE : CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
    return false;
  keys[next] = key;
  maps[next] = *map;
  next = (next + 1) % kKept;
  kept = kept < kKept ? kept + 1 : kKept;
  return true;
}

}  // namespace mla
#endif  // MLA_NVIDIA
