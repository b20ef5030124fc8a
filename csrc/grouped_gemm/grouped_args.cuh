// Device-side argument construction for the CUTLASS grouped kernels, 16-bit and FP8 (fp8/scaled_args.cuh): one
// argument kernel (grouped_args_kernel) whose block 0 scans m_splits (int32/int64, any number of experts, in chunks
// of the block size) and writes, for every expert, what a `Maker` computes from its span (problem size, operand
// pointers and strides: grouped_expert_args.h, fp8/scaled_expert_args.h); a forward launch's other blocks zero
// the output rows past the splits. No host involvement, so it runs inside CUDA graphs.
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

inline size_t align_up(size_t x, size_t a = 128) { return (x + a - 1) / a * a; }

// The per-expert arrays every grouped launch hands CUTLASS (16-bit: GroupedArrays; FP8: fp8's ScaledArrays adds
// the scale factors), all device arrays of length E inside the workspace: problem shapes, A / B / C / D pointers
// (C aliases D: read only by accumulating epilogues) and strides, the bias pointers (null without bias). `store`
// takes what an argument maker returns (ExpertArgs, fp8's ScaledExpert).
template <class EA, class EB, class ED, class EBias, class SA, class SB, class SD>
struct ExpertArrays {
  using ProblemShape = cute::Shape<int, int, int>;
  using ElementA = EA;
  using ElementB = EB;
  using ElementD = ED;
  using StrideA = SA;
  using StrideB = SB;
  using StrideC = SD;
  using StrideD = SD;
  static_assert(sizeof(SA) == 8 && sizeof(SB) == 8 && sizeof(SD) == 8 && sizeof(ProblemShape) == 12,
                "the workspace formulas (argument_bytes, scaled_argument_bytes) count 8-byte strides");

  ProblemShape* shapes;
  const EA** ptr_a;
  const EB** ptr_b;
  const ED** ptr_c;
  ED** ptr_d;
  SA* stride_a;
  SB* stride_b;
  SD* stride_c;
  SD* stride_d;
  const EBias** ptr_bias;  // forward: bias row of each expert (null when the launch has no bias)

