// CUDA implementation of the tile quantizer (semantics in fp8/quantize.h). Torch-free: raw pointers and a stream;
// one launch, a grid fixed by the shapes (capturable), no host synchronization.
//
//   Blocks [0, B * row_tiles * col_tiles): one tile each. Thread 0 locates the tile's rows from m_splits (the
//   groups walked once per block); the threads take the tile's amax (NaN-propagating shared-memory reduction),
//   thread 0 turns it into the scale (writes the scale entry), then the threads quantize the tile. Rowwise tiles
//   walk the columns fastest (coalesced reads and writes); transposed tiles walk the rows fastest (coalesced
//   writes of q_t). Blocks past the tiles zero the rows past sum(m_splits), one fixed chunk of them each.
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

__global__ void __launch_bounds__(kThreads) quantize_kernel(QuantizeProblem p, int64_t tiles) {
  __shared__ float s_amax[kThreads];
  __shared__ int64_t s_tile[3];  // row0, nrows, rows of the groups
  __shared__ float s_mult;
  const int tid = threadIdx.x;
  const int64_t blk = blockIdx.x;
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
    for (int64_t j = j0 + tid; j < n && j < j0 + kTailChunk; j += kThreads) {
      const int64_t r = p.transpose ? used + j % (p.rows - used) : used + j / p.cols;
      const int64_t c = p.transpose ? j / (p.rows - used) : j % p.cols;
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
  for (int64_t i = tid; i < n; i += kThreads) {
    const int64_t r = p.transpose ? row0 + i % nrows : row0 + i / w;
    const int64_t c = p.transpose ? c0 + i / nrows : c0 + i % w;
    amax = amax_update(amax, load_x(p, b, r, c));
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
  for (int64_t i = tid; i < n; i += kThreads) {
    const int64_t r = p.transpose ? row0 + i % nrows : row0 + i / w;
    const int64_t c = p.transpose ? c0 + i / nrows : c0 + i % w;
    quantize_store(p, mult, b, r, c);
  }
}

}  // namespace

cudaError_t quantize_cuda(const QuantizeProblem& p, cudaStream_t stream) {
  const int64_t tiles = p.batch * p.row_tiles * p.col_tiles;
  const int64_t tail = p.m_splits != nullptr ? (p.rows * p.cols + kTailChunk - 1) / kTailChunk : 0;
  if (tiles + tail == 0) return cudaSuccess;
  moe_graph::launch(quantize_kernel, dim3(static_cast<unsigned>(tiles + tail)), dim3(kThreads), 0, stream, p, tiles);
  return cudaGetLastError();
}

}  // namespace fp8
}  // namespace moe_graph
