// y = x w^T on cuBLASLt with our own plan cache (NVIDIA builds): the output
// stage's products (W_UV per head as a strided batch, then wo). PyTorch reaches cuBLASLt only through a process-wide
// preference, which would change every other product of the caller's
// process (and race with its threads); here the choice is local to the call.
#include "blas_lt.h"

#include <ATen/Context.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <climits>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>

#include "checks.h"

#if !defined(USE_ROCM)
#include <cublasLt.h>
#endif

namespace mla::api {

#if defined(USE_ROCM)

bool gemm_nt_lt(const at::Tensor&, const at::Tensor&, at::Tensor&) { return false; }
bool gemm_nt_lt_batched(const void*, int64_t, int64_t, const void*, int64_t, int64_t, void*, int64_t, int64_t, int64_t,
                        int64_t, int64_t, int64_t, const at::Tensor&, void*) {
  return false;
}

#else

namespace {

// Largest power of two (up to 256) dividing the address: cuBLASLt picks
// kernels by the operands' alignment.
int64_t alignment(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  int64_t al = 256;
  while (al > 2 && a % al) al /= 2;
  return al;
}

struct LtPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool ok = false;
};

// (device, m, n, k, ldx, ldw, ldy, batch, batch strides of x, w, y,
// alignment, reduced-precision reductions allowed) -> plan; descriptors are
// made once and only read afterwards (concurrent calls may share them).
using Key = std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                       int64_t, bool>;
std::mutex plans_mu;
std::map<Key, LtPlan>& plans = *new std::map<Key, LtPlan>();  // never destroyed (no CUDA work at exit)

// One batched product y_b [m, n] = x_b [m, k] w_b [n, k]^T, b < batch, bf16
// with unit last strides; ld* are row strides, s* batch strides (elements).
struct LtGemm {
  const void* x;
  int64_t ldx, sx;
  const void* w;
  int64_t ldw, sw;
  void* y;
  int64_t ldy, sy;
  int64_t m, n, k, batch;
};

bool set_batch(cublasLtMatrixLayout_t l, int64_t batch, int64_t stride) {
  if (batch == 1) return true;
  const int32_t count = static_cast<int32_t>(batch);
  return cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)) ==
             CUBLAS_STATUS_SUCCESS &&
         cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)) ==
             CUBLAS_STATUS_SUCCESS;
}

LtPlan make_plan(cublasLtHandle_t handle, const LtGemm& g, int64_t align, bool reduced) {
  // column-major view: Y^T [n, m] = W [k, n]^T . X^T [k, m]
  LtPlan pl;
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  if (cublasLtMatmulDescCreate(&pl.op, CUBLAS_COMPUTE_32F, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS) return pl;
  cublasLtMatmulDescSetAttribute(pl.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta));
  cublasLtMatmulDescSetAttribute(pl.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb));
  if (cublasLtMatrixLayoutCreate(&pl.a, CUDA_R_16BF, g.k, g.n, g.ldw) != CUBLAS_STATUS_SUCCESS ||
      cublasLtMatrixLayoutCreate(&pl.b, CUDA_R_16BF, g.k, g.m, g.ldx) != CUBLAS_STATUS_SUCCESS ||
      cublasLtMatrixLayoutCreate(&pl.c, CUDA_R_16BF, g.n, g.m, g.ldy) != CUBLAS_STATUS_SUCCESS ||
      !set_batch(pl.a, g.batch, g.sw) || !set_batch(pl.b, g.batch, g.sx) || !set_batch(pl.c, g.batch, g.sy))
    return pl;
  cublasLtMatmulPreference_t pref = nullptr;
  if (cublasLtMatmulPreferenceCreate(&pref) != CUBLAS_STATUS_SUCCESS) return pl;
  const size_t ws = kLtScratchBytes;
  const uint32_t al = static_cast<uint32_t>(align);
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al, sizeof(al));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al, sizeof(al));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al, sizeof(al));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al, sizeof(al));
  if (!reduced) {  // split-K partials summed in fp32 (or not split), never in the bf16 output
    const uint32_t mask = CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &mask, sizeof(mask));
  }
  cublasLtMatmulHeuristicResult_t res{};
  int found = 0;
  if (cublasLtMatmulAlgoGetHeuristic(handle, pl.op, pl.a, pl.b, pl.c, pl.c, pref, 1, &res, &found) ==
          CUBLAS_STATUS_SUCCESS &&
      found > 0) {
    pl.algo = res.algo;
    pl.ok = true;
  }
  cublasLtMatmulPreferenceDestroy(pref);
  return pl;
}

// torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction: a bool
// in older PyTorch, an option (0: allowed) in newer.
template <typename Option>
bool bf16_reduced_allowed(Option o) {
  if constexpr (std::is_same_v<Option, bool>)
    return o;
  else
    return static_cast<int>(o) == 0;
}

// g on the current stream of `device` with `scratch` (kLtScratchBytes, 256-byte
// aligned; null: taken from the caching allocator, as `like`'s); false,
// nothing launched, where cuBLASLt offers no kernel or an operand is less
// than 16-byte aligned.
bool run_lt(const LtGemm& g, int device, const at::TensorOptions& like, void* scratch) {
  if (g.m < 1 || g.n < 1 || g.k < 1 || g.batch < 1 || g.batch > INT32_MAX) return false;
  const int64_t align = std::min({alignment(g.x), alignment(g.w), alignment(g.y)});
  // (batch strides keep every batch's operands at that alignment)
  if (align < 16 || (g.batch > 1 && ((g.sx * 2) % align || (g.sw * 2) % align || (g.sy * 2) % align))) return false;
  const bool reduced = bf16_reduced_allowed(at::globalContext().allowBF16ReductionCuBLAS());
  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  const Key key{device, g.m, g.n, g.k, g.ldx, g.ldw, g.ldy, g.batch, g.sx, g.sw, g.sy, align, reduced};
  LtPlan pl;
  {
    std::lock_guard<std::mutex> lock(plans_mu);
    auto it = plans.find(key);
    if (it == plans.end()) it = plans.emplace(key, make_plan(handle, g, align, reduced)).first;
    pl = it->second;
  }
  if (!pl.ok) return false;
  at::Tensor ws;  // (stream-ordered scratch from the caching allocator where the caller has none)
  if (scratch == nullptr) {
    ws = at::empty({static_cast<int64_t>(kLtScratchBytes)}, like.dtype(at::kByte));
    scratch = ws.data_ptr();
  }
  const float one = 1.f, zero = 0.f;
  const cublasStatus_t st =
      cublasLtMatmul(handle, pl.op, &one, g.w, pl.a, g.x, pl.b, &zero, g.y, pl.c, g.y, pl.c, &pl.algo, scratch,
                     kLtScratchBytes, at::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)));
  if (st != CUBLAS_STATUS_SUCCESS) fail(std::string("cublasLtMatmul failed: status ") + std::to_string(int(st)));
  return true;
}

}  // namespace

bool gemm_nt_lt(const at::Tensor& x, const at::Tensor& w, at::Tensor& y) {
  if (!x.is_cuda()) fail_value("gemm_nt_lt: x must be on a GPU, got " + x.device().str());
  check_device(w, "w", x.device());
  check_device(y, "y", x.device());
  for (const at::Tensor* t : {&x, &w, static_cast<const at::Tensor*>(&y)}) check_dtype(*t, "gemm_nt_lt operand", at::kBFloat16);
  check_shape(x, "x", {-1, -1}, "[m, k]");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  check_shape(w, "w", {n, k}, "[n, k] (k as x's)");
  check_shape(y, "y", {m, n}, "[m, n]");
  for (const at::Tensor* t : {&x, &w, static_cast<const at::Tensor*>(&y)}) check_last_dim_contiguous(*t, "gemm_nt_lt operand");
  const LtGemm g{x.data_ptr(), x.stride(0), 0, w.data_ptr(), w.stride(0), 0, y.data_ptr(), y.stride(0), 0, m, n, k, 1};
  c10::cuda::CUDAGuard guard(x.device());  // (cuBLASLt's handle and the stream: x's device's)
  return run_lt(g, x.get_device(), x.options(), nullptr);
}

bool gemm_nt_lt_batched(const void* x, int64_t ldx, int64_t sx, const void* w, int64_t ldw, int64_t sw, void* y,
                        int64_t ldy, int64_t sy, int64_t m, int64_t n, int64_t k, int64_t batch,
                        const at::Tensor& like, void* scratch) {
  return run_lt({x, ldx, sx, w, ldw, sw, y, ldy, sy, m, n, k, batch}, like.get_device(), like.options(), scratch);
}

#endif

}  // namespace mla::api
