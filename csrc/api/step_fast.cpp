// The lean replay of custom_kernel / MLADecoder: mla_decode._C.fast_step,
// a plain CPython function (no pybind11 dispatch, no Python frames of
// ours) that replays the captured step of a call whose operands repeat a
// captured one. The task's harness times each call from an idle GPU, so
// the host's work before the graph launch is the call's time; after other
// work has run (its check of the previous output, the next inputs made) that
// code is cold in the CPU's caches, where each distinct piece of code or
// data touched costs time. This path touches the fewest: attribute
// reads, the key, the replay.
//
// A captured step's key (step_graph.h) holds every operand's address, dtype,
// sizes and strides and the layer's sizes: a call that matches it passed the
// checks when that step was captured, and only the length is new (checked
// here). A call that matches none runs the checked step (decode_step: every
// check, then the launches, or a capture) from here too, where the decoder
// has registered its choices for these sizes on this GPU (the RoPE table and
// the wished paths, register_step_plan): the task's leaderboard calls, whose
// fresh inputs never match a captured step, then pay no Python of ours
// either. Anything else (no registration, a stream capturing, an object that
// is not the task's, a length out of range, inputs the checks refuse)
// returns None with nothing done, and the caller takes the checked path in
// Python, which says what is wrong.
#include <torch/extension.h>
#include <torch/csrc/autograd/python_variable.h>

#include <c10/core/InferenceMode.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <mutex>
#include <vector>

#include "checks.h"
#include "ops.h"
#include "step_graph.h"

