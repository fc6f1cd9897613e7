// The decoder's repeated-call fast path (mla_decode/decoder.py) in C++: the
// check that a call's tensors lie exactly as those of the call a captured
// step was made for (LayoutStamp), and the step's launch: x copied in, the
// instantiated graph launched, y copied out (StepLauncher). Through Python
// the same checks and launches held the device idle for ~20-30 us per call
// (README, "custom_kernel at the task shapes"); here they are one call each.
// A step may also hold a second graph captured on a caller's x where it lay
// (set_direct): a call whose x lies at that address launches it with no
// copy in.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <cstdint>
#include <string>
#include <vector>

#include "../platform/vendor.h"
#include "checks.h"
#include "ops.h"
#include "step_launcher.h"

namespace mla::api {
namespace {

// What LayoutStamp compares: everything the decoder's input checks read of
// a tensor (shape, strides, dtype, device) and, where `pinned`, its address
// (a captured graph reads and writes those tensors where they lay).
struct Layout {
  const void* ptr;
  std::vector<int64_t> sizes, strides;
  c10::ScalarType dtype;
  c10::Device device;
  bool pinned;
};

class LayoutStamp {
 public:
  LayoutStamp(const std::vector<at::Tensor>& ts, const std::vector<bool>& pinned) {
    if (ts.size() != pinned.size())
      fail_value("LayoutStamp: " + std::to_string(ts.size()) + " tensors but " + std::to_string(pinned.size()) +
                 " pinned flags");
    layouts_.reserve(ts.size());
    for (size_t i = 0; i < ts.size(); ++i) {
      const at::Tensor& t = ts[i];
      if (!t.defined()) fail_value("LayoutStamp: tensor " + std::to_string(i) + " is undefined");
      layouts_.push_back({t.data_ptr(), t.sizes().vec(), t.strides().vec(), t.scalar_type(), t.device(), pinned[i]});
    }
  }

  // True when every tensor has the stamped layout (and address where pinned).
  bool matches(const std::vector<at::Tensor>& ts) const {
    if (ts.size() != layouts_.size()) return false;
    for (size_t i = 0; i < ts.size(); ++i) {
      const at::Tensor& t = ts[i];
      const Layout& l = layouts_[i];
      if (!t.defined() || t.scalar_type() != l.dtype || t.device() != l.device ||
          t.sizes() != c10::IntArrayRef(l.sizes) || t.strides() != c10::IntArrayRef(l.strides))
        return false;
      if (l.pinned && (!t.has_storage() || t.data_ptr() != l.ptr)) return false;
    }
    return true;
  }

 private:
  std::vector<Layout> layouts_;
};

// One captured step: x_static and y_static are the graph's input and output
// buffers, seqlens the per-sequence lengths it reads (the graph adds one).
// With `plan` (an undefined tensor: none), the graph's attention reads its
// split plan there and the graph plans the next step's lengths at its end;
// a launch whose lengths the last one did not leave plans them first
// (plan(seqlens, s_q, h_q, capacity, split), the attention op's planner).
class StepLauncher {
 public:
  StepLauncher(int64_t exec, at::Tensor x_static, at::Tensor y_static, at::Tensor seqlens,
               std::vector<int64_t> y_shape, at::Tensor plan, int64_t s_q, int64_t h_q, int64_t capacity,
               bool split)
      : exec_(static_cast<uintptr_t>(exec)),
        x_(std::move(x_static)),
        y_(std::move(y_static)),
        seqlens_(std::move(seqlens)),
        y_shape_(std::move(y_shape)),
        plan_(std::move(plan)),
        s_q_(s_q),
        h_q_(h_q),
        capacity_(capacity),
        split_(split) {
    if (exec == 0) fail_value("StepLauncher: the graph has no instantiated executable (handle 0)");
    if (!x_.is_cuda() || !y_.is_cuda() || !seqlens_.is_cuda())
      fail_value("StepLauncher: x, y and seqlens must be on a GPU");
    check_device(y_, "y", x_.device());
    check_device(seqlens_, "seqlens", x_.device());
    check_contiguous(x_, "x");
    check_contiguous(y_, "y");
    if (c10::multiply_integers(y_shape_) != y_.numel())
      fail_value("StepLauncher: y_shape " + list_str(y_shape_) + " does not hold y's " + std::to_string(y_.numel()) +
                 " elements");
    if (plan_.defined()) {
      check_device(plan_, "plan", x_.device());
      check_contiguous(plan_, "plan");
      if (plan_.scalar_type() != at::kInt) fail_value("StepLauncher: plan must be int32");
    }
  }

  // The graph `exec` (same step, same buffers) reads x at x's address
  // instead of x_static: launch() runs it, with no copy in, whenever its x
  // lies there (contiguous, x_static's dtype and size, as launch checks).
  // The caller keeps that graph alive as long as this launcher.
  void set_direct(int64_t exec, const at::Tensor& x) {
    if (exec == 0) fail_value("StepLauncher.set_direct: the graph has no instantiated executable (handle 0)");
    check_device(x, "x", x_.device());
    check_contiguous(x, "x");
    if (x.scalar_type() != x_.scalar_type() || x.numel() != x_.numel())
      fail_value("StepLauncher.set_direct: x must hold " + std::to_string(x_.numel()) + " " +
                 c10::toString(x_.scalar_type()) + " elements, got " + shape_str(x) + " " +
                 c10::toString(x.scalar_type()));
    direct_exec_ = static_cast<uintptr_t>(exec);
    direct_x_ = x.data_ptr();
  }

