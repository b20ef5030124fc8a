// Torch-level grouped GEMM ops (schemas in csrc/bindings.cpp). The CPU versions define the semantics; the CUDA
// versions match them (fp32 accumulation, bias added in fp32, one rounding to the output dtype).
#pragma once
#include <ATen/ATen.h>

#include <functional>
#include <optional>
#include <vector>

#ifdef MOE_GRAPH_WITH_CUDA
#include "grouped_gemm/grouped_gemm.h"
#endif

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

// Shared by the CUDA ops that launch through gg::LaunchEnv (grouped GEMM, FP8 scaled GEMM): the current device's
// environment (SM count less torch's carve-out, arch, stream, error flag) with workspace from PyTorch's caching
// allocator kept alive in `keep`; m_splits as gg::Splits; launcher errors (std::runtime_error) as torch errors
// prefixed with `op`.
gg::LaunchEnv make_env(const at::Tensor& like, std::vector<at::Tensor>& keep);
gg::Splits to_splits(const at::Tensor& m_splits);
void run_guarded(const char* op, const std::function<void()>& f);
#endif

}  // namespace moe_graph
