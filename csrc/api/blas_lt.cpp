// y = x w^T on cuBLASLt with our own plan cache (NVIDIA builds): the output
// projection's product. PyTorch reaches cuBLASLt only through a process-wide
// preference, which would change every other product of the caller's
// process (and race with its threads); here the choice is local to the call.
#include "blas_lt.h"

#include <ATen/cuda/CUDAContext.h>

#include <map>
#include <mutex>
#include <tuple>

#include "checks.h"

#if !defined(USE_ROCM)
#include <cublasLt.h>
#endif

namespace mla::api {

#if defined(USE_ROCM)

bool gemm_nt_lt(const at::Tensor&, const at::Tensor&, at::Tensor&) { return false; }

#else

namespace {

constexpr size_t kWorkspace = 4u << 20;

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

// (device, m, n, k, ldx, ldw, ldy, alignment) -> plan; descriptors are made
// once and only read afterwards (concurrent calls may share them).
using Key = std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>;
std::mutex plans_mu;
std::map<Key, LtPlan>& plans = *new std::map<Key, LtPlan>();  // never destroyed (no CUDA work at exit)

LtPlan make_plan(cublasLtHandle_t handle, int64_t m, int64_t n, int64_t k, int64_t ldx, int64_t ldw, int64_t ldy,
                 int64_t align) {
  // column-major view: Y^T [n, m] = W [k, n]^T . X^T [k, m]
  LtPlan pl;
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  if (cublasLtMatmulDescCreate(&pl.op, CUBLAS_COMPUTE_32F, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS) return pl;
  cublasLtMatmulDescSetAttribute(pl.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta));
  cublasLtMatmulDescSetAttribute(pl.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb));
  if (cublasLtMatrixLayoutCreate(&pl.a, CUDA_R_16BF, k, n, ldw) != CUBLAS_STATUS_SUCCESS ||
      cublasLtMatrixLayoutCreate(&pl.b, CUDA_R_16BF, k, m, ldx) != CUBLAS_STATUS_SUCCESS ||
      cublasLtMatrixLayoutCreate(&pl.c, CUDA_R_16BF, n, m, ldy) != CUBLAS_STATUS_SUCCESS)
    return pl;
  cublasLtMatmulPreference_t pref = nullptr;
  if (cublasLtMatmulPreferenceCreate(&pref) != CUBLAS_STATUS_SUCCESS) return pl;
  const size_t ws = kWorkspace;
  const uint32_t al = static_cast<uint32_t>(align);
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al, sizeof(al));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al, sizeof(al));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al, sizeof(al));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al, sizeof(al));
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
  if (m < 1 || n < 1 || k < 1) return false;
  const int64_t align =
      std::min({alignment(x.data_ptr()), alignment(w.data_ptr()), alignment(y.data_ptr())});
  if (align < 16) return false;
  const int device = x.get_device();
  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  const Key key{device, m, n, k, x.stride(0), w.stride(0), y.stride(0), align};
  LtPlan pl;
  {
    std::lock_guard<std::mutex> lock(plans_mu);
    auto it = plans.find(key);
    if (it == plans.end()) it = plans.emplace(key, make_plan(handle, m, n, k, x.stride(0), w.stride(0), y.stride(0), align)).first;
    pl = it->second;
  }
  if (!pl.ok) return false;
  // stream-ordered scratch from the caching allocator
  at::Tensor ws = at::empty({static_cast<int64_t>(kWorkspace)}, x.options().dtype(at::kByte));
  const float one = 1.f, zero = 0.f;
  const cublasStatus_t st =
      cublasLtMatmul(handle, pl.op, &one, w.data_ptr(), pl.a, x.data_ptr(), pl.b, &zero, y.data_ptr(), pl.c,
                     y.data_ptr(), pl.c, &pl.algo, ws.data_ptr(), kWorkspace, at::cuda::getCurrentCUDAStream());
  if (st != CUBLAS_STATUS_SUCCESS) fail(std::string("cublasLtMatmul failed: status ") + std::to_string(int(st)));
  return true;
}

#endif

}  // namespace mla::api
