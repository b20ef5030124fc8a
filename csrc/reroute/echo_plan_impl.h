// The whole echo offloading plan (assignment + allocation) as one native step, shared by the CPU and the CUDA
// implementation: the same phase functions run with one "thread" on the CPU and with a CUDA block on the GPU
// (strided loops, a barrier between phases; each sequential best-fit loop runs on one group: a warp on the GPU,
// the donor-constrained level search runs kLevelCandidates groups side by side, the water fills on their own
// groups at the same time). Results are identical to moe_graph.moe.echo_planner's torch code (gen_assignment +
// gen_allocation), tie-breaking included.
//
// Cost (R ranks, E experts, k slots, S = R*k, B = kLevelCandidates, N = kLevelRounds, w receivers per donor in the
// mask): unconstrained best fit S steps of O(R + E/R) on one group; donor-constrained (a mask that forbids some pair
// of distinct ranks) N*B level fills of at most S + R steps plus kWaterCandidates water fills of at most
// R * water_quantum moves, each step and move O(R + w*k + E/R) (the mask walked as lists), plus O(R^2) set-up and
// an O(S * (S + R)) replay of the best level fill's log, then the re-levelling of the chosen plan
// (kRelevelSweeps * S sequential steps of a few loads, no reductions, on one thread). On the GPU the B fills of a
// round run side by side, one per warp, while the water fills run on two more warps (per step three warp
// reductions, no block barrier): the
// critical path is max(N * (S + R) steps, 16 R moves), each ~(R + w*k + E/R) / 32 dependent loads per lane
// (R=64, E=256, k=2: max(1152, 1024) = 1152 dependent steps, against 1344 + 1024 for the candidates in sequence).
// The CPU runs all fills one after the other (R=64, w=32: ~5 ms).
//
// Torch-free and CUDA-header-free: compiled by the host compiler for the CPU path and by nvcc for the kernel.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define MG_HD __host__ __device__ __forceinline__
#define MG_NO_UNROLL _Pragma("unroll 1")  // short loops kept rolled: the plan kernel has 128 registers per thread
#define MG_HD_CALL __host__ __device__ __noinline__  // a phase compiled on its own (registers)
#else
#define MG_HD_CALL inline
#define MG_HD inline
#define MG_NO_UNROLL
#endif

