// Device-side argument construction of the scaled (FP8) grouped GEMM, and the scale relayouts the CUTLASS kernels
// need, all from the device m_splits (no host involvement: capturable). The argument kernel is the 16-bit one
// (gg::detail::grouped_args_kernel, grouped_gemm/grouped_args.cuh) with the makers below: it scans m_splits (the
// clamping rule of grouped_spans.h, offsets [E + 1] written), counts the 128-row blocks of the earlier experts
// (`q`) and writes every expert's problem size, pointers, strides, scale pointers and scale layouts
// (scaled_expert_args.h); the forward launch's other blocks zero the output rows past the clamped total. The
// relayout kernels run after it (they read the offsets).
//
// Scale layouts (the op's are compact, docs/fp8.md; CUTLASS's differ):
//   blockwise forward A   [rows, kb] -> per expert the MN-major grid [kb, count] at start * kb (sfa_group_mn)
//   blockwise forward B   [E, nb, kb] -> [E, kb, nb] (transpose_batched)
//   blockwise wgrad a/b   [n, RT] -> [RT, n] (transpose_batched with one batch)
#pragma once

#include <algorithm>
#include <cstdint>

#include "common/cuda_check.h"
#include "common/error_flag.h"
#include "common/launch.cuh"
#include "fp8/scaled_expert_args.h"
#include "fp8/quantize.h"
#include "fp8/scaled_gemm_cuda.h"
#include "fp8/scaled_plan.h"
#include "grouped_gemm/grouped_args.cuh"

