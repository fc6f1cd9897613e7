// The attention ops' schemas and their CUDA kernels, as torch.ops.mla_decode.*
// (so that torch.compile and graph capture see them). The projection ops add
// theirs in ops_projections.cpp (TORCH_LIBRARY_FRAGMENT); the library is
// defined here, once.
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(mla_decode, m) {
  m.def(
      "attention(Tensor q, Tensor kv, Tensor seqlens, Tensor? block_table, Tensor? rope_cs, "
      "float softmax_scale, bool causal, Tensor? kpe=None, int head_dim_v=512, Tensor? kpe_heads=None, "
      "Tensor? plan=None, bool split=True, float kv_scale=1.0) -> (Tensor, Tensor)");
  m.def(
      "attention_out(Tensor q, Tensor kv, Tensor seqlens, Tensor? block_table, Tensor? rope_cs, "
      "float softmax_scale, bool causal, Tensor(a!) out, Tensor(b!) lse, Tensor? kpe=None, int head_dim_v=512, "
      "Tensor? kpe_heads=None, Tensor? plan=None, bool split=True, float kv_scale=1.0) -> ()");
  m.def("combine(Tensor o_part, Tensor lse_part) -> (Tensor, Tensor)");
  m.def("merge_states(Tensor outs, Tensor lses) -> (Tensor, Tensor)");
  m.def("plan(Tensor seqlens, int s_q, int h_q, int capacity, bool split=True) -> Tensor");
}

TORCH_LIBRARY_IMPL(mla_decode, CUDA, m) {
  m.impl("attention", &mla::api::attention);
  m.impl("attention_out", &mla::api::attention_out);
  m.impl("combine", &mla::api::combine);
  m.impl("merge_states", &mla::api::merge_states);
  m.impl("plan", &mla::api::plan);
}
