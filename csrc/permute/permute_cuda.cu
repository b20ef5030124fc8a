// CUDA implementation of the permute ops (semantics in permute.h). Torch-free: raw pointers and a stream.
//
// expand / reduce: 256-thread blocks of (lanes x rows_per_block) threads, lanes = the packs of a row rounded up to
// a power of two (at most 256), one output row per thread row, grid-stride over rows. A pack is 16 bytes
// (V = 16 / sizeof(T) elements) when H % V == 0 and the data and output are 16-byte aligned, else one element.
// Each output row is written by its own threads only: no atomics, deterministic.
// route_dot: one warp per route, lanes over packs, a fixed xor-shuffle tree (deterministic).
// An out-of-range index sets kErrIndexOutOfRange and reads as the sentinel (never out of bounds).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/error_flag.h"
#include "common/launch.cuh"
#include "permute/permute.h"
#include "permute/permute_impl.h"

namespace moe_graph {
namespace permute {

template <>
struct Convert<__nv_bfloat16> {
  using Acc = float;
  static MOE_PERMUTE_HD float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }
  static MOE_PERMUTE_HD __nv_bfloat16 from_acc(float a) { return __float2bfloat16_rn(a); }
};

template <>
struct Convert<__half> {
  using Acc = float;
  static MOE_PERMUTE_HD float to_acc(__half x) { return __half2float(x); }
  static MOE_PERMUTE_HD __half from_acc(float a) { return __float2half_rn(a); }
};

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kMaxBlocks = int64_t(1) << 20;  // grid-stride beyond

template <RouteOp op, typename T, int V>
__global__ void __launch_bounds__(kThreads) rows_kernel(RouteProblem p, int32_t* error_flag) {
  const int64_t n_out = op == RouteOp::kExpand ? p.rows : p.tokens;
  const int64_t step = int64_t(gridDim.x) * blockDim.y;
  for (int64_t x = int64_t(blockIdx.x) * blockDim.y + threadIdx.y; x < n_out; x += step) {
    bool bad;
    if constexpr (op == RouteOp::kExpand)
      bad = expand_row<T, V>(p, x, threadIdx.x, blockDim.x);
    else
      bad = reduce_row<T, V>(p, x, threadIdx.x, blockDim.x);
    if (bad && threadIdx.x == 0) set_device_error(error_flag, kErrIndexOutOfRange);
  }
}

template <typename T, int V>
__global__ void __launch_bounds__(kThreads) dot_kernel(RouteProblem p, int32_t* error_flag) {
  using Acc = typename Convert<T>::Acc;
  const int64_t routes = p.tokens * p.topk;
  const int lane = threadIdx.x & 31;
  const int64_t step = int64_t(gridDim.x) * kWarps;
  for (int64_t q = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5); q < routes; q += step) {
    bool bad;
    Acc s = dot_part<T, V>(p, q, lane, 32, bad);
    MOE_PERMUTE_UNROLL
    for (int d = 16; d > 0; d >>= 1) s += __shfl_xor_sync(0xffffffffu, s, d);
    if (lane == 0) {
      static_cast<Acc*>(p.out)[q] = s;
      if (bad) set_device_error(error_flag, kErrIndexOutOfRange);
    }
  }
}

unsigned blocks_for(int64_t items, int64_t per_block) {
  const int64_t b = (items + per_block - 1) / per_block;
  return static_cast<unsigned>(b < kMaxBlocks ? b : kMaxBlocks);
}

bool aligned16(const void* q) { return q == nullptr || reinterpret_cast<uintptr_t>(q) % 16 == 0; }

template <RouteOp op, typename T, int V>
cudaError_t launch(const RouteProblem& p, int32_t* flag, cudaStream_t stream) {
  if constexpr (op == RouteOp::kDot) {
    moe_graph::launch(dot_kernel<T, V>, blocks_for(p.tokens * p.topk, kWarps), kThreads, 0, stream, p, flag);
  } else {
    int lanes = 1;
    while (lanes < kThreads && lanes < p.hidden / V) lanes <<= 1;
    const dim3 block(lanes, kThreads / lanes);
    moe_graph::launch(rows_kernel<op, T, V>, blocks_for(output_rows(op, p), block.y), block, 0, stream, p, flag);
  }
  return cudaGetLastError();
}

template <RouteOp op, typename T>
cudaError_t launch_typed(const RouteProblem& p, int32_t* flag, cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T);
  const bool packs = p.hidden % V == 0 && aligned16(p.token_data) && aligned16(p.row_data) &&
                     (op == RouteOp::kDot || aligned16(p.out));
  return packs ? launch<op, T, V>(p, flag, stream) : launch<op, T, 1>(p, flag, stream);
}

template <RouteOp op>
cudaError_t launch_op(const RouteProblem& p, int32_t* flag, cudaStream_t stream) {
  switch (p.dtype) {
    case DType::kDouble: return launch_typed<op, double>(p, flag, stream);
    case DType::kBFloat16: return launch_typed<op, __nv_bfloat16>(p, flag, stream);
    case DType::kHalf: return launch_typed<op, __half>(p, flag, stream);
    default: return launch_typed<op, float>(p, flag, stream);
  }
}

}  // namespace

cudaError_t route_op_cuda_launch(RouteOp op, const RouteProblem& p, int32_t* error_flag, cudaStream_t stream) {
  if (output_rows(op, p) == 0 || (op == RouteOp::kDot && p.topk == 0)) return cudaSuccess;
  switch (op) {
    case RouteOp::kExpand: return launch_op<RouteOp::kExpand>(p, error_flag, stream);
    case RouteOp::kReduce: return launch_op<RouteOp::kReduce>(p, error_flag, stream);
    default: return launch_op<RouteOp::kDot>(p, error_flag, stream);
  }
}

}  // namespace permute
}  // namespace moe_graph
