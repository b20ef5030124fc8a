// Torch glue of the fused expert activation: argument checks that name the tensor, allocation, threads / stream.
#include "activation/activation_ops.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <string>
#include <utility>

#include "activation/activation.h"
#include "common/torch_checks.h"

#ifdef MOE_GRAPH_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace moe_graph {
namespace {

constexpr const char* kFwd = "expert_activation";
constexpr const char* kBwd = "expert_activation_backward";

// The activation names of the op, in ActKind order (gated first, then plain).
constexpr std::pair<const char*, activation::ActKind> kKinds[] = {
    {"swiglu", activation::ActKind::kSwiglu},
    {"clamped_swiglu", activation::ActKind::kClampedSwiglu},
    {"limited_swiglu", activation::ActKind::kLimitedSwiglu},
    {"post_clamped_swiglu", activation::ActKind::kPostClampedSwiglu},
    {"softcapped_swiglu", activation::ActKind::kSoftcappedSwiglu},
    {"geglu_tanh", activation::ActKind::kGegluTanh},
    {"squared_relu", activation::ActKind::kSquaredRelu},
    {"relu", activation::ActKind::kRelu},
    {"silu", activation::ActKind::kSilu},
    {"gelu", activation::ActKind::kGelu},
};

activation::DType dtype_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return activation::DType::kF32;
    case at::kDouble: return activation::DType::kF64;
    case at::kBFloat16: return activation::DType::kBF16;
    default: return activation::DType::kF16;
  }
}

// Checks h, row_scale and the activation options; returns the problem without the output pointers.
activation::ActivationProblem check_and_describe(const char* op, const at::Tensor& h,
                                                 const std::optional<at::Tensor>& row_scale,
                                                 c10::string_view activation, double alpha, double limit) {
  activation::ActivationProblem p;
  bool known = false;
  for (const auto& [name, kind] : kKinds) {
    if (activation == name) {
      p.kind = kind;
      known = true;
    }
  }
  if (!known) {
    std::string names;
    for (const auto& kk : kKinds) names += std::string(names.empty() ? "\"" : ", \"") + kk.first + "\"";
    TORCH_CHECK(false, op, ": activation must be one of ", names, ", got \"", std::string(activation), "\"");
  }
  const bool gated = activation::is_gated(p.kind);
  TORCH_CHECK(std::isfinite(alpha) && alpha > 0, op, ": alpha (swiglu_alpha) must be a finite number > 0, got ",
              alpha);
  TORCH_CHECK(std::isfinite(limit) && limit > 0, op, ": limit (swiglu_limit) must be a finite number > 0, got ",
              limit);
  check_defined(h, op, "h");
  check_dim(h, 2, op, "h", gated ? "[N, 2F]" : "[N, F]");
  check_dtype(h, {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}, op, "h");
  TORCH_CHECK(!gated || h.size(1) % 2 == 0, op, ": h must have an even number of columns [N, 2F] (gate half, then "
              "up half) for the gated activation \"", std::string(activation), "\", got shape ", shape_str(h));
  check_contiguous(h, op, "h");
  p.rows = h.size(0);
  p.cols = gated ? h.size(1) / 2 : h.size(1);
  p.dtype = dtype_of(h.scalar_type());
  p.scale_dtype = activation::DType::kF32;
  p.alpha = alpha;
  p.limit = limit;
  p.h = h.data_ptr();
  if (row_scale.has_value() && row_scale->defined()) {
    const at::Tensor& s = *row_scale;
    check_dim(s, 1, op, "row_scale", "[N]");
    check_shape(s, {p.rows}, op, "row_scale");
    TORCH_CHECK(s.scalar_type() == at::kFloat || s.scalar_type() == h.scalar_type(), op,
                ": row_scale must have dtype Float or the dtype of h (", c10::toString(h.scalar_type()), "), got ",
                c10::toString(s.scalar_type()));
    check_device(s, h.device(), op, "row_scale");
    check_contiguous(s, op, "row_scale");
    p.scale_dtype = dtype_of(s.scalar_type());
    p.scale = s.data_ptr();
  }
  return p;
}

}  // namespace

activation::ActivationProblem describe_expert_activation(const char* op, const at::Tensor& h,
                                                         const std::optional<at::Tensor>& row_scale,
                                                         c10::string_view activation, double alpha, double limit) {
  return check_and_describe(op, h, row_scale, activation, alpha, limit);
}

