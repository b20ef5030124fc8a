// Torch-free interface of the sync-free grouped GEMM kernels.
//
// Rows of the activation matrices are grouped by expert, in expert order; the number of rows of expert e is
// m_splits[e], a device array (int32 or int64) that the host never reads. A small argument kernel turns it into
// per-expert problem sizes, pointers and strides inside a workspace; a CUTLASS grouped (ptr-array) kernel then
// runs from those. Buffers may have more rows (`rows`) than sum(m_splits): those output rows are zeroed. When
// the sum exceeds `rows`, the splits are clamped, nothing out of bounds is touched, and kErrSplitsOverflow is
// set in the device error flag.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>

#include "grouped_gemm/grouped_plan.h"

namespace moe_graph {
namespace gg {

// Per-expert tensors: either one base pointer with a fixed element stride between experts, or a host array of
// `num_experts` device pointers (one tensor per expert, as TransformerEngine keeps them). In the second case the
// launcher copies the pointers into the workspace with kernels whose arguments carry them by value, so it stays
// capturable in a CUDA graph.
struct ExpertPtrs {
  const void* base = nullptr;
  int64_t expert_stride = 0;           // elements between consecutive experts when `list` is null
  const void* const* list = nullptr;   // host array of device pointers, or null
};

struct Splits {
  const void* ptr = nullptr;  // device int32 / int64 [num_experts]
  bool is_int64 = true;
  int num_experts = 0;
};

// Allocates `bytes` of device memory valid until the launch has been enqueued (stream-ordered reuse after that is
// fine). The torch layer passes PyTorch's caching allocator, which also makes it graph-safe.
using Allocator = std::function<void*(size_t bytes)>;

struct LaunchEnv {
  int device = 0;
  int sm_count = 0;      // multiprocessors of `device`
  int arch = 0;          // compute capability * 10 + minor (e.g. 90, 100)
  cudaStream_t stream = nullptr;
  int32_t* error_flag = nullptr;
  Allocator alloc;
};

// out[r, :] = a[r, :] @ B_e^T (b_k_major: B_e is [n, k]) or a[r, :] @ B_e (else: B_e is [k, n]), + bias[e, :].
struct ForwardProblem {
  DType dtype = DType::kBF16;  // of a, b, out, bias
  bool b_k_major = true;
  int64_t rows = 0, n = 0, k = 0;
  const void* a = nullptr;     // [rows, k], row-major
  ExpertPtrs b;                // per expert [n, k] or [k, n], row-major
  void* out = nullptr;         // [rows, n], row-major
  const void* bias = nullptr;  // [num_experts, n] or null
  Splits splits;
  Config config = Config::kAuto;
};

// out_e (+)= dy_e^T @ a_e: out_e is [n, k] with n = dy.size(1), k = a.size(1).
// accumulate: accumulate_mask (device bool [E]) if given, else accumulate_all for every expert.
struct WgradProblem {
  DType dtype = DType::kBF16;      // of a and dy
  DType out_dtype = DType::kF32;   // kF32 or == dtype
  int64_t rows = 0, n = 0, k = 0;
  const void* a = nullptr;         // [rows, k]
  const void* dy = nullptr;        // [rows, n]
  ExpertPtrs out;                  // per expert [n, k], row-major
  bool accumulate_all = false;
  const bool* accumulate_mask = nullptr;
  Splits splits;
  Config config = Config::kAuto;
};

// db[e, :] = sum of dy rows of expert e (fp32 out [E, n]).
struct BiasGradProblem {
  DType dtype = DType::kBF16;
  int64_t rows = 0, n = 0;
  const void* dy = nullptr;
  float* out = nullptr;
  Splits splits;
};

// All launchers throw std::runtime_error with a message naming the failing step (CUTLASS status included).
void run_forward(const ForwardProblem& p, const LaunchEnv& env);
void run_wgrad(const WgradProblem& p, const LaunchEnv& env);
void run_bias_grad(const BiasGradProblem& p, const LaunchEnv& env);

// Which architectures the library was compiled for (e.g. "sm90a sm100a"), and whether `arch` can run.
const char* compiled_archs();
bool arch_supported(int arch);

}  // namespace gg
}  // namespace moe_graph
