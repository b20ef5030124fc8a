// Device-side argument construction for the CUTLASS grouped kernels: one block scans m_splits (int32/int64, any
// number of experts, in chunks of the block size) and writes, for every expert, its problem size, operand
// pointers and strides (the forward kernel's other blocks zero the output rows past the splits). No host
// involvement, so it runs inside CUDA graphs.
//
// Clamping rule: grouped_spans.h (shared with the CPU implementation). `offsets` receives the clamped row starts
// of the E experts and, at [E], the clamped total.
#pragma once

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cute/tensor.hpp>

#include <type_traits>

#include "common/cuda_check.h"
#include "common/error_flag.h"
#include "common/launch.cuh"
#include "grouped_gemm/grouped_expert_args.h"
#include "grouped_gemm/grouped_gemm.h"
#include "grouped_gemm/grouped_plan.h"
#include "grouped_gemm/grouped_spans.h"

namespace moe_graph {
namespace gg {
namespace detail {

constexpr int kArgThreads = 256;

// Index of the expert owning row r (< total): the last e with offsets[e] <= r (empty experts share their
// successor's offset and lose to it).
__device__ __forceinline__ int expert_of_row(const int64_t* offsets, int num_experts, int64_t r) {
  int lo = 0, hi = num_experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (offsets[mid] <= r)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

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

// Pointers and strides of one grouped launch, all device arrays of length E inside the workspace. `Tags`: the
// operand layouts (grouped_expert_args.h) the kernel was built from.
template <class GemmKernel, class Tags>
struct GroupedArrays {
  using ProblemShape = typename GemmKernel::ProblemShape::UnderlyingProblemShape;
  using ElementA = typename GemmKernel::ElementA;
  using ElementB = typename GemmKernel::ElementB;
  using ElementD = typename GemmKernel::ElementD;
  using StrideA = typename GemmKernel::InternalStrideA;
  using StrideB = typename GemmKernel::InternalStrideB;
  using StrideC = typename GemmKernel::InternalStrideC;
  using StrideD = typename GemmKernel::InternalStrideD;
  using Expert = ExpertArgs<Tags, ElementA, ElementB, ElementD>;
  // The host-tested argument function computes exactly the kernel's stride types, and the workspace formula of
  // grouped_plan.cpp (argument_bytes) holds for them.
  static_assert(std::is_same_v<ProblemShape, cute::Shape<int, int, int>>);
  static_assert(std::is_same_v<StrideA, typename Expert::Strides::A>);
  static_assert(std::is_same_v<StrideB, typename Expert::Strides::B>);
  static_assert(std::is_same_v<StrideC, typename Expert::Strides::D>);
  static_assert(std::is_same_v<StrideD, typename Expert::Strides::D>);
  static_assert(sizeof(StrideA) == 8 && sizeof(StrideB) == 8 && sizeof(StrideD) == 8 && sizeof(ProblemShape) == 12);

  ProblemShape* shapes;
  const ElementA** ptr_a;
  const ElementB** ptr_b;
  const ElementD** ptr_c;  // C aliases D (used only by accumulating epilogues)
  ElementD** ptr_d;
  StrideA* stride_a;
  StrideB* stride_b;
  StrideC* stride_c;
  StrideD* stride_d;
  const ElementD** ptr_bias;  // forward: bias row of each expert (null when the launch has no bias)

  __device__ __forceinline__ void store(int e, const Expert& x) {
    shapes[e] = x.shape;
    ptr_a[e] = x.a;
    ptr_b[e] = x.b;
    ptr_c[e] = x.d;
    ptr_d[e] = x.d;
    stride_a[e] = x.stride_a;
    stride_b[e] = x.stride_b;
    stride_c[e] = x.stride_d;
    stride_d[e] = x.stride_d;
    if (ptr_bias != nullptr) ptr_bias[e] = x.bias;
  }
};

// The clamped total of the splits (grouped_spans.h: the last offset for_each_expert_span writes), summed by one
// block without a scan.
__device__ __forceinline__ int64_t clamped_total(const void* splits, bool is_int64, int num_experts, int64_t rows) {
  using Reduce = cub::BlockReduce<int64_t, kArgThreads>;
  __shared__ typename Reduce::TempStorage temp;
  __shared__ int64_t total_smem;
  int64_t sum = 0;  // at most E * (rows + 1) (< 2^62, see grouped_spans.h)
  for (int e = threadIdx.x; e < num_experts; e += kArgThreads) {
    const int64_t raw = is_int64 ? static_cast<const int64_t*>(splits)[e] : static_cast<const int32_t*>(splits)[e];
    bool negative;
    sum += clamp_split(raw, rows, &negative);
  }
  const int64_t total = Reduce(temp).Sum(sum);
  if (threadIdx.x == 0) total_smem = total < rows ? total : rows;
  __syncthreads();
  return total_smem;
}

// Forward / dgrad: D_e[count, n] = A[start: start+count, :k] x B_e (+ bias_e). Block 0 writes the arguments; the
// other blocks (tail_zero_blocks of grouped_plan.cpp) zero the rows of D past the clamped total, which no GEMM
// tile writes. 16-bit D, n % 8 == 0 (16-byte rows, checked by the op).
template <class GemmKernel, bool kBKMajor>
__global__ void __launch_bounds__(kArgThreads) forward_args_kernel(
    GroupedArrays<GemmKernel, ForwardTags<kBKMajor>> arr, const void* splits, bool is_int64, int num_experts,
    int64_t rows, int n, int k, const typename GemmKernel::ElementA* a, const typename GemmKernel::ElementB* b_base,
    int64_t b_stride, const void* const* b_table, typename GemmKernel::ElementD* d,
    const typename GemmKernel::ElementD* bias, int64_t* offsets, int32_t* error_flag) {
  static_assert(sizeof(typename GemmKernel::ElementD) == 2, "the tail zeroing writes 8 elements per 16 bytes");
  if (blockIdx.x > 0) {
    const int64_t total = clamped_total(splits, is_int64, num_experts, rows);
    uint4* base = reinterpret_cast<uint4*>(d + total * n);
    const int64_t nvec = (rows - total) * (n / 8);
    const int64_t stride = int64_t(gridDim.x - 1) * kArgThreads;
    for (int64_t i = int64_t(blockIdx.x - 1) * kArgThreads + threadIdx.x; i < nvec; i += stride)
      base[i] = make_uint4(0u, 0u, 0u, 0u);
    return;
  }
  for_each_expert_span(splits, is_int64, num_experts, rows, error_flag, offsets, [&](int e, int64_t start,
                                                                                     int64_t count) {
    arr.store(e, forward_expert_args<kBKMajor>(e, start, count, n, k, a, b_base, b_stride, b_table, d, bias));
  });
}

// Wgrad: D_e[n, k] = dy_e^T x a_e, GEMM (M, N, K) = (n, k, count).
template <class GemmKernel>
__global__ void __launch_bounds__(kArgThreads) wgrad_args_kernel(
    GroupedArrays<GemmKernel, WgradTags> arr, const void* splits, bool is_int64, int num_experts, int64_t rows, int n,
    int k, const typename GemmKernel::ElementA* dy, const typename GemmKernel::ElementB* a,
    typename GemmKernel::ElementD* out_base, int64_t out_stride, void* const* out_table, int64_t* offsets,
    int32_t* error_flag) {
  for_each_expert_span(splits, is_int64, num_experts, rows, error_flag, offsets, [&](int e, int64_t start,
                                                                                     int64_t count) {
    arr.store(e, wgrad_expert_args(e, start, count, n, k, dy, a, out_base, out_stride, out_table));
  });
}

inline size_t align_up(size_t x, size_t a = 128) { return (x + a - 1) / a * a; }

// Carves the argument arrays out of one allocation of argument_bytes(e, with_bias) (grouped_plan.cpp), in the
// order that formula counts them.
template <class Arr>
Arr carve_arguments(char* base, int e, bool with_bias) {
  Arr a;
  auto take = [&](size_t n) {
    char* p = base;
    base += align_up(n);
    return p;
  };
  a.shapes = reinterpret_cast<typename Arr::ProblemShape*>(take(sizeof(typename Arr::ProblemShape) * e));
  a.ptr_a = reinterpret_cast<const typename Arr::ElementA**>(take(sizeof(void*) * e));
  a.ptr_b = reinterpret_cast<const typename Arr::ElementB**>(take(sizeof(void*) * e));
  a.ptr_c = reinterpret_cast<const typename Arr::ElementD**>(take(sizeof(void*) * e));
  a.ptr_d = reinterpret_cast<typename Arr::ElementD**>(take(sizeof(void*) * e));
  a.ptr_bias = with_bias ? reinterpret_cast<const typename Arr::ElementD**>(take(sizeof(void*) * e)) : nullptr;
  a.stride_a = reinterpret_cast<typename Arr::StrideA*>(take(sizeof(typename Arr::StrideA) * e));
  a.stride_b = reinterpret_cast<typename Arr::StrideB*>(take(sizeof(typename Arr::StrideB) * e));
  a.stride_c = reinterpret_cast<typename Arr::StrideC*>(take(sizeof(typename Arr::StrideC) * e));
  a.stride_d = reinterpret_cast<typename Arr::StrideD*>(take(sizeof(typename Arr::StrideD) * e));
  return a;
}

// The argument arrays of one launch, carved from one env.alloc of argument_bytes(e, with_bias).
template <class Arr>
Arr alloc_arguments(const LaunchEnv& env, int e, bool with_bias) {
  return carve_arguments<Arr>(static_cast<char*>(env.alloc(argument_bytes(e, with_bias))), e, with_bias);
}

// The forward argument kernel's launch: block 0 writes the arguments, tail_zero_blocks (plan_forward's
// arg_tail_blocks) more zero the rows past the clamped total. The CPU emulator runs it with a stand-in GemmKernel.
template <class GemmKernel, bool kBKMajor>
void enqueue_forward_args(const GroupedArrays<GemmKernel, ForwardTags<kBKMajor>>& arr, const ForwardProblem& p,
                          const LaunchEnv& env, const void* const* b_table, int64_t* offsets) {
  using ElementD = typename GemmKernel::ElementD;
  const int tail_blocks = tail_zero_blocks(p.rows, p.n);
  moe_graph::launch(forward_args_kernel<GemmKernel, kBKMajor>, 1 + tail_blocks, kArgThreads, 0, env.stream, arr,
      p.splits.ptr, p.splits.is_int64, p.splits.num_experts, p.rows, static_cast<int>(p.n), static_cast<int>(p.k),
      static_cast<const typename GemmKernel::ElementA*>(p.a),
      static_cast<const typename GemmKernel::ElementB*>(p.b.base), p.b.expert_stride, b_table,
      static_cast<ElementD*>(p.out), static_cast<const ElementD*>(p.bias), offsets, env.error_flag);
  check_launch("forward_args_kernel");
}

// The wgrad argument kernel's launch (one block).
template <class GemmKernel>
void enqueue_wgrad_args(const GroupedArrays<GemmKernel, WgradTags>& arr, const WgradProblem& p, const LaunchEnv& env,
                        void* const* out_table, int64_t* offsets) {
  moe_graph::launch(wgrad_args_kernel<GemmKernel>, 1, kArgThreads, 0, env.stream, arr, p.splits.ptr,
      p.splits.is_int64, p.splits.num_experts, p.rows, static_cast<int>(p.n), static_cast<int>(p.k),
      static_cast<const typename GemmKernel::ElementA*>(p.dy), static_cast<const typename GemmKernel::ElementB*>(p.a),
      static_cast<typename GemmKernel::ElementD*>(const_cast<void*>(p.out.base)), p.out.expert_stride, out_table,
      offsets, env.error_flag);
  check_launch("wgrad_args_kernel");
}

}  // namespace detail
}  // namespace gg
}  // namespace moe_graph
