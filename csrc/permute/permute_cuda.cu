// CUDA implementation of the permute ops (semantics in permute.h). Torch-free: raw pointers and a stream.
//
// expand / reduce: 256-thread blocks of (lanes x rows_per_block) threads, lanes = the packs of a row rounded up to
// a power of two (at most 256), one output row per thread row, grid-stride over rows. A pack is 16 bytes
// (V = 16 / sizeof(T) elements) when H % V == 0 and the data and output are 16-byte aligned, else one element.
// Each output row is written by its own threads only: no atomics, deterministic.
// route_dot: one warp per route, lanes over packs, a fixed xor-shuffle tree (deterministic).
// An out-of-range index sets kErrIndexOutOfRange and reads as the sentinel (never out of bounds).
// expand_quantize (expand_quantize.h): one 128-thread block per tile of the first problem, then of the second, each
// followed by its blocks zeroing the rows past sum(m_splits). Thread 0 locates the tile (fp8::locate_tile over
// m_splits); the threads take its amax (NaN-propagating shared-memory reduction), thread 0 makes the scale, then
// the threads quantize the tile. Rowwise tiles: threads over the columns of each row (coalesced q); transposed
// tiles: threads over the rows of each column (coalesced q_t); no division per element. The elements are read
// through LoadRoute (the row's token: src is read in place, the expanded rows never exist). A packed source's
// rowwise tiles copy their row's bytes and scale; a packed output's tiles write into their row after its bytes.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/error_flag.h"
#include "common/launch.cuh"
#include "permute/expand_quantize.h"
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

// ------------------------------------------------------------------------------------------- expand_quantize --
constexpr int kQThreads = 128;
constexpr int64_t kTailChunk = int64_t(kQThreads) * 64;  // elements of q zeroed per tail block

#if defined(MOE_GRAPH_EMULATE)
#define MOE_PERMUTE_GRID_CONSTANT
#else
#define MOE_PERMUTE_GRID_CONSTANT __grid_constant__
#endif

struct QuantizeArgs {
  fp8::QuantizeProblem p[2];
  int64_t tiles[2], blocks0;  // tile blocks per problem; blocks of the first problem (tiles + tail)
  ExpandRoutes e;
  int32_t* error_flag;
};

int64_t tail_blocks(const fp8::QuantizeProblem& p) {
  if (p.m_splits == nullptr || p.rows == 0) return 0;
  if (!p.transpose) return (p.rows * p.cols + kTailChunk - 1) / kTailChunk;  // one contiguous range
  return p.cols * ((p.rows + kTailChunk - 1) / kTailChunk);                    // a row chunk of one column each
}

