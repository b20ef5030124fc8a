// CUDA echo plan (semantics in echo_plan_impl.h): plan_body in one block of kLevelCandidates warps; the best-fit
// loops run per warp (warp reductions, no block barrier per step). State lives in the global workspace. No host
// synchronization; capturable.
#include <climits>
#include <cstdint>

#include "reroute/echo_plan.h"

namespace moe_graph {
namespace echo_plan {
namespace {

struct DevCtx {
  int64_t tid, nthreads;
  bool group;
  int64_t gid, ngroups;
  int64_t lane, nlanes;
  __device__ void sync() { __syncthreads(); }
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

constexpr int kPlanThreads = 32 * kLevelCandidates;  // one warp per level-search candidate

__global__ void __launch_bounds__(kPlanThreads) plan_kernel(PlanArgs args) {
  const int64_t warp = threadIdx.x / 32;
  DevCtx ctx{static_cast<int64_t>(threadIdx.x), static_cast<int64_t>(blockDim.x), threadIdx.x < 32,
             warp < kLevelCandidates ? warp : -1, kLevelCandidates, static_cast<int64_t>(threadIdx.x % 32), 32};
  plan_body(args, ctx);
}

}  // namespace

cudaError_t plan_cuda_launch(const PlanArgs& args, cudaStream_t stream) {
  if (args.R <= 0 || args.E <= 0 || args.k <= 0) return cudaSuccess;
  plan_kernel<<<1, kPlanThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace echo_plan
}  // namespace moe_graph
