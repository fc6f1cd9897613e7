// The vendor layer: the only header in the tree that knows whether it is
// compiled by nvcc (NVIDIA, sm_90) or by hipcc/clang (AMD, gfx942).
// Everything else includes this and uses the names below.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <utility>

#if defined(__HIP__) || defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__)
#define MLA_AMD 1
#define MLA_NVIDIA 0
#include <hip/hip_runtime.h>
#else
#define MLA_AMD 0
#define MLA_NVIDIA 1
#include <cuda_runtime.h>
#endif

#define MLA_DEVICE __device__ __forceinline__
#define MLA_HOST_DEVICE __host__ __device__ __forceinline__
#define MLA_GLOBAL __global__

namespace mla {

#if MLA_AMD
using stream_t = hipStream_t;
using error_t = hipError_t;
#else
using stream_t = cudaStream_t;
using error_t = cudaError_t;
#endif

// ---------------------------------------------------------------- host side
// A runtime call's result as these helpers return it: nullptr on success,
// else the runtime's message. Callers (csrc/api) turn a message into a
// Python exception.
inline const char* error_or_null(error_t e) {
#if MLA_AMD
  return e == hipSuccess ? nullptr : hipGetErrorString(e);
#else
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
#endif
}

// MLA_RT(Name): the runtime's hipName on AMD, cudaName on NVIDIA (functions,
// types and enumerators alike), for the wrappers below that differ only in it.
#if MLA_AMD
#define MLA_RT(name) hip##name
#else
#define MLA_RT(name) cuda##name
#endif

// Last launch error as a string, or nullptr when the launch succeeded.
inline const char* last_launch_error() { return error_or_null(MLA_RT(GetLastError)()); }

// Device-to-device copy of n bytes, ordered on `stream`. Error string or nullptr.
inline const char* memcpy_d2d_async(void* dst, const void* src, size_t n, stream_t stream) {
  return error_or_null(MLA_RT(MemcpyAsync)(dst, src, n, MLA_RT(MemcpyDeviceToDevice), stream));
}

// An event ordering work across streams (no timing). Error string or nullptr.
using event_t = MLA_RT(Event_t);
inline const char* event_create(event_t* e) {
  return error_or_null(MLA_RT(EventCreateWithFlags)(e, MLA_RT(EventDisableTiming)));
}
inline const char* event_record(event_t e, stream_t stream) { return error_or_null(MLA_RT(EventRecord)(e, stream)); }
inline const char* stream_wait_event(stream_t stream, event_t e) {
  return error_or_null(MLA_RT(StreamWaitEvent)(stream, e, 0));
}
inline void event_destroy(event_t e) { (void)MLA_RT(EventDestroy)(e); }

// ---- graphs (the decode step's replay cache, csrc/api/step_graph.cpp)
using graph_exec_t = MLA_RT(GraphExec_t);
inline const char* graph_launch(graph_exec_t exec, stream_t stream) {
  return error_or_null(MLA_RT(GraphLaunch)(exec, stream));
}
// Moves a new graph's launch resources to the device ahead of its first
// launch, ordered on `stream`. HIP headers without hipGraphUpload (before
// HIP 5.3): nothing here, the first launch uploads.
inline const char* graph_upload(graph_exec_t exec, stream_t stream) {
#if MLA_AMD && (!defined(HIP_VERSION) || HIP_VERSION < 50300000)
  (void)exec;
  (void)stream;
  return nullptr;
#else
  return error_or_null(MLA_RT(GraphUpload)(exec, stream));
#endif
}

// Wait for everything enqueued on the current device. Error string or nullptr.
inline const char* device_synchronize() { return error_or_null(MLA_RT(DeviceSynchronize)()); }

// Wait for everything enqueued on `stream`. Error string or nullptr.
inline const char* stream_synchronize(stream_t stream) { return error_or_null(MLA_RT(StreamSynchronize)(stream)); }

// Whether `stream` is capturing a graph (*capturing). Error string or nullptr.
inline const char* stream_capturing(stream_t stream, bool* capturing) {
  MLA_RT(StreamCaptureStatus) st = MLA_RT(StreamCaptureStatusNone);
  const error_t e = MLA_RT(StreamIsCapturing)(stream, &st);
  *capturing = st != MLA_RT(StreamCaptureStatusNone);
  return error_or_null(e);
}

// Raise a kernel's dynamic shared-memory limit (needed above 48 KB on NVIDIA).
// Returns an error string or nullptr.
template <typename Kernel>
inline const char* set_max_dynamic_smem(Kernel kernel, int bytes) {
#if MLA_AMD
  return error_or_null(
      hipFuncSetAttribute(reinterpret_cast<const void*>(kernel), hipFuncAttributeMaxDynamicSharedMemorySize, bytes));
#else
  return error_or_null(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
#endif
}

#if MLA_NVIDIA
// Launch `kernel` (NVIDIA) with cudaLaunchKernelEx: as a programmatic
// dependent of the previous kernel in the stream when `pdl` (the kernel
// then calls pdl_wait before reading what that kernel wrote), in clusters
// of cluster.x * cluster.y * cluster.z blocks when more than one (the grid a
// multiple of it). Error string or nullptr; a failed launch leaves no sticky
// error behind.
template <typename... KArgs, typename... Args>
inline const char* launch_ex(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, stream_t stream, bool pdl,
                             dim3 cluster, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  int n = 0;
  if (pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  if (cluster.x * cluster.y * cluster.z > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster.x;
    attr[n].val.clusterDim.y = cluster.y;
    attr[n].val.clusterDim.z = cluster.z;
    ++n;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return cudaGetErrorString(e);
  }
  return last_launch_error();
}
#endif

#if defined(__CUDACC__) || defined(__HIP__)  // device code: kernel sources only
// -------------------------------------------------------------- device side
#if MLA_AMD
constexpr int kWarpSize = 64;  // gfx942 (CDNA3) runs wave64
#else
constexpr int kWarpSize = 32;
#endif

// Thread and block indices through builtins: on AMD this keeps the device-only
// compile free of device-library calls (CI's gfx942 compile links none), on
// NVIDIA it is the usual.
MLA_DEVICE int thread_x() {
#if MLA_AMD
  return __builtin_amdgcn_workitem_id_x();
#else
  return threadIdx.x;
#endif
}
MLA_DEVICE int block_x() {
#if MLA_AMD
  return __builtin_amdgcn_workgroup_id_x();
#else
  return blockIdx.x;
#endif
}
MLA_DEVICE int block_y() {
#if MLA_AMD
  return __builtin_amdgcn_workgroup_id_y();
#else
  return blockIdx.y;
#endif
}
MLA_DEVICE int block_z() {
#if MLA_AMD
  return __builtin_amdgcn_workgroup_id_z();
#else
  return blockIdx.z;
#endif
}

MLA_DEVICE void sync_threads() {
#if MLA_AMD
  // the HIP headers' __syncthreads calls a device-library fence; builtins need none
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
  __builtin_amdgcn_s_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
#else
  __syncthreads();
#endif
}

// A block barrier that orders shared memory (LDS) only: global loads still
// in flight stay in flight across it (on gfx942 a workgroup fence also waits
// for every outstanding global load, which would expose a prefetch's
// latency at the next barrier). For kernels whose threads share data only
// through shared memory between barriers. NVIDIA: __syncthreads.
MLA_DEVICE void sync_threads_lds() {
#if MLA_AMD
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup", "local");
  __builtin_amdgcn_s_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup", "local");
#else
  __syncthreads();
#endif
}

MLA_DEVICE void atomic_add_relaxed(int* p, int v) {
#if MLA_AMD
  __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
#else
  atomicAdd(p, v);
#endif
}

MLA_DEVICE void atomic_min_relaxed(int* p, int v) {
#if MLA_AMD
  __atomic_fetch_min(p, v, __ATOMIC_RELAXED);
#else
  atomicMin(p, v);
#endif
}

MLA_DEVICE void atomic_max_relaxed(int* p, int v) {
#if MLA_AMD
  __atomic_fetch_max(p, v, __ATOMIC_RELAXED);
#else
  atomicMax(p, v);
#endif
}

MLA_DEVICE void sync_warp() {
#if MLA_AMD
  // a wave executes in lock step; only the compiler must not reorder LDS ops
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
  __builtin_amdgcn_wave_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");
#else
  __syncwarp();
#endif
}

MLA_DEVICE float shfl_xor(float v, int mask) {
#if MLA_AMD
  // ds_bpermute addresses lanes in bytes
  int lane = __builtin_amdgcn_mbcnt_hi(~0u, __builtin_amdgcn_mbcnt_lo(~0u, 0u));
  int src = (lane ^ mask) << 2;
  return __builtin_bit_cast(float, __builtin_amdgcn_ds_bpermute(src, __builtin_bit_cast(int, v)));
#else
  return __shfl_xor_sync(0xffffffffu, v, mask);
#endif
}

// Whether `pred` holds in every lane of the warp / wave (the same answer in
// every lane: a uniform branch). All lanes must be active.
MLA_DEVICE bool warp_all(bool pred) {
#if MLA_AMD
  return __builtin_amdgcn_ballot_w64(!pred) == 0;
#else
  return __all_sync(0xffffffffu, pred);
#endif
}

// 2^x, the hardware approximation on both vendors (softmax only).
MLA_DEVICE float fast_exp2(float x) {
#if MLA_AMD
  return __builtin_amdgcn_exp2f(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

// log2(x), hardware approximation (used once per row for the LSE).
MLA_DEVICE float fast_log2(float x) {
#if MLA_AMD
  return __builtin_amdgcn_logf(x);
#else
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

MLA_DEVICE float neg_inf() { return -__builtin_inff(); }
// The maximum an online softmax subtracts before exp2: m, or 0 for a row that
// has seen no key yet (m = -inf), whose exponentials are 0 either way (-inf - -inf
// would be NaN).
MLA_DEVICE float exp2_base(float m) { return m == neg_inf() ? 0.f : m; }

// Programmatic dependent launch (NVIDIA sm_90+; no-ops elsewhere and when
// the kernel was not launched as a dependent). pdl_wait: everything the
// previous kernel in the stream wrote is visible after it (it waits for that
// grid's completion); pdl_trigger: this block no longer holds back the launch
// of the next (dependent) kernel, which still waits in its own pdl_wait.
MLA_DEVICE void pdl_wait() {
#if MLA_NVIDIA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
MLA_DEVICE void pdl_trigger() {
#if MLA_NVIDIA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

#endif  // device code

}  // namespace mla

namespace mla {
// Resident blocks of `kernel` per SM/CU at this block size and dynamic
// shared memory, from the runtime's occupancy calculator (0 on error).
template <typename Kernel>
inline int max_active_blocks(Kernel kernel, int threads, int smem_bytes) {
  int n = 0;
#if MLA_AMD
  if (hipOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem_bytes) != hipSuccess) return 0;
#else
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem_bytes) != cudaSuccess) return 0;
#endif
  return n;
}
}  // namespace mla
