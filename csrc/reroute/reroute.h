// Token rerouting for echo experts (torch-free). Semantics, shared by the CPU and CUDA implementations:
//
//   inputs   routing_map [T, E] bool, probs [T, E] (2-, 4- or 8-byte floats, copied bit for bit),
//            tokens_to_spare [S] int64 (this rank's row of the allocation), offload_map [E, S] bool
//   outputs  out_map [T, E+S] bool, out_probs [T, E+S]
//
// Slot j hosts home expert home(j) = the first e with offload_map[e, j] (a second one sets kErrPlanInvalid;
// none: the slot takes nothing). For each home expert e, its slots in ascending j take e's routed tokens in
// ascending token order: the first tokens_to_spare[j1] go to j1, the next tokens_to_spare[j2] to j2, ... A moved
// route leaves column e (map false, prob +0) for column E + j (map true, prob = the original bits); every other
// entry is copied, spare columns are false / +0 elsewhere. Requests beyond the routed tokens are clamped and set
// kErrRerouteOverAsk; negative requests count as 0 and set kErrPlanInvalid.
#pragma once
#include <cstdint>
#include <functional>

#ifdef MOE_GRAPH_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace moe_graph {
namespace reroute {

struct RerouteProblem {
  int64_t num_tokens = 0;    // T
  int64_t num_experts = 0;   // E
  int64_t num_slots = 0;     // S
  const bool* routing_map = nullptr;       // [T, E]
  const void* probs = nullptr;             // [T, E]
  int prob_bytes = 4;                      // 2, 4 or 8
  const int64_t* tokens_to_spare = nullptr;  // [S]
  const bool* offload_map = nullptr;       // [E, S]
  bool* out_map = nullptr;                 // [T, E+S]
  void* out_probs = nullptr;               // [T, E+S]
  int32_t* error_flag = nullptr;           // host flag (CPU) or device flag (CUDA)
};

// Runs body(begin, end) over [0, n) split into chunks, possibly in parallel (the torch glue passes
// at::parallel_for); chunks must be disjoint and cover [0, n).
using ParallelFor = std::function<void(int64_t n, const std::function<void(int64_t, int64_t)>& body)>;

// CPU implementation. `parallel_for` may be empty (then everything runs on the calling thread).
void reroute_tokens_host(const RerouteProblem& p, const ParallelFor& parallel_for);

#ifdef MOE_GRAPH_WITH_CUDA
// Rows per tile of the CUDA kernels (the workspace depends on it).
constexpr int kRerouteTileRows = 64;
// int32 elements of device workspace reroute_tokens_cuda needs for a problem (caller allocates it).
int64_t reroute_workspace_elems(int64_t num_tokens, int64_t num_experts, int64_t num_slots);
// Largest S the CUDA path supports: the slot tables live in two [E, S] int32 workspaces (E = 1024, S = 4096:
// 32 MiB), so S is capped (S = R * k spare slots: 512 EP ranks with 8 spare slots each).
constexpr int64_t kRerouteMaxSlots = 1 << 12;
// Launches the kernels on `stream`; no host synchronization, fixed launch configuration for fixed shapes.
cudaError_t reroute_tokens_cuda_launch(const RerouteProblem& p, int32_t* workspace, cudaStream_t stream);
#endif

}  // namespace reroute
}  // namespace moe_graph
