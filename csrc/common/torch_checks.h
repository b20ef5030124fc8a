// Torch-level argument checks shared by every op: each error names the tensor and what was expected.
#pragma once
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <sstream>
#include <string>
#include <vector>

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

// An output the op writes in place: an inference tensor cannot be updated outside inference mode, and a tensor
// that requires grad (while grad mode is on) would be changed behind autograd's back.
inline void check_writable(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(!t.is_inference() || c10::InferenceMode::is_enabled(), op, ": ", name,
              " is an inference tensor (created under torch.inference_mode()); it cannot be written in place outside "
              "inference mode: pass a normal tensor (e.g. .clone() it outside inference mode)");
  TORCH_CHECK(!(t.requires_grad() && c10::GradMode::is_enabled()), op, ": ", name,
              " requires grad; the op writes it in place without recording it for autograd: pass a tensor that "
              "does not require grad (e.g. .detach() it) or call under torch.no_grad()");
}

// One operand of a memory-overlap check: a contiguous tensor (or undefined / empty: ignored).
struct MemOperand {
  std::string name;
  at::Tensor t;
  bool is_output;
};

// Rejects any output that shares memory with another operand (an input, or another output, including exact
// aliasing and the same tensor listed twice). Inputs may share memory with each other. Operands are contiguous,
// so each covers the byte range [data_ptr, data_ptr + nbytes); O(n log n) in the number of operands.
inline void check_outputs_disjoint(const std::vector<MemOperand>& ops_in, const char* op) {
  struct Range {
    uintptr_t begin, end;
    const MemOperand* m;
  };
  std::vector<Range> r;
  r.reserve(ops_in.size());
  for (const auto& m : ops_in) {
    if (!m.t.defined() || m.t.numel() == 0) continue;
    const auto b = reinterpret_cast<uintptr_t>(m.t.data_ptr());
    r.push_back({b, b + static_cast<uintptr_t>(m.t.numel()) * m.t.element_size(), &m});
  }
  std::sort(r.begin(), r.end(), [](const Range& x, const Range& y) { return x.begin < y.begin; });
  const Range* reach_any = nullptr;  // the earlier range reaching furthest, and the earlier output reaching furthest
  const Range* reach_out = nullptr;
  for (const auto& x : r) {
    const Range* hit = x.m->is_output ? reach_any : reach_out;
    if (hit != nullptr && x.begin < hit->end) {
      const MemOperand* out = hit->m->is_output ? hit->m : x.m;
      const MemOperand* other = out == hit->m ? x.m : hit->m;
      TORCH_CHECK(false, op, ": ", out->name, " overlaps ", other->name,
                  " in memory; an output must not share memory with an input or another output (pass separate "
                  "tensors, e.g. .clone() one of them)");
    }
    if (reach_any == nullptr || x.end > reach_any->end) reach_any = &x;
    if (x.m->is_output && (reach_out == nullptr || x.end > reach_out->end)) reach_out = &x;
  }
}

}  // namespace moe_graph
