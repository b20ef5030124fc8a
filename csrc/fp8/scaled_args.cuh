// Device-side argument construction of the scaled (FP8) grouped GEMM, and the scale relayouts the CUTLASS kernels
// need, all from the device m_splits (no host involvement: capturable). One block scans m_splits
// (gg::detail::for_each_expert_span: the clamping rule of grouped_spans.h, offsets [E + 1] written), a second scan
// counts the 128-row blocks of the earlier experts (`q`), and every expert's problem size, pointers, strides, scale
// pointers and scale layouts are written (scaled_expert_args.h). The forward kernel's other blocks zero the output
// rows past the clamped total. The relayout kernels run after it (they read the offsets).
//
// Scale layouts (the op's are compact, docs/fp8.md; CUTLASS's differ):
//   blockwise forward A   [rows, kb] -> per expert the MN-major grid [kb, count] at start * kb (sfa_group_mn)
//   blockwise forward B   [E, nb, kb] -> [E, kb, nb] (transpose_batched)
//   blockwise wgrad a/b   [n, RT] -> [RT, n] (transpose_batched with one batch)
#pragma once

#include <cub/block/block_scan.cuh>

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

// The per-expert argument arrays of one launch (device arrays of length E in the workspace).
template <class X>
struct ScaledArrays {
  using Expert = X;
  using Shape = cute::Shape<int, int, int>;
  using EA = typename X::ElementA;
  using EB = typename X::ElementB;
  using ED = typename X::ElementD;
  using ESF = typename X::ElementSF;
  using LayoutSFA = typename X::LayoutSFA;
  using LayoutSFB = typename X::LayoutSFB;
  // the workspace formula of scaled_plan.cpp (scaled_argument_bytes) holds for these types
  static_assert(sizeof(Shape) == 12 && sizeof(KMajorStride) == 8);
  static_assert(sizeof(LayoutSFA) <= kScaleLayoutBytes && sizeof(LayoutSFB) <= kScaleLayoutBytes);

  Shape* shapes;
  const EA** ptr_a;
  const EB** ptr_b;
  const ED** ptr_c;
  ED** ptr_d;
  const ESF** ptr_sfa;
  const ESF** ptr_sfb;
  const float** ptr_bias;  // null when the launch has no bias
  KMajorStride* stride_a;
  KMajorStride* stride_b;
  KMajorStride* stride_c;
  KMajorStride* stride_d;
  LayoutSFA* layout_sfa;
  LayoutSFB* layout_sfb;
  int64_t* tile0;  // wgrad: the expert's first token tile of block_m (its column in the [., RT] scale grids)

  MOE_GRAPH_HD void store(int e, const X& x) const {
    shapes[e] = x.shape;
    ptr_a[e] = x.a;
    ptr_b[e] = x.b;
    ptr_c[e] = x.d;
    ptr_d[e] = x.d;
    ptr_sfa[e] = x.sfa;
    ptr_sfb[e] = x.sfb;
    if (ptr_bias != nullptr) ptr_bias[e] = x.bias;
    stride_a[e] = x.stride_a;
    stride_b[e] = x.stride_b;
    stride_c[e] = x.stride_d;
    stride_d[e] = x.stride_d;
    layout_sfa[e] = x.layout_sfa;
    layout_sfb[e] = x.layout_sfb;
  }
};

// Carves the arrays from one allocation of scaled_argument_bytes(e, with_bias) (scaled_plan.cpp), in its order.
template <class Arr>
Arr carve_scaled_arguments(char* base, int e, bool with_bias) {
  Arr a;
  auto take = [&](size_t n) {
    char* p = base;
    base += gg::detail::align_up(n);
    return p;
  };
  const size_t ptr = sizeof(void*) * e;
  a.shapes = reinterpret_cast<typename Arr::Shape*>(take(12 * static_cast<size_t>(e)));
  a.ptr_a = reinterpret_cast<const typename Arr::EA**>(take(ptr));
  a.ptr_b = reinterpret_cast<const typename Arr::EB**>(take(ptr));
  a.ptr_c = reinterpret_cast<const typename Arr::ED**>(take(ptr));
  a.ptr_d = reinterpret_cast<typename Arr::ED**>(take(ptr));
  a.ptr_sfa = reinterpret_cast<const typename Arr::ESF**>(take(ptr));
  a.ptr_sfb = reinterpret_cast<const typename Arr::ESF**>(take(ptr));
  a.ptr_bias = with_bias ? reinterpret_cast<const float**>(take(ptr)) : nullptr;
  a.stride_a = reinterpret_cast<KMajorStride*>(take(sizeof(int64_t) * e));
  a.stride_b = reinterpret_cast<KMajorStride*>(take(sizeof(int64_t) * e));
  a.stride_c = reinterpret_cast<KMajorStride*>(take(sizeof(int64_t) * e));
  a.stride_d = reinterpret_cast<KMajorStride*>(take(sizeof(int64_t) * e));
  a.layout_sfa = reinterpret_cast<typename Arr::LayoutSFA*>(take(kScaleLayoutBytes * e));
  a.layout_sfb = reinterpret_cast<typename Arr::LayoutSFB*>(take(kScaleLayoutBytes * e));
  a.tile0 = reinterpret_cast<int64_t*>(take(sizeof(int64_t) * e));
  return a;
}