namespace moe_graph {
namespace fp8 {
namespace detail {

using gg::detail::kArgThreads;

// The per-expert argument arrays of one launch: the grouped GEMM's (gg::detail::ExpertArrays) and the scale
// factors' pointers and layouts, and the first token tile of each expert.
template <class X>
struct ScaledArrays : gg::detail::ExpertArrays<typename X::ElementA, typename X::ElementB, typename X::ElementD, float,
                                               KMajorStride, KMajorStride, KMajorStride> {
  using Base = gg::detail::ExpertArrays<typename X::ElementA, typename X::ElementB, typename X::ElementD, float,
                                        KMajorStride, KMajorStride, KMajorStride>;
  using Expert = X;
  using ESF = typename X::ElementSF;
  using LayoutSFA = typename X::LayoutSFA;
  using LayoutSFB = typename X::LayoutSFB;
  // the workspace formula of scaled_plan.cpp (scaled_argument_bytes) holds for these types
  static_assert(sizeof(LayoutSFA) <= kScaleLayoutBytes && sizeof(LayoutSFB) <= kScaleLayoutBytes);

  const ESF** ptr_sfa;
  const ESF** ptr_sfb;
  LayoutSFA* layout_sfa;
  LayoutSFB* layout_sfb;
  int64_t* tile0;  // wgrad: the expert's first token tile of block_m (its column in the [., RT] scale grids)

  MOE_GRAPH_HD void store(int e, const X& x) const {
    Base::store(e, x);
    ptr_sfa[e] = x.sfa;
    ptr_sfb[e] = x.sfb;
    layout_sfa[e] = x.layout_sfa;
    layout_sfb[e] = x.layout_sfb;
  }

  // scaled_argument_bytes (scaled_plan.cpp) counts these arrays.
  template <class Take>
  void carve(Take& take, int e, bool with_bias) {
    Base::carve(take, e, with_bias);
    ptr_sfa = reinterpret_cast<const ESF**>(take(sizeof(void*) * e));
    ptr_sfb = reinterpret_cast<const ESF**>(take(sizeof(void*) * e));
    layout_sfa = reinterpret_cast<LayoutSFA*>(take(kScaleLayoutBytes * e));
    layout_sfb = reinterpret_cast<LayoutSFB*>(take(kScaleLayoutBytes * e));
    tile0 = reinterpret_cast<int64_t*>(take(sizeof(int64_t) * e));
  }
};

// The makers of gg::detail::grouped_args_kernel: with the row-block counts (q, tile0) of the scale grids.
template <class X>
struct ForwardMaker {
  static constexpr bool kBlockCounts = true;
  int64_t tile_rows;  // 0: no token tiles
  bool mx;
  int n, k, kb;
  const typename X::ElementA* a;
  const typename X::ElementB* b;
  typename X::ElementD* d;
  const float* bias;
  const typename X::ElementSF* sfa;
  const typename X::ElementSF* sfb;
  MOE_GRAPH_HD X operator()(int e, int64_t start, int64_t count, int64_t q, bool*) const {
    return scaled_forward_expert<typename X::Config>(e, start, count, q, mx, n, k, kb, a, b, d, bias, sfa, sfb);
  }
};

// Wgrad experts (scaled_wgrad_expert).
template <class X>
struct WgradMaker {
  static constexpr bool kBlockCounts = true;
  int64_t tile_rows;  // block_m
  bool mx;
  int64_t rows;
  int n, k;
  const typename X::ElementA* a_t;
  const typename X::ElementB* b_t;
  float* out;
  const typename X::ElementSF* sfa;
  const typename X::ElementSF* sfb;
  MOE_GRAPH_HD X operator()(int e, int64_t start, int64_t count, int64_t q, bool* unaligned) const {
    return scaled_wgrad_expert<typename X::Config>(e, start, count, q, mx, rows, n, k, a_t, b_t, out, sfa, sfb,
                                                   unaligned);
  }
};

// blockwise forward A: compact [rows, kb] -> per expert e the MN-major [kb, count_e] grid at offsets[e] * kb.
template <int = 0>  // a template: one definition however many files include this header
__global__ void sfa_group_mn_kernel(const float* src, const int64_t* offsets, int num_experts, int kb, float* dst) {
  const int64_t total = offsets[num_experts];
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total * kb; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / kb;
    const int c = static_cast<int>(i % kb);
    const int e = gg::detail::expert_of_row(offsets, num_experts, r);
    const int64_t start = offsets[e], count = offsets[e + 1] - start;
    dst[start * kb + c * count + (r - start)] = src[i];
  }
}

// dst[b][c][r] = src[b][r][c] for `batch` matrices [R, C] (fp32).
template <int = 0>  // a template: one definition however many files include this header
__global__ void transpose_batched_kernel(const float* src, int64_t batch, int64_t R, int64_t C, float* dst) {
  const int64_t per = R * C;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < batch * per; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t b = i / per, rc = i % per, r = rc / C, c = rc % C;
    dst[b * per + c * R + r] = src[i];
  }
}

// Byte offset of scale (i, c) (row i, K block c of 32) inside one group's region of CUTLASS's Sm1xxBlkScaledConfig
// layout with `katoms` = ceil(K blocks / 4): atoms of 128 rows x 4 K blocks (512 bytes), K atoms first; inside an
// atom row i sits at (i % 32) * 16 + (i / 32 % 4) * 4, K block c at c % 4.
MOE_GRAPH_HD int64_t mx_sf_offset(int64_t i, int64_t c, int64_t katoms) {
  return ((i / 128) * katoms + c / 4) * 512 + (i % 32) * 16 + (i / 32 % 4) * 4 + c % 4;
}

// The MXFP8 relayout of one operand's compact E8M0 grid into per-group padded regions (blockIdx.y = group e):
//   kRows   forward A: rows [start, start + count) of src [rows, kb] (offsets), region at ptr_sf[e]
//   kFixed  forward B: rows [e * n, e * n + n) of src [E * n, kb], region at dst + e * nb * 128 * kb4
//   kTokens wgrad a_t / b_t: all `fixed_rows` rows of src [fixed_rows, rt], columns [tile0_e, tile0_e + ceil(count /
//           32)), region at ptr_sf[e]
// Padding (rows up to a multiple of 128, K blocks up to a multiple of 4) holds 127 (2^0): finite, times the zeros
// TMA reads past the group's rows or K.
enum class MxSource : int { kRows = 0, kFixed = 1, kTokens = 2 };

template <int = 0>  // a template: one definition however many files include this header
__global__ void mx_relayout_kernel(const uint8_t* src, MxSource mode, const int64_t* offsets, const int64_t* tile0,
                                   const uint8_t* const* ptr_sf, uint8_t* dst, int64_t fixed_rows, int64_t src_cols,
                                   int64_t kb) {
  const int e = blockIdx.y;
  int64_t row0 = 0, col0 = 0, nrows = fixed_rows, ncols = kb;
  uint8_t* region;
  if (mode == MxSource::kFixed) {
    row0 = e * fixed_rows;
    region = dst + e * ((fixed_rows + 127) / 128) * 128 * ((kb + 3) / 4 * 4);
  } else {
    const int64_t start = offsets[e], count = offsets[e + 1] - start;
    region = dst + (ptr_sf[e] - static_cast<const uint8_t*>(dst));
    if (mode == MxSource::kRows) {
      row0 = start;
      nrows = count;
    } else {
      col0 = tile0[e];
      ncols = (count + 31) / 32;
      if (count == 0) return;  // no K blocks: an empty region
    }
  }
  if (nrows == 0) return;
  const int64_t katoms = (ncols + 3) / 4;
  const int64_t prow = (nrows + 127) / 128 * 128, pcol = katoms * 4;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < prow * pcol;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = idx / pcol, c = idx % pcol;
    const uint8_t v = (i < nrows && c < ncols) ? src[(row0 + i) * src_cols + col0 + c] : uint8_t(127);
    region[mx_sf_offset(i, c, katoms)] = v;
  }
}

