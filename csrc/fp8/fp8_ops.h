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
#ifdef MOE_GRAPH_WITH_CUDA
std::tuple<at::Tensor, at::Tensor> fp8_quantize_cuda(const at::Tensor& x, const std::optional<at::Tensor>& m_splits,
                                                     int64_t tile_rows, int64_t tile_cols, at::ScalarType fp8_dtype,
                                                     bool mx, double eps, bool pow2, bool transpose);
#endif

}  // namespace moe_graph
