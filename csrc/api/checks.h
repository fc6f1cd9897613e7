// Input validation helpers for the torch glue. Checks run in the order
// device, dtype, layout, shape, and every message names what was expected
// and what was given. They throw c10::Error (ValueError/TypeError-like
// RuntimeError in Python); nothing here exits.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <c10/util/SmallVector.h>
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

// Byte offset of t's first element from a 16-byte boundary.
inline int64_t offset16(const at::Tensor& t) {
  return static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16);
}

// For rows_aligned16. kFree: a dimension of size 1 may have any stride (only
// index 0 exists, so no address moves by it); kChecked: its stride meets the
// rule too (a TMA map, for one, encodes every stride).
enum class Size1Strides { kChecked, kFree };

// The kernels read and write rows in 16-byte pieces: the base address on a
// 16-byte boundary, every stride but the last a multiple of 8 elements (16
// bytes: every caller holds bf16 or fp16) and the last stride 1. A slice of
// a wider buffer often fails it.
inline bool rows_aligned16(const at::Tensor& t, Size1Strides size1 = Size1Strides::kChecked) {
  if (offset16(t) != 0) return false;
  for (int64_t i = 0; i + 1 < t.dim(); ++i)
    if (!(size1 == Size1Strides::kFree && t.size(i) == 1) && t.stride(i) % 8 != 0) return false;
  return t.dim() == 0 || t.stride(-1) == 1;
}

// rows_aligned16 with size-1 strides free, raising before anything is
// launched. The caller has checked the last dimension contiguous.
inline void check_rows_aligned(const at::Tensor& t, const char* name) {
  if (!rows_aligned16(t, Size1Strides::kFree))
    fail_value(std::string(name) + " must be 16-byte aligned: a base address on a 16-byte boundary and strides "
               "that are multiples of 8 elements (a slice of a wider buffer often is not), got strides " +
               list_str(t.strides()) + " at byte offset " + num(offset16(t)));
}

// Whether two indices of t may name one element (an expanded or stride-0
// tensor, rows closer than their width): each dimension's stride, smallest
// first, must step past everything the smaller ones span. Sufficient: a
// layout it refuses may in rare interleavings still be disjoint, never the
// reverse. (mla_decode.validate.elements_overlap is the same test.)
inline bool elements_overlap(const at::Tensor& t) {
  if (t.numel() == 0 || t.is_non_overlapping_and_dense()) return false;  // (PyTorch keeps that flag)
  c10::SmallVector<std::pair<int64_t, int64_t>, 8> dims;  // (stride, size) of the dimensions that move
  for (int64_t i = 0; i < t.dim(); ++i)
    if (t.size(i) > 1) dims.emplace_back(t.stride(i), t.size(i));
  std::sort(dims.begin(), dims.end());
  int64_t span = 1;
  for (const auto& [stride, size] : dims) {
    if (stride < span) return true;
    span += stride * (size - 1);
  }
  return false;
}

inline void check_launch(const char* err, const char* what) {
  if (err != nullptr) fail(std::string(what) + " failed: " + err);
}

}  // namespace mla::api
