// Input validation helpers for the torch glue. Checks run in the order
// device, dtype, layout, shape, and every message names what was expected
// and what was given. They throw c10::Error (ValueError/TypeError-like
// RuntimeError in Python); nothing here exits.
#pragma once

#include <sstream>
#include <string>
#include <vector>

#include <torch/types.h>

namespace mla::api {

inline std::string shape_str(const at::Tensor& t) {
  std::ostringstream os;
  os << "[";
  for (int64_t i = 0; i < t.dim(); ++i) os << (i ? ", " : "") << t.size(i);
  os << "]";
  return os.str();
}

// `want` entries < 0 are free; names are printed for them.
inline void check_shape(const at::Tensor& t, const char* name, const std::vector<int64_t>& want,
                        const char* want_text) {
  bool ok = t.dim() == static_cast<int64_t>(want.size());
  for (size_t i = 0; ok && i < want.size(); ++i) ok = want[i] < 0 || t.size(i) == want[i];
  TORCH_CHECK_VALUE(ok, name, " must have shape ", want_text, ", got ", shape_str(t));
}

inline void check_device(const at::Tensor& t, const char* name, const at::Device& dev) {
  TORCH_CHECK_VALUE(t.device() == dev, name, " must be on ", dev.str(), " (where q is), got ",
                    t.device().str());
}

inline void check_dtype(const at::Tensor& t, const char* name, at::ScalarType want) {
  TORCH_CHECK_TYPE(t.scalar_type() == want, name, " must be ", c10::toString(want), ", got ",
                   c10::toString(t.scalar_type()));
}

inline void check_last_dim_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.stride(-1) == 1, name, " must be contiguous in its last dimension, got strides ",
                    t.strides());
}

inline void check_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous, got strides ", t.strides(),
                    " for shape ", shape_str(t));
}

inline void check_launch(const char* err, const char* what) {
  TORCH_CHECK(err == nullptr, what, " failed: ", err ? err : "");
}

}  // namespace mla::api
