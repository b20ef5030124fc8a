// FP8 quantization in tiles, per expert group (torch-free). One op covers TransformerEngine's recipes:
//
//   x [B, M, K] (fp32 / bf16 / fp16), optional m_splits [E] (B == 1 only; int32 or int64, on x's device): the rows
//   are grouped in expert order, rows past sum(m_splits) belong to no group. Without m_splits each batch entry is
//   one group of M rows.
//
//   A tile is TR rows x TC columns of one group, counted from the group's first row and from column 0; the last
//   tile of a group (or of the columns) may be partial: it is quantized as if padded with zeros (TE's references
//   pad). TR == 0 means "all rows of the group", TC == 0 "all columns":
//     1 x 128 (TR 1, TC 128)    Float8BlockScaling activations / gradients, rowwise copy
//     128 x 1                   their columnwise copy (written transposed)
//     128 x 128                 Float8BlockScaling weights ([E, N, K] with B = E)
//     1 x 32 / 32 x 1 (mx)      MXFP8BlockScaling rowwise / columnwise
//     0 x 0                     Float8CurrentScaling (one scale per group)
//
//   Row tiles are numbered group after group: group g's tiles start at sum_{h<g} tiles(h), tiles(h) =
//   ceil(m_h / TR) (1 with TR == 0, zero-token groups included). The scale tensor has `row_tiles` rows (a static
//   capacity >= the tiles any m_splits can need); entries of no tile hold 1 (fp32) / 127 (E8M0 = 1.0).
//
//   Outputs: q [B, M, K] (or [B, K, M] when `transpose`: q_t[b, c, r] = q[b, r, c]) as FP8 bytes, zero on rows past
//   sum(m_splits); scale [B, row_tiles, col_tiles] (or [B, col_tiles, row_tiles] when `transpose`), fp32 scale_inv
//   (the dequantization factor: x ~ decode(q) * scale_inv) or, with `mx`, E8M0 bytes.
//
//   Per tile: amax = max |x| (NaN propagates); fp32 scales by fp8::scale_from_amax (eps, pow2, inf_scale), MX by
//   fp8::e8m0_from_amax; q = encode_fp8(float(x) * scale) (MX: * e8m0_quant_mult(e)).
//
//   Non-finite input (the rule of docs/fp8.md): a tile holding a NaN gets a NaN scale (fp32 scale_inv +NaN, E8M0
//   0xFF) and every byte 0x7F; a tile holding +-inf and no NaN gets fp32 scale_inv +inf with bytes 0x7F for the
//   infs and +-0 for the rest (x * 0), or E8M0 0xFE (2^127) with bytes +-max for the infs and x * 2^-127 for the
//   rest. Each such tile sets `*nonfinite_flag` (an int32 the optimizer's inf check reads; nullptr: not flagged).
//
//   sum(m_splits) > M sets kErrSplitsOverflow (groups are clipped at M), a negative count kErrNegativeSplit (0).
//
//   Fused activation (producer of fc2's input): with `has_act`, the values quantized are the expert activation's
//   output y = act(h) * s rounded to h's dtype (activation/activation.h: `act` describes h [M, W], its kind and
//   row scale s; K = act.cols), computed per element from h by the same functions expert_activation runs, so the
//   bytes equal quantizing expert_activation's y, without y in memory. x is unused.
//
//   Fused activation backward (producer of fc1's FP8 dy): with `has_act` and `act_grad`, the values quantized are
//   the activation backward's grad_h [M, W] (W = 2F gated, F plain; K = W, act.cols = F) for the output gradient
//   g = act.grad_y [M, F]: grad_h[r, c] = g[r, f] * s[r] * d act / d a (c = f < F) or d act / d b (gated, c = F + f),
//   rounded to h's dtype, computed per element from g, h and s by the functions expert_activation_backward runs
//   (LoadActGrad), so the bytes equal quantizing its grad_h, without grad_h in memory.
//
//   Row-scale gradient in the same pass: with act_grad, act.grad_scale (nullptr: none; needs act.scale) and rowwise
//   tiles of one row and at most 256 columns (TR == 1, 1 <= TC <= 256, not transposed: the rowwise problem of
//   Float8BlockScaling / MXFP8, row_tiles == M; row_dot),
//   ds[r] = sum_f g[r, f] * act(h)[r, f] (rounded once to the scale's dtype) for every row r < M, rows past
//   sum(m_splits) included, as expert_activation_backward defines it. The CPU sums in column order (bit-equal to
//   expert_activation_backward's CPU implementation, which it runs); the CUDA kernel, like expert_activation's,
//   in its own order: one block per row, thread t summing the products of column c0 + t of each of the row's
//   column tiles (c0 the tile's first column) in column order, then a tree over the block's 256 threads: within
//   fp32 summation rounding of the CPU's (the emulator compares them with expert_activation's tolerance).
//
//   Pair (quantize_pair_cuda): two problems over the same input in one launch (the rowwise and the columnwise
//   copy), each with its own tiles, layout and outputs; the CPU runs them one after the other.
//
//   FP8 input (requantization): x [M, K] FP8 bytes (E4M3 / E5M2) with their rowwise scales x_scale [M, ceil(K / XC)]
//   (fp32 scale_inv with XC = 128: Float8BlockScaling's 1 x 128 tiles; E8M0 with XC = 32: MXFP8's 1 x 32) are read
//   as the fp32 decode(x) * x_scale (e8m0_value for E8M0), the values `dequantize` gives, and quantized as above
//   (an infinite scale becomes fp32's largest value): one pass from the rowwise copy that crossed the exchange to
//   the columnwise copy of the wgrad, without the fp32 rows in memory.
#pragma once
#include <cstdint>
#include <type_traits>

