// Torch-level row expansion / reduction ops (schemas in csrc/bindings.cpp; semantics in permute/permute.h).
#pragma once
#include <ATen/ATen.h>

#include <c10/util/Optional.h>

#include <tuple>

namespace moe_graph {

// src [n, H], route_of_row [m] int64, K >= 0, weights [n, K] or None -> out [m, H] of src's dtype.
at::Tensor expand_rows_cpu(const at::Tensor& src, const at::Tensor& route_of_row, int64_t topk,
                           const c10::optional<at::Tensor>& weights);
// src [m, H], route_rows [n, K] int64, weights [n, K] or None -> out [n, H] of src's dtype.
at::Tensor reduce_rows_cpu(const at::Tensor& src, const at::Tensor& route_rows, const c10::optional<at::Tensor>& weights);
// rows [n, H], src [m, H] (same dtype), route_rows [n, K] int64 -> [n, K] float32 (float64 for float64 data).
at::Tensor route_dot_cpu(const at::Tensor& rows, const at::Tensor& src, const at::Tensor& route_rows);
// The FP8 copies of expand_rows(src, route_of_row, K) (permute/expand_quantize.h), without the expanded rows:
// src [n, H] fp32/bf16/fp16, m_splits [E] int32/int64 grouping the m rows, tiles [rowwise TR, TC, columnwise TR,
// TC], weights [n, K] (src's dtype or fp32) or None -> (q [m, H], scale, q_t [H, m], scale_t), bit-equal to
// fp8_quantize_pair of expand_rows(src, route_of_row, K, weights); plus_zero (no weights): of each element read
// as +0 + x (reduce_rows' one-route sum: -0 becomes +0).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> expand_quantize_pair_cpu(
    const at::Tensor& src, const at::Tensor& route_of_row, int64_t topk, const at::Tensor& m_splits,
    at::IntArrayRef tiles, at::ScalarType fp8_dtype, bool mx, double eps, bool pow2,
    const c10::optional<at::Tensor>& weights, bool plus_zero);

#ifdef MOE_GRAPH_WITH_CUDA
at::Tensor expand_rows_cuda(const at::Tensor& src, const at::Tensor& route_of_row, int64_t topk,
                            const c10::optional<at::Tensor>& weights);
at::Tensor reduce_rows_cuda(const at::Tensor& src, const at::Tensor& route_rows,
                            const c10::optional<at::Tensor>& weights);
at::Tensor route_dot_cuda(const at::Tensor& rows, const at::Tensor& src, const at::Tensor& route_rows);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> expand_quantize_pair_cuda(
    const at::Tensor& src, const at::Tensor& route_of_row, int64_t topk, const at::Tensor& m_splits,
    at::IntArrayRef tiles, at::ScalarType fp8_dtype, bool mx, double eps, bool pow2,
    const c10::optional<at::Tensor>& weights, bool plus_zero);
#endif

}  // namespace moe_graph