inline int relayout_blocks(int64_t elems) {
  const int64_t b = (elems + 255) / 256;
  return static_cast<int>(b < 1 ? 1 : (b > 1024 ? 1024 : b));
}

inline void enqueue_transpose(const float* src, int64_t batch, int64_t R, int64_t C, float* dst, cudaStream_t s) {
  moe_graph::launch(transpose_batched_kernel<>, relayout_blocks(batch * R * C), 256, 0, s, src, batch, R, C, dst);
  check_launch("transpose_batched_kernel");
}

// out[0 : elems] = 0 (fp32, elems % 4 == 0: k % 8 is a plan rule): an overwriting wgrad before its GEMM.
template <int = 0>  // a template: one definition however many files include this header
__global__ void zero_f32_kernel(float* out, int64_t elems) {
  float4* p = reinterpret_cast<float4*>(out);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < elems / 4; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = make_float4(0.f, 0.f, 0.f, 0.f);
}

inline void enqueue_wgrad_zero(float* out, int num_experts, int64_t expert_elems, cudaStream_t s) {
  const int64_t elems = num_experts * expert_elems;
  moe_graph::launch(zero_f32_kernel<>, relayout_blocks(elems / 4), 256, 0, s, out, elems);
  check_launch("zero_f32_kernel");
}

// The forward launch's device work before the GEMM: argument kernel (block 0) + tail zeroing (plan.arg_tail_blocks
// more blocks), then the scale relayouts into sfa / sfb (plan.sfa_bytes / sfb_bytes). The emulator runs it with
// the real ScaledExpert types and no GEMM.
template <class X>
void enqueue_scaled_forward_args(const ScaledArrays<X>& arr, const ScaledForwardCuda& p, const ScaledForwardPlan& plan,
                                 const gg::LaunchEnv& env, int64_t* offsets, typename X::ElementSF* sfa,
                                 typename X::ElementSF* sfb) {
  const int e = p.splits.num_experts;
  const int kb = static_cast<int>(p.k / p.block_k);
  const bool mx = plan.kernel == ScaledKernel::kSm100Mxfp8;
  ForwardMaker<X> maker{0, mx, static_cast<int>(p.n), static_cast<int>(p.k), kb,
                        static_cast<const typename X::ElementA*>(p.a), static_cast<const typename X::ElementB*>(p.b),
                        static_cast<typename X::ElementD*>(p.out), p.bias, sfa, sfb};
  moe_graph::launch(gg::detail::grouped_args_kernel<ScaledArrays<X>, ForwardMaker<X>>, 1 + plan.arg_tail_blocks,
                    kArgThreads, 0, env.stream, arr, maker, p.splits.ptr, p.splits.is_int64, e, p.rows, offsets,
                    static_cast<uint16_t*>(p.out), p.n, env.error_flag);
  check_launch("grouped_args_kernel (scaled forward)");
  if (!mx) {
    const auto* sa = static_cast<const float*>(p.a_scale);
    moe_graph::launch(sfa_group_mn_kernel<>, relayout_blocks(p.rows * kb), 256, 0, env.stream, sa, offsets, e, kb,
                      reinterpret_cast<float*>(sfa));
    check_launch("sfa_group_mn_kernel");
    enqueue_transpose(static_cast<const float*>(p.b_scale), e, (p.n + 127) / 128, kb, reinterpret_cast<float*>(sfb),
                      env.stream);
  } else {
    const int bx = relayout_blocks(mx_sf_bytes(p.rows, kb) / std::max(e, 1) + 512);
    moe_graph::launch(mx_relayout_kernel<>, dim3(bx, e), 256, 0, env.stream, static_cast<const uint8_t*>(p.a_scale),
                      MxSource::kRows, offsets, static_cast<const int64_t*>(nullptr),
                      reinterpret_cast<const uint8_t* const*>(arr.ptr_sfa), reinterpret_cast<uint8_t*>(sfa), p.rows,
                      int64_t(kb), int64_t(kb));
    check_launch("mx_relayout_kernel (A)");
    moe_graph::launch(mx_relayout_kernel<>, dim3(relayout_blocks(mx_sf_bytes(p.n, kb)), e), 256, 0, env.stream,
                      static_cast<const uint8_t*>(p.b_scale), MxSource::kFixed, offsets,
                      static_cast<const int64_t*>(nullptr), static_cast<const uint8_t* const*>(nullptr),
                      reinterpret_cast<uint8_t*>(sfb), p.n, int64_t(kb), int64_t(kb));
    check_launch("mx_relayout_kernel (B)");
  }
}

