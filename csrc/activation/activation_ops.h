// Torch-level fused expert activation ops (schemas in csrc/bindings.cpp; semantics in activation/activation.h).
#pragma once
#include <ATen/ATen.h>

#include <c10/util/string_view.h>

#include <optional>
#include <tuple>

namespace moe_graph {

namespace activation {
struct ActivationProblem;
}

// The checks of expert_activation (naming `op` in its errors) and the problem they describe (h, row_scale, kind,
// alpha, limit; no outputs): the FP8 quantizer's fused activation input (fp8_quantize_pair) runs the same ones.
activation::ActivationProblem describe_expert_activation(const char* op, const at::Tensor& h,
                                                         const std::optional<at::Tensor>& row_scale,
                                                         c10::string_view activation, double alpha, double limit);

// h [N, 2F] (gated) or [N, F] (plain) contiguous (fp32/fp64/bf16/fp16), row_scale [N] contiguous (fp32 or h's
// dtype) or None, activation "swiglu" | "clamped_swiglu" | "limited_swiglu" | "post_clamped_swiglu" |
// "softcapped_swiglu" | "geglu_tanh" (gated) | "squared_relu" | "relu" | "silu" | "gelu" (plain) -> y [N, F] in h's
// dtype.
at::Tensor expert_activation_cpu(const at::Tensor& h, const std::optional<at::Tensor>& row_scale,
                                c10::string_view activation, double alpha, double limit);
// grad_y [N, F] -> (grad_h like h, grad_row_scale [N] in row_scale's dtype, or [0] fp32 without a scale);
// write_grad_h false: grad_h is not written (returned as an empty [0] tensor), the row-scale gradient only.
std::tuple<at::Tensor, at::Tensor> expert_activation_backward_cpu(const at::Tensor& grad_y, const at::Tensor& h,
                                                                 const std::optional<at::Tensor>& row_scale,
                                                                 c10::string_view activation, double alpha,
                                                                 double limit, bool write_grad_h);

#ifdef MOE_GRAPH_WITH_CUDA
at::Tensor expert_activation_cuda(const at::Tensor& h, const std::optional<at::Tensor>& row_scale,
                                 c10::string_view activation, double alpha, double limit);
std::tuple<at::Tensor, at::Tensor> expert_activation_backward_cuda(const at::Tensor& grad_y, const at::Tensor& h,
                                                                  const std::optional<at::Tensor>& row_scale,
                                                                  c10::string_view activation, double alpha,
                                                                  double limit, bool write_grad_h);
#endif

}  // namespace moe_graph
