// The per-expert arguments of a grouped launch (problem shape, operand pointers, strides), as one function for
// the host and the device: the argument kernel (grouped_args.cuh) calls it on the GPU and the CPU test
// (grouped_probe.cpp) calls it on the host, then evaluates CuTe's layout of every operand at sampled coordinates
// and compares the address with the torch index it must address. Needs CuTe/CUTLASS headers (no torch).
//
// Operand layouts (CUTLASS conventions: A is (M, K), B is (N, K), C/D are (M, N), L = 1 per group):
//   forward / dgrad  D_e[count, n] = A[start:start+count, :k] x B_e; A row-major; B_e stored [n, k] (k-major,
//                    CUTLASS ColumnMajor) or [k, n] (n-major, RowMajor); D row-major; bias_e broadcast over rows.
//   wgrad            D_e[n, k] = dy_e^T x a_e, GEMM (M, N, K) = (n, k, count): A = dy^T (dy is [rows, n]
//                    row-major, i.e. M-major: ColumnMajor), B = a ([rows, k] row-major, N-major: RowMajor).
#pragma once

#include <cute/layout.hpp>
#include <cutlass/detail/layout.hpp>
#include <cutlass/layout/matrix.h>
#include <cutlass/util/packed_stride.hpp>

#include <cstdint>
#include <type_traits>

#include "grouped_gemm/grouped_spans.h"

namespace moe_graph {
namespace gg {
namespace detail {

using RowMajor = cutlass::layout::RowMajor;
using ColMajor = cutlass::layout::ColumnMajor;

// Layout tags of one kind of launch; the kernel types (grouped_kernel.cuh) are built from the same tags and
// static_assert that their strides are the ones below.
template <bool kBKMajor>
struct ForwardTags {
  using A = RowMajor;
  using B = std::conditional_t<kBKMajor, ColMajor, RowMajor>;
};
struct WgradTags {
  using A = ColMajor;
  using B = RowMajor;
};

template <class Tags>
struct TagStrides {
  using A = cute::remove_pointer_t<cutlass::detail::TagToStrideA_t<typename Tags::A*>>;
  using B = cute::remove_pointer_t<cutlass::detail::TagToStrideB_t<typename Tags::B*>>;
  using D = cute::remove_pointer_t<cutlass::detail::TagToStrideC_t<RowMajor*>>;
};

// The bias row broadcast of the forward epilogue: bias_e[n] for every row m (per-group pointer, L stride 0).
using BiasStride = cute::Stride<cute::_0, cute::_1, cute::_0>;

template <class Tags, class EA, class EB, class ED>
struct ExpertArgs {
  using Strides = TagStrides<Tags>;
  cute::Shape<int, int, int> shape;  // GEMM (M, N, K) of the group
  const EA* a;
  const EB* b;
  ED* d;           // C aliases D where the kernel reads a source
  const ED* bias;  // forward: bias row of the expert (BiasStride), null without bias; wgrad: null
  typename Strides::A stride_a;
  typename Strides::B stride_b;
  typename Strides::D stride_d;
};

// Per-expert tensor e: from a table of pointers (one tensor per expert) when `table` is set, else base + e * stride.
template <class T>
MOE_GRAPH_HD T* expert_ptr(int e, T* base, int64_t stride, const void* const* table) {
  return table ? static_cast<T*>(const_cast<void*>(table[e])) : base + e * stride;
}

// Forward / dgrad group of expert e covering rows [start, start + count) (count < 2^31: checked on the host).
template <bool kBKMajor, class EA, class EB, class ED>
MOE_GRAPH_HD ExpertArgs<ForwardTags<kBKMajor>, EA, EB, ED> forward_expert_args(
    int e, int64_t start, int64_t count, int n, int k, const EA* a, const EB* b_base, int64_t b_stride,
    const void* const* b_table, ED* d, const ED* bias) {
  using R = ExpertArgs<ForwardTags<kBKMajor>, EA, EB, ED>;
  using S = typename R::Strides;
  const int m = static_cast<int>(count);
  R r;
  r.shape = cute::make_shape(m, n, k);
  r.a = a + start * k;
  r.b = expert_ptr(e, b_base, b_stride, b_table);
  r.d = d + start * n;
  r.bias = bias ? bias + static_cast<int64_t>(e) * n : nullptr;
  r.stride_a = cutlass::make_cute_packed_stride(typename S::A{}, cute::make_shape(m, k, 1));
  r.stride_b = cutlass::make_cute_packed_stride(typename S::B{}, cute::make_shape(n, k, 1));
  r.stride_d = cutlass::make_cute_packed_stride(typename S::D{}, cute::make_shape(m, n, 1));
  return r;
}

// Wgrad group of expert e: GEMM (n, k, count). Experts without rows get M = 0 (no tiles): an empty K loop would
// leave the accumulators unwritten; the launcher zero-fills them where they are overwritten.
template <class EA, class EB, class ED>
MOE_GRAPH_HD ExpertArgs<WgradTags, EA, EB, ED> wgrad_expert_args(int e, int64_t start, int64_t count, int n, int k,
                                                                 const EA* dy, const EB* a, ED* out_base,
                                                                 int64_t out_stride, const void* const* out_table) {
  using R = ExpertArgs<WgradTags, EA, EB, ED>;
  using S = typename R::Strides;
  const int kk = static_cast<int>(count);
  R r;
  r.shape = cute::make_shape(kk > 0 ? n : 0, k, kk);
  r.a = dy + start * n;
  r.b = a + start * k;
  r.d = expert_ptr(e, out_base, out_stride, out_table);
  r.bias = nullptr;
  r.stride_a = cutlass::make_cute_packed_stride(typename S::A{}, cute::make_shape(n, kk, 1));
  r.stride_b = cutlass::make_cute_packed_stride(typename S::B{}, cute::make_shape(k, kk, 1));
  r.stride_d = cutlass::make_cute_packed_stride(typename S::D{}, cute::make_shape(n, k, 1));
  return r;
}

}  // namespace detail
}  // namespace gg
}  // namespace moe_graph
