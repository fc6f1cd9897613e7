// Skinny GEMMs of the projection stages (pipeline steps 1, 2 and 5): y = x
// W^T with few rows in x (the batch, M <= 256) and the weight W [N, K]
// streamed once from memory, bf16 in and out, fp32 accumulation.
//
// One launch computes up to two products on the same x (segments: the
// down-projection's W_qd and W_kvd where they lie) and a batch of them (per
// head: W_UV), with any row strides. Rows of a segment's output may be placed
// by the device (the cache append: output row m goes to row seqlens[m] - 1).
// The Hopper kernel (gemm_sm90.cu, wgmma + TMA, split-K within a thread-block
// cluster, reduced through a workspace in L2) is NVIDIA-only; the AMD
// build keeps the vendor BLAS for these products (mla_decode/projections.py).
#pragma once

#include <cstdint>

#include "../../platform/bf16.h"

namespace mla {

struct GemmSeg {
  const bf16_t* w;         // [batch][n][k], unit last stride
  int64_t w_row_stride, w_batch_stride;
  bf16_t* y;               // [batch][m][n], unit last stride (row m at y + m * y_row_stride)
  int64_t y_row_stride, y_batch_stride;
  const int32_t* row_pos;  // or nullptr: row m goes to y + m * y_row_stride + (row_pos[m] - 1) * y_pos_stride
  int64_t y_pos_stride;
  int pos_limit;           // with row_pos: rows whose row_pos[m] - 1 is outside [0, pos_limit) are not written
  int n;
};

struct GemmParams {
  const bf16_t* x;  // [batch][m][k], unit last stride
  int64_t x_row_stride, x_batch_stride;
  int m, k, batch;
  int nseg;  // 1 or 2
  GemmSeg seg[2];
  bool pdl;  // launch as a programmatic dependent of the previous kernel (weights stream before the wait)
  float* ws;         // split-K workspace (16-byte aligned), at least GemmConfig::ws_bytes; unused without splits
  int64_t ws_bytes;
};

// The configuration the launcher picks for these sizes (exposed for tests
// and benchmarks): tile rows of W per block (bn), padded rows of x (bm),
// split-K ways (= cluster size), pipeline stages, blocks, shared memory,
// the load group (k blocks requested back to back once as many slots
// are free) and the bytes of global workspace the split-K reduction needs
// (0 without splits).
struct GemmConfig {
  int bn, bm, splits, stages, blocks, smem, group;
  int64_t ws_bytes;
};

// The current device's SM count and opt-in shared memory per block, queried
// once per device (NVIDIA builds; the Hopper kernels' planners).
bool sm90_device_limits(int* sms, int* smem_max);

// nullptr when the Hopper GEMM takes these sizes (m rows of x, k, batch,
// nseg weights of n0 and n1 rows), else why not: the size rules alone, the
// same on every device and build (mla_decode.kernel_choice asks them).
const char* gemm_sm90_sizes(int m, int k, int batch, int nseg, int n0, int n1);
// nullptr when the Hopper kernel takes these sizes (else why not); fills cfg.
const char* gemm_sm90_config(const GemmParams& p, GemmConfig* cfg);
// The same for sizes alone (m rows of x, k, batch, weights of n0 and n1 rows,
// n1 0 for one weight; alignment not checked): what gemm_sm90_config gives
// any aligned operands of these sizes (made once per device and sizes).
const char* gemm_sm90_config_for(int m, int k, int batch, int n0, int n1, GemmConfig* cfg);
// nullptr when p's operands meet the kernel's alignment (else why not): with
// a cfg from gemm_sm90_config_for(p's sizes), what gemm_sm90_config checks
// beyond the sizes.
const char* gemm_sm90_aligned(const GemmParams& p);
// Launches with cfg as gemm_sm90_config filled it for p (planned once per
// call: the caller sizes the workspace from it).
const char* launch_gemm_sm90(const GemmParams& p, const GemmConfig& cfg, stream_t stream);

}  // namespace mla
