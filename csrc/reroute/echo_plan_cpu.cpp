// CPU best-fit placement (semantics in echo_plan.h).
#include <algorithm>
#include <vector>

#include "reroute/echo_plan.h"

namespace moe_graph {
namespace echo_plan {

void best_fit_host(const int64_t* counts, int64_t R, int64_t E, int64_t k, int64_t* h, const bool* allowed) {
  if (R <= 0 || E <= 0 || k <= 0) return;
  const int64_t L = E / R, S = R * k;
  std::vector<int64_t> avail(E, 0), load(R, 0), excess(R), cap(R), used(R, 0);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t e = 0; e < E; ++e) avail[e] += std::max<int64_t>(0, counts[r * E + e]);
  int64_t total = 0;
  for (int64_t q = 0; q < R; ++q) {
    for (int64_t l = 0; l < L; ++l) load[q] += avail[q * L + l];
    total += load[q];
  }
  const int64_t avg = total / R;
  for (int64_t q = 0; q < R; ++q) {
    excess[q] = std::max<int64_t>(0, load[q] - avg);
    cap[q] = std::max<int64_t>(0, avg - load[q]);
  }
  for (int64_t step = 0; step < S; ++step) {
    // q: the largest excess among ranks with an open receiver they may donate to (all ranks when unconstrained)
    auto key = [&](int64_t i) -> int64_t {
      if (allowed == nullptr) return excess[i];
      for (int64_t r = 0; r < R; ++r)
        if (allowed[r * R + i] && used[r] < k && cap[r] > 0) return excess[i];
      return 0;
    };
    int64_t q = 0, kq = key(0);
    for (int64_t i = 1; i < R; ++i) {
      const int64_t ki = key(i);
      if (ki > kq) {
        q = i;
        kq = ki;
      }
    }
    int64_t e = q * L;
    for (int64_t i = q * L + 1; i < (q + 1) * L; ++i)
      if (avail[i] > avail[e]) e = i;
    const int64_t x = std::min(kq, avail[e]);
    int64_t r_fit = -1, r_big = -1;
    for (int64_t i = 0; i < R; ++i) {
      if (!(used[i] < k && cap[i] > 0)) continue;
      if (allowed != nullptr && !allowed[i * R + q]) continue;
      if (cap[i] >= x && (r_fit < 0 || cap[i] < cap[r_fit])) r_fit = i;
      if (r_big < 0 || cap[i] > cap[r_big]) r_big = i;
    }
    const int64_t r = r_fit >= 0 ? r_fit : r_big;
    if (r < 0 || x <= 0) continue;
    const int64_t a = std::min(x, cap[r]);
    if (a <= 0) continue;
    h[e * S + r * k + std::min(used[r], k - 1)] += a;
    used[r] += 1;
    excess[q] -= a;
    cap[r] -= a;
    avail[e] -= a;
  }
}

namespace {
struct HostCtx {
  int64_t tid = 0, nthreads = 1;
  bool group = true;
  int64_t lane = 0, nlanes = 1;
  void sync() {}
  void group_sync() {}
  Best group_best(Best b) { return b; }
};
}  // namespace

void plan_host(const PlanArgs& args) {
  if (args.R <= 0 || args.E <= 0 || args.k <= 0) return;
  HostCtx ctx;
  plan_body(args, ctx);
}

}  // namespace echo_plan
}  // namespace moe_graph
