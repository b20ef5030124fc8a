// CUDA implementation of the fused expert activation (semantics in activation.h). Torch-free: raw pointers and a
// stream; one launch per call, fixed configuration for fixed shapes (capturable), no host synchronization.
//
//   Both kernels walk the rows in vectors of V elements (16 bytes when F is a multiple of V and every pointer is
//   16-byte aligned, else V = 1; fp64 post_clamped_swiglu and gelu always V = 1: vector_elems),
//   each row by one group of up to 32 lanes of a warp (short rows share a warp),
//   grid-stride over the rows. The backward's scale gradient is the row's sum over its lanes, a shuffle
//   reduction inside the group written by its first lane (no atomics). Without grad_h (nullptr) the backward
//   computes the same values and writes the scale gradient only.
#include <algorithm>
#include <cstdint>

#include "activation/activation.h"
#include "common/launch.cuh"

namespace moe_graph {
namespace activation {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kBlocksPerSm = 2048 / kThreads;  // enough resident threads to fill an SM
constexpr unsigned kFull = 0xffffffffu;

template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

template <typename T, int V>
__device__ __forceinline__ Vec<T, V> load(const T* p) {
  return *reinterpret_cast<const Vec<T, V>*>(p);
}

template <typename T, int V>
__device__ __forceinline__ void store(T* p, const Vec<T, V>& x) {
  *reinterpret_cast<Vec<T, V>*>(p) = x;
}

// Rows are handed out to groups of G lanes (G a power of two, the smallest >= the vectors of a row, at most 32;
// 32 / G rows per warp), grid-stride over the rows; a lane walks its row in steps of G vectors. Only shifts and
// masks on the lane: no integer division in the kernels.
struct RowGroups {
  int log2_lanes;   // log2(G)
  int64_t rows_per_step;  // rows covered by the whole grid per step
};

template <ActKind K, typename T, typename S, int V>
__global__ void __launch_bounds__(kThreads) forward_kernel(ActivationProblem p, RowGroups rg) {
  using A = acc_t<T>;
  const int64_t F = p.cols;
  const A alpha = static_cast<A>(p.alpha), limit = static_cast<A>(p.limit);
  const T* __restrict__ h = static_cast<const T*>(p.h);
  const S* __restrict__ scale = static_cast<const S*>(p.scale);
  T* __restrict__ y = static_cast<T*>(p.y);
  const int lane = threadIdx.x & 31;
  const int lanes = 1 << rg.log2_lanes;
  const int64_t first = ((int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5)) << (5 - rg.log2_lanes)) +
                        (lane >> rg.log2_lanes);
  const int64_t c0 = int64_t(lane & (lanes - 1)) * V;
  constexpr int64_t kWidth = is_gated(K) ? 2 : 1;  // h's columns per output column
  for (int64_t r = first; r < p.rows; r += rg.rows_per_step) {
    const A s = scale ? static_cast<A>(widen(scale[r])) : A(1);
#pragma unroll 1
    for (int64_t c = c0; c < F; c += int64_t(lanes) * V) {
      const Vec<T, V> a = load<T, V>(h + r * kWidth * F + c);
      Vec<T, V> out;
      if constexpr (is_gated(K)) {
        const Vec<T, V> b = load<T, V>(h + r * kWidth * F + F + c);
#pragma unroll
        for (int k = 0; k < V; ++k)
          out.v[k] = Narrow<T>::to(gated_value<K, A>(widen(a.v[k]), widen(b.v[k]), alpha, limit) * s);
      } else {
#pragma unroll
        for (int k = 0; k < V; ++k) out.v[k] = Narrow<T>::to(plain_value<K, A>(widen(a.v[k])) * s);
      }
      store<T, V>(y + r * F + c, out);
    }
  }
}

template <ActKind K, typename T, typename S, int V>
__global__ void __launch_bounds__(kThreads) backward_kernel(ActivationProblem p, RowGroups rg) {
  using A = acc_t<T>;
  const int64_t F = p.cols;
  const A alpha = static_cast<A>(p.alpha), limit = static_cast<A>(p.limit);
  const T* __restrict__ h = static_cast<const T*>(p.h);
  const T* __restrict__ dy = static_cast<const T*>(p.grad_y);
  const S* __restrict__ scale = static_cast<const S*>(p.scale);
  T* __restrict__ dh = static_cast<T*>(p.grad_h);
  S* __restrict__ ds = static_cast<S*>(p.grad_scale);
  const int lane = threadIdx.x & 31;
  const int lanes = 1 << rg.log2_lanes;
  const int64_t first = ((int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5)) << (5 - rg.log2_lanes)) +
                        (lane >> rg.log2_lanes);
  const int64_t c0 = int64_t(lane & (lanes - 1)) * V;
  constexpr int64_t kWidth = is_gated(K) ? 2 : 1;
  // Every lane of a warp runs the same number of steps (the shuffles below need all 32): a lane past the last row
  // computes nothing and writes nothing.
  for (int64_t base = first - (lane >> rg.log2_lanes); base < p.rows; base += rg.rows_per_step) {
    const int64_t r = base + (lane >> rg.log2_lanes);
    const bool active = r < p.rows;
    A dot = A(0);
    if (active) {
      const A s = scale ? static_cast<A>(widen(scale[r])) : A(1);
#pragma unroll 1
      for (int64_t c = c0; c < F; c += int64_t(lanes) * V) {
        const Vec<T, V> a = load<T, V>(h + r * kWidth * F + c);
        const Vec<T, V> g = load<T, V>(dy + r * F + c);
        Vec<T, V> da;
        if constexpr (is_gated(K)) {
          const Vec<T, V> b = load<T, V>(h + r * kWidth * F + F + c);
          Vec<T, V> db;
#pragma unroll
          for (int k = 0; k < V; ++k) {
            const GatedGrad<A> d = gated_grad<K, A>(widen(a.v[k]), widen(b.v[k]), alpha, limit);
            const A gv = static_cast<A>(widen(g.v[k]));
            const A gs = gv * s;
            da.v[k] = Narrow<T>::to(gs * d.d_a);
            db.v[k] = Narrow<T>::to(gs * d.d_b);
            dot += gv * d.act;
          }
          if (dh != nullptr) store<T, V>(dh + r * kWidth * F + F + c, db);
        } else {
#pragma unroll
          for (int k = 0; k < V; ++k) {
            const PlainGrad<A> d = plain_grad<K, A>(widen(a.v[k]));
            const A gv = static_cast<A>(widen(g.v[k]));
            const A gs = gv * s;
            da.v[k] = Narrow<T>::to(gs * d.d_a);
            dot += gv * d.act;
          }
        }
        if (dh != nullptr) store<T, V>(dh + r * kWidth * F + c, da);  // nullptr: the scale gradient only
      }
    }
    if (ds != nullptr) {  // uniform over the warp: the row's sum over its group of lanes (aligned, power of two)
      for (int d = lanes >> 1; d > 0; d >>= 1) dot += __shfl_xor_sync(kFull, dot, d);
      if (active && (lane & (lanes - 1)) == 0) ds[r] = Narrow<S>::to(dot);
    }
  }
}

