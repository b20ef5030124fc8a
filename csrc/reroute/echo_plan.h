// The echo offloading plan as one native step (moe_graph.moe.echo_planner.gen_plan: assignment + allocation;
// its best-fit assignment alone is the plan's home_to_spare in mode kPlanBestFit), torch-free. The algorithm and
// its cost are in echo_plan_impl.h, shared by the CPU and the CUDA implementation; results are identical to the
// torch code, tie-breaking included.
#pragma once
#include <cstdint>

#include "reroute/echo_plan_impl.h"

#ifdef MOE_GRAPH_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace moe_graph {
namespace echo_plan {

// args.ws must hold plan_workspace_elems(R, E, k) int64.
void plan_host(const PlanArgs& args);

#ifdef MOE_GRAPH_WITH_CUDA
// One block; no host synchronization.
cudaError_t plan_cuda_launch(const PlanArgs& args, cudaStream_t stream);
#endif

}  // namespace echo_plan
}  // namespace moe_graph
