// Torch-level grouped GEMM ops (schemas in csrc/bindings.cpp). The CPU versions define the semantics; the CUDA
// versions match them (fp32 accumulation, bias added in fp32, one rounding to the output dtype).
#pragma once
#include <ATen/ATen.h>

#include <optional>

namespace moe_graph {

at::Tensor grouped_gemm_cpu(const at::Tensor& a, at::TensorList b, const at::Tensor& m_splits, bool trans_b,
                            const std::optional<at::Tensor>& bias);
void grouped_gemm_out_cpu(const at::Tensor& a, at::TensorList b, const at::Tensor& m_splits, bool trans_b,
                          const std::optional<at::Tensor>& bias, const at::Tensor& out);
at::Tensor grouped_gemm_wgrad_cpu(const at::Tensor& a, const at::Tensor& dy, const at::Tensor& m_splits,
                                  std::optional<at::ScalarType> out_dtype);
void grouped_gemm_wgrad_out_cpu(const at::Tensor& a, const at::Tensor& dy, const at::Tensor& m_splits,
                                at::TensorList out, bool accumulate, const std::optional<at::Tensor>& accumulate_mask);
at::Tensor grouped_bias_grad_cpu(const at::Tensor& dy, const at::Tensor& m_splits);

#ifdef MOE_GRAPH_WITH_CUDA
at::Tensor grouped_gemm_cuda(const at::Tensor& a, at::TensorList b, const at::Tensor& m_splits, bool trans_b,
                             const std::optional<at::Tensor>& bias);
void grouped_gemm_out_cuda(const at::Tensor& a, at::TensorList b, const at::Tensor& m_splits, bool trans_b,
                           const std::optional<at::Tensor>& bias, const at::Tensor& out);
at::Tensor grouped_gemm_wgrad_cuda(const at::Tensor& a, const at::Tensor& dy, const at::Tensor& m_splits,
                                   std::optional<at::ScalarType> out_dtype);
void grouped_gemm_wgrad_out_cuda(const at::Tensor& a, const at::Tensor& dy, const at::Tensor& m_splits,
                                 at::TensorList out, bool accumulate,
                                 const std::optional<at::Tensor>& accumulate_mask);
at::Tensor grouped_bias_grad_cuda(const at::Tensor& dy, const at::Tensor& m_splits);
#endif

}  // namespace moe_graph