#include "activation/activation.h"
#include "common/host_device.h"
#include "fp8/fp8_math.h"

#ifdef MOE_GRAPH_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace moe_graph {
namespace fp8 {

enum class InType : int { kF32 = 0, kBF16 = 1, kF16 = 2, kE4M3 = 3, kE5M2 = 4 };

struct QuantizeProblem {
  int64_t batch = 1, rows = 0, cols = 0;  // B, M, K
  InType in_type = InType::kF32;
  Format format = Format::kE4M3;
  const void* x = nullptr;
  const void* x_scale = nullptr;  // FP8 input only: [M, x_scale_cols] fp32 or E8M0 (x_scale_e8m0)
  bool x_scale_e8m0 = false;
  int64_t x_scale_cols = 0;  // ceil(K / XC): XC = 128 with fp32 scales, 32 with E8M0 (x_scale_shift)
  const void* m_splits = nullptr;  // [E] or nullptr
  bool splits_i64 = false;
  int64_t groups = 0;  // E (0 without m_splits)
  int64_t tile_rows = 1, tile_cols = 128;  // TR, TC (0: all)
  int64_t row_tiles = 0, col_tiles = 0;    // scale capacity
  bool mx = false;
  float eps = 0.0f;
  bool pow2 = false;
  float inf_scale = 3.40282347e38f;
  bool transpose = false;
  uint8_t* q = nullptr;
  void* scale = nullptr;  // float* or uint8_t* (mx)
  int32_t* error_flag = nullptr;
  int32_t* nonfinite_flag = nullptr;  // set to 1 by a tile whose amax is inf or NaN
  bool has_act = false;               // fused activation: the values are act(h) * s (B == 1)
  bool act_grad = false;              // with has_act: the values are the activation backward's grad_h
  activation::ActivationProblem act;  // h, scale, kind, dtype, alpha, limit, grad_y (act_grad), grad_scale
                                      // (act_grad with a row-dot problem: row_dot) (rows == M; cols == K, or
                                      // K / 2 for a gated kind with act_grad)
};

// True when the problem also writes the row-scale gradient (act.grad_scale): the fused activation backward's
// rowwise problem with tiles of one row.
constexpr int64_t kRowDotMaxTileCols = 256;  // the CUDA kernel's threads per block: one column of a tile each
MOE_GRAPH_HD bool row_dot(const QuantizeProblem& p) {
  return p.has_act && p.act_grad && p.act.grad_scale != nullptr && p.tile_rows == 1 && p.tile_cols >= 1 &&
         p.tile_cols <= kRowDotMaxTileCols && !p.transpose;
}

// Static number of scale rows for M rows in E groups (E == 0: one group) and tile rows TR.
inline int64_t row_tile_capacity(int64_t rows, int64_t groups, int64_t tile_rows) {
  if (tile_rows == 0) return groups > 0 ? groups : 1;
  const int64_t per_rows = (rows + tile_rows - 1) / tile_rows;
  if (groups == 0) return per_rows;
  const int64_t bound = per_rows + groups;
  return bound < rows ? bound : rows;
}

// The tiling and the scale rule of a problem whose rows, cols and groups are set (the argument builders of
// fp8_quantize and expand_quantize): tiles TR x TC (0 x 0: per tensor), E8M0 scales (mx), the fp32 scale rule (eps,
// pow2) and the largest finite scale. TE's references: an infinite scale becomes the largest finite value of the
// input dtype (blockwise tiles) or of fp32 (per-tensor current scaling; `wide_input`: fp32 or FP8 input, whose
// dequantization is fp32).
inline void set_tiling(QuantizeProblem& p, int64_t tile_rows, int64_t tile_cols, bool mx, double eps, bool pow2,
                       bool transpose, bool wide_input, bool bf16_input) {
  p.tile_rows = tile_rows;
  p.tile_cols = tile_cols;
  p.row_tiles = row_tile_capacity(p.rows, p.groups, tile_rows);
  p.col_tiles = tile_cols == 0 ? 1 : (p.cols + tile_cols - 1) / tile_cols;
  p.mx = mx;
  p.eps = static_cast<float>(eps);
  p.pow2 = pow2;
  const bool per_tensor = tile_rows == 0 && tile_cols == 0;
  p.inf_scale = per_tensor || wide_input ? 3.40282347e38f : bf16_input ? 3.38953139e38f : 65504.0f;
  p.transpose = transpose;
}

MOE_GRAPH_HD int64_t read_split(const QuantizeProblem& p, int64_t g) {
  return p.splits_i64 ? static_cast<const int64_t*>(p.m_splits)[g] : static_cast<const int32_t*>(p.m_splits)[g];
}

// The rows [row0, row0 + nrows) of row tile `rt` (nrows 0: no tile). Walks the groups (O(E)). `D`: the type of the
// division by TR (the CUDA kernel's uint32_t: rows and TR < 2^31, checked by its launcher; no 64-bit division call).
struct TileRows {
  int64_t row0 = 0, nrows = 0;
};

template <class D = int64_t>
MOE_GRAPH_HD TileRows locate_tile(const QuantizeProblem& p, int64_t rt) {
  TileRows t;
  const int64_t TR = p.tile_rows;
  if (p.m_splits == nullptr) {
    if (TR == 0) {
      if (rt == 0) t.nrows = p.rows;
      return t;
    }
    t.row0 = rt * TR;
    const int64_t left = p.rows - t.row0;
    t.nrows = left < 0 ? 0 : (left < TR ? left : TR);
    return t;
  }
  int64_t start = 0, tiles = 0;
  for (int64_t g = 0; g < p.groups; ++g) {
    int64_t m = read_split(p, g);
    if (m < 0) m = 0;
    if (start + m > p.rows) m = p.rows - start;
    const int64_t n = TR == 0 ? 1 : static_cast<int64_t>(static_cast<D>(m + TR - 1) / static_cast<D>(TR));
    if (rt < tiles + n) {
      const int64_t local = TR == 0 ? 0 : (rt - tiles) * TR;
      t.row0 = start + local;
      const int64_t left = m - local;
      t.nrows = TR == 0 ? m : (left < TR ? left : TR);
      return t;
    }
    tiles += n;
    start += m;
  }
  return t;
}

// Rows of the groups (clipped at M), and the error bits of m_splits.
MOE_GRAPH_HD int64_t grouped_rows(const QuantizeProblem& p, int32_t* bits) {
  if (p.m_splits == nullptr) return p.rows;
  int64_t s = 0;
  int32_t b = 0;
  for (int64_t g = 0; g < p.groups; ++g) {
    const int64_t m = read_split(p, g);
    if (m < 0) b |= 1 << 1;  // kErrNegativeSplit
    s += m < 0 ? 0 : m;
  }
  if (s > p.rows) {
    b |= 1 << 0;  // kErrSplitsOverflow
    s = p.rows;
  }
  if (bits) *bits = b;
  return s;
}

// log2 of the columns one rowwise scale of an FP8 x covers: 1 x 128 fp32 tiles, MXFP8's 1 x 32 E8M0 tiles.
MOE_GRAPH_HD int x_scale_shift(const QuantizeProblem& p) { return p.x_scale_e8m0 ? 5 : 7; }

// decode(byte) * s in fp32: an FP8 element times its scale_inv (dequantize's product).
MOE_GRAPH_HD float dequantize_byte(Format f, uint8_t byte, float s) {
  return (f == Format::kE4M3 ? decode_fp8<Format::kE4M3>(byte) : decode_fp8<Format::kE5M2>(byte)) * s;
}

MOE_GRAPH_HD float load_x(const QuantizeProblem& p, int64_t b, int64_t r, int64_t c) {
  const int64_t i = (b * p.rows + r) * p.cols + c;
  switch (p.in_type) {
    case InType::kF32: return static_cast<const float*>(p.x)[i];
    case InType::kBF16: return bits_float(static_cast<uint32_t>(static_cast<const uint16_t*>(p.x)[i]) << 16);
    case InType::kE4M3:
    case InType::kE5M2: {  // decode(x) * its rowwise scale, in fp32 (dequantize's product)
      const int64_t si = (b * p.rows + r) * p.x_scale_cols + (c >> x_scale_shift(p));
      const float s = p.x_scale_e8m0 ? e8m0_value(static_cast<const uint8_t*>(p.x_scale)[si])
                                     : static_cast<const float*>(p.x_scale)[si];
      return dequantize_byte(p.in_type == InType::kE4M3 ? Format::kE4M3 : Format::kE5M2,
                             static_cast<const uint8_t*>(p.x)[i], s);
    }
    default: break;
  }
  // fp16 -> fp32 (exact)
  const uint32_t h = static_cast<const uint16_t*>(p.x)[i];
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  if (e == 0x1Fu) return bits_float(sign | 0x7F800000u | (m << 13));
  if (e == 0) {
    const float v = static_cast<float>(m) * bits_float(0x33800000u);  // m * 2^-24
    return sign ? -v : v;
  }
  return bits_float(sign | ((e + 112u) << 23) | (m << 13));
}

MOE_GRAPH_HD int64_t q_index(const QuantizeProblem& p, int64_t b, int64_t r, int64_t c) {
  return p.transpose ? (b * p.cols + c) * p.rows + r : (b * p.rows + r) * p.cols + c;
}

MOE_GRAPH_HD int64_t scale_index(const QuantizeProblem& p, int64_t b, int64_t rt, int64_t ct) {
  return p.transpose ? (b * p.col_tiles + ct) * p.row_tiles + rt : (b * p.row_tiles + rt) * p.col_tiles + ct;
}

MOE_GRAPH_HD float amax_update(float amax, float v) {
  const float a = v < 0.0f ? -v : v;
  if (amax != amax) return amax;  // NaN propagates
  return (a > amax || a != a) ? a : amax;
}

// Sets the non-finite flag (from any thread: an atomic OR on the device, a host atomic in the CPU implementation
// and in the emulator, so that both compile the same body).
MOE_GRAPH_HD void flag_nonfinite(int32_t* flag) {
  if (flag == nullptr) return;
#ifdef __CUDA_ARCH__
  atomicOr(flag, 1);
#else
  __atomic_fetch_or(flag, 1, __ATOMIC_RELAXED);
#endif
}

// The scale of a tile from its amax: the factor x is multiplied by and the scale entry (the E8M0 byte with p.mx,
// else the fp32 scale_inv), returned by value (no address taken: stays in registers).
struct TileScale {
  float mult = 1.0f, inv = 1.0f;
  uint8_t e8m0 = 127;
};

MOE_GRAPH_HD TileScale tile_scale_value(const QuantizeProblem& p, float amax) {
  if (nonfinite(amax)) flag_nonfinite(p.nonfinite_flag);
  TileScale t;
  if (p.mx) {
    t.e8m0 = p.format == Format::kE4M3 ? e8m0_from_amax<Format::kE4M3>(amax) : e8m0_from_amax<Format::kE5M2>(amax);
    t.mult = e8m0_quant_mult(t.e8m0);
    return t;
  }
  const float fmax = p.format == Format::kE4M3 ? Traits<Format::kE4M3>::kMax : Traits<Format::kE5M2>::kMax;
  t.mult = scale_from_amax(amax, fmax, p.eps, p.pow2, p.inf_scale, &t.inv);
  return t;
}

// tile_scale_value, its entry written to `entry` (a uint8_t with p.mx, else a float); returns the factor.
MOE_GRAPH_HD float tile_scale_to(const QuantizeProblem& p, float amax, void* entry) {
  const TileScale t = tile_scale_value(p, amax);
  if (p.mx)
    *static_cast<uint8_t*>(entry) = t.e8m0;
  else
    *static_cast<float*>(entry) = t.inv;
  return t.mult;
}

// tile_scale_to the tile's entry of p.scale.
MOE_GRAPH_HD float tile_scale(const QuantizeProblem& p, float amax, int64_t b, int64_t rt, int64_t ct) {
  const int64_t si = scale_index(p, b, rt, ct);
  return tile_scale_to(p, amax, p.mx ? static_cast<void*>(static_cast<uint8_t*>(p.scale) + si)
                                     : static_cast<void*>(static_cast<float*>(p.scale) + si));
}

MOE_GRAPH_HD void write_unused_scale(const QuantizeProblem& p, int64_t b, int64_t rt, int64_t ct) {
  const int64_t si = scale_index(p, b, rt, ct);
  if (p.mx)
    static_cast<uint8_t*>(p.scale)[si] = 127;
  else
    static_cast<float*>(p.scale)[si] = 1.0f;
}

// The FP8 byte of value x under the factor mult.
MOE_GRAPH_HD uint8_t quantized_byte(const QuantizeProblem& p, float x, float mult) {
  const float v = x * mult;
  return p.format == Format::kE4M3 ? encode_fp8<Format::kE4M3>(v) : encode_fp8<Format::kE5M2>(v);
}

// Writes the byte of element (b, r, c) of value x.
MOE_GRAPH_HD void quantize_value(const QuantizeProblem& p, float x, float mult, int64_t b, int64_t r, int64_t c) {
  p.q[q_index(p, b, r, c)] = quantized_byte(p, x, mult);
}

// The loaders: the value of element (b, r, c) of the input being quantized.
struct LoadX {  // x itself (fp32 / bf16 / fp16, or FP8 with its rowwise scales)
  static constexpr bool kRowDot = false;
  MOE_GRAPH_HD float operator()(const QuantizeProblem& p, int64_t b, int64_t r, int64_t c) const {
    return load_x(p, b, r, c);
  }
};

template <activation::ActKind K, typename T, typename S>
struct LoadAct {  // the fused activation: y[r, c] as expert_activation writes it (rounded to h's dtype)
  static constexpr bool kRowDot = false;
  MOE_GRAPH_HD float operator()(const QuantizeProblem& p, int64_t, int64_t r, int64_t c) const {
    using A = activation::acc_t<T>;
    constexpr int64_t kWidth = activation::is_gated(K) ? 2 : 1;
    const T* row = static_cast<const T*>(p.act.h) + r * kWidth * p.cols;
    const A s = p.act.scale ? static_cast<A>(activation::widen(static_cast<const S*>(p.act.scale)[r])) : A(1);
    A v;
    if constexpr (activation::is_gated(K))
      v = activation::gated_value<K, A>(activation::widen(row[c]), activation::widen(row[p.cols + c]),
                                        static_cast<A>(p.act.alpha), static_cast<A>(p.act.limit));
    else
      v = activation::plain_value<K, A>(activation::widen(row[c]));
    return static_cast<float>(activation::widen(activation::Narrow<T>::to(v * s)));
  }
};

template <activation::ActKind K, typename T, typename S>
struct LoadActGrad {  // the fused activation backward: grad_h[r, c] as expert_activation_backward writes it
  static constexpr bool kRowDot = true;
  // grad_h[r, c]; with kDot, also adds the row-scale gradient's product g[r, f] * act[r, f] to *dot when c is a
  // column of the gate half (gated kinds) or any column (plain kinds): c = f < F.
  template <bool kDot = false>
  MOE_GRAPH_HD float value(const QuantizeProblem& p, int64_t r, int64_t c, float* dot = nullptr) const {
    using A = activation::acc_t<T>;
    const int64_t F = p.act.cols;
    constexpr int64_t kWidth = activation::is_gated(K) ? 2 : 1;
    const bool up = kWidth == 2 && c >= F;  // the up half's column (gated kinds)
    const int64_t f = up ? c - F : c;
    const T* row = static_cast<const T*>(p.act.h) + r * kWidth * F;
    const A s = p.act.scale ? static_cast<A>(activation::widen(static_cast<const S*>(p.act.scale)[r])) : A(1);
    const A gv = static_cast<A>(activation::widen(static_cast<const T*>(p.act.grad_y)[r * F + f]));
    const A gs = gv * s;
    A d;
    if constexpr (activation::is_gated(K)) {
      const activation::GatedGrad<A> gg = activation::gated_grad<K, A>(
          activation::widen(row[f]), activation::widen(row[F + f]), static_cast<A>(p.act.alpha),
          static_cast<A>(p.act.limit));
      d = up ? gg.d_b : gg.d_a;
      if constexpr (kDot)
        if (!up) *dot += gv * gg.act;
    } else {
      const activation::PlainGrad<A> pg = activation::plain_grad<K, A>(activation::widen(row[f]));
      d = pg.d_a;
      if constexpr (kDot) *dot += gv * pg.act;
    }
    return static_cast<float>(activation::widen(activation::Narrow<T>::to(gs * d)));
  }
  MOE_GRAPH_HD float operator()(const QuantizeProblem& p, int64_t, int64_t r, int64_t c) const {
    return value(p, r, c);
  }
  // Writes the row's scale gradient (rounded once to the scale's dtype).
  MOE_GRAPH_HD void store_grad_scale(const QuantizeProblem& p, int64_t r, float dot) const {
    static_cast<S*>(p.act.grad_scale)[r] = activation::Narrow<S>::to(dot);
  }
};

// Calls f(loader) with the problem's loader (host code: the launchers and the CPU implementation).
template <class F>
void with_loader(const QuantizeProblem& p, F&& f) {
  if (!p.has_act) {
    f(LoadX{});
    return;
  }
  activation::dispatch_activation(p.act, [&](auto kind, auto t, auto s) {
    using T = typename decltype(t)::type;
    using S = typename decltype(s)::type;
    if constexpr (!std::is_same_v<T, double>) {  // fp64 h is refused by the op (no FP8 quantizer reads fp64)
      if (p.act_grad)
        f(LoadActGrad<decltype(kind)::value, T, S>{});
      else
        f(LoadAct<decltype(kind)::value, T, S>{});
    }
  });
}

MOE_GRAPH_HD int64_t col_tile_width(const QuantizeProblem& p) { return p.tile_cols == 0 ? p.cols : p.tile_cols; }

// The CUDA kernel divides in 32 bits: its launcher refuses (cudaErrorInvalidValue) a problem with a size, tile size
// or tile count of 2^31 or more, or a grid of 2^31 blocks or more (the CUDA op checks this first, with a message).
constexpr int64_t kMaxIndex32 = (int64_t(1) << 31) - 1;
inline bool index32_ok(const QuantizeProblem& p) {
  return p.batch <= kMaxIndex32 && p.rows <= kMaxIndex32 && p.cols <= kMaxIndex32 && p.tile_rows <= kMaxIndex32 &&
         p.tile_cols <= kMaxIndex32 && p.row_tiles <= kMaxIndex32 && p.col_tiles <= kMaxIndex32;
}

// CPU: tiles [t0, t1) of the B * row_tiles * col_tiles (callers split them across threads), and the rest: the m_splits
// error bits and the zero rows past sum(m_splits).
void quantize_tiles_cpu(const QuantizeProblem& p, int64_t t0, int64_t t1);
void quantize_tail_cpu(const QuantizeProblem& p);
// The row-scale gradient of rows [r0, r1) of a row_dot problem (nothing otherwise).
void quantize_row_dots_cpu(const QuantizeProblem& p, int64_t r0, int64_t r1);
void quantize_cpu(const QuantizeProblem& p);  // all three, on the calling thread

#ifdef MOE_GRAPH_WITH_CUDA
// One launch (none when there is nothing to write) on `stream`; no host synchronization (capturable).
cudaError_t quantize_cuda(const QuantizeProblem& p, cudaStream_t stream);
// p0 and, when p1 is not null, p1 (the same input and loader: x / act, in_type) in one launch.
cudaError_t quantize_pair_cuda(const QuantizeProblem& p0, const QuantizeProblem* p1, cudaStream_t stream);
#endif

}  // namespace fp8
}  // namespace moe_graph
