// CUDA best-fit placement (semantics in echo_plan.h): one block; per step three block-wide arg-reductions (the
// most overloaded rank, its heaviest remaining expert, the receiving rank) and one thread applying the piece.
// State lives in shared memory. No host synchronization; capturable.
#include <climits>
#include <cstdint>

#include "reroute/echo_plan.h"

namespace moe_graph {
namespace echo_plan {
namespace {

constexpr int kThreads = 256;

struct ArgBest {
  long long v;
  int i;
};

// Larger value wins; equal values: lower index wins (the first maximum, like torch.argmax).
__device__ __forceinline__ ArgBest pick(ArgBest a, ArgBest b) {
  return (b.v > a.v || (b.v == a.v && b.i < a.i)) ? b : a;
}

__device__ __forceinline__ ArgBest none() { return ArgBest{LLONG_MIN, INT_MAX}; }

__device__ ArgBest block_argmax(ArgBest mine, ArgBest* s_warp) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    ArgBest other{__shfl_down_sync(0xffffffffu, mine.v, off), __shfl_down_sync(0xffffffffu, mine.i, off)};
    mine = pick(mine, other);
  }
  if (lane == 0) s_warp[warp] = mine;
  __syncthreads();
  if (warp == 0) {
    mine = lane < warps ? s_warp[lane] : none();
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      ArgBest other{__shfl_down_sync(0xffffffffu, mine.v, off), __shfl_down_sync(0xffffffffu, mine.i, off)};
      mine = pick(mine, other);
    }
    if (lane == 0) s_warp[0] = mine;
  }
  __syncthreads();
  const ArgBest res = s_warp[0];
  __syncthreads();  // s_warp is reused by the next reduction
  return res;
}

__global__ void best_fit_kernel(const int64_t* __restrict__ counts, int64_t R, int64_t E, int64_t k,
                                int64_t* __restrict__ h, const bool* __restrict__ allowed) {
  extern __shared__ long long smem[];
  long long* excess = smem;
  long long* cap = excess + R;
  long long* used = cap + R;
  long long* avail = used + R;
  __shared__ ArgBest s_warp[32];
  __shared__ long long s_avg;
  const int64_t L = E / R, S = R * k;
  const int tid = threadIdx.x, nt = blockDim.x;

  for (int64_t e = tid; e < E; e += nt) {
    long long s = 0;
    for (int64_t r = 0; r < R; ++r) {
      const long long c = counts[r * E + e];
      s += c > 0 ? c : 0;
    }
    avail[e] = s;
  }
  __syncthreads();
  for (int64_t q = tid; q < R; q += nt) {
    long long s = 0;
    for (int64_t l = 0; l < L; ++l) s += avail[q * L + l];
    excess[q] = s;  // the load, for now
  }
  __syncthreads();
  if (tid == 0) {
    long long total = 0;
    for (int64_t q = 0; q < R; ++q) total += excess[q];
    s_avg = total / R;
  }
  __syncthreads();
  const long long avg = s_avg;
  for (int64_t q = tid; q < R; q += nt) {
    const long long load = excess[q];
    excess[q] = load > avg ? load - avg : 0;
    cap[q] = avg > load ? avg - load : 0;
    used[q] = 0;
  }
  __syncthreads();

  const long long kBig = 1LL << 61, kClosed = 1LL << 62;
  for (int64_t step = 0; step < S; ++step) {
    ArgBest m = none();
    for (int64_t i = tid; i < R; i += nt) {
      long long key = excess[i];  // 0 when no open receiver may host rank i's experts (donor mask)
      if (allowed != nullptr) {
        bool any = false;
        for (int64_t r = 0; r < R && !any; ++r) any = allowed[r * R + i] && used[r] < k && cap[r] > 0;
        if (!any) key = 0;
      }
      m = pick(m, ArgBest{key, static_cast<int>(i)});
    }
    const ArgBest qb = block_argmax(m, s_warp);
    const int q = qb.i;
    m = none();
    for (int64_t i = tid; i < L; i += nt) m = pick(m, ArgBest{avail[q * L + i], static_cast<int>(q * L + i)});
    const int e = block_argmax(m, s_warp).i;
    const long long x = qb.v < avail[e] ? qb.v : avail[e];
    m = none();
    for (int64_t i = tid; i < R; i += nt) {
      const bool open = used[i] < k && cap[i] > 0 && (allowed == nullptr || allowed[i * R + q]);
      const long long key = open ? (cap[i] >= x ? cap[i] : kBig - cap[i]) : kClosed;
      m = pick(m, ArgBest{-key, static_cast<int>(i)});  // the smallest key, first index on ties
    }
    const int r = block_argmax(m, s_warp).i;
    if (tid == 0) {
      const bool open = used[r] < k && cap[r] > 0 && (allowed == nullptr || allowed[r * R + q]);
      const long long a = x < cap[r] ? x : cap[r];
      if (open && x > 0 && a > 0) {
        const long long slot = used[r] < k - 1 ? used[r] : k - 1;
        h[static_cast<int64_t>(e) * S + static_cast<int64_t>(r) * k + slot] += a;
        used[r] += 1;
        excess[q] -= a;
        cap[r] -= a;
        avail[e] -= a;
      }
    }
    __syncthreads();
  }
}

struct DevCtx {
  int64_t tid, nthreads;
  bool group;
  int64_t lane, nlanes;
  __device__ void sync() { __syncthreads(); }
  __device__ void group_sync() { __syncwarp(); }
  // butterfly over warp 0: every lane ends with the group's best
  __device__ Best group_best(Best m) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      Best o{static_cast<int64_t>(__shfl_xor_sync(0xffffffffu, static_cast<long long>(m.v), off)),
             static_cast<int64_t>(__shfl_xor_sync(0xffffffffu, static_cast<long long>(m.i), off))};
      m = pick(m, o);
    }
    return m;
  }
};

constexpr int kPlanThreads = 512;

__global__ void plan_kernel(PlanArgs args) {
  DevCtx ctx{static_cast<int64_t>(threadIdx.x), static_cast<int64_t>(blockDim.x), threadIdx.x < 32,
             static_cast<int64_t>(threadIdx.x), 32};
  plan_body(args, ctx);
}

}  // namespace

cudaError_t plan_cuda_launch(const PlanArgs& args, cudaStream_t stream) {
  if (args.R <= 0 || args.E <= 0 || args.k <= 0) return cudaSuccess;
  plan_kernel<<<1, kPlanThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

int64_t best_fit_shared_bytes(int64_t R, int64_t E) { return (3 * R + E) * static_cast<int64_t>(sizeof(long long)); }

cudaError_t best_fit_cuda_launch(const int64_t* counts, int64_t R, int64_t E, int64_t k, int64_t* h,
                                 const bool* allowed, cudaStream_t stream) {
  if (R <= 0 || E <= 0 || k <= 0) return cudaSuccess;
  const int64_t smem = best_fit_shared_bytes(R, E);
  if (smem > kBestFitMaxDynamicSmem) return cudaErrorInvalidValue;  // the op checks first, with a clear message
  best_fit_kernel<<<1, kThreads, static_cast<size_t>(smem), stream>>>(counts, R, E, k, h, allowed);
  return cudaGetLastError();
}

}  // namespace echo_plan
}  // namespace moe_graph