// The wgrad launch's device work before the GEMM: the zero fill of an overwrite (plan.zero_fill), the argument
// kernel, the scale relayouts.
template <class X>
void enqueue_scaled_wgrad_args(const ScaledArrays<X>& arr, const ScaledWgradCuda& p, const ScaledWgradPlan& plan,
                               const gg::LaunchEnv& env, int64_t* offsets, typename X::ElementSF* sfa,
                               typename X::ElementSF* sfb) {
  const int e = p.splits.num_experts;
  const bool mx = plan.kernel == ScaledKernel::kSm100Mxfp8;
  if (plan.zero_fill) enqueue_wgrad_zero(p.out, e, p.n * p.k, env.stream);
  WgradMaker<X> maker{p.block_m, mx, p.rows, static_cast<int>(p.n), static_cast<int>(p.k),
                      static_cast<const typename X::ElementA*>(p.a_t), static_cast<const typename X::ElementB*>(p.b_t),
                      p.out, sfa, sfb};
  moe_graph::launch(gg::detail::grouped_args_kernel<ScaledArrays<X>, WgradMaker<X>>, 1, kArgThreads, 0, env.stream,
                    arr, maker, p.splits.ptr, p.splits.is_int64, e, p.rows, offsets, static_cast<uint16_t*>(nullptr),
                    int64_t(0), env.error_flag);
  check_launch("grouped_args_kernel (scaled wgrad)");
  if (!mx) {
    const int64_t rt = row_tile_capacity(p.rows, e, p.block_m);
    enqueue_transpose(static_cast<const float*>(p.a_scale), 1, p.n, rt, reinterpret_cast<float*>(sfa), env.stream);
    enqueue_transpose(static_cast<const float*>(p.b_scale), 1, p.k, rt, reinterpret_cast<float*>(sfb), env.stream);
  } else {
    const int64_t rt = row_tile_capacity(p.rows, e, p.block_m);
    const int bx = relayout_blocks(mx_sf_bytes(std::max(p.n, p.k), 4 * ((p.rows + 127) / 128 + e)) / std::max(e, 1));
    moe_graph::launch(mx_relayout_kernel<>, dim3(bx, e), 256, 0, env.stream, static_cast<const uint8_t*>(p.a_scale),
                      MxSource::kTokens, offsets, static_cast<const int64_t*>(arr.tile0),
                      reinterpret_cast<const uint8_t* const*>(arr.ptr_sfa), reinterpret_cast<uint8_t*>(sfa), p.n, rt,
                      int64_t(0));
    check_launch("mx_relayout_kernel (a_t)");
    moe_graph::launch(mx_relayout_kernel<>, dim3(bx, e), 256, 0, env.stream, static_cast<const uint8_t*>(p.b_scale),
                      MxSource::kTokens, offsets, static_cast<const int64_t*>(arr.tile0),
                      reinterpret_cast<const uint8_t* const*>(arr.ptr_sfb), reinterpret_cast<uint8_t*>(sfb), p.k, rt,
                      int64_t(0));
    check_launch("mx_relayout_kernel (b_t)");
  }
}

}  // namespace detail
}  // namespace fp8
}  // namespace moe_graph
