// expand_quantize: the expert input's FP8 copies written straight from the tokens (torch-free). Semantics:
//
//   src [n, H] (fp32 / bf16 / fp16), route_of_row [m] int64 (expand_rows' index, permute.h: row i is token
//   route_of_row[i] / K, the sentinel n*K a zero row), K, and one or two fp8::QuantizeProblem (fp8/quantize.h) over
//   rows = m, cols = H (x = src, in_type src's; m_splits, tiles, format, scales, transpose as for fp8_quantize),
//   optional weights [n*K] fp32 (one per route): every output byte and scale equals fp8_quantize of
//   expand_rows(src, route_of_row, K, weights) with that problem, without the expanded [m, H] rows in memory. Each
//   element is read through LoadRoute (the row's token, then fp8::load_x; with weights, w[route] * x rounded to
//   src's dtype as expand_rows writes it: the combine's backward handing fc2 its FP8 output gradient), the tiles
//   are the quantizer's (fp8::locate_tile, tile_scale, quantize_value, amax_update), rows past sum(m_splits) zero
//   (fp8::quantize_tail_cpu's rule), the m_splits error bits the quantizer's. With plus_zero (no weights), each
//   element reads as +0 + x: reduce_rows' one-route sum (permute.h: accumulated from +0, so -0 reads as +0), the
//   bytes of quantizing reduce_rows(src, route_rows [m, 1]) for K = 1 (the combine's backward at EP > 1: fc2's
//   output gradient regrouped from the received rows).
//
//   An index outside [0, n*K] reads as the sentinel (a zero row). The CPU glue refuses one before writing; the CUDA
//   kernel sets kErrIndexOutOfRange for such an index of a row inside the groups (the rows the tiles read).
//
//   CUDA: one launch for both problems (rowwise and columnwise copy), one block per tile, then the blocks that zero
//   the rows past sum(m_splits); 32-bit index math (sizes, tile counts, n*K < 2^31: expand_quantize_ok).
#pragma once
#include <cstdint>

#include "common/host_device.h"
#include "fp8/quantize.h"

#ifdef MOE_GRAPH_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace moe_graph {
namespace permute {

struct ExpandRoutes {
  const int64_t* route_of_row = nullptr;  // [m]
  int64_t tokens = 0, topk = 0;           // n, K
  const float* weights = nullptr;         // [n*K] or null: each route's row weight (expand_rows' weights)
  bool plus_zero = false;                 // each element read as +0 + x (reduce_rows' one-route sum); no weights
};

// w * x rounded to the input's dtype (fp32 / bf16 / fp16, round to nearest even): expand_rows' weighted element.
MOE_GRAPH_HD float round_to_input(const fp8::QuantizeProblem& p, float v) {
  if (p.in_type == fp8::InType::kBF16) return activation::widen(activation::Narrow<activation::bf16_t>::to(v));
  if (p.in_type == fp8::InType::kF16) return activation::widen(activation::Narrow<activation::f16_t>::to(v));
  return v;
}

MOE_GRAPH_HD bool route_in_range(int64_t r, int64_t sentinel) { return r >= 0 && r <= sentinel; }

// The value of element (r, c) of expand_rows(src, route_of_row, K, weights): src[route / K][c] (times
// weights[route], rounded to src's dtype), 0 for the sentinel (and for an out-of-range route). 32-bit division:
// n*K < 2^31 (expand_quantize_ok).
struct LoadRoute {
  ExpandRoutes e;
  MOE_GRAPH_HD float operator()(const fp8::QuantizeProblem& p, int64_t, int64_t r, int64_t c) const {
    const int64_t route = e.route_of_row[r];
    if (route < 0 || route >= e.tokens * e.topk) return 0.0f;
    const int64_t token = static_cast<uint32_t>(route) / static_cast<uint32_t>(e.topk);
    const float x = fp8::load_x(p, 0, token, c);  // x = src [n, H]: element (token, c)
    if (e.weights != nullptr) return round_to_input(p, e.weights[route] * x);
    return e.plus_zero ? 0.0f + x : x;  // +0 + x: -0 reads as +0 (exact otherwise; no fast-math folds it)
  }
};

// The problem sizes the CUDA kernel's 32-bit index math covers (the CUDA op checks this first, with a message).
inline bool expand_quantize_ok(const fp8::QuantizeProblem& p, const ExpandRoutes& e) {
  return fp8::index32_ok(p) && e.tokens * e.topk <= fp8::kMaxIndex32 && e.topk <= fp8::kMaxIndex32;
}

// CPU: tiles [t0, t1) of p's row_tiles * col_tiles (callers split them over threads); the tail (rows past
// sum(m_splits), error bits) is fp8::quantize_tail_cpu(p). Returns whether a row of a tile holds an out-of-range
// route (the glue refuses those before, so this is the emulator comparison's flag).
bool expand_quantize_tiles_host(const fp8::QuantizeProblem& p, const ExpandRoutes& e, int64_t t0, int64_t t1);

#ifdef MOE_GRAPH_WITH_CUDA
// p0 and, when p1 is not null, p1 (the same src, routes and m_splits) in one launch (none when there is nothing to
// write) on `stream`; no host synchronization (capturable). cudaErrorInvalidValue past expand_quantize_ok.
cudaError_t expand_quantize_cuda_launch(const fp8::QuantizeProblem& p0, const fp8::QuantizeProblem* p1,
                                        const ExpandRoutes& e, int32_t* error_flag, cudaStream_t stream);
#endif

}  // namespace permute
}  // namespace moe_graph
