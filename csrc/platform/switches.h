// The C++ side's environment switches, read once per process (at the first
// call that asks) into one struct: every kernel path the environment can
// change is here, and the code that decides a path asks switches() instead
// of the environment. All are for measurements and tests; unset, each keeps
// the default path. (The Python side's switches are in
// mla_decode/kernel_choice.py; `mla_decode._C.switches()` returns these.)
#pragma once

#include <cstdlib>
#include <cstring>
#include <string>

namespace mla {

struct Switches {
  // attention (csrc/api/attention_choice.cpp, attention_ops.cpp, attention_sm90.cu)
  std::string attn_kernel;  // MLA_DECODE_ATTN_KERNEL: "" (the default choice), "portable" or "hopper"
  int portable_rows;        // MLA_DECODE_PORTABLE_ROWS: cap of the portable kernel's head block (0: none)
  bool plan_p0;             // MLA_DECODE_PLAN_P0=1: the split planner keeps its P0 candidate alone
  bool tma;                 // MLA_DECODE_TMA=0: the Hopper kernel loads everything by cp.async
  bool persist;             // MLA_DECODE_PERSIST=0: one Hopper block per work item, not persistent blocks
  int attn_ctas;            // MLA_DECODE_ATTN_CTAS: at most this many persistent blocks (0: one per slot)
  bool pdl;                 // MLA_DECODE_PDL=0: no programmatic dependent launches
  // projections (csrc/kernels/projections/gemm_sm90.cu)
  int gemm_mw;              // MLA_DECODE_GEMM_MW: force the skinny GEMM's tile width (1 or 2; 0: chosen)
  int gemm_splits;          // MLA_DECODE_GEMM_SPLITS: force its split count (0: chosen)
  int gemm_group;           // MLA_DECODE_GEMM_GROUP: force its load group (0: chosen)
  // the decode step (csrc/api/step_graph.cpp)
  bool step_graph;          // MLA_DECODE_STEP_GRAPH=0: no captured steps (every step eager)
  int step_graph_trace;     // MLA_DECODE_STEP_GRAPH_TRACE: 1 prints captures, 2 also marks calls
};

namespace detail {
inline bool env_is(const char* name, const char* value) {
  const char* e = std::getenv(name);
  return e != nullptr && std::strcmp(e, value) == 0;
}
inline bool env_off(const char* name) { return env_is(name, "0"); }
inline int env_int(const char* name) {
  const char* e = std::getenv(name);
  return e == nullptr ? 0 : std::atoi(e);
}
inline Switches read_switches() {
  Switches s;
  const char* k = std::getenv("MLA_DECODE_ATTN_KERNEL");
  s.attn_kernel = k == nullptr ? "" : k;
  s.portable_rows = env_int("MLA_DECODE_PORTABLE_ROWS");
  s.plan_p0 = env_is("MLA_DECODE_PLAN_P0", "1");
  s.tma = !env_off("MLA_DECODE_TMA");
  s.persist = !env_off("MLA_DECODE_PERSIST");
  s.attn_ctas = env_int("MLA_DECODE_ATTN_CTAS");
  s.pdl = !env_off("MLA_DECODE_PDL");
  s.gemm_mw = env_int("MLA_DECODE_GEMM_MW");
  s.gemm_splits = env_int("MLA_DECODE_GEMM_SPLITS");
  s.gemm_group = env_int("MLA_DECODE_GEMM_GROUP");
  s.step_graph = !env_off("MLA_DECODE_STEP_GRAPH");
  s.step_graph_trace = env_int("MLA_DECODE_STEP_GRAPH_TRACE");
  return s;
}
}  // namespace detail

// The switches, read at the first call (thread-safe; one copy per process:
// an inline function's static).
inline const Switches& switches() {
  static const Switches s = detail::read_switches();
  return s;
}

}  // namespace mla
