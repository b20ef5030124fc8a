// Best-fit placement of EP-rank overload into spare expert slots (torch-free). The sequential heart of
// moe_graph.planner.best_fit_assignment, as one native step instead of R*k rounds of tiny kernels; the result is
// identical to the pure-torch version (same tie-breaking: lowest index).
//
//   counts [R, E] int64 (negative entries count as 0), k spare slots per rank -> home_to_spare [E, R*k] int64
//   (zero-initialized by the caller, filled here).
//
// With L = E / R, load_e = sum_r counts[r, e], load[q] = sum of q's experts, avg = sum(load) / R (floor):
// excess[q] = max(0, load[q] - avg), cap[r] = max(0, avg - load[r]), avail[e] = load_e. For R*k steps:
//   q = argmax excess (with a donor mask: over ranks that have an open receiver allowed to host their experts);
//   e = argmax of avail over q's experts; x = min(excess[q], avail[e]);
//   open[r] = used[r] < k && cap[r] > 0 (&& allowed[r, q]); among open ranks with cap >= x the smallest cap, else
//   the largest cap;
//   a = min(x, cap[r]) (0 when r is not open or x == 0); the piece goes to slot r*k + used[r];
//   excess[q], cap[r], avail[e] shrink by a; used[r] grows when a > 0.
#pragma once
#include <cstdint>

#include "reroute/echo_plan_impl.h"

#ifdef MOE_GRAPH_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace moe_graph {
namespace echo_plan {

// allowed: [R, R] donor mask (allowed[r * R + q]: a slot on rank r may host rank q's experts) or nullptr.
void best_fit_host(const int64_t* counts, int64_t R, int64_t E, int64_t k, int64_t* home_to_spare,
                   const bool* allowed);

// The whole plan (moe_graph.planner.gen_assignment(mode) + gen_allocation) in one step; see echo_plan_impl.h.
// args.ws must hold plan_workspace_elems(R, E, k) int64.
void plan_host(const PlanArgs& args);

#ifdef MOE_GRAPH_WITH_CUDA
// Bytes of dynamic shared memory the CUDA kernel needs (8 * (3R + E)); the caller checks it against
// kBestFitMaxDynamicSmem: the 48 KiB a launch may use without an opt-in, less 1 KiB for the kernel's static
// shared memory. So 3R + E <= 6016 (moe_graph.ops.reroute.BEST_FIT_CUDA_MAX; the planner takes the torch path above it).
constexpr int64_t kBestFitMaxDynamicSmem = 47 * 1024;
int64_t best_fit_shared_bytes(int64_t R, int64_t E);
// One block; no host synchronization.
cudaError_t best_fit_cuda_launch(const int64_t* counts, int64_t R, int64_t E, int64_t k, int64_t* home_to_spare,
                                 const bool* allowed, cudaStream_t stream);
// One block; no host synchronization.
cudaError_t plan_cuda_launch(const PlanArgs& args, cudaStream_t stream);
#endif

}  // namespace echo_plan
}  // namespace moe_graph
