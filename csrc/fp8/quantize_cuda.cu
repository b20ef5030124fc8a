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
//   division per element. Blocks past the tiles zero the rows past sum(m_splits), a fixed part of them each
//   (tail_blocks). The input element is read through the loader of quantize.h (x itself, or the fused activation
//   of h). The fused activation backward's rowwise problem with the row-scale gradient (row_dot) runs one block
//   per row instead: its column tiles in turn, the gradient's products summed on the way, then over the block
//   (quantize_row). Index math without 64-bit divisions (their ABI calls spill registers): 32-bit divisions, sizes and tile
//   counts < 2^31 (index32_ok, checked by the launcher).
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

// Blocks quantizing tiles: one per tile, or one per row for a row_dot problem (its row tiles, B == 1).
int64_t tile_count(const QuantizeProblem& p) {
  return row_dot(p) ? p.batch * p.row_tiles : p.batch * p.row_tiles * p.col_tiles;
}
// The blocks zeroing the rows past sum(m_splits) (sized for any m_splits; no 64-bit division in the kernel). Rowwise
// q: those rows are one contiguous range, kTailChunk bytes per block. Transposed q (q_t[c, r], r in [used, rows)):
// block t takes row chunk t % chunks (kTailChunk rows from `used`) of tail_cols_per_block columns from
// (t / chunks) * tail_cols_per_block, chunks = tail_chunks_per_col (about kTailChunk bytes per block).
constexpr int kTailShift = 13;  // kTailChunk == 1 << kTailShift
static_assert(kTailChunk == int64_t(1) << kTailShift, "kTailChunk is a power of two");
__host__ __device__ __forceinline__ int64_t tail_chunks_per_col(int64_t rows) {
  return (rows + kTailChunk - 1) >> kTailShift;
}
__host__ __device__ __forceinline__ int64_t tail_cols_per_block(int64_t rows) {  // rows < 2^31
  return rows > 0 && rows <= kTailChunk ? int64_t(uint32_t(kTailChunk) / uint32_t(rows)) : 1;
}
int64_t tail_blocks(const QuantizeProblem& p) {
  if (p.m_splits == nullptr) return 0;
  if (!p.transpose) return (p.rows * p.cols + kTailChunk - 1) / kTailChunk;
  const int64_t per = tail_cols_per_block(p.rows);
  return tail_chunks_per_col(p.rows) * ((p.cols + per - 1) / per);
}