namespace {

bool has_scale(const std::optional<at::Tensor>& row_scale) { return row_scale.has_value() && row_scale->defined(); }

at::Tensor forward_out(const at::Tensor& h, activation::ActivationProblem& p) {
  at::Tensor y = at::empty({p.rows, p.cols}, h.options());
  p.y = y.data_ptr();
  return y;
}

// write_grad_h false: grad_h is not computed into memory (an empty [0] tensor is returned in its place).
std::tuple<at::Tensor, at::Tensor> backward_out(const at::Tensor& grad_y, const at::Tensor& h,
                                                const std::optional<at::Tensor>& row_scale,
                                                activation::ActivationProblem& p, bool write_grad_h) {
  check_defined(grad_y, kBwd, "grad_y");
  check_shape(grad_y, {p.rows, p.cols}, kBwd, "grad_y");
  check_same_dtype(grad_y, h, kBwd, "grad_y", "h");
  check_device(grad_y, h.device(), kBwd, "grad_y");
  check_contiguous(grad_y, kBwd, "grad_y");
  at::Tensor grad_h = write_grad_h ? at::empty_like(h) : at::empty({0}, h.options());
  at::Tensor grad_scale = has_scale(row_scale) ? at::empty({p.rows}, row_scale->options())
                                               : at::empty({0}, h.options().dtype(at::kFloat));
  p.grad_y = grad_y.data_ptr();
  p.grad_h = write_grad_h ? grad_h.data_ptr() : nullptr;
  p.grad_scale = has_scale(row_scale) ? grad_scale.data_ptr() : nullptr;
  return {grad_h, grad_scale};
}

// Rows per parallel chunk: about 32K elements of h each.
int64_t cpu_grain(const activation::ActivationProblem& p) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, (activation::is_gated(p.kind) ? 2 : 1) * p.cols));
}

}  // namespace

at::Tensor expert_activation_cpu(const at::Tensor& h, const std::optional<at::Tensor>& row_scale,
                                c10::string_view activation, double alpha, double limit) {
  auto p = check_and_describe(kFwd, h, row_scale, activation, alpha, limit);
  at::Tensor y = forward_out(h, p);
  at::parallel_for(0, p.rows, cpu_grain(p),
                   [&](int64_t r0, int64_t r1) { activation::activation_forward_rows(p, r0, r1); });
  return y;
}

std::tuple<at::Tensor, at::Tensor> expert_activation_backward_cpu(const at::Tensor& grad_y, const at::Tensor& h,
                                                                 const std::optional<at::Tensor>& row_scale,
                                                                 c10::string_view activation, double alpha,
                                                                 double limit, bool write_grad_h) {
  auto p = check_and_describe(kBwd, h, row_scale, activation, alpha, limit);
  auto out = backward_out(grad_y, h, row_scale, p, write_grad_h);
  at::parallel_for(0, p.rows, cpu_grain(p),
                   [&](int64_t r0, int64_t r1) { activation::activation_backward_rows(p, r0, r1); });
  return out;
}

#ifdef MOE_GRAPH_WITH_CUDA
namespace {
int sm_count_of(const at::Tensor& t) { return at::cuda::getDeviceProperties(t.device().index())->multiProcessorCount; }
}  // namespace

at::Tensor expert_activation_cuda(const at::Tensor& h, const std::optional<at::Tensor>& row_scale,
                                 c10::string_view activation, double alpha, double limit) {
  c10::cuda::CUDAGuard guard(h.device());
  auto p = check_and_describe(kFwd, h, row_scale, activation, alpha, limit);
  at::Tensor y = forward_out(h, p);
  p.sm_count = sm_count_of(h);
  C10_CUDA_CHECK(activation::activation_forward_cuda(p, at::cuda::getCurrentCUDAStream(h.device().index()).stream()));
  return y;
}

std::tuple<at::Tensor, at::Tensor> expert_activation_backward_cuda(const at::Tensor& grad_y, const at::Tensor& h,
                                                                  const std::optional<at::Tensor>& row_scale,
                                                                  c10::string_view activation, double alpha,
                                                                  double limit, bool write_grad_h) {
  c10::cuda::CUDAGuard guard(h.device());
  auto p = check_and_describe(kBwd, h, row_scale, activation, alpha, limit);
  auto out = backward_out(grad_y, h, row_scale, p, write_grad_h);
  p.sm_count = sm_count_of(h);
  C10_CUDA_CHECK(activation::activation_backward_cuda(p, at::cuda::getCurrentCUDAStream(h.device().index()).stream()));
  return out;
}
#endif

}  // namespace moe_graph
