// Per-route and per-row rules of dispatch_layout / receive_layout (semantics in dispatch_layout.h), shared by the CPU
// loops and the CUDA kernels so that both compute the same keys, clamps and statistics.
#pragma once
#include <cstdint>

#include "permute/dispatch_layout.h"

#if defined(__CUDACC__)
#define MOE_DL_HD __host__ __device__ __forceinline__
#else
#define MOE_DL_HD inline
#endif

namespace moe_graph {
namespace dispatch {

// Destination rank of route r, or R when the route is not live; `local` gets its local expert (-1: not live) and
// `err` the kind of a range error (left alone otherwise).
MOE_DL_HD int64_t route_destination(const LayoutProblem& p, int64_t r, int64_t* local, int* err) {
  *local = -1;
  const int64_t R = p.num_ranks;
  if (p.valid != nullptr && !p.valid[r]) return R;
  const int64_t c = p.indices[r];
  if (c < 0 || c >= p.num_columns) {
    *err = LayoutError::kIndex;
    return R;
  }
  const int64_t d = p.column_rank[c], l = p.column_local[c];
  if (d < 0 || d >= R) {
    *err = LayoutError::kColumnRank;
    return R;
  }
  if (l < 0 || l >= p.num_local) {
    *err = LayoutError::kColumnLocal;
    return R;
  }
  *local = l;
  return d;
}

// Quota mode (dest_quota given): per-destination limits and packed send slots.
MOE_DL_HD bool quota_mode(const LayoutProblem& p) { return p.dest_quota != nullptr; }

// Send slots N: R * capacity (one padded block per destination) or, in quota mode, n (packed).
MOE_DL_HD int64_t num_slots(const LayoutProblem& p) {
  return quota_mode(p) ? p.num_routes : p.num_ranks * p.capacity;
}

// Live routes destination d keeps: `capacity`, or its quota (a negative quota reads as 0).
MOE_DL_HD int64_t destination_limit(const LayoutProblem& p, int64_t d) {
  if (!quota_mode(p)) return p.capacity;
  const int64_t q = p.dest_quota[d];
  return q > 0 ? q : 0;
}

// First send slot of destination d, given the kept routes of the destinations before it (`kept_before`).
MOE_DL_HD int64_t destination_base(const LayoutProblem& p, int64_t d, int64_t kept_before) {
  return quota_mode(p) ? kept_before : d * p.capacity;
}

// Routes of one destination over its limit.
MOE_DL_HD int64_t over_capacity(int64_t live, int64_t limit) { return live > limit ? live - limit : 0; }

// Folds one call's drops and largest destination load into the counters (when counting).
MOE_DL_HD void fold_statistics(const LayoutProblem& p, int64_t dropped, int64_t max_live) {
  p.dropped[0] = dropped;
  if (p.dropped_routes != nullptr) p.dropped_routes[0] += dropped;
  if (p.step_dropped_routes != nullptr) p.step_dropped_routes[0] += dropped;
  if (p.step_max_load_ratio != nullptr && p.num_routes > 0) {
    const double ratio = static_cast<double>(max_live) * static_cast<double>(p.num_ranks) /
                         static_cast<double>(p.num_routes);
    if (ratio > p.step_max_load_ratio[0]) p.step_max_load_ratio[0] = ratio;
  }
}

// A received count as used: negative -> 0 (kNegativeCount), past the room left in the source's block -> clamped
// (kCountOverflow). `used`: rows of the block already taken by smaller local experts.
MOE_DL_HD int64_t usable_count(int64_t count, int64_t used, int64_t capacity, int* err) {
  if (count < 0) {
    *err = LayoutError::kNegativeCount;
    return 0;
  }
  if (count > capacity - used) {
    *err = LayoutError::kCountOverflow;
    return capacity - used;
  }
  return count;
}

// Local expert of position p in a source block with exclusive prefix `row_start[0..Lc)` and counts `cnt`, or -1 when
// p is past the block's rows (binary search: the last l with row_start[l] <= p).
MOE_DL_HD int64_t local_of_position(const int64_t* row_start, const int64_t* cnt, int64_t Lc, int64_t p) {
  int64_t lo = 0, hi = Lc;  // first l with row_start[l] > p lies in [lo, hi]
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (row_start[mid] <= p)
      lo = mid + 1;
    else
      hi = mid;
  }
  const int64_t l = lo - 1;
  return (l >= 0 && p < row_start[l] + cnt[l]) ? l : -1;
}

}  // namespace dispatch
}  // namespace moe_graph
