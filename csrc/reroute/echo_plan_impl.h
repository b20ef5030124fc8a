// The whole echo offloading plan (assignment + allocation) as one native step, shared by the CPU and the CUDA
// implementation: the same phase functions run with one "thread" on the CPU and with a CUDA block on the GPU
// (strided loops, a barrier between phases; the sequential best-fit loop runs on one warp). Results are identical
// to moe_graph.planner's torch code (gen_assignment + gen_allocation), tie-breaking included.
//
// Torch-free and CUDA-header-free: compiled by the host compiler for the CPU path and by nvcc for the kernel.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define MG_HD __host__ __device__ __forceinline__
#else
#define MG_HD inline
#endif

namespace moe_graph {
namespace echo_plan {

enum PlanMode : int { kPlanAuto = 0, kPlanGreedy = 1, kPlanBestFit = 2 };

// int64 workspace elements the plan needs.
MG_HD int64_t plan_workspace_elems(int64_t R, int64_t E, int64_t k) {
  const int64_t S = R * k;
  return 4 * E + 8 * R + 2 * E * S + R * E + 4 * S + 4;
}

struct PlanArgs {
  const int64_t* counts;  // [R, E]
  int64_t R, E, k;
  int mode;
  // [R, R] or nullptr (unconstrained): allowed[r * R + q] != 0 when a spare slot on rank r may host an expert whose
  // home is rank q (donor-constrained placement, moe_graph.planner.donor_mask).
  const bool* allowed;
  int64_t* home_to_spare;  // [E, S] out
  int64_t* allocation;     // [R, S] out
  int64_t* ws;             // plan_workspace_elems
};

struct PlanArrays {
  int64_t *load_e, *spill, *avail, *cs;             // [E]
  int64_t *load_r, *cap, *excess, *capb, *used, *bs, *la_g, *la_b;  // [R]
  int64_t *hg, *hb;                                 // [E, S]
  int64_t* left;                                    // [R, E]
  int64_t *home, *amount, *rem, *bstart;            // [S]
  int64_t* sc;                                      // [4]: avg, choose
};

MG_HD PlanArrays carve_plan(int64_t* ws, int64_t R, int64_t E, int64_t k) {
  const int64_t S = R * k;
  PlanArrays a;
  int64_t* p = ws;
  a.load_e = p; p += E;
  a.spill = p; p += E;
  a.avail = p; p += E;
  a.cs = p; p += E;
  a.load_r = p; p += R;
  a.cap = p; p += R;
  a.excess = p; p += R;
  a.capb = p; p += R;
  a.used = p; p += R;
  a.bs = p; p += R;
  a.la_g = p; p += R;
  a.la_b = p; p += R;
  a.hg = p; p += E * S;
  a.hb = p; p += E * S;
  a.left = p; p += R * E;
  a.home = p; p += S;
  a.amount = p; p += S;
  a.rem = p; p += S;
  a.bstart = p; p += S;
  a.sc = p;
  return a;
}

MG_HD int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }
MG_HD int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

struct Best {
  int64_t v;
  int64_t i;
};
// Larger value wins; equal values: the lower index (the first maximum, like torch.argmax).
MG_HD Best pick(Best a, Best b) { return (b.v > a.v || (b.v == a.v && b.i < a.i)) ? b : a; }
MG_HD Best no_best() { return Best{INT64_MIN, INT64_MAX}; }

// Best-fit donor key of rank q: its excess, or 0 when no open receiver (free slot, capacity left) may host q's
// experts. Unconstrained (allowed == nullptr): the excess (a rank with excess has no capacity itself, so every
// open rank is another rank: the same choice as without the check).
MG_HD int64_t donor_key(const PlanArrays& a, const bool* allowed, int64_t R, int64_t k, int64_t q) {
  if (allowed == nullptr) return a.excess[q];
  for (int64_t r = 0; r < R; ++r)
    if (allowed[r * R + q] && a.used[r] < k && a.capb[r] > 0) return a.excess[q];
  return 0;
}

// Ctx provides: tid, nthreads (block-wide strided loops), sync() (block barrier); lane, nlanes, group
// (the best-fit group: lane/nlanes strided loops when group is true), group_best(Best) (reduction over the group,
// result on every lane), group_sync().
template <typename Ctx>
MG_HD void plan_body(const PlanArgs& args, Ctx& ctx) {
  const int64_t R = args.R, E = args.E, k = args.k, L = E / R, S = R * k;
  const int64_t* counts = args.counts;
  PlanArrays a = carve_plan(args.ws, R, E, k);
  const int64_t tid = ctx.tid, nt = ctx.nthreads;

  // P0/P1: zero the candidate plans; expert loads
  for (int64_t i = tid; i < E * S; i += nt) {
    a.hg[i] = 0;
    a.hb[i] = 0;
  }
  for (int64_t e = tid; e < E; e += nt) {
    int64_t s = 0;
    for (int64_t r = 0; r < R; ++r) s += imax(0, counts[r * E + e]);
    a.load_e[e] = s;
  }
  ctx.sync();
  // P2: rank loads
  for (int64_t q = tid; q < R; q += nt) {
    int64_t s = 0;
    for (int64_t l = 0; l < L; ++l) s += a.load_e[q * L + l];
    a.load_r[q] = s;
  }
  ctx.sync();
  if (tid == 0) {
    int64_t total = 0;
    for (int64_t q = 0; q < R; ++q) total += a.load_r[q];
    a.sc[0] = total / R;
  }
  ctx.sync();
  const int64_t avg = a.sc[0];
  // P4: capacity / excess per rank; spillover per expert (ascending stable order within its rank)
  for (int64_t q = tid; q < R; q += nt) {
    a.cap[q] = imax(0, avg - a.load_r[q]);
    a.excess[q] = imax(0, a.load_r[q] - avg);
    a.capb[q] = a.cap[q];
    a.used[q] = 0;
  }
  for (int64_t e = tid; e < E; e += nt) {
    const int64_t q = e / L, le = a.load_e[e];
    int64_t incl = 0;
    for (int64_t f = q * L; f < (q + 1) * L; ++f) {
      const int64_t lf = a.load_e[f];
      if (lf < le || (lf == le && f <= e)) incl += lf;
    }
    a.spill[e] = imax(0, incl - avg) - imax(0, incl - le - avg);
    a.avail[e] = le;
  }
  ctx.sync();
  // P5: interval starts in descending stable order (spillover over experts, capacity over ranks)
  for (int64_t e = tid; e < E; e += nt) {
    const int64_t se = a.spill[e];
    int64_t s = 0;
    for (int64_t f = 0; f < E; ++f) {
      const int64_t sf = a.spill[f];
      if (sf > se || (sf == se && f < e)) s += sf;
    }
    a.cs[e] = s;
  }
  for (int64_t r = tid; r < R; r += nt) {
    const int64_t cr = a.cap[r];
    int64_t s = 0;
    for (int64_t u = 0; u < R; ++u) {
      const int64_t cu = a.cap[u];
      if (cu > cr || (cu == cr && u < r)) s += cu;
    }
    a.bs[r] = s;
  }
  ctx.sync();
  // P6: greedy: per receiving rank, the k largest overlaps (stable: ties to the lower expert)
  if (args.mode != kPlanBestFit) {
    for (int64_t r = tid; r < R; r += nt) {
      const int64_t b0 = a.bs[r], b1 = a.bs[r] + a.cap[r];
      int64_t pv = INT64_MAX, pe = -1;
      for (int64_t i = 0; i < imin(k, E); ++i) {
        Best best = no_best();
        for (int64_t e = 0; e < E; ++e) {
          int64_t v = imax(0, imin(a.cs[e] + a.spill[e], b1) - imax(a.cs[e], b0));
          if (args.allowed != nullptr && !args.allowed[r * R + e / L]) v = 0;  // rank e / L is no donor of r
          if (v < pv || (v == pv && e > pe)) best = pick(best, Best{v, e});
        }
        a.hg[best.i * S + r * k + i] = best.v;
        pv = best.v;
        pe = best.i;
      }
    }
  }
  // P7: best fit (sequential over S steps, on the group)
  if (args.mode != kPlanGreedy && ctx.group) {
    const int64_t lane = ctx.lane, nl = ctx.nlanes;
    const int64_t kBig = int64_t(1) << 61, kClosed = int64_t(1) << 62;
    for (int64_t step = 0; step < S; ++step) {
      // q: the largest excess among the ranks that still have an open receiver they may donate to
      Best m = no_best();
      for (int64_t i = lane; i < R; i += nl) m = pick(m, Best{donor_key(a, args.allowed, R, k, i), i});
      const Best qb = ctx.group_best(m);
      const int64_t q = qb.i;
      m = no_best();
      for (int64_t i = q * L + lane; i < (q + 1) * L; i += nl) m = pick(m, Best{a.avail[i], i});
      const int64_t e = ctx.group_best(m).i;
      const int64_t x = imin(qb.v, a.avail[e]);
      m = no_best();
      for (int64_t i = lane; i < R; i += nl) {
        const bool open = a.used[i] < k && a.capb[i] > 0 && (args.allowed == nullptr || args.allowed[i * R + q]);
        const int64_t key = open ? (a.capb[i] >= x ? a.capb[i] : kBig - a.capb[i]) : kClosed;
        m = pick(m, Best{-key, i});
      }
      const int64_t r = ctx.group_best(m).i;
      if (lane == 0) {
        const bool open = a.used[r] < k && a.capb[r] > 0 && (args.allowed == nullptr || args.allowed[r * R + q]);
        const int64_t amt = imin(x, a.capb[r]);
        if (open && x > 0 && amt > 0) {
          a.hb[e * S + r * k + imin(a.used[r], k - 1)] += amt;
          a.used[r] += 1;
          a.excess[q] -= amt;
          a.capb[r] -= amt;
          a.avail[e] -= amt;
        }
      }
      ctx.group_sync();
    }
  }
  ctx.sync();
  // P8: max load after each candidate; choose
  for (int64_t r = tid; r < R; r += nt) {
    int64_t out_g = 0, out_b = 0, in_g = 0, in_b = 0;
    for (int64_t e = r * L; e < (r + 1) * L; ++e)
      for (int64_t j = 0; j < S; ++j) {
        out_g += a.hg[e * S + j];
        out_b += a.hb[e * S + j];
      }
    for (int64_t j = r * k; j < (r + 1) * k; ++j)
      for (int64_t e = 0; e < E; ++e) {
        in_g += a.hg[e * S + j];
        in_b += a.hb[e * S + j];
      }
    a.la_g[r] = a.load_r[r] - out_g + in_g;
    a.la_b[r] = a.load_r[r] - out_b + in_b;
  }
  ctx.sync();
  if (tid == 0) {
    int64_t mg = INT64_MIN, mb = INT64_MIN;
    for (int64_t r = 0; r < R; ++r) {
      mg = imax(mg, a.la_g[r]);
      mb = imax(mb, a.la_b[r]);
    }
    a.sc[1] = args.mode == kPlanBestFit ? 1 : (args.mode == kPlanGreedy ? 0 : (mb < mg ? 1 : 0));
  }
  ctx.sync();
  const bool use_b = a.sc[1] != 0;
  int64_t* h = args.home_to_spare;
  for (int64_t i = tid; i < E * S; i += nt) h[i] = use_b ? a.hb[i] : a.hg[i];
  ctx.sync();
  // P10: slot homes (first non-zero row, 0 if none) and amounts
  for (int64_t j = tid; j < S; j += nt) {
    int64_t home = -1, amount = 0;
    for (int64_t e = 0; e < E; ++e) {
      const int64_t v = h[e * S + j];
      if (v > 0 && home < 0) home = e;
      amount += v;
    }
    a.home[j] = home < 0 ? 0 : home;
    a.amount[j] = amount;
  }
  ctx.sync();
  // P11: breadth-first (proportional floors)
  int64_t* alloc = args.allocation;
  for (int64_t idx = tid; idx < R * S; idx += nt) {
    const int64_t r = idx / S, j = idx - r * S, e = a.home[j];
    alloc[idx] = imax(0, counts[r * E + e]) * a.amount[j] / imax(1, a.load_e[e]);
  }
  ctx.sync();
  // P12: leftovers per slot; tokens each (rank, expert) still has
  for (int64_t j = tid; j < S; j += nt) {
    int64_t s = 0;
    for (int64_t r = 0; r < R; ++r) s += alloc[r * S + j];
    a.rem[j] = a.amount[j] - s;
  }
  for (int64_t r = tid; r < R; r += nt) {  // one rank per thread: no write conflicts
    for (int64_t e = 0; e < E; ++e) a.left[r * E + e] = imax(0, counts[r * E + e]);
    for (int64_t j = 0; j < S; ++j) a.left[r * E + a.home[j]] -= alloc[r * S + j];
  }
  ctx.sync();
  // P13: bucket starts per slot (same expert, earlier slots); inclusive cumsum of `left` over ranks
  for (int64_t j = tid; j < S; j += nt) {
    int64_t s = 0;
    for (int64_t u = 0; u < j; ++u)
      if (a.home[u] == a.home[j]) s += a.rem[u];
    a.bstart[j] = s;
  }
  for (int64_t e = tid; e < E; e += nt) {
    int64_t s = 0;
    for (int64_t r = 0; r < R; ++r) {
      s += a.left[r * E + e];
      a.left[r * E + e] = s;
    }
  }
  ctx.sync();
  // P14: depth-first: overlap of each rank's interval with the slot's leftover interval
  for (int64_t idx = tid; idx < R * S; idx += nt) {
    const int64_t r = idx / S, j = idx - r * S, e = a.home[j];
    const int64_t cend = a.left[r * E + e], cstart = r > 0 ? a.left[(r - 1) * E + e] : 0;
    const int64_t b0 = a.bstart[j], b1 = a.bstart[j] + a.rem[j];
    alloc[idx] += imax(0, imin(cend, b1) - imax(cstart, b0));
  }
}

}  // namespace echo_plan
}  // namespace moe_graph