  int64_t direct_address() const { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(direct_x_)); }

  // Copy x in (unless the direct graph reads it where it lies), set the
  // lengths to L where the graph's last step did not leave them there,
  // launch the graph and return a new tensor of shape y_shape holding y,
  // all on the current stream. None (nothing done) when that stream is
  // capturing a graph.
  py::object launch(const at::Tensor& x, int64_t L) {
    c10::cuda::CUDAGuard guard(x_.device());
    const stream_t stream = at::cuda::getCurrentCUDAStream(x_.device().index()).stream();
    bool capturing = false;
    check_launch(stream_capturing(stream, &capturing), "stream capture query");
    if (capturing) return py::none();
    if (x.device() != x_.device() || x.scalar_type() != x_.scalar_type() || x.numel() != x_.numel() ||
        !x.is_contiguous())
      fail_value("StepLauncher.launch: x must be contiguous " + std::string(c10::toString(x_.scalar_type())) +
                 " with " + std::to_string(x_.numel()) + " elements on " + x_.device().str() + ", got " +
                 shape_str(x) + " " + c10::toString(x.scalar_type()) + " on " + x.device().str());
    // (measured on an H200, the task's harness: ~8 us of wall clock per call
    // for the x copy ahead of the launch, against the direct graph; copying
    // x and y by a kernel instead of cudaMemcpyAsync changed nothing)
    const bool direct = direct_exec_ != 0 && x.data_ptr() == direct_x_;
    if (!direct)
      check_launch(memcpy_d2d_async(x_.data_ptr(), x.data_ptr(), x_.nbytes(), stream), "copy of x into the step");
    if (L != next_len_) {
      next_len_ = -1;  // (L + 1 once the graph is launched; anything failing before leaves it unknown)
      seqlens_.fill_(L);
      if (plan_.defined()) {  // the graph planned other lengths (or none yet): plan these
        const at::Tensor fresh = plan(seqlens_, s_q_, h_q_, capacity_, split_);
        if (fresh.numel() != plan_.numel()) fail_value("StepLauncher: the plan's size changed");
        check_launch(memcpy_d2d_async(plan_.data_ptr(), fresh.data_ptr(), plan_.nbytes(), stream), "copy of the plan");
      }
    }
    check_launch(graph_launch(direct ? direct_exec_ : exec_, stream), "graph launch of the step");
    next_len_ = L + 1;
    at::Tensor y = at::empty(y_shape_, y_.options());
    check_launch(memcpy_d2d_async(y.data_ptr(), y_.data_ptr(), y_.nbytes(), stream), "copy of y out of the step");
    return py::cast(y);
  }

 private:
  uintptr_t exec_;
  at::Tensor x_, y_, seqlens_;
  std::vector<int64_t> y_shape_;
  at::Tensor plan_;
  int64_t s_q_, h_q_, capacity_;
  bool split_;
  int64_t next_len_ = -1;  // what seqlens holds, and plan is made for (-1: unknown)
  uintptr_t direct_exec_ = 0;         // the graph reading x at direct_x_ (0: none)
  const void* direct_x_ = nullptr;
};

}  // namespace

void bind_step_launcher(py::module& m) {
  py::class_<LayoutStamp>(m, "LayoutStamp",
                          "Layouts (shape, strides, dtype, device; the address where pinned) of a list of tensors")
      .def(py::init<const std::vector<at::Tensor>&, const std::vector<bool>&>(), py::arg("tensors"),
           py::arg("pinned"))
      .def("matches", &LayoutStamp::matches, py::arg("tensors"),
           "True when every tensor has the stamped layout (and address where pinned)");
  py::class_<StepLauncher>(m, "StepLauncher",
                           "A captured decode step: x copied in, the graph launched, y copied out, on the current "
                           "stream")
      .def(py::init<int64_t, at::Tensor, at::Tensor, at::Tensor, std::vector<int64_t>, at::Tensor, int64_t, int64_t,
                    int64_t, bool>(),
           py::arg("exec"), py::arg("x"), py::arg("y"), py::arg("seqlens"), py::arg("y_shape"),
           py::arg("plan") = at::Tensor(), py::arg("s_q") = 1, py::arg("h_q") = 1, py::arg("capacity") = 0,
           py::arg("split") = true)
      .def("launch", &StepLauncher::launch, py::arg("x"), py::arg("L"),
           "Run the step for length L; returns y (a new tensor), or None while the current stream is capturing")
      .def("set_direct", &StepLauncher::set_direct, py::arg("exec"), py::arg("x"),
           "Register the step's graph captured on x where it lies: launches with x at that address run it, with "
           "no copy in")
      .def_property_readonly("direct_address", &StepLauncher::direct_address,
                             "x's address of the direct graph (0: none)");
}

}  // namespace mla::api