// Block 0: the spans (offsets), then q_e = sum_{g < e} ceil(count_g / 128), tile0_e = sum_{g < e}
// ceil(count_g / maker.tile_rows) (0 when tile_rows is 0) and maker(e, start, count, q) stored.
// Other blocks (forward only: d_tail != null) zero the rows of the 16-bit output past the clamped total.
template <class Arr, class Maker>
__global__ void __launch_bounds__(kArgThreads) scaled_args_kernel(Arr arr, Maker maker, const void* splits,
                                                                  bool is_int64, int num_experts, int64_t rows,
                                                                  int64_t* offsets, uint16_t* d_tail, int64_t n,
                                                                  int32_t* error_flag) {
  if (blockIdx.x > 0) {
    const int64_t total = gg::detail::clamped_total(splits, is_int64, num_experts, rows);
    uint4* base = reinterpret_cast<uint4*>(d_tail + total * n);
    const int64_t nvec = (rows - total) * (n / 8);
    const int64_t stride = int64_t(gridDim.x - 1) * kArgThreads;
    for (int64_t i = int64_t(blockIdx.x - 1) * kArgThreads + threadIdx.x; i < nvec; i += stride)
      base[i] = make_uint4(0u, 0u, 0u, 0u);
    return;
  }
  gg::detail::for_each_expert_span(splits, is_int64, num_experts, rows, error_flag, offsets,
                                   [](int, int64_t, int64_t) {});
  __syncthreads();  // offsets (global, this block's writes) visible to every thread
  using Scan = cub::BlockScan<int64_t, kArgThreads>;
  __shared__ typename Scan::TempStorage temp;
  __shared__ int64_t carry_smem, tcarry_smem;
  if (threadIdx.x == 0) carry_smem = tcarry_smem = 0;
  __syncthreads();
  int32_t err = 0;
  for (int base = 0; base < num_experts; base += kArgThreads) {
    const int e = base + threadIdx.x;
    int64_t start = 0, count = 0;
    if (e < num_experts) {
      start = offsets[e];
      count = offsets[e + 1] - start;
    }
    int64_t prefix, chunk_total, tprefix, tchunk_total;
    Scan(temp).ExclusiveSum((count + 127) / 128, prefix, chunk_total);
    __syncthreads();  // temp storage reused
    const int64_t tr = maker.tile_rows;
    Scan(temp).ExclusiveSum(tr > 0 ? (count + tr - 1) / tr : 0, tprefix, tchunk_total);
    const int64_t carry = carry_smem, tcarry = tcarry_smem;
    __syncthreads();
    if (e < num_experts) {
      bool unaligned = false;
      arr.store(e, maker(e, start, count, carry + prefix, &unaligned));
      arr.tile0[e] = tcarry + tprefix;
      if (unaligned) err |= kErrUnalignedSplit;
    }
    if (threadIdx.x == 0) {
      carry_smem = carry + chunk_total;
      tcarry_smem = tcarry + tchunk_total;
    }
    __syncthreads();
  }
  if (err) set_device_error(error_flag, err);
}

// Forward / dgrad experts (scaled_forward_expert).
template <class X>
struct ForwardMaker {
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
  moe_graph::launch(scaled_args_kernel<ScaledArrays<X>, ForwardMaker<X>>, 1 + plan.arg_tail_blocks, kArgThreads, 0,
                    env.stream, arr, maker, p.splits.ptr, p.splits.is_int64, e, p.rows, offsets,
                    static_cast<uint16_t*>(p.out), p.n, env.error_flag);
  check_launch("scaled_args_kernel (forward)");
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
  moe_graph::launch(scaled_args_kernel<ScaledArrays<X>, WgradMaker<X>>, 1, kArgThreads, 0, env.stream, arr, maker,
                    p.splits.ptr, p.splits.is_int64, e, p.rows, offsets, static_cast<uint16_t*>(nullptr), int64_t(0),
                    env.error_flag);
  check_launch("scaled_args_kernel (wgrad)");
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