// Block `blk` of problem p: a tile (blk < tiles), else a part of the rows past sum(m_splits). `first`: the problem
// that reports the m_splits bits and the out-of-range routes (the other one reads the same rows).
__device__ __forceinline__ void expand_quantize_block(const fp8::QuantizeProblem& p, const ExpandRoutes& e,
                                                      int32_t* flag, bool first, int64_t tiles, int64_t blk) {
  __shared__ float s_amax[kQThreads];
  __shared__ int64_t s_tile[3];  // row0, nrows, rows of the groups
  __shared__ float s_mult;
  const int tid = threadIdx.x;
  const uint32_t n_ct = uint32_t(p.col_tiles < 1 ? 1 : p.col_tiles);
  const uint32_t rt = uint32_t(blk) / n_ct;  // blk < 2^31 (checked by the launcher)
  const int64_t ct = uint32_t(blk) - rt * n_ct;
  if (tid == 0) {
    int32_t bits = 0;
    s_tile[2] = fp8::grouped_rows(p, &bits);
    if (blk == 0 && first && bits) set_device_error(flag, bits);
    if (blk < tiles) {
      const fp8::TileRows tr = fp8::locate_tile<uint32_t>(p, rt);
      s_tile[0] = tr.row0;
      s_tile[1] = tr.nrows;
    }
  }
  __syncthreads();
  if (blk >= tiles) {
    const int64_t used = s_tile[2];
    const uint32_t t = uint32_t(blk - tiles);
    if (!p.transpose) {  // rowwise: the rows past `used` are one contiguous range of q
      const int64_t n = (p.rows - used) * p.cols, j0 = int64_t(t) * kTailChunk;
      for (int64_t j = j0 + tid; j < n && j < j0 + kTailChunk; j += kQThreads) p.q[used * p.cols + j] = 0;
      return;
    }
    const uint32_t chunks = uint32_t((p.rows + kTailChunk - 1) / kTailChunk);  // >= 1: rows > 0 here
    const uint32_t c = t / chunks;
    const int64_t r0 = used + int64_t(t - c * chunks) * kTailChunk;
    const int64_t r1 = r0 + kTailChunk < p.rows ? r0 + kTailChunk : p.rows;
    for (int64_t r = r0 + tid; r < r1; r += kQThreads) p.q[int64_t(c) * p.rows + r] = 0;
    return;
  }
  const int64_t row0 = s_tile[0], row1 = s_tile[0] + s_tile[1];
  if (s_tile[1] == 0 && p.tile_rows != 0) {  // a scale entry of no tile
    if (tid == 0) fp8::write_unused_scale(p, 0, rt, ct);
    return;
  }
  const int64_t TC = fp8::col_tile_width(p), c0 = ct * TC;
  const int64_t c1 = c0 + TC < p.cols ? c0 + TC : p.cols;
  const LoadRoute load{e};
  if (first && ct == 0) {  // the rows of this tile (the first problem's column-0 tiles cover the groups' rows)
    for (int64_t r = row0 + tid; r < row1; r += kQThreads)
      if (!route_in_range(row_route(e, r), e.tokens * e.topk)) set_device_error(flag, kErrIndexOutOfRange);
  }
  if (e.packed.src && !p.transpose) {  // the source row's bytes and scale (a tile of one row)
    if (tid == 0) copy_packed_scale(p, e, row0, rt, ct);
    for (int64_t c = c0 + tid; c < c1; c += kQThreads) copy_packed_byte(p, e, row0, c);
    return;
  }
  // rowwise: threads along the columns of each row; transposed: along the rows of each column (q_t's rows)
  const int64_t n_slow0 = p.transpose ? c0 : row0, n_slow1 = p.transpose ? c1 : row1;
  const int64_t n_fast0 = p.transpose ? row0 : c0, n_fast1 = p.transpose ? row1 : c1;
  float amax = 0.0f;
  for (int64_t s = n_slow0; s < n_slow1; ++s)
    for (int64_t f = n_fast0 + tid; f < n_fast1; f += kQThreads)
      amax = fp8::amax_update(amax, p.transpose ? load(p, 0, f, s) : load(p, 0, s, f));
  s_amax[tid] = amax;
  __syncthreads();
  for (int h = kQThreads / 2; h > 0; h >>= 1) {
    if (tid < h) s_amax[tid] = fp8::amax_update(s_amax[tid], s_amax[tid + h]);
    __syncthreads();
  }
  if (tid == 0)
    s_mult = e.packed.out ? pack_tile_scale(p, e, s_amax[0], row0, ct) : fp8::tile_scale(p, s_amax[0], 0, rt, ct);
  __syncthreads();
  const float mult = s_mult;
  for (int64_t s = n_slow0; s < n_slow1; ++s)
    for (int64_t f = n_fast0 + tid; f < n_fast1; f += kQThreads) {
      const int64_t r = p.transpose ? f : s, c = p.transpose ? s : f;
      expand_quantize_value(p, e, load(p, 0, r, c), mult, r, c);
    }
}

__global__ void __launch_bounds__(kQThreads) expand_quantize_kernel(const MOE_PERMUTE_GRID_CONSTANT QuantizeArgs a) {
  const int64_t blk = blockIdx.x;
  const int i = blk < a.blocks0 ? 0 : 1;
  expand_quantize_block(a.p[i], a.e, a.error_flag, i == 0, a.tiles[i], i == 0 ? blk : blk - a.blocks0);
}

}  // namespace

cudaError_t expand_quantize_cuda_launch(const fp8::QuantizeProblem& p0, const fp8::QuantizeProblem* p1,
                                        const ExpandRoutes& e, int32_t* error_flag, cudaStream_t stream) {
  if (!expand_quantize_ok(p0, e) || (p1 && !expand_quantize_ok(*p1, e))) return cudaErrorInvalidValue;
  QuantizeArgs a{{p0, p1 ? *p1 : p0}, {p0.row_tiles * p0.col_tiles, p1 ? p1->row_tiles * p1->col_tiles : 0}, 0, e,
                 error_flag};
  a.blocks0 = a.tiles[0] + tail_blocks(p0);
  const int64_t blocks = a.blocks0 + (p1 ? a.tiles[1] + tail_blocks(*p1) : 0);
  if (blocks == 0) return cudaSuccess;
  if (blocks > fp8::kMaxIndex32) return cudaErrorInvalidValue;  // blk < 2^31
  moe_graph::launch(expand_quantize_kernel, dim3(static_cast<unsigned>(blocks)), dim3(kQThreads), 0, stream, a);
  return cudaGetLastError();
}

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
