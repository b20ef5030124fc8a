// Per-output-row bodies of the permute ops (semantics in permute.h), shared by the CPU loops and the CUDA kernels:
// each covers the packs lane, lane + stride, ... of one row (CPU: lane 0, stride 1). A pack is V consecutive
// elements (V > 1 only when H % V == 0 and the data are aligned to the pack). Storage types of 16-bit data come
// from the including unit: it specializes Convert<T> (to_acc / from_acc) for them; float and double are here.
#pragma once
#include <cstdint>

#include "permute/permute.h"

#if defined(__CUDACC__)
#define MOE_PERMUTE_HD __host__ __device__ __forceinline__
#define MOE_PERMUTE_UNROLL _Pragma("unroll")
#else
#define MOE_PERMUTE_HD inline
#define MOE_PERMUTE_UNROLL
#endif

namespace moe_graph {
namespace permute {

template <typename T>
struct Convert;

template <>
struct Convert<float> {
  using Acc = float;
  static MOE_PERMUTE_HD float to_acc(float x) { return x; }
  static MOE_PERMUTE_HD float from_acc(float a) { return a; }
};

template <>
struct Convert<double> {
  using Acc = double;
  static MOE_PERMUTE_HD double to_acc(double x) { return x; }
  static MOE_PERMUTE_HD double from_acc(double a) { return a; }
};

template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

MOE_PERMUTE_HD bool out_of_range(int64_t index, int64_t sentinel) { return index < 0 || index > sentinel; }

// Expand, output row i: row i = w[r] * src[r / K] for r = route_of_row[i] (no weights: a copy), the sentinel n*K
// or an out-of-range r: zeros. Returns true for an out-of-range r.
template <typename T, int V>
MOE_PERMUTE_HD bool expand_row(const RouteProblem& p, int64_t i, int64_t lane, int64_t stride) {
  using P = Pack<T, V>;
  using C = Convert<T>;
  using Acc = typename C::Acc;
  const int64_t packs = p.hidden / V, sentinel = p.tokens * p.topk;
  const int64_t r = p.route_of_row[i];
  P* o = reinterpret_cast<P*>(static_cast<T*>(p.out) + i * p.hidden);
  if (r == sentinel || out_of_range(r, sentinel)) {
    P z;
    MOE_PERMUTE_UNROLL
    for (int v = 0; v < V; ++v) z.v[v] = C::from_acc(Acc(0));
    for (int64_t c = lane; c < packs; c += stride) o[c] = z;
    return r != sentinel;
  }
  const P* s = reinterpret_cast<const P*>(static_cast<const T*>(p.token_data) + (r / p.topk) * p.hidden);
  if (p.weights == nullptr) {
    for (int64_t c = lane; c < packs; c += stride) o[c] = s[c];
    return false;
  }
  const Acc w = static_cast<const Acc*>(p.weights)[r];
  for (int64_t c = lane; c < packs; c += stride) {
    const P x = s[c];
    P y;
    MOE_PERMUTE_UNROLL
    for (int v = 0; v < V; ++v) y.v[v] = C::from_acc(w * C::to_acc(x.v[v]));
    o[c] = y;
  }
  return false;
}

// Reduce, output row j: sum over k ascending of w[j, k] * src[route_rows[j, k]] (no weights: a plain sum) in Acc
// from +0; the sentinel m and out-of-range rows skipped. Returns true if a route of j is out of range.
template <typename T, int V>
MOE_PERMUTE_HD bool reduce_row(const RouteProblem& p, int64_t j, int64_t lane, int64_t stride) {
  using P = Pack<T, V>;
  using C = Convert<T>;
  using Acc = typename C::Acc;
  const int64_t packs = p.hidden / V, K = p.topk, m = p.rows;
  const int64_t* rows = p.route_rows + j * K;
  const Acc* w = p.weights == nullptr ? nullptr : static_cast<const Acc*>(p.weights) + j * K;
  const P* s = reinterpret_cast<const P*>(p.row_data);
  P* o = reinterpret_cast<P*>(static_cast<T*>(p.out) + j * p.hidden);
  for (int64_t c = lane; c < packs; c += stride) {
    Acc acc[V];
    MOE_PERMUTE_UNROLL
    for (int v = 0; v < V; ++v) acc[v] = Acc(0);
    for (int64_t k = 0; k < K; ++k) {
      const int64_t r = rows[k];
      if (r == m || out_of_range(r, m)) continue;
      const P x = s[r * packs + c];
      if (w == nullptr) {
        MOE_PERMUTE_UNROLL
        for (int v = 0; v < V; ++v) acc[v] += C::to_acc(x.v[v]);
      } else {
        const Acc wk = w[k];
        MOE_PERMUTE_UNROLL
        for (int v = 0; v < V; ++v) acc[v] += wk * C::to_acc(x.v[v]);
      }
    }
    P y;
    MOE_PERMUTE_UNROLL
    for (int v = 0; v < V; ++v) y.v[v] = C::from_acc(acc[v]);
    o[c] = y;
  }
  bool bad = false;
  for (int64_t k = 0; k < K; ++k) bad |= out_of_range(rows[k], m);
  return bad;
}

// route_dot, route q = j*K + k: this lane's part of dot(tokens[j], rows[route_rows[q]]) (its packs, ascending);
// 0 for the sentinel m or an out-of-range row, which sets `bad`.
template <typename T, int V>
MOE_PERMUTE_HD typename Convert<T>::Acc dot_part(const RouteProblem& p, int64_t q, int64_t lane, int64_t stride,
                                                 bool& bad) {
  using P = Pack<T, V>;
  using C = Convert<T>;
  typename C::Acc acc(0);
  const int64_t r = p.route_rows[q], m = p.rows;
  bad = out_of_range(r, m);
  if (r == m || bad) return acc;
  const int64_t packs = p.hidden / V;
  const P* a = reinterpret_cast<const P*>(static_cast<const T*>(p.token_data) + (q / p.topk) * p.hidden);
  const P* b = reinterpret_cast<const P*>(static_cast<const T*>(p.row_data) + r * p.hidden);
  for (int64_t c = lane; c < packs; c += stride) {
    const P x = a[c];
    const P y = b[c];
    MOE_PERMUTE_UNROLL
    for (int v = 0; v < V; ++v) acc += C::to_acc(x.v[v]) * C::to_acc(y.v[v]);
  }
  return acc;
}

}  // namespace permute
}  // namespace moe_graph
