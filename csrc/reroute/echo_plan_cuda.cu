// CUDA echo plan (semantics in echo_plan_impl.h): plan_body in one block of kLevelCandidates warps. With a donor
// mask the level search runs on all of them (one candidate level per warp, a named barrier among them between
// rounds), then the water fills on the first kWaterCandidates warps; a block barrier, then the pick of the best.
// The best-fit loops run per warp (warp reductions, no block barrier per step). State lives in the global
// workspace. No host synchronization; capturable.
//
// Why 16 warps and not 16 + 2 side by side: a block's registers are allocated for its warps rounded up to a
// multiple of 4 (the warp allocation granularity), so 18 warps cost as much as 20: 20 * 32 * 112 registers >
// 65536, and the launch failed on an H200 ("too many resources requested for launch"); at 18 warps the kernel must
// fit in 96 registers, where it spills. 16 warps x 128 registers fit (launch_fits_registers, a static_assert).
//
// Critical path (R ranks, k slots, S = R * k): kLevelRounds * (S + R) level-fill steps, then R * 16 water moves,
// each three warp reductions and ~(R + w*k + E/R) / 32 dependent loads per lane. R = 64, k = 2: 6 * 192 + 1024 =
// 2176 steps; then the re-levelling of the chosen plan on one thread: kRelevelSweeps * S = 512 light steps (a few
// dependent loads each, no shuffles).
#include <climits>
#include <cstdint>

#include "common/launch.cuh"
#include "reroute/echo_plan.h"

namespace moe_graph {
namespace echo_plan {
namespace {

constexpr int kLevelThreads = 32 * kLevelCandidates;  // one warp per level-search candidate
constexpr int kPlanThreads = kLevelThreads;            // the water fills after it, on the first warps
constexpr int kPlanRegisters = 128;  // 16 warps x 128 = 64K: the whole register file
static_assert(kWaterCandidates <= kLevelCandidates, "one warp per water fill");
static_assert(launch_fits_registers(kPlanThreads, kPlanRegisters), "the plan block's registers exceed 64K");

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

__global__ void __maxnreg__(kPlanRegisters) plan_kernel(PlanArgs args) {
  const int64_t warp = threadIdx.x / 32;
  DevCtx ctx{static_cast<int64_t>(threadIdx.x),
             static_cast<int64_t>(blockDim.x),
             threadIdx.x < 32,
             warp,
             kLevelCandidates,
             kLevelThreads,
             warp < kWaterCandidates ? warp : -1,
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
