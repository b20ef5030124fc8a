// Per-route and per-row rules of dispatch_layout / receive_layout (semantics in dispatch_layout.h), shared by the CPU
// loops and the CUDA kernels so that both compute the same keys, clamps and statistics.
#pragma once
#include <cstdint>

#include "common/row_align.h"
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

// aligned_groups' padded rows P and a group's rows rounded up to a multiple of align (common/row_align.h).
using ::moe_graph::align_up;
using ::moe_graph::aligned_padded_rows;

// Quota mode (dest_quota given): per-destination limits and packed send slots.
MOE_DL_HD bool quota_mode(const LayoutProblem& p) { return p.dest_quota != nullptr; }

// Send slots of one destination's block: capacity, with align its aligned padded rows (align = 1: capacity).
MOE_DL_HD int64_t slot_block(const LayoutProblem& p) {
  return aligned_padded_rows(p.capacity, p.num_local, p.align);
}

// Send slots N: R * slot_block (one padded block per destination) or, in quota mode, n (packed).
MOE_DL_HD int64_t num_slots(const LayoutProblem& p) {
  return quota_mode(p) ? p.num_routes : p.num_ranks * slot_block(p);
}

// Live routes destination d keeps: `capacity`, or its quota (a negative quota reads as 0).
MOE_DL_HD int64_t destination_limit(const LayoutProblem& p, int64_t d) {
  if (!quota_mode(p)) return p.capacity;
  const int64_t q = p.dest_quota[d];
  return q > 0 ? q : 0;
}

// First send slot of destination d, given the kept routes of the destinations before it (`kept_before`).
MOE_DL_HD int64_t destination_base(const LayoutProblem& p, int64_t d, int64_t kept_before) {
  return quota_mode(p) ? kept_before : d * slot_block(p);
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

// First i in [0, n) with a[i] > x in the non-decreasing a (n when none): binary search.
MOE_DL_HD int64_t upper_bound_of(const int64_t* a, int64_t n, int64_t x) {
  int64_t lo = 0, hi = n;  // the answer lies in [lo, hi]
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (a[mid] <= x)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

// Local expert of position p in a source block with exclusive prefix `row_start[0..Lc)` and counts `cnt`, or -1 when
// p is past the block's rows (the last l with row_start[l] <= p).
MOE_DL_HD int64_t local_of_position(const int64_t* row_start, const int64_t* cnt, int64_t Lc, int64_t p) {
  const int64_t l = upper_bound_of(row_start, Lc, p) - 1;
  return (l >= 0 && p < row_start[l] + cnt[l]) ? l : -1;
}

// aligned_groups' tables from the counts: end[g] (the source rows' exclusive end of group g: the running sum of the
// counts read as >= 0, clamped to `rows`) and pend[g] (the padded rows' end); writes the padded counts.
MOE_DL_HD void aligned_group_tables(const AlignProblem& p, int64_t* end, int64_t* pend) {
  int64_t run = 0, prun = 0, prev = 0;
  for (int64_t g = 0; g < p.num_groups; ++g) {
    const int64_t m = p.m_splits[g] > 0 ? p.m_splits[g] : 0;
    run = (m > p.rows - run) ? p.rows : run + m;
    const int64_t padded = align_up(run - prev, p.align);
    prun += padded;
    end[g] = run;
    pend[g] = prun;
    p.padded_m_splits[g] = padded;
    prev = run;
  }
}

// First g with ends[g] > x, clamped to G - 1 (the group a row at x falls in when it falls in one).
MOE_DL_HD int64_t group_of_row(const int64_t* ends, int64_t G, int64_t x) {
  const int64_t g = upper_bound_of(ends, G, x);
  return g < G ? g : G - 1;
}

// source_of_padded[q]: the source row of padded row q, or `rows` (a zero row: past its group's rows or the groups).
MOE_DL_HD int64_t aligned_source_of(const AlignProblem& p, const int64_t* end, const int64_t* pend, int64_t q) {
  const int64_t G = p.num_groups;
  if (G == 0 || q >= pend[G - 1]) return p.rows;
  const int64_t g = group_of_row(pend, G, q);
  const int64_t start = g ? end[g - 1] : 0, pstart = g ? pend[g - 1] : 0;
  const int64_t local = q - pstart;
  return local < end[g] - start ? start + local : p.rows;
}

// padded_of_source[r]: the padded row of source row r, or P (a row past the groups).
MOE_DL_HD int64_t aligned_target_of(const AlignProblem& p, const int64_t* end, const int64_t* pend, int64_t r,
                                    int64_t P) {
  const int64_t G = p.num_groups;
  if (G == 0 || r >= end[G - 1]) return P;
  const int64_t g = group_of_row(end, G, r);
  const int64_t start = g ? end[g - 1] : 0, pstart = g ? pend[g - 1] : 0;
  return pstart + (r - start);
}

}  // namespace dispatch
}  // namespace moe_graph
