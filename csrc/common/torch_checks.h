// Torch-level argument checks shared by every op: each error names the tensor and what was expected.
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <initializer_list>
#include <sstream>
#include <string>

namespace moe_graph {

inline std::string shape_str(const at::Tensor& t) {
  std::ostringstream os;
  os << t.sizes();
  return os.str();
}

// Fails with "<op>: <name> must be ..., got ..." messages.
inline void check_defined(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.defined(), op, ": ", name, " must be a tensor, got None");
}

inline void check_dim(const at::Tensor& t, int64_t dim, const char* op, const char* name, const char* layout) {
  TORCH_CHECK(t.dim() == dim, op, ": ", name, " must be a ", dim, "-D tensor ", layout, ", got shape ",
              shape_str(t));
}

inline void check_dtype(const at::Tensor& t, std::initializer_list<at::ScalarType> ok, const char* op,
                        const char* name) {
  for (auto s : ok)
    if (t.scalar_type() == s) return;
  std::ostringstream os;
  bool first = true;
  for (auto s : ok) {
    os << (first ? "" : " or ") << c10::toString(s);
    first = false;
  }
  TORCH_CHECK(false, op, ": ", name, " must have dtype ", os.str(), ", got ", c10::toString(t.scalar_type()));
}

inline void check_same_dtype(const at::Tensor& t, const at::Tensor& ref, const char* op, const char* name,
                             const char* ref_name) {
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), op, ": ", name, " must have the dtype of ", ref_name, " (",
              c10::toString(ref.scalar_type()), "), got ", c10::toString(t.scalar_type()));
}

inline void check_device(const at::Tensor& t, const at::Device& dev, const char* op, const char* name) {
  TORCH_CHECK(t.device() == dev, op, ": ", name, " must be on ", dev.str(), " (the device of the input), got ",
              t.device().str());
}

inline void check_contiguous(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous (row-major), got strides ", t.strides(),
              " for shape ", shape_str(t), "; call .contiguous() first");
}

inline void check_shape(const at::Tensor& t, at::IntArrayRef expected, const char* op, const char* name) {
  TORCH_CHECK(t.sizes() == expected, op, ": ", name, " must have shape ", expected, ", got ", shape_str(t));
}

// 16-byte alignment of the base pointer (TMA and vectorized loads need it).
inline void check_aligned16(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, op, ": ", name,
              " must start at a 16-byte aligned address (its storage offset makes it misaligned); use "
              ".clone() or a fresh allocation");
}

}  // namespace moe_graph
