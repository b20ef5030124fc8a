// Torch-level FP8 ops (schemas in csrc/bindings.cpp; semantics in fp8/quantize.h).
#pragma once
#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace moe_graph {

// x [M, K] or [B, M, K] (fp32/bf16/fp16, contiguous), m_splits [E] int32/int64 (2-D x only) or None ->
// (q fp8_dtype [.., M, K] or [.., K, M] when transpose, scale fp32 scale_inv or float8_e8m0fnu (mx)
// [.., row_tiles, col_tiles] or [.., col_tiles, row_tiles]).
std::tuple<at::Tensor, at::Tensor> fp8_quantize_cpu(const at::Tensor& x, const std::optional<at::Tensor>& m_splits,
                                                    int64_t tile_rows, int64_t tile_cols, at::ScalarType fp8_dtype,
                                                    bool mx, double eps, bool pow2, bool transpose);
// Scaled grouped GEMM (semantics in fp8/scaled_gemm.h): a [M, K], b [E, N, K] FP8; a_scale [M, ceil(K/BK)],
// b_scale [E, ceil(N/BN), ceil(K/BK)] fp32 or float8_e8m0fnu; bias [E, N] fp32 or None -> [M, N] out_dtype.
at::Tensor fp8_scaled_grouped_gemm_cpu(const at::Tensor& a, const at::Tensor& a_scale, const at::Tensor& b,
                                       const at::Tensor& b_scale, const at::Tensor& m_splits, int64_t block_k,
                                       int64_t block_n, const std::optional<at::Tensor>& bias,
                                       at::ScalarType out_dtype);
// Wgrad: a_t = dy^T [N, M], b_t = x^T [K, M] FP8; a_scale [N, RT], b_scale [K, RT]; out [E, N, K] fp32 written
// (accumulate: added to).
void fp8_scaled_grouped_wgrad_out_cpu(const at::Tensor& a_t, const at::Tensor& a_scale, const at::Tensor& b_t,
                                      const at::Tensor& b_scale, const at::Tensor& m_splits, int64_t block_m,
                                      const at::Tensor& out, bool accumulate);

#ifdef MOE_GRAPH_WITH_CUDA
std::tuple<at::Tensor, at::Tensor> fp8_quantize_cuda(const at::Tensor& x, const std::optional<at::Tensor>& m_splits,
                                                     int64_t tile_rows, int64_t tile_cols, at::ScalarType fp8_dtype,
                                                     bool mx, double eps, bool pow2, bool transpose);
#endif

}  // namespace moe_graph
