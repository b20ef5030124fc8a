// CPU implementation of dispatch_layout / receive_layout / aligned_groups (semantics in dispatch_layout.h).
// Torch-free.
//
// dispatch_layout is two stable counting passes: (1) the routes in drop order, counted per destination, decide which
// are kept; (2) the kept routes in route order, counted per (destination, local expert), get their positions from
// the exclusive prefix of those counts within each destination. O(n + R * Lc + N).
#include <algorithm>
#include <vector>

#include "permute/dispatch_layout.h"
#include "permute/dispatch_layout_impl.h"

namespace moe_graph {
namespace dispatch {

LayoutError dispatch_layout_host(const LayoutProblem& p) {
  const int64_t n = p.num_routes, R = p.num_ranks, Lc = p.num_local, N = num_slots(p);
  LayoutError e;
  // the tables first: every entry in range (the CUDA path flags only the entries a live route reaches)
  for (int64_t c = 0; c < p.num_columns; ++c) {
    if (p.column_rank[c] < 0 || p.column_rank[c] >= R) return {LayoutError::kColumnRank, c, p.column_rank[c]};
    if (p.column_local[c] < 0 || p.column_local[c] >= Lc) return {LayoutError::kColumnLocal, c, p.column_local[c]};
  }
  std::vector<int64_t> dst(n), local(n);
  for (int64_t r = 0; r < n; ++r) {
    int err = LayoutError::kNone;
    dst[r] = route_destination(p, r, &local[r], &err);
    if (err != LayoutError::kNone) return {static_cast<LayoutError::Kind>(err), r, p.indices[r]};
  }
  if (p.route_order != nullptr) {
    std::vector<char> seen(n, 0);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = p.route_order[i];
      if (r < 0 || r >= n) return {LayoutError::kOrderRange, i, r};
      if (seen[r]) return {LayoutError::kOrderRepeat, i, r};
      seen[r] = 1;
    }
  }
  // (1) drop order: the first destination_limit live routes of each destination are kept
  std::vector<int64_t> live(R + 1, 0);
  std::vector<char> kept(n, 0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = p.route_order != nullptr ? p.route_order[i] : i;
    const int64_t rank = live[dst[r]]++;
    kept[r] = dst[r] < R && rank < destination_limit(p, dst[r]);
  }
  std::fill(p.column_counts, p.column_counts + p.num_columns, 0);
  for (int64_t r = 0; r < n; ++r)
    if (dst[r] < R) p.column_counts[p.indices[r]]++;
  // (2) positions by (local expert, route) within each destination
  std::fill(p.send_counts, p.send_counts + R * Lc, 0);
  for (int64_t r = 0; r < n; ++r)
    if (kept[r]) p.send_counts[dst[r] * Lc + local[r]]++;
  std::vector<int64_t> next(R * Lc);  // the next send slot of each (destination, local expert)
  int64_t kept_before = 0;
  for (int64_t d = 0; d < R; ++d) {
    int64_t run = destination_base(p, d, kept_before);
    for (int64_t l = 0; l < Lc; ++l) {
      const int64_t m = p.send_counts[d * Lc + l];
      next[d * Lc + l] = run;
      p.aligned_counts[d * Lc + l] = align_up(m, p.align);
      run += p.aligned_counts[d * Lc + l];  // each group starts at a multiple of align
      kept_before += m;
    }
  }
  std::fill(p.route_of_slot, p.route_of_slot + N, n);
  for (int64_t r = 0; r < n; ++r) {
    if (!kept[r]) {
      p.route_slot[r] = N;
      continue;
    }
    const int64_t s = next[dst[r] * Lc + local[r]]++;
    p.route_slot[r] = s;
    p.route_of_slot[s] = r;
  }
  int64_t dropped = 0, max_live = 0;
  for (int64_t d = 0; d < R; ++d) {
    dropped += over_capacity(live[d], destination_limit(p, d));
    max_live = std::max(max_live, live[d]);
  }
  fold_statistics(p, dropped, max_live);
  return e;
}

LayoutError receive_layout_host(const ReceiveProblem& p) {
  const int64_t R = p.num_ranks, Lc = p.num_local, cap = p.capacity, N = R * cap;
  const int64_t P = aligned_padded_rows(N, Lc, p.align);
  std::vector<int64_t> cnt(R * Lc), row_start(R * Lc);
  for (int64_t s = 0; s < R; ++s) {
    int64_t used = 0;
    for (int64_t l = 0; l < Lc; ++l) {
      int err = LayoutError::kNone;
      const int64_t v = p.recv_counts[s * Lc + l];
      cnt[s * Lc + l] = usable_count(v, used, cap, &err);
      if (err != LayoutError::kNone) return {static_cast<LayoutError::Kind>(err), s * Lc + l, v};
      row_start[s * Lc + l] = used;
      used += cnt[s * Lc + l];
    }
  }
  // expert rows: local expert, then source rank
  std::fill(p.expert_row_source, p.expert_row_source + P, N);
  std::fill(p.recv_row_target, p.recv_row_target + N, P);
  int64_t first = 0;  // the group's first expert row: a multiple of align
  for (int64_t l = 0; l < Lc; ++l) {
    int64_t row = first;
    for (int64_t s = 0; s < R; ++s) {
      for (int64_t j = 0; j < cnt[s * Lc + l]; ++j, ++row) {
        const int64_t recv = s * cap + row_start[s * Lc + l] + j;
        p.expert_row_source[row] = recv;
        p.recv_row_target[recv] = row;
      }
    }
    p.m_splits[l] = row - first;
    p.aligned_m_splits[l] = align_up(row - first, p.align);
    first += p.aligned_m_splits[l];
  }
  return {};
}

void aligned_groups_host(const AlignProblem& p) {
  const int64_t G = p.num_groups, P = aligned_padded_rows(p.rows, G, p.align);
  std::vector<int64_t> end(G), pend(G);
  aligned_group_tables(p, end.data(), pend.data());
  std::fill(p.source_of_padded, p.source_of_padded + P, p.rows);
  std::fill(p.padded_of_source, p.padded_of_source + p.rows, P);
  for (int64_t g = 0; g < G; ++g) {  // each group's rows, in order, from its padded start
    const int64_t start = g ? end[g - 1] : 0, pstart = g ? pend[g - 1] : 0;
    for (int64_t j = 0; j < end[g] - start; ++j) {
      p.source_of_padded[pstart + j] = start + j;
      p.padded_of_source[start + j] = pstart + j;
    }
  }
}

}  // namespace dispatch
}  // namespace moe_graph
