// The per-expert arguments of a scaled (FP8) grouped launch, as one function for the host and the device: the
// argument kernel (scaled_args.cuh) calls it on the GPU, the emulator family `fp8_scaled` compares its arrays with
// an independent host computation. Needs CuTe/CUTLASS headers (no torch).
//
// Operands (CUTLASS conventions: A is (M, K), B is (N, K), D is (M, N); every operand K-major, D row-major):
//   forward / dgrad  D_e[count, n] = A[start:start+count, :k] x B_e^T + bias_e: A row-major [rows, k], B_e [n, k].
//   wgrad            D_e[n, k] = a_t[:, start:start+count] x b_t[:, start:start+count]^T, GEMM (n, k, count):
//                    a_t = dy^T [n, rows] and b_t = x^T [k, rows] row-major (row stride `rows`, not `count`).
// Scales: `ScaleConfig` is CUTLASS's scale-factor configuration of the kernel (Sm90BlockwiseScaleConfig or
// Sm1xxBlkScaledConfig); the layout of group e is ScaleConfig::tile_atom_to_shape_SFA/SFB of its problem shape
// (what the kernels compute themselves), the pointer the group's region in the relayouted scale buffers
// (scaled_args.cuh: `q` = sum over the earlier experts of ceil(count / 128)).
#pragma once

#include <cute/layout.hpp>
#include <cute/tensor.hpp>

#include <cstdint>

#include "common/host_device.h"

namespace moe_graph {
namespace fp8 {
namespace detail {

using KMajorStride = cute::Stride<int64_t, cute::_1, cute::_0>;  // (row stride, 1, 0): CUTLASS's grouped strides

template <class ScaleConfig, class EA, class EB, class ED, class ESF>
struct ScaledExpert {
  using Config = ScaleConfig;
  using ElementA = EA;
  using ElementB = EB;
  using ElementD = ED;
  using ElementSF = ESF;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  cute::Shape<int, int, int> shape;  // GEMM (M, N, K) of the group
  const EA* a;
  const EB* b;
  ED* d;               // C aliases D where the kernel reads a source
  const float* bias;   // forward: bias row of the expert (fp32), null without bias; wgrad: null
  const ESF* sfa;
  const ESF* sfb;
  KMajorStride stride_a, stride_b, stride_d;
  LayoutSFA layout_sfa;
  LayoutSFB layout_sfb;
};

// Forward / dgrad group e: rows [start, start + count), `q` the 128-row blocks of the earlier groups. `mx`: the
// MXFP8 layouts (A's scales in 128-row padded regions, one region of the weight's per expert), else blockwise (A's
// group region at start * kb in its MN-major grid, B's at e * kb * nb).
template <class ScaleConfig, class EA, class EB, class ED, class ESF>
MOE_GRAPH_HD ScaledExpert<ScaleConfig, EA, EB, ED, ESF> scaled_forward_expert(
    int e, int64_t start, int64_t count, int64_t q, bool mx, int n, int k, int kb, const EA* a, const EB* b, ED* d,
    const float* bias, const ESF* sfa, const ESF* sfb) {
  ScaledExpert<ScaleConfig, EA, EB, ED, ESF> r;
  const int m = static_cast<int>(count);
  r.shape = cute::make_shape(m, n, k);
  r.a = a + start * k;
  r.b = b + static_cast<int64_t>(e) * n * k;
  r.d = d + start * n;
  r.bias = bias ? bias + static_cast<int64_t>(e) * n : nullptr;
  const int64_t kb4 = (kb + 3) / 4 * 4;
  const int64_t nb = (n + 127) / 128;
  r.sfa = sfa + (mx ? q * 128 * kb4 : start * kb);
  r.sfb = sfb + (mx ? static_cast<int64_t>(e) * nb * 128 * kb4 : static_cast<int64_t>(e) * nb * kb);
  r.stride_a = KMajorStride{int64_t(k), cute::_1{}, cute::_0{}};
  r.stride_b = KMajorStride{int64_t(k), cute::_1{}, cute::_0{}};
  r.stride_d = KMajorStride{int64_t(n), cute::_1{}, cute::_0{}};
  const auto mnkl = cute::make_shape(m, n, k, 1);
  r.layout_sfa = ScaleConfig::tile_atom_to_shape_SFA(mnkl);
  r.layout_sfb = ScaleConfig::tile_atom_to_shape_SFB(mnkl);
  return r;
}

// Wgrad group e: GEMM (n, k, count) over tokens [start, start + count). A group whose first token is not a
// multiple of 16 (TMA needs 16-byte aligned bases of the FP8 rows) gets M = 0 and sets *unaligned; so does an empty
// group (no tile: the launcher zero-fills it where it overwrites). Scales: blockwise, the transposed grids [RT, n]
// and [RT, k] from tile q; mx, 128-row padded regions of ceil(count / 128) blocks of 4 K blocks each.
template <class ScaleConfig, class EA, class EB, class ESF>
MOE_GRAPH_HD ScaledExpert<ScaleConfig, EA, EB, float, ESF> scaled_wgrad_expert(
    int e, int64_t start, int64_t count, int64_t q, bool mx, int64_t rows, int n, int k, const EA* a_t, const EB* b_t,
    float* out, const ESF* sfa, const ESF* sfb, bool* unaligned) {
  ScaledExpert<ScaleConfig, EA, EB, float, ESF> r;
  const int kk = static_cast<int>(count);
  *unaligned = count > 0 && start % 16 != 0;
  r.shape = cute::make_shape((kk > 0 && !*unaligned) ? n : 0, k, kk);
  r.a = a_t + start;
  r.b = b_t + start;
  r.d = out + static_cast<int64_t>(e) * n * k;
  r.bias = nullptr;
  r.sfa = sfa + (mx ? q * ((n + 127) / 128) * 128 * 4 : q * n);
  r.sfb = sfb + (mx ? q * ((k + 127) / 128) * 128 * 4 : q * k);
  r.stride_a = KMajorStride{rows, cute::_1{}, cute::_0{}};
  r.stride_b = KMajorStride{rows, cute::_1{}, cute::_0{}};
  r.stride_d = KMajorStride{int64_t(k), cute::_1{}, cute::_0{}};
  const auto mnkl = cute::make_shape(n, k, kk, 1);
  r.layout_sfa = ScaleConfig::tile_atom_to_shape_SFA(mnkl);
  r.layout_sfb = ScaleConfig::tile_atom_to_shape_SFB(mnkl);
  return r;
}

}  // namespace detail
}  // namespace fp8
}  // namespace moe_graph
