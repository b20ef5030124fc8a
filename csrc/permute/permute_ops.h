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
// as +0 + x (reduce_rows' one-route sum: -0 becomes +0). route_of_row None: row i is src's row i (K = 1, m = n).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> expand_quantize_pair_cpu(
    const at::Tensor& src, const c10::optional<at::Tensor>& route_of_row, int64_t topk, const at::Tensor& m_splits,
    at::IntArrayRef tiles, at::ScalarType fp8_dtype, bool mx, double eps, bool pow2,
    const c10::optional<at::Tensor>& weights, int64_t packed_cols, bool plus_zero);
// With packed_cols > 0, src is packed FP8 rows [n, B] uint8 of packed_cols elements (permute/expand_quantize.h) and
// weights None: the rowwise copy is their bytes and scales, the columnwise copy quantized from their dequantized values.
// plus_zero: each element read as +0 + x (reduce_rows' one-route sum: -0 reads as +0), weights None.
// pack_rows of expand_rows(src, route_of_row, K) (route_of_row None: the rows of src, K = 1) -> uint8 [m, B].
at::Tensor expand_quantize_pack_cpu(const at::Tensor& src, const c10::optional<at::Tensor>& route_of_row, int64_t K,
                                    at::ScalarType fp8_dtype, bool mx, double eps, bool pow2);

#ifdef MOE_GRAPH_WITH_CUDA
at::Tensor expand_rows_cuda(const at::Tensor& src, const at::Tensor& route_of_row, int64_t topk,
                            const c10::optional<at::Tensor>& weights);
at::Tensor reduce_rows_cuda(const at::Tensor& src, const at::Tensor& route_rows,
                            const c10::optional<at::Tensor>& weights);
at::Tensor route_dot_cuda(const at::Tensor& rows, const at::Tensor& src, const at::Tensor& route_rows);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> expand_quantize_pair_cuda(
    const at::Tensor& src, const c10::optional<at::Tensor>& route_of_row, int64_t topk, const at::Tensor& m_splits,
    at::IntArrayRef tiles, at::ScalarType fp8_dtype, bool mx, double eps, bool pow2,
    const c10::optional<at::Tensor>& weights, int64_t packed_cols, bool plus_zero);
at::Tensor expand_quantize_pack_cuda(const at::Tensor& src, const c10::optional<at::Tensor>& route_of_row, int64_t K,
                                     at::ScalarType fp8_dtype, bool mx, double eps, bool pow2);
#endif

}  // namespace moe_graph
