// Device-side argument construction for the CUTLASS grouped kernels: one block scans m_splits (int32/int64, any
// number of experts, in chunks of the block size) and writes, for every expert, its problem size, operand
// pointers and strides. No host involvement, so it runs inside CUDA graphs.
//
// Clamping rule: grouped_spans.h (shared with the CPU implementation). `offsets` receives the clamped row starts
// of the E experts and, at [E], the clamped total.
#pragma once

#include <cub/block/block_scan.cuh>
#include <cute/tensor.hpp>
#include <cutlass/util/packed_stride.hpp>

#include "common/error_flag.h"
#include "grouped_gemm/grouped_spans.h"

namespace moe_graph {
namespace gg {
namespace detail {

constexpr int kArgThreads = 256;

// Calls fn(e, start_e, count_e) for every expert from a block-wide scan of the splits.
template <class Fn>
__device__ __forceinline__ void for_each_expert_span(const void* splits, bool is_int64, int num_experts,
                                                     int64_t rows, int32_t* error_flag, int64_t* offsets, Fn fn) {
  using Scan = cub::BlockScan<int64_t, kArgThreads>;
  __shared__ typename Scan::TempStorage temp;
  __shared__ int64_t carry_smem;
  if (threadIdx.x == 0) carry_smem = 0;
  __syncthreads();
  int32_t err = 0;
  for (int base = 0; base < num_experts; base += kArgThreads) {
    const int e = base + threadIdx.x;
    int64_t m = 0;
    if (e < num_experts) {
      const int64_t raw = is_int64 ? static_cast<const int64_t*>(splits)[e] : static_cast<const int32_t*>(splits)[e];
      bool negative;
      m = clamp_split(raw, rows, &negative);
      if (negative) err |= kErrNegativeSplit;
    }
    int64_t prefix, chunk_total;
    Scan(temp).ExclusiveSum(m, prefix, chunk_total);
    const int64_t carry = carry_smem;
    __syncthreads();  // everyone read carry and finished with temp storage
    if (e < num_experts) {
      bool cut;
      const ExpertSpan span = expert_span(carry + prefix, m, rows, &cut);
      if (cut) err |= kErrSplitsOverflow;
      if (offsets != nullptr) offsets[e] = span.start;
      fn(e, span.start, span.count);
    }
    if (threadIdx.x == 0) carry_smem = carry + chunk_total;
    __syncthreads();
  }
  if (threadIdx.x == 0 && offsets != nullptr) offsets[num_experts] = carry_smem < rows ? carry_smem : rows;
  if (err) set_device_error(error_flag, err);
}

// Pointers and strides of one grouped launch, all device arrays of length E inside the workspace.
template <class GemmKernel>
struct GroupedArrays {
  using ProblemShape = typename GemmKernel::ProblemShape::UnderlyingProblemShape;
  using ElementA = typename GemmKernel::ElementA;
  using ElementB = typename GemmKernel::ElementB;
  using ElementD = typename GemmKernel::ElementD;
  using StrideA = typename GemmKernel::InternalStrideA;
  using StrideB = typename GemmKernel::InternalStrideB;
  using StrideC = typename GemmKernel::InternalStrideC;
  using StrideD = typename GemmKernel::InternalStrideD;

  ProblemShape* shapes;
  const ElementA** ptr_a;
  const ElementB** ptr_b;
  const ElementD** ptr_c;  // C aliases D (used only by accumulating epilogues)
  ElementD** ptr_d;
  StrideA* stride_a;
  StrideB* stride_b;
  StrideC* stride_c;
  StrideD* stride_d;
};

// Forward / dgrad: D_e[count, n] = A[start: start+count, :k] x B_e.
template <class GemmKernel>
__global__ void __launch_bounds__(kArgThreads) forward_args_kernel(
    GroupedArrays<GemmKernel> arr, const void* splits, bool is_int64, int num_experts, int64_t rows, int n, int k,
    const typename GemmKernel::ElementA* a, const typename GemmKernel::ElementB* b_base, int64_t b_stride,
    const void* const* b_table, typename GemmKernel::ElementD* d, int64_t* offsets, int32_t* error_flag) {
  using Arr = GroupedArrays<GemmKernel>;
  for_each_expert_span(splits, is_int64, num_experts, rows, error_flag, offsets, [&](int e, int64_t start,
                                                                                     int64_t count) {
    const int m = static_cast<int>(count);
    arr.shapes[e] = typename Arr::ProblemShape(m, n, k);
    arr.ptr_a[e] = a + start * k;
    arr.ptr_b[e] = b_table ? static_cast<const typename Arr::ElementB*>(b_table[e]) : b_base + e * b_stride;
    arr.ptr_d[e] = d + start * n;
    arr.ptr_c[e] = arr.ptr_d[e];
    arr.stride_a[e] = cutlass::make_cute_packed_stride(typename Arr::StrideA{}, cute::make_shape(m, k, 1));
    arr.stride_b[e] = cutlass::make_cute_packed_stride(typename Arr::StrideB{}, cute::make_shape(n, k, 1));
    arr.stride_c[e] = cutlass::make_cute_packed_stride(typename Arr::StrideC{}, cute::make_shape(m, n, 1));
    arr.stride_d[e] = cutlass::make_cute_packed_stride(typename Arr::StrideD{}, cute::make_shape(m, n, 1));
  });
}

// Wgrad: D_e[n, k] = dy_e^T x a_e, GEMM (M, N, K) = (n, k, count). Experts without rows get M = 0 (no tiles):
// an empty K loop would leave the accumulators unwritten.
template <class GemmKernel>
__global__ void __launch_bounds__(kArgThreads) wgrad_args_kernel(
    GroupedArrays<GemmKernel> arr, const void* splits, bool is_int64, int num_experts, int64_t rows, int n, int k,
    const typename GemmKernel::ElementA* dy, const typename GemmKernel::ElementB* a,
    typename GemmKernel::ElementD* out_base, int64_t out_stride, void* const* out_table, int64_t* offsets,
    int32_t* error_flag) {
  using Arr = GroupedArrays<GemmKernel>;
  for_each_expert_span(splits, is_int64, num_experts, rows, error_flag, offsets, [&](int e, int64_t start,
                                                                                     int64_t count) {
    const int kk = static_cast<int>(count);
    arr.shapes[e] = typename Arr::ProblemShape(kk > 0 ? n : 0, k, kk);
    arr.ptr_a[e] = dy + start * n;
    arr.ptr_b[e] = a + start * k;
    arr.ptr_d[e] = out_table ? static_cast<typename Arr::ElementD*>(out_table[e]) : out_base + e * out_stride;
    arr.ptr_c[e] = arr.ptr_d[e];
    arr.stride_a[e] = cutlass::make_cute_packed_stride(typename Arr::StrideA{}, cute::make_shape(n, kk, 1));
    arr.stride_b[e] = cutlass::make_cute_packed_stride(typename Arr::StrideB{}, cute::make_shape(k, kk, 1));
    arr.stride_c[e] = cutlass::make_cute_packed_stride(typename Arr::StrideC{}, cute::make_shape(n, k, 1));
    arr.stride_d[e] = cutlass::make_cute_packed_stride(typename Arr::StrideD{}, cute::make_shape(n, k, 1));
  });
}

}  // namespace detail
}  // namespace gg
}  // namespace moe_graph