namespace moe_graph {
namespace echo_plan {

enum PlanMode : int { kPlanAuto = 0, kPlanGreedy = 1, kPlanBestFit = 2 };

// Donor-constrained level search: kLevelRounds rounds of kLevelCandidates levels evaluated side by side
// (moe_graph.moe.echo_planner.LEVEL_CANDIDATES / LEVEL_ROUNDS must match).
constexpr int64_t kLevelCandidates = 16;
constexpr int64_t kLevelRounds = 6;
// Water-filling candidates next to the level search, one per quantum (echo_planner.WATER_QUANTA must match).
constexpr int64_t kWaterCandidates = 2;
MG_HD int64_t water_quantum(int64_t c) { return c == 0 ? 8 : 16; }
// Sweeps of the re-levelling pass over the chosen donor-constrained plan (echo_planner.RELEVEL_SWEEPS must match).
constexpr int64_t kRelevelSweeps = 4;


// Per-candidate state of a level fill: ex, cap, used, pot, stuck, hl, nfree, ntop, dem [R]; avail [E]; slot_e [S].
MG_HD int64_t level_state_elems(int64_t R, int64_t E, int64_t k) { return 9 * R + E + R * k; }

// Per-candidate log of a level fill: one (e * S + slot, tokens) pair per step, S + R steps.
MG_HD int64_t level_log_elems(int64_t R, int64_t k) { return 2 * (R * k + R); }

// Per-candidate state of a water fill: load, used [R]; avail [E]; slot_e [S]; plan [E, S]; max load [1].
MG_HD int64_t water_state_elems(int64_t R, int64_t E, int64_t k) { return 2 * R + E + R * k + E * R * k + 1; }

// int64 workspace elements the plan needs.
MG_HD int64_t plan_workspace_elems(int64_t R, int64_t E, int64_t k) {
  const int64_t S = R * k;
  return 4 * E + 8 * R + 2 * E * S + R * E + 4 * S + 12 + kLevelCandidates * (level_state_elems(R, E, k) + 2) +
         (kLevelCandidates + 1) * level_log_elems(R, k) + kWaterCandidates * water_state_elems(R, E, k) +
         2 * R * R + 2 * R;
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
  int64_t* sc;  // [12]: avg, choose, restrictive, lo[2], hi[2], best level, best max, best cascade, water choice
  int64_t *lv_state, *lv_lam, *lv_max;  // level search: [B, level_state_elems] states; [B] levels and max loads
  int64_t *lv_log, *lv_best_log;         // level fills' logs: [B, level_log_elems]; the best evaluated fill's
  int64_t* wf_state;                     // water filling: [kWaterCandidates, water_state_elems]
  // donor mask as lists, [2R + 2, R]: row q < R lists the ranks r with allowed[r, q], row R + r the ranks p with
  // allowed[r, p] (ascending); rows 2R and 2R + 1 their lengths (mask_lists)
  int64_t* lists;
};

// Receivers of q: list(a, R, q)[i] for i < list_len(a, R, q); donors of r: list(a, R, R + r), list_len(a, R, R + r).
MG_HD const int64_t* mask_list(const PlanArrays& a, int64_t R, int64_t row) { return a.lists + row * R; }
MG_HD int64_t mask_list_len(const PlanArrays& a, int64_t R, int64_t row) { return a.lists[2 * R * R + row]; }

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
  a.sc = p; p += 12;
  a.lv_lam = p; p += kLevelCandidates;
  a.lv_max = p; p += kLevelCandidates;
  a.lv_state = p; p += kLevelCandidates * level_state_elems(R, E, k);
  a.lv_log = p; p += kLevelCandidates * level_log_elems(R, k);
  a.lv_best_log = p; p += level_log_elems(R, k);
  a.wf_state = p; p += kWaterCandidates * water_state_elems(R, E, k);
  a.lists = p;
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

// Receiver key of a donor-constrained fill step (smaller is better): below kRecvClass a top-up (the most room
// first), then a new slot: class 1 the smallest room that fits x, 2 the largest room (some left, none fits; with
// demand ranking first the fewest other shedding donors that may use the receiver, then the largest room), 3 the
// smallest cascade capacity that fits x, 4 the largest cascade capacity; kRecvClosed: r may take nothing.
constexpr int64_t kRecvClass = int64_t(1) << 50;
constexpr int64_t kRecvClosed = 5 * kRecvClass;
// Demand steps inside class 2, one kDemandUnit apart (rooms stay below kDemandUnit / 2: totals <= 2^31 tokens;
// demand below 2^15 ranks).
constexpr int64_t kDemandUnit = int64_t(1) << 34;

MG_HD int64_t receiver_key(bool top, bool open, int64_t cap, int64_t ceff, int64_t x, int64_t demand) {
  if (top) return kRecvClass / 2 - cap;
  if (!open) return kRecvClosed;
  if (cap >= x) return kRecvClass + cap;
  if (cap > 0) return 2 * kRecvClass + demand * kDemandUnit + (kDemandUnit / 2 - cap);
  if (ceff >= x) return 3 * kRecvClass + ceff;
  return 4 * kRecvClass + (kRecvClass / 2 - ceff);
}

struct LevelState {
  int64_t *ex, *cap, *used, *pot, *stuck, *hl, *nfree, *ntop, *dem, *avail, *slot_e;
};

MG_HD LevelState carve_level(int64_t* p, int64_t R, int64_t E) {
  LevelState s;
  s.ex = p; p += R;
  s.cap = p; p += R;
  s.used = p; p += R;
  s.pot = p; p += R;
  s.stuck = p; p += R;
  s.hl = p; p += R;
  s.nfree = p; p += R;
  s.ntop = p; p += R;
  s.dem = p; p += R;
  s.avail = p; p += E;
  s.slot_e = p;
  return s;
}

// Cascade capacity of receiver r for a new slot: its room below the level plus (cascade) what it could pass on
// from its home experts: at most its home tokens beyond its own excess, the room of its receivers (pot), and its
// heaviest remaining expert per slot it could use (free slots of its receivers and replicas of its experts).
MG_HD int64_t cascade_capacity(const LevelState& s, bool cascade, int64_t r, int64_t L, int64_t k) {
  if (s.used[r] >= k) return 0;
  if (!cascade) return s.cap[r];
  int64_t maxav = INT64_MIN;
  for (int64_t e = r * L; e < (r + 1) * L; ++e) maxav = imax(maxav, s.avail[e]);
  const int64_t passable = imin(imin(s.hl[r] - s.ex[r], s.pot[r]), (s.nfree[r] + s.ntop[r]) * maxav);
  return s.cap[r] + imax(0, passable);
}

// Whether receiver r hosts an expert of rank p in one of its slots.
MG_HD bool hosts_rank(const LevelState& s, int64_t r, int64_t p, int64_t L, int64_t k) {
  MG_NO_UNROLL
  for (int64_t i = 0; i < k; ++i) {
    const int64_t e = s.slot_e[r * k + i];
    if (e >= 0 && e / L == p) return true;
  }
  return false;
}

// Donor-constrained fill at level lam, on one group (moe_graph.moe.echo_planner._level_fill is the same in torch).
// Donors shed what exceeds lam, receivers take up to lam. S + R steps; each takes the most loaded donor q and
// tops up a replica of one of q's experts that a receiver already hosts (no new slot), or puts a piece of q's
// heaviest remaining expert into a new slot (a cascading receiver may take more than its room and sheds its own
// home experts in turn), or marks q stuck when no allowed receiver can take anything (final: room only shrinks).
// With demand, a new slot that no room fits (class 2) goes to the receiver fewest other shedding donors may use
// (dem[r]: r's donors with tokens to shed, kept up to date as donors finish or start), so that a hot rank's cascade
// does not take the one cold receiver a neighbouring hot rank needs. Step t's piece goes to log[2t] (e * S + slot)
// and log[2t + 1] (tokens; 0 for no piece). Afterwards rank r's load is lam + ex[r] - cap[r].
template <typename Ctx>
MG_HD void level_fill(const PlanArgs& args, const PlanArrays& a, Ctx& ctx, LevelState s, int64_t lam, bool cascade,
                      bool demand, int64_t* log) {
  const int64_t R = args.R, E = args.E, k = args.k, L = E / R, S = R * k;
  const int64_t lane = ctx.lane, nl = ctx.nlanes;
  for (int64_t i = lane; i < R; i += nl) {
    s.ex[i] = imax(0, a.load_r[i] - lam);
    s.cap[i] = imax(0, lam - a.load_r[i]);
    s.used[i] = 0;
    s.stuck[i] = 0;
    s.hl[i] = a.load_r[i];
    s.ntop[i] = 0;
  }
  for (int64_t e = lane; e < E; e += nl) s.avail[e] = a.load_e[e];
  for (int64_t j = lane; j < S; j += nl) s.slot_e[j] = -1;
  for (int64_t t = lane; t < 2 * (S + R); t += nl) log[t] = 0;
  ctx.group_sync();
  for (int64_t p = lane; p < R; p += nl) {
    int64_t v = 0;
    const int64_t* rl = mask_list(a, R, p);
    const int64_t n = mask_list_len(a, R, p);
    MG_NO_UNROLL
    for (int64_t i = 0; i < n; ++i) v += s.cap[rl[i]];
    s.pot[p] = v;
    s.nfree[p] = k * n;
    int64_t d = 0;  // dem[p]: donors of p with tokens to shed
    const int64_t* dl = mask_list(a, R, R + p);
    MG_NO_UNROLL
    for (int64_t i = 0; demand && i < mask_list_len(a, R, R + p); ++i) d += s.ex[dl[i]] > 0 ? 1 : 0;
    s.dem[p] = d;
  }
  ctx.group_sync();
  for (int64_t step = 0; step < S + R; ++step) {
    Best m = no_best();
    for (int64_t i = lane; i < R; i += nl) m = pick(m, Best{s.stuck[i] ? 0 : s.ex[i], i});
    const Best qb = ctx.group_best(m);
    const int64_t q = qb.i, kq = qb.v;
    if (kq <= 0) break;  // nothing left to shed (group-uniform)
    m = no_best();
    for (int64_t i = q * L + lane; i < (q + 1) * L; i += nl) m = pick(m, Best{s.avail[i], i});
    const int64_t e_new = ctx.group_best(m).i;
    const int64_t x = imin(kq, s.avail[e_new]);
    m = no_best();
    const int64_t* rl = mask_list(a, R, q);
    const int64_t nr = mask_list_len(a, R, q);
    MG_NO_UNROLL
    for (int64_t i = lane; i < nr; i += nl) {  // the ranks that may host q's experts
      const int64_t r = rl[i];
      if (r == q) continue;
      bool top = false;
      MG_NO_UNROLL
      for (int64_t j = 0; j < k && !top; ++j) {
        const int64_t e = s.slot_e[r * k + j];
        top = e >= 0 && e / L == q && s.avail[e] > 0;
      }
      const int64_t ceff = cascade_capacity(s, cascade, r, L, k);
      const int64_t dem = demand ? s.dem[r] - 1 : 0;  // r's other donors still shedding (q is one of them)
      m = pick(m, Best{-receiver_key(top && s.cap[r] > 0, ceff > 0, s.cap[r], ceff, x, dem), r});
    }
    const Best rb = ctx.group_best(m);
    const bool listed = rb.v != INT64_MIN;  // no receiver at all: closed (r is then never written)
    const int64_t r = listed ? rb.i : 0, rkey = listed ? -rb.v : kRecvClosed;
    const bool none = rkey == kRecvClosed, topup = rkey < kRecvClass;
    const int64_t cap_r = s.cap[r], used_r = s.used[r];
    int64_t slot = r * k + used_r, e = e_new, amt = 0;
    if (topup) {
      MG_NO_UNROLL
      for (int64_t i = k - 1; i >= 0; --i) {  // the first hosting slot with tokens left
        const int64_t f = s.slot_e[r * k + i];
        if (f >= 0 && f / L == q && s.avail[f] > 0) slot = r * k + i;
      }
      e = s.slot_e[slot];
      amt = imin(imin(kq, s.avail[e]), cap_r);
    } else if (!none) {
      amt = imin(x, cascade_capacity(s, cascade, r, L, k));
    }
    const int64_t cap_new = amt > cap_r ? 0 : cap_r - amt;
    const int64_t used_new = used_r + (topup ? 0 : 1);
    if (!none) {  // r's contribution to pot[p]: its room while it has a free slot or hosts one of p's experts
      MG_NO_UNROLL
      for (int64_t i = lane; i < mask_list_len(a, R, R + r); i += nl) {
        const int64_t p = mask_list(a, R, R + r)[i];
        const bool hosts_old = hosts_rank(s, r, p, L, k), hosts_new = hosts_old || (p == q && !topup);
        s.pot[p] += ((used_new < k || hosts_new) ? cap_new : 0) - ((used_r < k || hosts_old) ? cap_r : 0);
        if (!topup) s.nfree[p] -= 1;
      }
    }
    // dem: q stops shedding (done or stuck): one donor less for its receivers; r starts (a cascade): one more
    const bool q_off = demand && (none || kq - amt <= 0);
    const bool r_on = demand && !none && s.ex[r] == 0 && amt > cap_r;
    MG_NO_UNROLL
    for (int64_t i = lane; q_off && i < nr; i += nl) s.dem[rl[i]] -= 1;
    ctx.group_sync();  // every lane has read the state this step changes
    if (lane == 0) {
      if (none) {
        s.stuck[q] = 1;
      } else {
        log[2 * step] = e * S + slot;
        log[2 * step + 1] = amt;
        if (!topup) {
          s.slot_e[slot] = e;
          s.ntop[q] += 1;
        }
        s.ex[q] -= amt;
        s.hl[q] -= amt;
        s.avail[e] -= amt;
        if (amt > cap_r) s.ex[r] += amt - cap_r;
        s.cap[r] = cap_new;
        s.used[r] = used_new;
      }
    }
    MG_NO_UNROLL
    for (int64_t i = lane; r_on && i < mask_list_len(a, R, r); i += nl) s.dem[mask_list(a, R, r)[i]] += 1;
    ctx.group_sync();
  }
}

// Level search on the level groups of ctx (gid in [0, ngroups), -1: none; level_sync() the barrier among them); the
// log of the best evaluated fill ends in lv_best_log. Two searches side by side (c = 0: receivers take up to the
// level; c = 1: cascading receivers), candidate g = 2 * j + c evaluating level j of its search. Per search, every
// round evaluates H = B / 2 levels evenly inside (lo, hi) (lo starts at avg - 1: below the mean no level is
// reached; hi at the highest load: nothing to shed) and zooms in to the neighbours of its best one. The plan is the
// evaluated (level, c) with the lowest maximum load after the fill (first candidate in evaluation order on ties;
// the empty plan at the highest load to start).
template <typename Ctx>
MG_HD_CALL void level_search(const PlanArgs& args, const PlanArrays& a, Ctx& ctx) {
  const int64_t R = args.R, E = args.E, B = kLevelCandidates, H = B / 2, NL = level_log_elems(R, args.k);
  int64_t* lo = a.sc + 3;  // [2]
  int64_t* hi = a.sc + 5;  // [2]
  if (ctx.tid == 0) {
    int64_t top = 0;
    for (int64_t q = 0; q < R; ++q) top = imax(top, a.load_r[q]);
    lo[0] = lo[1] = a.sc[0] - 1;
    hi[0] = hi[1] = top;
    a.sc[7] = top;
    a.sc[8] = top;
    a.sc[9] = 0;
  }
  for (int64_t t = ctx.tid; t < NL; t += ctx.nlevel_threads) a.lv_best_log[t] = 0;  // the empty plan
  ctx.level_sync();
  for (int64_t round = 0; round < kLevelRounds; ++round) {
    for (int64_t g = ctx.gid; g >= 0 && g < B; g += ctx.ngroups) {
      const int64_t c = g % 2, j = g / 2;
      const int64_t lam = lo[c] + (hi[c] - lo[c]) * (j + 1) / (H + 1);
      LevelState st = carve_level(a.lv_state + g * level_state_elems(R, E, args.k), R, E);
      int64_t mx = INT64_MAX;
      if (lam > lo[c]) {
        level_fill(args, a, ctx, st, lam, c == 1, c == 1, a.lv_log + g * NL);  // cascading fills rank by demand
        Best d = no_best();
        for (int64_t i = ctx.lane; i < R; i += ctx.nlanes) d = pick(d, Best{st.ex[i] - st.cap[i], i});
        mx = lam + ctx.group_best(d).v;
      }
      if (ctx.lane == 0) {
        a.lv_lam[g] = lam;
        a.lv_max[g] = mx;
      }
      ctx.group_sync();
    }
    ctx.level_sync();
    if (ctx.tid == 0) {
      a.sc[11] = -1;
      for (int64_t g = 0; g < B; ++g)
        if (a.lv_max[g] < a.sc[8]) {
          a.sc[8] = a.lv_max[g];
          a.sc[7] = a.lv_lam[g];
          a.sc[9] = g % 2;
          a.sc[11] = g;
        }
      for (int64_t c = 0; c < 2; ++c) {
        int64_t f = 0;
        for (int64_t j = 1; j < H; ++j)
          if (a.lv_max[2 * j + c] < a.lv_max[2 * f + c]) f = j;
        const int64_t lo_new = f > 0 ? a.lv_lam[2 * (f - 1) + c] : lo[c];
        if (f < H - 1) hi[c] = a.lv_lam[2 * (f + 1) + c];
        lo[c] = imax(lo[c], lo_new);
      }
    }
    ctx.level_sync();
    const int64_t won = a.sc[11];  // this round's best candidate when it beats every earlier one
    if (won >= 0)
      for (int64_t t = ctx.tid; t < NL; t += ctx.nlevel_threads) a.lv_best_log[t] = a.lv_log[won * NL + t];
    ctx.level_sync();  // the copy is done before the next round rewrites the logs
  }
}

struct WaterState {
  int64_t *load, *used, *avail, *slot_e, *plan, *max;
};

MG_HD WaterState carve_water(int64_t* p, int64_t R, int64_t E, int64_t k) {
  WaterState s;
  s.load = p; p += R;
  s.used = p; p += R;
  s.avail = p; p += E;
  s.slot_e = p; p += R * k;
  s.plan = p; p += E * R * k;
  s.max = p;
  return s;
}

// The replica of one of q's experts that receiver r tops up: the one with the most tokens left (lowest expert on
// ties), -1 when r hosts none with tokens left.
MG_HD int64_t hosted_expert(const WaterState& s, int64_t r, int64_t q, int64_t L, int64_t k) {
  int64_t eh = -1, hav = -1;
  MG_NO_UNROLL
  for (int64_t i = 0; i < k; ++i) {
    const int64_t f = s.slot_e[r * k + i];
    if (f >= 0 && f / L == q && s.avail[f] > 0 && (s.avail[f] > hav || (s.avail[f] == hav && f < eh))) {
      eh = f;
      hav = s.avail[f];
    }
  }
  return eh;
}

// Donor-constrained water filling with quantum Q on one group (moe_graph.moe.echo_planner._water_fill is the same
// in torch): at most R * Q moves, each from the most loaded rank q (lowest on ties) to the least loaded rank r
// (lowest on ties) that may host q's experts and can take some: min(tokens left, gap / 2, total / (R * Q)) tokens
// into r's replica of q's expert with the most tokens left, else into a new slot with q's heaviest remaining expert.
// Stops when no move is possible. Per move three group reductions and O(R / lanes * k + L / lanes) loads per lane.
template <typename Ctx>
MG_HD void water_fill(const PlanArgs& args, const PlanArrays& a, Ctx& ctx, WaterState s, int64_t quantum) {
  const int64_t R = args.R, E = args.E, k = args.k, L = E / R, S = R * k;
  const int64_t lane = ctx.lane, nl = ctx.nlanes;
  int64_t total = 0;
  for (int64_t q = 0; q < R; ++q) total += a.load_r[q];
  const int64_t delta = imax(1, total / (R * quantum));
  for (int64_t i = lane; i < R; i += nl) {
    s.load[i] = a.load_r[i];
    s.used[i] = 0;
  }
  for (int64_t e = lane; e < E; e += nl) s.avail[e] = a.load_e[e];
  for (int64_t j = lane; j < S; j += nl) s.slot_e[j] = -1;
  for (int64_t i = lane; i < E * S; i += nl) s.plan[i] = 0;
  ctx.group_sync();
  for (int64_t move = 0; move < R * quantum; ++move) {
    Best m = no_best();
    for (int64_t i = lane; i < R; i += nl) m = pick(m, Best{s.load[i], i});
    const Best qb = ctx.group_best(m);
    const int64_t q = qb.i, lq = qb.v;
    m = no_best();
    for (int64_t i = q * L + lane; i < (q + 1) * L; i += nl) m = pick(m, Best{s.avail[i], i});
    const int64_t e_new = ctx.group_best(m).i;
    m = no_best();
    const int64_t* rl = mask_list(a, R, q);
    const int64_t nr = mask_list_len(a, R, q);
    MG_NO_UNROLL
    for (int64_t i = lane; i < nr; i += nl) {
      const int64_t r = rl[i];
      if (r == q) continue;
      const int64_t eh = hosted_expert(s, r, q, L, k);
      if (eh < 0 && s.used[r] >= k) continue;
      const int64_t amt = imin(imin(s.avail[eh >= 0 ? eh : e_new], (lq - s.load[r]) / 2), delta);
      if (amt > 0) m = pick(m, Best{-s.load[r], r});
    }
    const Best rb = ctx.group_best(m);
    if (rb.v == INT64_MIN) break;  // no move possible (group-uniform)
    const int64_t r = rb.i;
    if (lane == 0) {
      const int64_t eh = hosted_expert(s, r, q, L, k), e = eh >= 0 ? eh : e_new;
      const int64_t amt = imin(imin(s.avail[e], (lq - s.load[r]) / 2), delta);
      int64_t slot = r * k + s.used[r];
      if (eh >= 0) {
        MG_NO_UNROLL
        for (int64_t i = 0; i < k; ++i)
          if (s.slot_e[r * k + i] == e) slot = r * k + i;
      } else {
        s.slot_e[slot] = e;
        s.used[r] += 1;
      }
      s.plan[e * S + slot] += amt;
      s.avail[e] -= amt;
      s.load[q] -= amt;
      s.load[r] += amt;
    }
    ctx.group_sync();
  }
  Best m = no_best();
  for (int64_t i = lane; i < R; i += nl) m = pick(m, Best{s.load[i], i});
  const int64_t mx = ctx.group_best(m).v;
  if (lane == 0) s.max[0] = mx;
  ctx.group_sync();
}

// The water-filling candidates (one per water group, wid in [0, nwgroups), -1: none; on the GPU side by side with
// the level search's groups).
template <typename Ctx>
MG_HD_CALL void water_search(const PlanArgs& args, const PlanArrays& a, Ctx& ctx) {
  const int64_t R = args.R, E = args.E, k = args.k, W = water_state_elems(R, E, k);
  for (int64_t c = ctx.wid; c >= 0 && c < kWaterCandidates; c += ctx.nwgroups)
    water_fill(args, a, ctx, carve_water(a.wf_state + c * W, R, E, k), water_quantum(c));
}

// hb becomes the first plan with the lowest maximum load among the level search's best fill (lv_best_log) and the
// water fills'.
template <typename Ctx>
MG_HD_CALL void pick_best_fit(const PlanArgs& args, const PlanArrays& a, Ctx& ctx) {
  const int64_t R = args.R, E = args.E, k = args.k, L = E / R, S = R * k, W = water_state_elems(R, E, k);
  ctx.sync();
  for (int64_t j = ctx.tid; j < S; j += ctx.nthreads) {  // one slot per thread: its pieces in step order
    MG_NO_UNROLL
    for (int64_t t = 0; t < S + R; ++t) {
      const int64_t idx = a.lv_best_log[2 * t], amt = a.lv_best_log[2 * t + 1];
      if (amt != 0 && idx - (idx / S) * S == j) a.hb[idx] += amt;
    }
  }
  ctx.sync();
  for (int64_t r = ctx.tid; r < R; r += ctx.nthreads) {  // the level search's loads
    int64_t out = 0, in = 0;
    for (int64_t e = r * L; e < (r + 1) * L; ++e)
      for (int64_t j = 0; j < S; ++j) out += a.hb[e * S + j];
    for (int64_t j = r * k; j < (r + 1) * k; ++j)
      for (int64_t e = 0; e < E; ++e) in += a.hb[e * S + j];
    a.la_b[r] = a.load_r[r] - out + in;
  }
  ctx.sync();
  if (ctx.tid == 0) {
    int64_t best = INT64_MIN, choice = -1;
    for (int64_t r = 0; r < R; ++r) best = imax(best, a.la_b[r]);
    for (int64_t c = 0; c < kWaterCandidates; ++c) {
      const int64_t mx = carve_water(a.wf_state + c * W, R, E, k).max[0];
      if (mx < best) {
        best = mx;
        choice = c;
      }
    }
    a.sc[10] = choice;
  }
  ctx.sync();
  const int64_t choice = a.sc[10];
  if (choice >= 0) {
    const int64_t* plan = carve_water(a.wf_state + choice * W, R, E, k).plan;
    for (int64_t i = ctx.tid; i < E * S; i += ctx.nthreads) a.hb[i] = plan[i];
  }
  ctx.sync();
}

// Slot j's home expert in plan h [E, S] (its first non-zero row, -1 for an empty slot) and its tokens.
MG_HD void slot_home(const int64_t* h, int64_t E, int64_t S, int64_t j, int64_t& home, int64_t& amount) {
  home = -1;
  amount = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t v = h[e * S + j];
    if (v > 0 && home < 0) home = e;
    amount += v;
  }
}

// Re-levelling of the chosen donor-constrained plan hb with every slot's home expert kept
// (moe_graph.moe.echo_planner._relevel is the same in torch): kRelevelSweeps sweeps over the slots in order; slot j
// (home expert e of rank q, on rank r, x tokens) moves min(tokens of e still at home, gap / 2) from q to r when
// gap = load[q] - load[r] >= 2, or min(x, -gap / 2) back when gap <= -2. A move leaves both ranks at most at the
// larger of their loads: the maximum never rises. Set-up and write-back block-parallel; the sweeps sequential on one
// thread (kRelevelSweeps * S steps of a few loads each, no reductions).
template <typename Ctx>
MG_HD_CALL void relevel(const PlanArgs& args, const PlanArrays& a, Ctx& ctx) {
  const int64_t R = args.R, E = args.E, k = args.k, L = E / R, S = R * k;
  const int64_t tid = ctx.tid, nt = ctx.nthreads;
  int64_t *home = a.home, *x = a.amount, *avail = a.avail, *load = a.la_b;  // scratch until plan_allocation
  for (int64_t j = tid; j < S; j += nt) slot_home(a.hb, E, S, j, home[j], x[j]);
  for (int64_t e = tid; e < E; e += nt) {
    int64_t out = 0;
    for (int64_t j = 0; j < S; ++j) out += a.hb[e * S + j];
    avail[e] = a.load_e[e] - out;
  }
  ctx.sync();
  for (int64_t r = tid; r < R; r += nt) {
    int64_t out = 0, in = 0;
    for (int64_t e = r * L; e < (r + 1) * L; ++e) out += a.load_e[e] - avail[e];
    for (int64_t j = r * k; j < (r + 1) * k; ++j)
      for (int64_t e = 0; e < E; ++e) in += a.hb[e * S + j];
    load[r] = a.load_r[r] - out + in;
  }
  ctx.sync();
  if (tid == 0) {
    MG_NO_UNROLL
    for (int64_t sweep = 0; sweep < kRelevelSweeps; ++sweep) {
      MG_NO_UNROLL
      for (int64_t j = 0; j < S; ++j) {
        const int64_t e = home[j];
        if (e < 0) continue;
        const int64_t q = e / L, r = j / k, gap = load[q] - load[r];
        const int64_t d = gap >= 2 ? imin(avail[e], gap / 2) : (gap <= -2 ? -imin(x[j], -gap / 2) : 0);
        x[j] += d;
        avail[e] -= d;
        load[q] -= d;
        load[r] += d;
      }
    }
  }
  ctx.sync();
  for (int64_t j = tid; j < S; j += nt)
    if (home[j] >= 0) a.hb[home[j] * S + j] = x[j];
  ctx.sync();
}

// Greedy into hg: per receiving rank, the k largest overlaps (stable: ties to the lower expert); block-strided.
template <typename Ctx>
MG_HD_CALL void greedy_fit(const PlanArgs& args, const PlanArrays& a, Ctx& ctx) {
  const int64_t R = args.R, E = args.E, k = args.k, L = E / R, S = R * k, tid = ctx.tid, nt = ctx.nthreads;
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

// Unconstrained best fit at avg into hb on the group of ctx: S steps, one after the other.
template <typename Ctx>
MG_HD_CALL void unconstrained_best_fit(const PlanArgs& args, const PlanArrays& a, Ctx& ctx) {
  const int64_t R = args.R, E = args.E, k = args.k, L = E / R, S = R * k;
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

// P8-P14 of plan_body: the chosen candidate into home_to_spare, then the allocation.
template <typename Ctx>
MG_HD_CALL void plan_allocation(const PlanArgs& args, const PlanArrays& a, Ctx& ctx) {
  const int64_t R = args.R, E = args.E, k = args.k, L = E / R, S = R * k;
  const int64_t* counts = args.counts;
  const int64_t tid = ctx.tid, nt = ctx.nthreads;
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
    slot_home(h, E, S, j, a.home[j], a.amount[j]);
    a.home[j] = imax(0, a.home[j]);
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

// Ctx provides: tid, nthreads (block-wide strided loops), sync() (block barrier); lane, nlanes, group
// (the best-fit group: lane/nlanes strided loops when group is true), gid / ngroups (this thread's level-search
// group, -1 for none, and the number of groups; the level groups' threads are tid < nlevel_threads, level_sync()
// their barrier), wid / nwgroups (the same for the water fills), group_best(Best) (reduction over the thread's
// group, result on every lane), group_sync().
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
  // P6: greedy
  if (args.mode != kPlanBestFit) greedy_fit(args, a, ctx);
  // P7: best fit. A donor mask that forbids some pair of distinct ranks: level search (level_search); otherwise
  // the unconstrained best fit at avg (sequential over S steps, on the group)
  if (tid == 0) a.sc[2] = 0;
  ctx.sync();
  if (args.allowed != nullptr)
    for (int64_t i = tid; i < R * R; i += nt)
      if (!args.allowed[i] && i / R != i % R) a.sc[2] = 1;  // every writer writes 1
  ctx.sync();
  const bool restrictive = a.sc[2] != 0;
  if (args.mode != kPlanGreedy && restrictive) {
    for (int64_t q = tid; q < R; q += nt) {
      int64_t nr = 0, nd = 0;
      for (int64_t r = 0; r < R; ++r) {
        if (args.allowed[r * R + q]) a.lists[q * R + nr++] = r;
        if (args.allowed[q * R + r]) a.lists[(R + q) * R + nd++] = r;
      }
      a.lists[2 * R * R + q] = nr;
      a.lists[2 * R * R + R + q] = nd;
    }
    ctx.sync();
    if (ctx.gid >= 0) level_search(args, a, ctx);
    water_search(args, a, ctx);
    pick_best_fit(args, a, ctx);
    relevel(args, a, ctx);
  }
  if (args.mode != kPlanGreedy && !restrictive && ctx.group) unconstrained_best_fit(args, a, ctx);
  ctx.sync();
  plan_allocation(args, a, ctx);
}

}  // namespace echo_plan
}  // namespace moe_graph