bool aligned16(const void* ptr) { return ptr == nullptr || reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// Elements per 16-byte vector when F and every row pointer allow it, else 1.
template <typename T>
bool can_vectorize(const ActivationProblem& p) {
  constexpr int64_t V = 16 / sizeof(T);
  return p.cols % V == 0 && aligned16(p.h) && aligned16(p.y) && aligned16(p.grad_y) && aligned16(p.grad_h);
}

// The row groups for vectors of V elements and the grid that covers the rows (at most enough blocks to fill
// every SM; grid-stride beyond).
RowGroups row_groups(const ActivationProblem& p, int V, unsigned* grid) {
  const int64_t vectors = p.cols / V;
  RowGroups rg{0, 0};
  while ((int64_t(1) << rg.log2_lanes) < vectors && rg.log2_lanes < 5) ++rg.log2_lanes;
  const int64_t rows_per_block = int64_t(kWarps) << (5 - rg.log2_lanes);
  const int64_t need = (p.rows + rows_per_block - 1) / rows_per_block;
  const int64_t cap = int64_t(std::max(p.sm_count, 1)) * kBlocksPerSm;
  *grid = static_cast<unsigned>(std::max<int64_t>(1, std::min(need, cap)));
  rg.rows_per_step = int64_t(*grid) * rows_per_block;
  return rg;
}

// Elements per vector of kind K on T: a 16-byte vector, except fp64 post_clamped_swiglu and gelu, which run
// unvectorized (their V = 2 forward keeps both elements live across the slow-path call of the fp64 division / erf
// and spills 12 / 16 bytes; V = 1 does not).
template <ActKind K, typename T>
constexpr int vector_elems() {
  return ((K == ActKind::kPostClampedSwiglu || K == ActKind::kGelu) && sizeof(T) == 8)
             ? 1
             : static_cast<int>(16 / sizeof(T));
}

template <ActKind K, typename T, typename S, bool Backward>
void launch(const ActivationProblem& p, cudaStream_t stream) {
  constexpr int V = vector_elems<K, T>();
  unsigned grid = 1;
  if (V > 1 && can_vectorize<T>(p)) {
    const RowGroups rg = row_groups(p, V, &grid);
    if constexpr (Backward)
      moe_graph::launch(backward_kernel<K, T, S, V>, grid, kThreads, 0, stream, p, rg);
    else
      moe_graph::launch(forward_kernel<K, T, S, V>, grid, kThreads, 0, stream, p, rg);
  } else {
    const RowGroups rg = row_groups(p, 1, &grid);
    if constexpr (Backward)
      moe_graph::launch(backward_kernel<K, T, S, 1>, grid, kThreads, 0, stream, p, rg);
    else
      moe_graph::launch(forward_kernel<K, T, S, 1>, grid, kThreads, 0, stream, p, rg);
  }
}

}  // namespace

cudaError_t activation_forward_cuda(const ActivationProblem& p, cudaStream_t stream) {
  if (p.rows == 0 || p.cols == 0) return cudaSuccess;
  dispatch_activation(p, [&](auto kind, auto t, auto s) {
    launch<decltype(kind)::value, typename decltype(t)::type, typename decltype(s)::type, false>(p, stream);
  });
  return cudaGetLastError();
}

cudaError_t activation_backward_cuda(const ActivationProblem& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  if ((p.cols == 0 || p.grad_h == nullptr) && p.grad_scale == nullptr) return cudaSuccess;
  dispatch_activation(p, [&](auto kind, auto t, auto s) {
    launch<decltype(kind)::value, typename decltype(t)::type, typename decltype(s)::type, true>(p, stream);
  });
  return cudaGetLastError();
}

}  // namespace activation
}  // namespace moe_graph
