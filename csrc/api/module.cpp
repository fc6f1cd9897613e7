// The Python module mla_decode._C: importing it registers the torch ops
// (registration.cpp, ops_projections.cpp) and exposes build facts through
// pybind11.
#include <torch/extension.h>

#include "../kernels/projections/gemm.h"
#include "../kernels/projections/query.h"
#include "../platform/switches.h"
#include "blas_lt.h"
#include "ops.h"

namespace mla::api {
void add_fast_step(pybind11::module_& m);  // step_fast.cpp
}

#ifndef MLA_BUILD_ARCHS
#define MLA_BUILD_ARCHS "unknown"
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "mla_decode kernels (CUDA/HIP)";
#if defined(USE_ROCM)
  m.attr("platform") = "hip";
#else
  m.attr("platform") = "cuda";
#endif
  m.attr("archs") = MLA_BUILD_ARCHS;
  m.def(
      "switches",
      [] {
        const mla::Switches& s = mla::switches();
        py::dict d;
        d["attn_kernel"] = s.attn_kernel;
        d["portable_rows"] = s.portable_rows;
        d["plan_p0"] = s.plan_p0;
        d["tma"] = s.tma;
        d["persist"] = s.persist;
        d["attn_ctas"] = s.attn_ctas;
        d["pdl"] = s.pdl;
        d["gemm_mw"] = s.gemm_mw;
        d["gemm_splits"] = s.gemm_splits;
        d["gemm_group"] = s.gemm_group;
        d["step_graph"] = s.step_graph;
        d["step_graph_trace"] = s.step_graph_trace;
        return d;
      },
      "the C++ side's environment switches as read once by this process (csrc/platform/switches.h)");
  m.def(
      "step_bits",
      [] {
        py::dict d;
        d["down_own"] = static_cast<int64_t>(mla::api::kStepDownOwn);
        d["query_fused"] = static_cast<int64_t>(mla::api::kStepQueryFused);
        d["wo_lt"] = static_cast<int64_t>(mla::api::kStepWoLt);
        d["graph"] = static_cast<int64_t>(mla::api::kStepGraph);
        d["captured"] = static_cast<int64_t>(mla::api::kStepCaptured);
        d["plan_in_query"] = static_cast<int64_t>(mla::api::kStepPlanInQuery);
        return d;
      },
      "the decode step's path bits by name (decode_step's `want` and the paths it reports: csrc/api/ops.h)");
  m.def(
      "attention_info",
      [](int64_t device, int64_t dv, int64_t rope) {
        const mla::api::AttentionFacts f = mla::api::attention_info(device, dv, rope);
        py::dict d;
        d["rows_per_block"] = f.rows_per_block;
        d["keys_per_tile"] = f.keys_per_tile;
        d["threads"] = f.threads;
        d["smem_bytes"] = f.smem_bytes;
        d["warp_size"] = f.warp_size;
        d["blocks_per_sm"] = f.blocks_per_sm;
        d["sms"] = f.sms;
        d["kernel"] = f.hopper ? "hopper" : "portable";
        return d;
      },
      py::arg("device"), py::arg("dv") = 512, py::arg("rope") = 64,
      "the attention kernel's facts by name (mla_decode._ext.AttentionInfo's fields) for value width dv and rope "
      "width rope inside the key (0: per-head rope keys)");
  // (the Hopper GEMM's and fused query's size rules, for mla_decode.kernel_choice's reasons)
  const auto why = [](const char* e) -> py::object { return e == nullptr ? py::object(py::none()) : py::str(e); };
  m.def(
      "gemm_sm90_sizes",
      [why](int m, int k, int n0, int n1, int batch) {
        return why(mla::gemm_sm90_sizes(m, k, batch, n1 > 0 ? 2 : 1, n0, n1));
      },
      py::arg("m"), py::arg("k"), py::arg("n0"), py::arg("n1") = 0, py::arg("batch") = 1,
      "None when the Hopper GEMM takes x [batch, m, k] times weights of n0 (and n1) rows, else why not "
      "(sizes only)");
  m.def(
      "query_sm90_sizes",
      [why](int m, int k, int heads, int nope, int rope, int r) {
        return why(mla::query_sm90_sizes(m, k, heads, nope, rope, r));
      },
      py::arg("m"), py::arg("k"), py::arg("heads"), py::arg("nope"), py::arg("rope"), py::arg("r"),
      "None when the fused Hopper query takes these sizes, else why not (sizes only)");
  m.def("plan_target_parts", &mla::api::plan_target_parts, py::arg("device"), py::arg("s_q"), py::arg("h_q"),
        "the split planner's target parts per head block on `device` for s_q x h_q query rows");
  m.def("splits_possible", &mla::api::splits_possible, py::arg("device"), py::arg("bs"), py::arg("s_q"),
        py::arg("h_q"), "whether the split planner can split a batch of bs sequences of one length on `device`");
  m.def("attention", &mla::api::attention, py::arg("q"), py::arg("kv"), py::arg("seqlens"),
        py::arg("block_table"), py::arg("rope_cs"), py::arg("softmax_scale"), py::arg("causal"),
        py::arg("kpe") = py::none(), py::arg("head_dim_v") = 512, py::arg("kpe_heads") = py::none(),
        py::arg("plan") = py::none(), py::arg("split") = true, py::arg("kv_scale") = 1.0);
  m.def("decode_step", &mla::api::decode_step, py::arg("x"), py::arg("w_qd"), py::arg("w_kvd"), py::arg("w_qu"),
        py::arg("w_kvu"), py::arg("w_o"), py::arg("cache"), py::arg("pos"), py::arg("cfg"), py::arg("rope_cs"),
        py::arg("want"),
        "one decode step of the layer (checked, then enqueued): returns (y [bs, 1, dim], the paths that ran)");
  m.def("gemm_nt_lt", &mla::api::gemm_nt_lt, py::arg("x"), py::arg("w"), py::arg("y"),
        "y = x w^T on cuBLASLt (bf16, 2-D, unit last strides); False where it cannot (nothing ran)");
  m.def("release_cached", &mla::api::release_cached, "drop the decode step's captured graphs and eager-step workspaces");
  m.def("combine", &mla::api::combine, py::arg("o_part"), py::arg("lse_part"));
  mla::api::add_fast_step(m);
}
