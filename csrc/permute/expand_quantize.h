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
//   Packed FP8 rows (ExpandRoutes::packed; ops/fp8.py pack_rows' layout, FP8 dispatch): each row `stride` bytes, its
//   `cols` FP8 bytes, then its scales: ceil(cols / 128) fp32 scale_inv (little-endian, at any byte offset) or, with
//   e8m0, ceil(cols / 32) E8M0 bytes. With `packed.src` the source is such rows [n, stride] (uint8) and every element
//   reads as decode(byte) * its scale in fp32 (the value fp8::load_x gives an FP8 x with its x_scale); the rowwise
//   problem, whose tiles must then be the source's (1 x 128 fp32 / 1 x 32 E8M0), copies each row's bytes and
//   scales instead of requantizing them (a sentinel row: zero bytes and zero scale entries, what a zero packed row
//   holds), the columnwise problem quantizes the dequantized values (fp8_quantize with x_scale: the FP8-dispatched
//   rows' wgrad copy). With `packed.out` the one (rowwise, not transposed, tiles of one row, no m_splits) problem
//   writes packed rows [m, stride] instead of q and scale: every row quantized as fp8_quantize would, its scale
//   entries after its bytes (a sentinel row: all zero bytes), i.e. pack_rows of expand_rows(src, route_of_row, K).
//   A null route_of_row reads row i as route i with K = 1 (m = n: the tokens themselves).
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

struct PackedRows {  // packed FP8 rows (see above); neither pointer set: src [n, H] and q / scale as usual
  const uint8_t* src = nullptr;  // the source rows [n, stride]
  uint8_t* out = nullptr;        // the rowwise problem's output rows [m, stride]
  int64_t cols = 0, stride = 0;  // H, bytes per row
  fp8::Format format = fp8::Format::kE4M3;  // the source's FP8 format
  bool e8m0 = false;                        // E8M0 scales of 1 x 32 tiles, else fp32 of 1 x 128
};

struct ExpandRoutes {
  const int64_t* route_of_row = nullptr;  // [m]; nullptr: row i is route i (K = 1)
  int64_t tokens = 0, topk = 0;           // n, K
  const float* weights = nullptr;         // [n*K] or null: each route's row weight (expand_rows' weights)
  PackedRows packed;                      // packed FP8 source rows (then weights is null)
  bool plus_zero = false;                 // each element read as +0 + x (reduce_rows' one-route sum); no weights
};

// w * x rounded to the input's dtype (fp32 / bf16 / fp16, round to nearest even): expand_rows' weighted element.
MOE_GRAPH_HD float round_to_input(const fp8::QuantizeProblem& p, float v) {
  if (p.in_type == fp8::InType::kBF16) return activation::widen(activation::Narrow<activation::bf16_t>::to(v));
  if (p.in_type == fp8::InType::kF16) return activation::widen(activation::Narrow<activation::f16_t>::to(v));
  return v;
}

MOE_GRAPH_HD bool route_in_range(int64_t r, int64_t sentinel) { return r >= 0 && r <= sentinel; }

MOE_GRAPH_HD int64_t row_route(const ExpandRoutes& e, int64_t r) { return e.route_of_row ? e.route_of_row[r] : r; }

// The token of row r (-1: the sentinel or an out-of-range route). 32-bit division: n*K < 2^31 (expand_quantize_ok).
MOE_GRAPH_HD int64_t row_token(const ExpandRoutes& e, int64_t r) {
  const int64_t route = row_route(e, r);
  if (route < 0 || route >= e.tokens * e.topk) return -1;
  return static_cast<uint32_t>(route) / static_cast<uint32_t>(e.topk);
}

MOE_GRAPH_HD int64_t packed_scale_bytes(const PackedRows& k) { return k.e8m0 ? 1 : 4; }

// Scale entry st of a packed row (fp32 read byte by byte: a row's scales may sit at any byte offset).
MOE_GRAPH_HD float packed_scale(const PackedRows& k, const uint8_t* row, int64_t st) {
  const uint8_t* b = row + k.cols + st * packed_scale_bytes(k);
  if (k.e8m0) return fp8::e8m0_value(b[0]);
  return fp8::bits_float(uint32_t(b[0]) | uint32_t(b[1]) << 8 | uint32_t(b[2]) << 16 | uint32_t(b[3]) << 24);
}

