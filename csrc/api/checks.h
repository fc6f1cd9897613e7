// Input validation helpers for the torch glue. Checks run in the order
// device, dtype, layout, shape, and every message names what was expected
// and what was given. They throw c10::Error (ValueError/TypeError-like
// RuntimeError in Python); nothing here exits.
#pragma once

#include <string>
#include <vector>

#include <torch/types.h>

namespace mla::api {

// Messages are built as one std::string (std::to_string for numbers) and
// handed to TORCH_CHECK whole: seen on the device (PyTorch 2.11 wheel, g++
// 13), std::ostream's integer insertion instantiated inside this extension
// crashed, so nothing here streams numbers.
inline std::string num(int64_t v) { return std::to_string(v); }
inline std::string num(double v) { return std::to_string(v); }

inline std::string list_str(c10::IntArrayRef v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}
inline std::string shape_str(const at::Tensor& t) { return list_str(t.sizes()); }

[[noreturn]] inline void fail_value(const std::string& msg) { TORCH_CHECK_VALUE(false, msg); }
[[noreturn]] inline void fail_type(const std::string& msg) { TORCH_CHECK_TYPE(false, msg); }
[[noreturn]] inline void fail(const std::string& msg) { TORCH_CHECK(false, msg); }

// `want` entries < 0 are free.
inline void check_shape(const at::Tensor& t, const char* name, const std::vector<int64_t>& want,
                        const char* want_text) {
  bool ok = t.dim() == static_cast<int64_t>(want.size());
  for (size_t i = 0; ok && i < want.size(); ++i) ok = want[i] < 0 || t.size(i) == want[i];
  if (!ok) fail_value(std::string(name) + " must have shape " + want_text + ", got " + shape_str(t));
}

inline void check_device(const at::Tensor& t, const char* name, const at::Device& dev) {
  if (t.device() != dev)
    fail_value(std::string(name) + " must be on " + dev.str() + " (where q is), got " + t.device().str());
}

inline void check_dtype(const at::Tensor& t, const char* name, at::ScalarType want) {
  if (t.scalar_type() != want)
    fail_type(std::string(name) + " must be " + c10::toString(want) + ", got " + c10::toString(t.scalar_type()));
}

inline void check_last_dim_contiguous(const at::Tensor& t, const char* name) {
  if (t.dim() > 0 && t.stride(-1) != 1)
    fail_value(std::string(name) + " must be contiguous in its last dimension, got strides " + list_str(t.strides()));
}

inline void check_contiguous(const at::Tensor& t, const char* name) {
  if (!t.is_contiguous())
    fail_value(std::string(name) + " must be contiguous, got strides " + list_str(t.strides()) + " for shape " +
               shape_str(t));
}

inline void check_launch(const char* err, const char* what) {
  if (err != nullptr) fail(std::string(what) + " failed: " + err);
}

}  // namespace mla::api
