// Fused activation of the expert MLPs (torch-free). Semantics in activation/activation_math.h:
//
//   forward   h [N, W] (W = 2F for a gated kind: gate half, then up half; W = F for a plain kind; row-major) and an
//             optional row scale s [N] -> y [N, F] = act(h) * s[:, None]
//   backward  dy [N, F], h, s -> dh [N, W], ds [N] (ds only with a scale: ds[r] = sum_f dy[r, f] * act[r, f])
//
// h, y, dy and dh share one dtype (fp32, fp64, bf16 or fp16); s and ds are fp32 or that dtype. The math runs in
// double for fp64 data and in float otherwise; every output element is rounded once.
#pragma once
#include <cstdint>
#include <type_traits>

#include "activation/activation_math.h"

#ifdef MOE_GRAPH_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace moe_graph {
namespace activation {

enum class DType : int { kF32 = 0, kF64 = 1, kBF16 = 2, kF16 = 3 };

struct ActivationProblem {
  int64_t rows = 0;  // N
  int64_t cols = 0;  // F (h has 2F columns for a gated kind, F for a plain one)
  DType dtype = DType::kF32;        // h, y, grad_y, grad_h
  DType scale_dtype = DType::kF32;  // scale, grad_scale (fp32 or dtype)
  ActKind kind = ActKind::kSwiglu;
  double alpha = 1.702, limit = 7.0;  // clamped_swiglu (alpha, limit); limited_ / post_clamped_swiglu (limit);
                                      // softcapped_swiglu (alpha: the gate's cap, limit: the up half's cap)
  const void* h = nullptr;            // [N, 2F] / [N, F]
  const void* scale = nullptr;        // [N] or nullptr (scale 1)
  void* y = nullptr;                  // forward: [N, F]
  const void* grad_y = nullptr;       // backward: [N, F]
  void* grad_h = nullptr;             // backward: like h (nullptr: not written, the scale gradient only)
  void* grad_scale = nullptr;         // backward: [N] (nullptr: not computed; needs scale)
  int sm_count = 1;                   // CUDA: multiprocessors of the device (sizes the grid)
};

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls f(std::integral_constant<ActKind, K>, TypeTag<T>, TypeTag<S>) for the problem's kind, storage type T and
// scale type S (without a scale S is float and unused).
template <typename F>
void dispatch_activation(const ActivationProblem& p, F&& f) {
  auto with_kind = [&](auto t, auto s) {
    switch (p.kind) {
      case ActKind::kSwiglu: f(std::integral_constant<ActKind, ActKind::kSwiglu>{}, t, s); break;
      case ActKind::kClampedSwiglu: f(std::integral_constant<ActKind, ActKind::kClampedSwiglu>{}, t, s); break;
      case ActKind::kLimitedSwiglu: f(std::integral_constant<ActKind, ActKind::kLimitedSwiglu>{}, t, s); break;
      case ActKind::kPostClampedSwiglu:
        f(std::integral_constant<ActKind, ActKind::kPostClampedSwiglu>{}, t, s);
        break;
      case ActKind::kSoftcappedSwiglu:
        f(std::integral_constant<ActKind, ActKind::kSoftcappedSwiglu>{}, t, s);
        break;
      case ActKind::kGegluTanh: f(std::integral_constant<ActKind, ActKind::kGegluTanh>{}, t, s); break;
      case ActKind::kSquaredRelu: f(std::integral_constant<ActKind, ActKind::kSquaredRelu>{}, t, s); break;
      case ActKind::kRelu: f(std::integral_constant<ActKind, ActKind::kRelu>{}, t, s); break;
      case ActKind::kSilu: f(std::integral_constant<ActKind, ActKind::kSilu>{}, t, s); break;
      case ActKind::kGelu: f(std::integral_constant<ActKind, ActKind::kGelu>{}, t, s); break;
    }
  };
  auto with_scale = [&](auto t) {
    using T = typename decltype(t)::type;
    if (p.scale_dtype == DType::kF32)
      with_kind(t, TypeTag<float>{});
    else
      with_kind(t, TypeTag<T>{});
  };
  switch (p.dtype) {
    case DType::kF32: with_scale(TypeTag<float>{}); break;
    case DType::kF64: with_scale(TypeTag<double>{}); break;
    case DType::kBF16: with_scale(TypeTag<bf16_t>{}); break;
    case DType::kF16: with_scale(TypeTag<f16_t>{}); break;
  }
}

// CPU: rows [row_begin, row_end) of the forward / backward (callers split the rows across threads).
void activation_forward_rows(const ActivationProblem& p, int64_t row_begin, int64_t row_end);
void activation_backward_rows(const ActivationProblem& p, int64_t row_begin, int64_t row_end);

#ifdef MOE_GRAPH_WITH_CUDA
// One launch each on `stream` (none when there is nothing to write); no host synchronization (capturable).
// Vectorized, grid-stride over the rows, each row walked by a group of lanes of one warp; the scale gradient is a
// shuffle reduction over the row's lanes (no atomics).
cudaError_t activation_forward_cuda(const ActivationProblem& p, cudaStream_t stream);
cudaError_t activation_backward_cuda(const ActivationProblem& p, cudaStream_t stream);
#endif

}  // namespace activation
}  // namespace moe_graph
