// CUDA echo plan (semantics in echo_plan_impl.h): plan_body in one block of kLevelCandidates + kWaterCandidates
// warps. With a donor mask the level search runs on warps 0..B-1 (one candidate level per warp, a named barrier
// among them between rounds) while the water fills run on the last kWaterCandidates warps, side by side; a block
// barrier, then the pick of the best. The best-fit loops run per warp (warp reductions, no block barrier per step).
// State lives in the global workspace. No host synchronization; capturable.
//
// Critical path (R ranks, k slots, S = R * k): max(kLevelRounds * (S + R) level-fill steps, R * 16 water moves)
// dependent steps, each three warp reductions and ~(R + w*k + E/R) / 32 dependent loads per lane. R = 64, k = 2:
// max(6 * 192, 1024) = 1152 steps (sequential candidates: 7 * 192 + 1024 = 2368); then the re-levelling of the
// chosen plan on one thread: kRelevelSweeps * S = 512 light steps (a few dependent loads each, no shuffles).
#include <climits>
#include <cstdint>

#include "common/launch.cuh"
#include "reroute/echo_plan.h"

namespace moe_graph {
namespace echo_plan {
namespace {

constexpr int kLevelThreads = 32 * kLevelCandidates;                      // one warp per level-search candidate
constexpr int kPlanThreads = kLevelThreads + 32 * kWaterCandidates;      // then one warp per water fill

struct DevCtx {
  int64_t tid, nthreads;
  bool group;
  int64_t gid, ngroups, nlevel_threads;
  int64_t wid, nwgroups;
  int64_t lane, nlanes;
  __device__ void sync() { __syncthreads(); }
  // barrier 1 among the level-search warps only (the water warps do not wait for it)
  __device__ void level_sync() { named_barrier_sync<1>(kLevelThreads); }
  __device__ void group_sync() { __syncwarp(); }
  // butterfly over the thread's warp: every lane ends with the group's best
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

__global__ void __maxnreg__(112) plan_kernel(PlanArgs args) {
  const int64_t warp = threadIdx.x / 32;
  const bool level = warp < kLevelCandidates;
  DevCtx ctx{static_cast<int64_t>(threadIdx.x),
             static_cast<int64_t>(blockDim.x),
             threadIdx.x < 32,
             level ? warp : -1,
             kLevelCandidates,
             kLevelThreads,
             level ? -1 : warp - kLevelCandidates,
             kWaterCandidates,
             static_cast<int64_t>(threadIdx.x % 32),
             32};
  plan_body(args, ctx);
}

}  // namespace

cudaError_t plan_cuda_launch(const PlanArgs& args, cudaStream_t stream) {
  if (args.R <= 0 || args.E <= 0 || args.k <= 0) return cudaSuccess;
  moe_graph::launch(plan_kernel, 1, kPlanThreads, 0, stream, args);
  return cudaGetLastError();
}

}  // namespace echo_plan
}  // namespace moe_graph