// The value of element (r, c) of expand_rows(src, route_of_row, K, weights): src[route / K][c] (a packed source's
// decode(byte) * scale; with weights, times weights[route] rounded to src's dtype), 0 for the sentinel (and for an
// out-of-range route).
struct LoadRoute {
  ExpandRoutes e;
  MOE_GRAPH_HD float operator()(const fp8::QuantizeProblem& p, int64_t, int64_t r, int64_t c) const {
    const int64_t token = row_token(e, r);
    if (token < 0) return 0.0f;
    if (e.packed.src) {
      const uint8_t* row = e.packed.src + token * e.packed.stride;
      return fp8::dequantize_byte(e.packed.format, row[c], packed_scale(e.packed, row, c >> (e.packed.e8m0 ? 5 : 7)));
    }
    const float x = fp8::load_x(p, 0, token, c);  // x = src [n, H]: element (token, c)
    if (e.weights != nullptr) return round_to_input(p, e.weights[row_route(e, r)] * x);
    return e.plus_zero ? 0.0f + x : x;  // +0 + x: -0 reads as +0 (exact otherwise; no fast-math folds it)
  }
};

// Packed source, rowwise problem: the scale entry (rt, ct) of row r is its source row's entry ct (0: sentinel).
MOE_GRAPH_HD void copy_packed_scale(const fp8::QuantizeProblem& p, const ExpandRoutes& e, int64_t r, int64_t rt,
                                    int64_t ct) {
  const int64_t token = row_token(e, r), si = fp8::scale_index(p, 0, rt, ct);
  const uint8_t* row = e.packed.src + (token < 0 ? 0 : token) * e.packed.stride;
  if (e.packed.e8m0)
    static_cast<uint8_t*>(p.scale)[si] = token < 0 ? 0 : row[e.packed.cols + ct];
  else
    static_cast<float*>(p.scale)[si] = token < 0 ? 0.0f : packed_scale(e.packed, row, ct);
}

// Packed source, rowwise problem: byte (r, c) is its source row's (0: sentinel).
MOE_GRAPH_HD void copy_packed_byte(const fp8::QuantizeProblem& p, const ExpandRoutes& e, int64_t r, int64_t c) {
  const int64_t token = row_token(e, r);
  p.q[fp8::q_index(p, 0, r, c)] = token < 0 ? 0 : e.packed.src[token * e.packed.stride + c];
}

// Packed output: the scale of row r's tile ct from its amax, stored after the row's bytes (zero bytes for a sentinel
// row, whose elements are 0 whatever the factor); returns the factor.
MOE_GRAPH_HD float pack_tile_scale(const fp8::QuantizeProblem& p, const ExpandRoutes& e, float amax, int64_t r,
                                   int64_t ct) {
  fp8::TileScale t;  // a sentinel row: factor 1, zero entry bytes
  t.inv = 0.0f;
  t.e8m0 = 0;
  if (row_token(e, r) >= 0) t = fp8::tile_scale_value(p, amax);
  uint8_t* b = e.packed.out + r * e.packed.stride + e.packed.cols + ct * packed_scale_bytes(e.packed);
  if (e.packed.e8m0) {
    b[0] = t.e8m0;
  } else {
    const uint32_t u = fp8::float_bits(t.inv);
    for (int i = 0; i < 4; ++i) b[i] = static_cast<uint8_t>(u >> (8 * i));
  }
  return t.mult;
}

// Writes element (r, c) of value v under the factor mult: to q, or to the packed output row.
MOE_GRAPH_HD void expand_quantize_value(const fp8::QuantizeProblem& p, const ExpandRoutes& e, float v, float mult,
                                        int64_t r, int64_t c) {
  if (e.packed.out)
    e.packed.out[r * e.packed.stride + c] = fp8::quantized_byte(p, v, mult);
  else
    fp8::quantize_value(p, v, mult, 0, r, c);
}

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