// Elements start, start + kThreads, ... of an n_slow x n_fast extent walked fastest along n_fast (the columns of a
// rowwise tile, the rows of a transposed one), while slow < n_slow: (fast, slow) advanced without a division per
// element. Unsigned 32-bit: both extents < 2^31 (rows and columns, checked by the launcher), so fast and slow stay
// below 2^31 + kThreads + 1; start < kThreads, so an extent past kThreads divides like kThreads + 1 (quotients 0).
struct Walk {
  uint32_t fast, slow, n_fast, d_fast, d_slow;
  __device__ __forceinline__ Walk(int start, int64_t n) : n_fast(uint32_t(n)) {  // 0 <= start < kThreads, n > 0
    const uint32_t n32 = n > kThreads ? uint32_t(kThreads + 1) : uint32_t(n);
    slow = uint32_t(start) / n32;
    fast = uint32_t(start) - slow * n_fast;
    d_slow = uint32_t(kThreads) / n32;
    d_fast = uint32_t(kThreads) - d_slow * n_fast;
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

// Sum (op 0) or NaN-propagating max (op 1) of v over the block's threads, a tree in s_red; every thread gets it.
// Ends with a barrier after the read: s_red is free again.
template <int kOp>
__device__ __forceinline__ float block_reduce(float* s_red, float v) {
  const int tid = threadIdx.x;
  s_red[tid] = v;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (tid < s) s_red[tid] = kOp == 0 ? s_red[tid] + s_red[tid + s] : amax_update(s_red[tid], s_red[tid + s]);
    __syncthreads();
  }
  const float out = s_red[0];
  __syncthreads();
  return out;
}

// A row_dot problem's block for row r (== its row tile: TR 1): the row's column tiles one after the other (amax,
// scale, quantize), the row-scale gradient's products summed per thread on the way (column c0 + tid of each tile,
// in the gate half), then over the block; rows past sum(m_splits) (no tile: unused scale entries, q zeroed by the
// tail blocks) still get their scale gradient.
template <class L>
__device__ __forceinline__ void quantize_row(const QuantizeProblem& p, const L& load, int64_t r) {
  __shared__ float s_red[kThreads];
  __shared__ int64_t s_nrows;
  __shared__ float s_mult;
  const int tid = threadIdx.x;
  if (tid == 0) {
    int32_t bits = 0;
    grouped_rows(p, &bits);
    if (r == 0 && bits) set_device_error(p.error_flag, bits);
    s_nrows = locate_tile<uint32_t>(p, r).nrows;  // rows < 2^31 (checked by the launcher)
  }
  __syncthreads();
  const bool quantized = s_nrows != 0;
  // 32-bit indices (rows, columns < 2^31: checked by the launcher); thread tid holds column c0 + tid of each tile
  // (TC <= kThreads: row_dot), its value computed once for the amax and the bytes
  const uint32_t r32 = uint32_t(r), TC = uint32_t(p.tile_cols);
  float dot = 0.0f;
  uint32_t ct = 0;
#pragma unroll 1
  for (uint32_t c0 = 0; c0 < uint32_t(p.cols); c0 += TC, ++ct) {
    const uint32_t c = c0 + tid;
    const bool mine = uint32_t(tid) < TC && c < uint32_t(p.cols);
    if (!quantized) {
      if (tid == 0) write_unused_scale(p, 0, r32, ct);
      if (mine && c < uint32_t(p.act.cols)) load.template value<true>(p, r32, c, &dot);
      continue;
    }
    const float v = mine ? load.template value<true>(p, r32, c, &dot) : 0.0f;
    const float amax = block_reduce<1>(s_red, amax_update(0.0f, v));
    if (tid == 0) s_mult = tile_scale(p, amax, 0, r32, ct);
    __syncthreads();
    const float mult = s_mult;
    __syncthreads();  // s_mult is written again by the next tile
    if (mine) quantize_value(p, v, mult, 0, r32, c);
  }
  dot = block_reduce<0>(s_red, dot);
  if (tid == 0) load.store_grad_scale(p, r, dot);
}

template <class L>
__device__ __forceinline__ void quantize_block(const QuantizeProblem& p, const L& load, int64_t tiles, int64_t blk) {
  if constexpr (L::kRowDot) {
    if (row_dot(p) && blk < tiles) {
      quantize_row(p, load, blk);
      return;
    }
  }
  __shared__ float s_amax[kThreads];
  __shared__ int64_t s_tile[3];  // row0, nrows, rows of the groups
  __shared__ float s_mult;
  const int tid = threadIdx.x;
  // The tile's (b, rt, ct), column tiles fastest: 32-bit divisions (blk < 2^31, the tile counts < 2^31: checked
  // by the launcher; used only when blk < tiles, where both counts are >= 1).
  const uint32_t blk_rows = uint32_t(blk) / uint32_t(p.col_tiles < 1 ? 1 : p.col_tiles);
  const int64_t ct = uint32_t(blk) - blk_rows * uint32_t(p.col_tiles);
  const int64_t rt = blk_rows % uint32_t(p.row_tiles < 1 ? 1 : p.row_tiles);
  const int64_t b = blk_rows / uint32_t(p.row_tiles < 1 ? 1 : p.row_tiles);
  if (tid == 0) {
    int32_t bits = 0;
    s_tile[2] = grouped_rows(p, &bits);
    if (blk == 0 && bits) set_device_error(p.error_flag, bits);
    if (blk < tiles) {
      const TileRows tr = locate_tile<uint32_t>(p, rt);  // rows < 2^31 (checked by the launcher)
      s_tile[0] = tr.row0;
      s_tile[1] = tr.nrows;
    }
  }
  __syncthreads();
  if (blk >= tiles) {  // zero a part of the rows past sum(m_splits) (tail_blocks)
    const int64_t used = s_tile[2];
    const uint32_t t = uint32_t(blk - tiles);
    if (!p.transpose) {  // rowwise: the rows past `used` are one contiguous range of q
      const int64_t n = (p.rows - used) * p.cols;
      const int64_t j0 = int64_t(t) * kTailChunk;
      for (int64_t j = j0 + tid; j < n && j < j0 + kTailChunk; j += kThreads) p.q[used * p.cols + j] = 0;
      return;
    }
    const uint32_t chunks = uint32_t(tail_chunks_per_col(p.rows)), per = uint32_t(tail_cols_per_block(p.rows));
    const int64_t r0 = used + (int64_t(t % chunks) << kTailShift);
    const int64_t c0 = int64_t(t / chunks) * per;
    if (r0 >= p.rows || c0 >= p.cols) return;
    const int64_t nr = (p.rows - r0) < kTailChunk ? (p.rows - r0) : kTailChunk;
    const int64_t nc = (p.cols - c0) < int64_t(per) ? (p.cols - c0) : int64_t(per);
    for (Walk e(tid, nr); e.slow < nc; e.next()) p.q[q_index(p, 0, r0 + e.fast, c0 + e.slow)] = 0;  // rows fastest
    return;
  }
  const int64_t row0 = s_tile[0], nrows = s_tile[1];
  if (nrows == 0 && p.tile_rows != 0) {
    if (tid == 0) write_unused_scale(p, b, rt, ct);
    return;
  }
  const int64_t TC = col_tile_width(p);
  const int64_t c0 = ct * TC;
  const int64_t w = (p.cols - c0) < TC ? (p.cols - c0) : TC;
  float amax = 0.0f;
  // n_fast * n_slow elements; an empty extent (a per-tensor tile of no rows) walks nothing (n_slow 0). The walk
  // starts at (row0, c0) and stays in 32 bits (rows, columns < 2^31): fewer registers live across the calls of the
  // loaders' slow paths (fp32 division).
  const uint32_t n_fast = nrows * w == 0 ? 1 : uint32_t(p.transpose ? nrows : w);
  const uint32_t n_slow = nrows * w == 0 ? 0 : uint32_t(p.transpose ? w : nrows);
  const uint32_t r0 = uint32_t(row0), cc0 = uint32_t(c0), b32 = uint32_t(b);
  Walk e(tid, n_fast);
  for (; e.slow < n_slow; e.next()) {
    const uint32_t r = r0 + (p.transpose ? e.fast : e.slow);
    const uint32_t c = cc0 + (p.transpose ? e.slow : e.fast);
    amax = amax_update(amax, load(p, b32, r, c));
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
  for (; e.slow < n_slow; e.next()) {
    const uint32_t r = r0 + (p.transpose ? e.fast : e.slow);
    const uint32_t c = cc0 + (p.transpose ? e.slow : e.fast);
    quantize_value(p, load(p, b32, r, c), mult, b32, r, c);
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
__device__ __forceinline__ void quantize_problems(const Problems& ps) {
  const int64_t blk = blockIdx.x;
  const int i = blk < ps.blocks0 ? 0 : 1;
  quantize_block(ps.p[i], L{}, ps.tiles[i], i == 0 ? blk : blk - ps.blocks0);
}

template <class L>
__global__ void __launch_bounds__(kThreads) quantize_kernel(const MOE_GRAPH_GRID_CONSTANT Problems ps) {
  quantize_problems<L>(ps);
}

// The activation backward's loader (with the row_dot path): 4 blocks per SM (at most 64 registers); with
// __launch_bounds__(kThreads) alone ptxas allocates 40 registers and spills around the loader's slow-path calls
// (sm_90a: fp32 SwiGLU variants; sm_100a: 16-bit softcapped_swiglu). The other loaders keep no minimum (an explicit
// one changes their allocation).
template <class L>
__global__ void __launch_bounds__(kThreads, 4) quantize_grad_kernel(const MOE_GRAPH_GRID_CONSTANT Problems ps) {
  quantize_problems<L>(ps);
}

}  // namespace

cudaError_t quantize_pair_cuda(const QuantizeProblem& p0, const QuantizeProblem* p1, cudaStream_t stream) {
  if (!index32_ok(p0) || (p1 && !index32_ok(*p1))) return cudaErrorInvalidValue;  // the kernel's 32-bit divisions
  for (const QuantizeProblem* p : {&p0, p1})  // a row_dot problem: one block per row, its row tile
    if (p && row_dot(*p) && (p->batch != 1 || p->row_tiles != p->rows)) return cudaErrorInvalidValue;
  const int64_t tiles0 = tile_count(p0), blocks0 = tiles0 + tail_blocks(p0);
  const int64_t tiles1 = p1 ? tile_count(*p1) : 0, blocks1 = p1 ? tiles1 + tail_blocks(*p1) : 0;
  if (blocks0 + blocks1 == 0) return cudaSuccess;
  if (blocks0 + blocks1 > kMaxIndex32) return cudaErrorInvalidValue;  // blk < 2^31
  const Problems ps{{p0, p1 ? *p1 : p0}, {tiles0, tiles1}, blocks0};
  with_loader(p0, [&](auto load) {
    using L = decltype(load);
    if constexpr (L::kRowDot)
      moe_graph::launch(quantize_grad_kernel<L>, dim3(static_cast<unsigned>(blocks0 + blocks1)), dim3(kThreads), 0,
                        stream, ps);
    else
      moe_graph::launch(quantize_kernel<L>, dim3(static_cast<unsigned>(blocks0 + blocks1)), dim3(kThreads), 0,
                        stream, ps);
  });
  return cudaGetLastError();
}

cudaError_t quantize_cuda(const QuantizeProblem& p, cudaStream_t stream) { return quantize_pair_cuda(p, nullptr, stream); }

}  // namespace fp8
}  // namespace moe_graph