namespace mla::api {
namespace {

constexpr int kWeights = 5, kDims = 7, kNames = 2 + kWeights + kDims;
// The names read: the cache's two (data, length), then the config's weights
// and sizes in the key's order. Python names them (mla_decode.validate:
// CACHE_FIELDS + WEIGHTS + CONFIG_DIMS, set_step_names at import); until
// then fast_step does nothing.
PyObject* names[kNames] = {};

void set_step_names(const std::vector<std::string>& n) {
  if (static_cast<int>(n.size()) != kNames)
    fail_value("set_step_names: the cache's 2 attribute names, the 5 weights' and the 7 sizes', got " +
               num(static_cast<int64_t>(n.size())) + " names");
  for (int i = 0; i < kNames; ++i) {
    PyObject* s = PyUnicode_InternFromString(n[i].c_str());
    if (s == nullptr) throw pybind11::error_already_set();
    PyObject* old = names[i];
    names[i] = s;
    Py_XDECREF(old);
  }
}

std::vector<std::string> step_names() {
  std::vector<std::string> r;
  for (PyObject* s : names) r.push_back(s != nullptr ? PyUnicode_AsUTF8(s) : "");
  return r;
}

// A new reference to obj.name, or null (the error cleared) where it is missing.
PyObject* attr(PyObject* obj, int i) {
  PyObject* r = PyObject_GetAttr(obj, names[i]);
  if (r == nullptr) PyErr_Clear();
  return r;
}

// The decoder's choices for a GPU, the layer's sizes and a batch
// (register_step_plan): the RoPE table the step takes and its wished paths.
struct StepPlan {
  int device;
  int64_t cfg[kDims];
  int64_t bs;
  at::Tensor table;
  int64_t want;
};
std::mutex plans_mu;
std::vector<StepPlan>& plans = *new std::vector<StepPlan>();  // a few (one per sizes and GPU); leaked as the graphs

bool find_plan(int device, const int64_t (&cfg)[kDims], int64_t bs, at::Tensor* table, int64_t* want) {
  std::lock_guard<std::mutex> lock(plans_mu);
  for (const StepPlan& p : plans)
    if (p.device == device && p.bs == bs && std::equal(cfg, cfg + kDims, p.cfg)) {
      *table = p.table;
      *want = p.want;
      return true;
    }
  return false;
}

void register_step_plan(int64_t device, const std::vector<int64_t>& cfg, int64_t bs, const at::Tensor& table,
                        int64_t want) {
  TORCH_CHECK_VALUE(cfg.size() == kDims, "register_step_plan: cfg must hold the layer's 7 sizes");
  std::lock_guard<std::mutex> lock(plans_mu);
  for (StepPlan& p : plans)
    if (p.device == device && p.bs == bs && std::equal(cfg.begin(), cfg.end(), p.cfg)) {
      p.table = table;
      p.want = want;
      return;
    }
  if (plans.size() >= 16) plans.erase(plans.begin());  // (bounded: the oldest goes; its next call registers again)
  StepPlan p{static_cast<int>(device), {}, bs, table, want};
  std::copy(cfg.begin(), cfg.end(), p.cfg);
  plans.push_back(std::move(p));
}

void clear_step_plans() {
  std::lock_guard<std::mutex> lock(plans_mu);
  plans.clear();
}

struct Refs {  // new references held for the call
  PyObject* p[1 + kWeights] = {};
  ~Refs() {
    for (PyObject* o : p) Py_XDECREF(o);
  }
};

// fast_step((config, x, kv_cache)) -> (y, kv_cache.data, paths) after a
// replay or the checked step (kv_cache.seq_len advanced), or None.
PyObject* fast_step(PyObject* /*module*/, PyObject* data) {
  if (names[0] == nullptr || !PyTuple_Check(data) || PyTuple_GET_SIZE(data) != 3) Py_RETURN_NONE;
  PyObject* config = PyTuple_GET_ITEM(data, 0);
  PyObject* xo = PyTuple_GET_ITEM(data, 1);
  PyObject* kv = PyTuple_GET_ITEM(data, 2);
  if (!THPVariable_Check(xo)) Py_RETURN_NONE;
  const at::Tensor& x = THPVariable_Unpack(xo);
  if (!x.is_cuda() || x.dim() != 3) Py_RETURN_NONE;
  StepMarksScope marks;  // (MLA_DECODE_STEP_GRAPH_TRACE=2)
  Refs refs;
  PyObject*& cache_o = refs.p[0];
  cache_o = attr(kv, 0);
  if (cache_o == nullptr || !THPVariable_Check(cache_o)) Py_RETURN_NONE;
  const at::Tensor& cache = THPVariable_Unpack(cache_o);
  PyObject* seq = attr(kv, 1);
  if (seq == nullptr) Py_RETURN_NONE;
  int overflow = 0;
  const long long pos = PyLong_CheckExact(seq) ? PyLong_AsLongLongAndOverflow(seq, &overflow) : -1;
  Py_DECREF(seq);
  if (overflow != 0 || pos < 0 || cache.dim() != 3 || pos >= cache.size(1)) Py_RETURN_NONE;
  const at::Tensor* w[kWeights];
  for (int i = 0; i < kWeights; ++i) {
    refs.p[1 + i] = attr(config, 2 + i);
    if (refs.p[1 + i] == nullptr || !THPVariable_Check(refs.p[1 + i])) Py_RETURN_NONE;
    w[i] = &THPVariable_Unpack(refs.p[1 + i]);
  }
  int64_t cfg[kDims];
  for (int i = 0; i < kDims; ++i) {
    PyObject* d = attr(config, 2 + kWeights + i);
    if (d == nullptr) Py_RETURN_NONE;
    cfg[i] = PyLong_CheckExact(d) ? PyLong_AsLongLongAndOverflow(d, &overflow) : -1;
    Py_DECREF(d);
    if (overflow != 0 || cfg[i] < 0) Py_RETURN_NONE;
  }
  StepOut out;
  try {
    const StepKey key = step_key_prefix(x, {w[0], w[1], w[2], w[3], w[4]}, cache, c10::ArrayRef<int64_t>(cfg, kDims));
    c10::cuda::CUDAGuard guard(x.device());
    at::AutoDispatchBelowADInplaceOrView below_autograd;  // (as decode_step: y is a plain tensor)
    step_mark("operands");
    if (!replay_captured(key, static_cast<int32_t>(pos + 1), &out)) {
      at::Tensor table;
      int64_t want = 0;
      if (!find_plan(key.device, cfg, x.size(0), &table, &want) || table.size(0) < cache.size(1)) Py_RETURN_NONE;
      try {
        auto [y, ran] = decode_step_keyed(x, *w[0], *w[1], *w[2], *w[3], *w[4], cache, pos,
                                          c10::ArrayRef<int64_t>(cfg, kDims), table, want, &key);
        out.y = std::move(y);
        out.ran = ran;
      } catch (const c10::ValueError&) {  // refused before anything was written: the checked path says why
        Py_RETURN_NONE;
      } catch (const c10::TypeError&) {
        Py_RETURN_NONE;
      }
    }
  } catch (const std::exception& e) {  // a launch that failed: raised, as the checked path would
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  PyObject* next = PyLong_FromLongLong(pos + 1);
  if (next == nullptr) return nullptr;
  const int set = PyObject_SetAttr(kv, names[1], next);
  Py_DECREF(next);
  if (set != 0) return nullptr;
  PyObject* y = THPVariable_Wrap(out.y);
  if (y == nullptr) return nullptr;
  PyObject* ran = PyLong_FromLongLong(out.ran);
  if (ran == nullptr) {
    Py_DECREF(y);
    return nullptr;
  }
  PyObject* r = PyTuple_Pack(3, y, cache_o, ran);
  Py_DECREF(y);
  Py_DECREF(ran);
  return r;
}

PyMethodDef fast_step_def = {"fast_step", fast_step, METH_O,
                             "fast_step((config, x, kv_cache)): (y, kv_cache.data, paths) after replaying the "
                             "captured step these operands match, or after the checked step where a plan is "
                             "registered for these sizes (kv_cache.seq_len advanced), else None with nothing "
                             "done"};

}  // namespace

void add_fast_step(pybind11::module_& m) {
  PyObject* f = PyCFunction_New(&fast_step_def, nullptr);
  if (f == nullptr) throw pybind11::error_already_set();
  m.attr("fast_step") = pybind11::reinterpret_steal<pybind11::object>(f);
  m.def("register_step_plan", &register_step_plan, pybind11::arg("device"), pybind11::arg("cfg"),
        pybind11::arg("bs"), pybind11::arg("table"), pybind11::arg("want"),
        "the decoder's choices for a GPU, the layer's sizes and a batch (the RoPE table, the wished paths): "
        "fast_step then runs the checked step itself for calls that match no captured step");
  m.def("clear_step_plans", &clear_step_plans, "forget every register_step_plan");
  m.def("set_step_names", &set_step_names, pybind11::arg("names"),
        "the attribute names fast_step reads: the cache's data and length, the config's 5 weights and 7 sizes");
  m.def("step_names", &step_names, "the names set_step_names gave (empty strings before)");
}

}  // namespace mla::api
