// Torch-level FP8 ops (schemas in csrc/bindings.cpp; semantics in fp8/quantize.h).
#pragma once
#include <ATen/ATen.h>

#include <c10/util/string_view.h>

#include <optional>
#include <tuple>
#include <vector>

namespace moe_graph {

// x [M, K] or [B, M, K] (fp32/bf16/fp16, contiguous; or FP8 [M, K] with x_scale, its rowwise scales
// [M, ceil(K/128)] fp32 or [M, ceil(K/32)] float8_e8m0fnu: requantized from decode(x) * x_scale), m_splits [E]
// int32/int64 (2-D x only) or None -> (q fp8_dtype [.., M, K] or [.., K, M] when transpose, scale fp32 scale_inv
// or float8_e8m0fnu (mx) [.., row_tiles, col_tiles] or [.., col_tiles, row_tiles]).
std::tuple<at::Tensor, at::Tensor> fp8_quantize_cpu(const at::Tensor& x, const std::optional<at::Tensor>& m_splits,
                                                    int64_t tile_rows, int64_t tile_cols, at::ScalarType fp8_dtype,
                                                    bool mx, double eps, bool pow2, bool transpose,
                                                    const std::optional<at::Tensor>& x_scale);
// Both copies in one pass over the tiles (one launch on CUDA): (q [M, K], scale) with tiles tiles[0] x tiles[1]
// and the transposed (q_t [K, M], scale_t) with tiles tiles[2] x tiles[3], of x [M, K] (2-D: fp32/bf16/fp16), or
// with `activation` of the fused activation act(h) * row_scale of h = x [M, 2K] (gated) / [M, K] (plain), the
// values expert_activation writes (its checks and options: alpha, limit, row_scale [M]); with `activation` and
// grad_y [M, F] (h's dtype), of expert_activation_backward's grad_h (q [M, W], q_t [W, M]); with grad_y, row_scale
// and grad_scale [M] (row_scale's dtype; rowwise tiles of one row), the row-scale gradient written into grad_scale.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fp8_quantize_pair_cpu(
    const at::Tensor& x, const std::optional<at::Tensor>& m_splits, at::IntArrayRef tiles, at::ScalarType fp8_dtype,
    bool mx, double eps, bool pow2, std::optional<c10::string_view> activation, double alpha, double limit,
    const std::optional<at::Tensor>& row_scale, const std::optional<at::Tensor>& grad_y,
    const std::optional<at::Tensor>& grad_scale);
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

// Test-only (tests/test_fp8_launch_logic.py): the CUDA launch plan (fp8/scaled_plan.h) as integers: forward
// (wgrad false: block_k, block_n, flag = has_bias) -> [kernel, run_offsets, run_gemm, arg_tail_blocks, offsets_bytes,
// argument_bytes, sfa_bytes, sfb_bytes]; wgrad (block_k = block_m, flag = accumulate) -> [kernel, run_offsets,
// run_gemm, zero_fill, offsets_bytes, argument_bytes, sfa_bytes, sfb_bytes]. Plan errors raise.
std::vector<int64_t> fp8_scaled_plan_probe(bool wgrad, int64_t arch, int64_t rows, int64_t num_experts, int64_t n,
                                           int64_t k, int64_t block_k, int64_t block_n, bool e8m0, bool flag);

#ifdef MOE_GRAPH_WITH_CUDA
std::tuple<at::Tensor, at::Tensor> fp8_quantize_cuda(const at::Tensor& x, const std::optional<at::Tensor>& m_splits,
                                                     int64_t tile_rows, int64_t tile_cols, at::ScalarType fp8_dtype,
                                                     bool mx, double eps, bool pow2, bool transpose,
                                                     const std::optional<at::Tensor>& x_scale);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fp8_quantize_pair_cuda(
    const at::Tensor& x, const std::optional<at::Tensor>& m_splits, at::IntArrayRef tiles, at::ScalarType fp8_dtype,
    bool mx, double eps, bool pow2, std::optional<c10::string_view> activation, double alpha, double limit,
    const std::optional<at::Tensor>& row_scale, const std::optional<at::Tensor>& grad_y,
    const std::optional<at::Tensor>& grad_scale);
at::Tensor fp8_scaled_grouped_gemm_cuda(const at::Tensor& a, const at::Tensor& a_scale, const at::Tensor& b,
                                        const at::Tensor& b_scale, const at::Tensor& m_splits, int64_t block_k,
                                        int64_t block_n, const std::optional<at::Tensor>& bias,
                                        at::ScalarType out_dtype);
void fp8_scaled_grouped_wgrad_out_cuda(const at::Tensor& a_t, const at::Tensor& a_scale, const at::Tensor& b_t,
                                       const at::Tensor& b_scale, const at::Tensor& m_splits, int64_t block_m,
                                       const at::Tensor& out, bool accumulate);
#endif

}  // namespace moe_graph
