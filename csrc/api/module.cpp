// The Python module mla_decode._C: importing it registers the torch ops
// (ops.cpp) and exposes build facts through pybind11.
#include <torch/extension.h>

#include "ops.h"
#include "step_launcher.h"

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
  m.def("attention_info", &mla::api::attention_info, py::arg("device"), py::arg("dv") = 512, py::arg("rope") = 64,
        "[rows per block, keys per tile, threads, smem bytes, warp size, blocks per SM, SM count, kernel (0 portable, "
        "1 hopper)] for value width dv and rope width rope inside the key (0: per-head rope keys)");
  m.def("plan_target_parts", &mla::api::plan_target_parts, py::arg("device"), py::arg("s_q"), py::arg("h_q"),
        "the split planner's target parts per head block on `device` for s_q x h_q query rows");
  m.def("attention_bounded_register", &mla::api::attention_bounded_register, py::arg("kv"), py::arg("kpe"),
        py::arg("dv") = 512,
        "register a contiguous cache's layout (and kpe's) so the Hopper attention loads partial key halves by TMA; "
        "returns the map table (keep it alive with graphs capturing such calls), or None where it does not apply "
        "(not the Hopper kernel, or capturing)");
  m.def("attention", &mla::api::attention, py::arg("q"), py::arg("kv"), py::arg("seqlens"),
        py::arg("block_table"), py::arg("rope_cs"), py::arg("softmax_scale"), py::arg("causal"),
        py::arg("kpe") = py::none(), py::arg("head_dim_v") = 512, py::arg("kpe_heads") = py::none(),
        py::arg("plan") = py::none(), py::arg("split") = true);
  m.def("copy_async", &mla::api::copy_async, py::arg("dst"), py::arg("src"),
        "dst <- src on the current stream (same dtype and size, contiguous, one GPU)");
  m.def("combine", &mla::api::combine, py::arg("o_part"), py::arg("lse_part"));
  mla::api::bind_step_launcher(m);
}
