// CUDA implementation of the tile quantizer (semantics in fp8/quantize.h). Torch-free: raw pointers and a stream;
// one launch, a grid fixed by the shapes (capturable), no host synchronization.
//
//   One launch quantizes one problem or two problems over the same input (quantize_pair_cuda: the rowwise and the
//   columnwise copy of an activation or gradient, or of the fused activation's output): blocks [0, blocks(p0)) run
//   p0, the rest p1. Per problem, blocks [0, B * row_tiles * col_tiles): one tile each. Thread 0 locates the
//   tile's rows from m_splits (the groups walked once per block); the threads take the tile's amax
//   (NaN-propagating shared-memory reduction), thread 0 turns it into the scale (writes the scale entry), then the
//   threads quantize the tile. Rowwise tiles walk the columns fastest (coalesced reads and writes); transposed
//   tiles walk the rows fastest (coalesced writes of q_t), each thread's (row, column) advanced without a
//   division per element. Blocks past the tiles zero the rows past sum(m_splits),
//   one fixed chunk of them each. The input element is read through the loader of quantize.h (x itself, or the
//   fused activation of h).
#include <algorithm>
#include <cstdint>

#include "common/error_flag.h"
#include "common/launch.cuh"
#include "fp8/quantize.h"

namespace moe_graph {
namespace fp8 {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kTailChunk = int64_t(kThreads) * 32;  // bytes of q zeroed per tail block

int64_t tile_count(const QuantizeProblem& p) { return p.batch * p.row_tiles * p.col_tiles; }
int64_t tail_blocks(const QuantizeProblem& p) {
  return p.m_splits != nullptr ? (p.rows * p.cols + kTailChunk - 1) / kTailChunk : 0;
}

// Element i = start, start + kThreads, ... of an extent walked fastest along `n_fast` (the columns of a rowwise
// tile, the rows of a transposed one): (fast, slow) advanced without a 64-bit division per element (one per walk).
struct Walk {
  int64_t fast, slow, n_fast, d_fast, d_slow;
  __device__ __forceinline__ Walk(int64_t start, int64_t n) : n_fast(n) {  // n > 0
    slow = start / n;
    fast = start - slow * n;
    d_slow = kThreads / n;
    d_fast = kThreads - d_slow * n;
  }
  __device__ __forceinline__ void next() {
    fast += d_fast;
    slow += d_slow;
    if (fast >= n_fast) {
      fast -= n_fast;
      ++slow;
    }
  }
};

template <class L>
__device__ __forceinline__ void quantize_block(const QuantizeProblem& p, const L& load, int64_t tiles, int64_t blk) {
  __shared__ float s_amax[kThreads];
  __shared__ int64_t s_tile[3];  // row0, nrows, rows of the groups
  __shared__ float s_mult;
  const int tid = threadIdx.x;
  if (tid == 0) {
    int32_t bits = 0;
    s_tile[2] = grouped_rows(p, &bits);
    if (blk == 0 && bits) set_device_error(p.error_flag, bits);
    if (blk < tiles) {
      const TileRows tr = locate_tile(p, (blk / p.col_tiles) % p.row_tiles);
      s_tile[0] = tr.row0;
      s_tile[1] = tr.nrows;
    }
  }
  __syncthreads();
  if (blk >= tiles) {  // zero a chunk of the rows past sum(m_splits)
    const int64_t used = s_tile[2];
    const int64_t n = (p.rows - used) * p.cols;
    const int64_t j0 = (blk - tiles) * kTailChunk;
    if (n == 0) return;
    Walk e(j0 + tid, p.transpose ? p.rows - used : p.cols);
    for (int64_t j = j0 + tid; j < n && j < j0 + kTailChunk; j += kThreads, e.next()) {
      const int64_t r = used + (p.transpose ? e.fast : e.slow);
      const int64_t c = p.transpose ? e.slow : e.fast;
      p.q[q_index(p, 0, r, c)] = 0;
    }
    return;
  }
  const int64_t ct = blk % p.col_tiles;
  const int64_t rt = (blk / p.col_tiles) % p.row_tiles;
  const int64_t b = blk / (p.col_tiles * p.row_tiles);
  const int64_t row0 = s_tile[0], nrows = s_tile[1];
  if (nrows == 0 && p.tile_rows != 0) {
    if (tid == 0) write_unused_scale(p, b, rt, ct);
    return;
  }
  const int64_t TC = col_tile_width(p);
  const int64_t c0 = ct * TC;
  const int64_t w = (p.cols - c0) < TC ? (p.cols - c0) : TC;
  const int64_t n = nrows * w;
  float amax = 0.0f;
  const int64_t n_fast = n == 0 ? 1 : p.transpose ? nrows : w;  // n == 0: a per-tensor tile of no rows
  Walk e(tid, n_fast);
  for (int64_t i = tid; i < n; i += kThreads, e.next()) {
    const int64_t r = row0 + (p.transpose ? e.fast : e.slow);
    const int64_t c = c0 + (p.transpose ? e.slow : e.fast);
    amax = amax_update(amax, load(p, b, r, c));
  }
  s_amax[tid] = amax;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (tid < s) s_amax[tid] = amax_update(s_amax[tid], s_amax[tid + s]);
    __syncthreads();
  }
  if (tid == 0) s_mult = tile_scale(p, s_amax[0], b, rt, ct);
  __syncthreads();
  const float mult = s_mult;
  e = Walk(tid, n_fast);  // made again: nothing of the walk lives across the reduction
  for (int64_t i = tid; i < n; i += kThreads, e.next()) {
    const int64_t r = row0 + (p.transpose ? e.fast : e.slow);
    const int64_t c = c0 + (p.transpose ? e.slow : e.fast);
    quantize_value(p, load(p, b, r, c), mult, b, r, c);
  }
}

// The two problems of a launch, read in place from the parameter space (__grid_constant__: indexing them makes no
// local copy; one inlined body for both).
struct Problems {
  QuantizeProblem p[2];
  int64_t tiles[2];
  int64_t blocks0;
};

#if defined(MOE_GRAPH_EMULATE)
#define MOE_GRAPH_GRID_CONSTANT
#else
#define MOE_GRAPH_GRID_CONSTANT __grid_constant__
#endif

template <class L>
__global__ void __launch_bounds__(kThreads) quantize_kernel(const MOE_GRAPH_GRID_CONSTANT Problems ps) {
  const int64_t blk = blockIdx.x;
  const int i = blk < ps.blocks0 ? 0 : 1;
  quantize_block(ps.p[i], L{}, ps.tiles[i], i == 0 ? blk : blk - ps.blocks0);
}

}  // namespace

cudaError_t quantize_pair_cuda(const QuantizeProblem& p0, const QuantizeProblem* p1, cudaStream_t stream) {
  const int64_t tiles0 = tile_count(p0), blocks0 = tiles0 + tail_blocks(p0);
  const int64_t tiles1 = p1 ? tile_count(*p1) : 0, blocks1 = p1 ? tiles1 + tail_blocks(*p1) : 0;
  if (blocks0 + blocks1 == 0) return cudaSuccess;
  const Problems ps{{p0, p1 ? *p1 : p0}, {tiles0, tiles1}, blocks0};
  with_loader(p0, [&](auto load) {
    moe_graph::launch(quantize_kernel<decltype(load)>, dim3(static_cast<unsigned>(blocks0 + blocks1)), dim3(kThreads),
                      0, stream, ps);
  });
  return cudaGetLastError();
}

cudaError_t quantize_cuda(const QuantizeProblem& p, cudaStream_t stream) { return quantize_pair_cuda(p, nullptr, stream); }

}  // namespace fp8
}  // namespace moe_graph