  template <class X>
  MOE_GRAPH_HD void store(int e, const X& x) const {
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

  // These arrays from `take(bytes)` (consecutive 128-byte aligned pieces of one workspace allocation).
  template <class Take>
  void carve(Take& take, int e, bool with_bias) {
    const size_t ptr = sizeof(void*) * e;
    shapes = reinterpret_cast<ProblemShape*>(take(sizeof(ProblemShape) * e));
    ptr_a = reinterpret_cast<const EA**>(take(ptr));
    ptr_b = reinterpret_cast<const EB**>(take(ptr));
    ptr_c = reinterpret_cast<const ED**>(take(ptr));
    ptr_d = reinterpret_cast<ED**>(take(ptr));
    ptr_bias = with_bias ? reinterpret_cast<const EBias**>(take(ptr)) : nullptr;
    stride_a = reinterpret_cast<SA*>(take(sizeof(SA) * e));
    stride_b = reinterpret_cast<SB*>(take(sizeof(SB) * e));
    stride_c = reinterpret_cast<SD*>(take(sizeof(SD) * e));
    stride_d = reinterpret_cast<SD*>(take(sizeof(SD) * e));
  }
};

// The arrays of a 16-bit launch of `GemmKernel`. `Tags`: the operand layouts (grouped_expert_args.h) the kernel
// was built from.
template <class GemmKernel, class Tags>
struct GroupedArrays
    : ExpertArrays<typename GemmKernel::ElementA, typename GemmKernel::ElementB, typename GemmKernel::ElementD,
                   typename GemmKernel::ElementD, typename GemmKernel::InternalStrideA,
                   typename GemmKernel::InternalStrideB, typename GemmKernel::InternalStrideD> {
  using Expert = ExpertArgs<Tags, typename GemmKernel::ElementA, typename GemmKernel::ElementB,
                            typename GemmKernel::ElementD>;
  // The host-tested argument function computes exactly the kernel's stride types.
  static_assert(std::is_same_v<typename GemmKernel::ProblemShape::UnderlyingProblemShape, cute::Shape<int, int, int>>);
  static_assert(std::is_same_v<typename GemmKernel::InternalStrideA, typename Expert::Strides::A>);
  static_assert(std::is_same_v<typename GemmKernel::InternalStrideB, typename Expert::Strides::B>);
  static_assert(std::is_same_v<typename GemmKernel::InternalStrideC, typename Expert::Strides::D>);
  static_assert(std::is_same_v<typename GemmKernel::InternalStrideD, typename Expert::Strides::D>);
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

// Blocks 1.. of a forward argument launch: zero the rows [clamped total, rows) of the 16-bit output `d` [rows, n]
// (n % 8 == 0: 16-byte rows), which no GEMM tile writes.
__device__ __forceinline__ void zero_tail_rows(uint16_t* d, int64_t n, const void* splits, bool is_int64,
                                               int num_experts, int64_t rows) {
  const int64_t total = clamped_total(splits, is_int64, num_experts, rows);
  uint4* base = reinterpret_cast<uint4*>(d + total * n);
  const int64_t nvec = (rows - total) * (n / 8);
  const int64_t stride = int64_t(gridDim.x - 1) * kArgThreads;
  for (int64_t i = int64_t(blockIdx.x - 1) * kArgThreads + threadIdx.x; i < nvec; i += stride)
    base[i] = make_uint4(0u, 0u, 0u, 0u);
}

// The argument kernel of every grouped launch. Block 0: the spans of m_splits (offsets [E + 1] written, the
// clamping rule of grouped_spans.h), then arr.store(e, maker(...)) for every expert:
//   Maker::kBlockCounts false  maker(e, start, count), in the scan;
//   Maker::kBlockCounts true   (FP8: the scale grids are laid out by row blocks) a second pass over the offsets
//                              also scans q_e = sum_{g < e} ceil(count_g / 128) and tile0_e = sum_{g < e}
//                              ceil(count_g / maker.tile_rows) (0 when tile_rows is 0), stores
//                              maker(e, start, count, q_e, &unaligned) and arr.tile0[e] = tile0_e; an unaligned
//                              expert sets kErrUnalignedSplit.
// Blocks 1.. (forward launches: d_tail, the 16-bit output [rows, n]) zero the rows past the clamped total.
template <class Arr, class Maker>
__global__ void __launch_bounds__(kArgThreads) grouped_args_kernel(Arr arr, Maker maker, const void* splits,
                                                                   bool is_int64, int num_experts, int64_t rows,
                                                                   int64_t* offsets, uint16_t* d_tail, int64_t n,
                                                                   int32_t* error_flag) {
  if (blockIdx.x > 0) {
    zero_tail_rows(d_tail, n, splits, is_int64, num_experts, rows);
    return;
  }
  if constexpr (!Maker::kBlockCounts) {
    for_each_expert_span(splits, is_int64, num_experts, rows, error_flag, offsets,
                         [&](int e, int64_t start, int64_t count) { arr.store(e, maker(e, start, count)); });
  } else {
    for_each_expert_span(splits, is_int64, num_experts, rows, error_flag, offsets, [](int, int64_t, int64_t) {});
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
}

// Forward / dgrad: D_e[count, n] = A[start: start+count, :k] x B_e (+ bias_e).
template <class GemmKernel, bool kBKMajor>
struct ForwardArgsMaker {
  static constexpr bool kBlockCounts = false;
  int n, k;
  const typename GemmKernel::ElementA* a;
  const typename GemmKernel::ElementB* b_base;
  int64_t b_stride;
  const void* const* b_table;
  typename GemmKernel::ElementD* d;
  const typename GemmKernel::ElementD* bias;
  MOE_GRAPH_HD auto operator()(int e, int64_t start, int64_t count) const {
    return forward_expert_args<kBKMajor>(e, start, count, n, k, a, b_base, b_stride, b_table, d, bias);
  }
};

// Wgrad: D_e[n, k] = dy_e^T x a_e, GEMM (M, N, K) = (n, k, count).
template <class GemmKernel>
struct WgradArgsMaker {
  static constexpr bool kBlockCounts = false;
  int n, k;
  const typename GemmKernel::ElementA* dy;
  const typename GemmKernel::ElementB* a;
  typename GemmKernel::ElementD* out_base;
  int64_t out_stride;
  void* const* out_table;
  MOE_GRAPH_HD auto operator()(int e, int64_t start, int64_t count) const {
    return wgrad_expert_args(e, start, count, n, k, dy, a, out_base, out_stride, out_table);
  }
};

// Carves the arrays from one allocation of their workspace formula (argument_bytes(e, with_bias) of
// grouped_plan.cpp, scaled_argument_bytes of fp8/scaled_plan.cpp), in the order Arr::carve takes them.
template <class Arr>
Arr carve_arguments(char* base, int e, bool with_bias) {
  Arr a;
  auto take = [&](size_t n) {
    char* p = base;
    base += align_up(n);
    return p;
  };
  a.carve(take, e, with_bias);
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
  static_assert(sizeof(ElementD) == 2, "the tail zeroing writes 8 elements per 16 bytes");
  using Maker = ForwardArgsMaker<GemmKernel, kBKMajor>;
  const Maker maker{static_cast<int>(p.n), static_cast<int>(p.k), static_cast<const typename GemmKernel::ElementA*>(p.a),
                    static_cast<const typename GemmKernel::ElementB*>(p.b.base), p.b.expert_stride, b_table,
                    static_cast<ElementD*>(p.out), static_cast<const ElementD*>(p.bias)};
  moe_graph::launch(grouped_args_kernel<GroupedArrays<GemmKernel, ForwardTags<kBKMajor>>, Maker>,
                    1 + tail_zero_blocks(p.rows, p.n), kArgThreads, 0, env.stream, arr, maker, p.splits.ptr,
                    p.splits.is_int64, p.splits.num_experts, p.rows, offsets, static_cast<uint16_t*>(p.out), p.n,
                    env.error_flag);
  check_launch("grouped_args_kernel (forward)");
}

// The wgrad argument kernel's launch (one block).
template <class GemmKernel>
void enqueue_wgrad_args(const GroupedArrays<GemmKernel, WgradTags>& arr, const WgradProblem& p, const LaunchEnv& env,
                        void* const* out_table, int64_t* offsets) {
  using Maker = WgradArgsMaker<GemmKernel>;
  const Maker maker{static_cast<int>(p.n), static_cast<int>(p.k),
                    static_cast<const typename GemmKernel::ElementA*>(p.dy),
                    static_cast<const typename GemmKernel::ElementB*>(p.a),
                    static_cast<typename GemmKernel::ElementD*>(const_cast<void*>(p.out.base)), p.out.expert_stride,
                    out_table};
  moe_graph::launch(grouped_args_kernel<GroupedArrays<GemmKernel, WgradTags>, Maker>, 1, kArgThreads, 0, env.stream,
                    arr, maker, p.splits.ptr, p.splits.is_int64, p.splits.num_experts, p.rows, offsets,
                    static_cast<uint16_t*>(nullptr), int64_t(0), env.error_flag);
  check_launch("grouped_args_kernel (wgrad)");
}

}  // namespace detail
}  // namespace gg
}  // namespace moe_graph
