// Token rerouting for echo experts (torch-free). Two forms of one rule, shared by the CPU and CUDA implementations.
//
// Dense form (reroute_tokens):
//   inputs   routing_map [T, E] bool, probs [T, E] (2-, 4- or 8-byte floats, copied bit for bit),
//            tokens_to_spare [S] int64 (this rank's row of the allocation), offload_map [E, S]
//   outputs  out_map [T, E+S] bool, out_probs [T, E+S]
// Index form (reroute_indices):
//   inputs   indices [T, K] int64 (the home expert of each route), valid [T, K] bool (optional),
//            tokens_to_spare [S], offload_map [E, S]
//   outputs  out_indices [T, K] int64 in [0, E+S), slot_home [S] int64 (the slot's home expert, E: none)
//
// Slot j hosts home expert home(j) = the first e with offload_map[e, j] > 0 (bool, or the planner's int64
// home_to_spare read as "> 0"; a second one sets kErrPlanInvalid; none: the slot takes nothing). For each home
// expert e, its slots in ascending j take e's routes in ascending token order: the first tokens_to_spare[j1] go
// to j1, the next tokens_to_spare[j2] to j2, ... Dense form: a moved route leaves column e (map false, prob +0)
// for column E + j (map true, prob = the original bits); every other entry is copied, spare columns are false / +0
// elsewhere. Index form: a route counts when it is valid and 0 <= index < E (others are copied unchanged and not
// counted); routes are ranked in row-major (t, k) order, which is token order since a token routes to an expert at
// most once; a moved route's entry becomes E + j, every other entry is copied (probabilities are untouched: the
// caller keeps them). On the same routes both forms move the same (token, expert) pairs to the same slots.
// Requests beyond the routed tokens are clamped and set kErrRerouteOverAsk; negative requests count as 0 and set
// kErrPlanInvalid.
#pragma once
#include <cstdint>
#include <functional>

#include "common/error_flag.h"

#ifdef MOE_GRAPH_WITH_CUDA
#include <cuda_runtime.h>
#endif

#if defined(__CUDACC__)
#define MOE_REROUTE_HD __host__ __device__
#else
#define MOE_REROUTE_HD
#endif

namespace moe_graph {
namespace reroute {

// offload_map[idx] > 0 for a map stored as bool (1 byte), int32 (4) or int64 (8).
MOE_REROUTE_HD inline bool hosted(const void* map, int bytes, int64_t idx) {
  if (bytes == 1) return static_cast<const uint8_t*>(map)[idx] != 0;
  if (bytes == 4) return static_cast<const int32_t*>(map)[idx] > 0;
  return static_cast<const int64_t*>(map)[idx] > 0;
}

// Slot j's home expert (-1: none) and its request, clamped to [0, T]; returns the error bits it finds.
MOE_REROUTE_HD inline int32_t slot_request(const void* map, int bytes, const int64_t* tokens_to_spare, int64_t T,
                                           int64_t E, int64_t S, int64_t j, int64_t* home_out, int64_t* want_out) {
  int64_t home = -1;
  int32_t err = 0;
  for (int64_t e = 0; e < E; ++e) {
    if (hosted(map, bytes, e * S + j)) {
      if (home < 0)
        home = e;
      else
        err |= kErrPlanInvalid;
    }
  }
  int64_t w = tokens_to_spare[j];
  if (w < 0) {
    err |= kErrPlanInvalid;
    w = 0;
  }
  if (home < 0 && w > 0) err |= kErrRerouteOverAsk;
  if (w > T) {  // more than there are tokens: certainly an over-ask
    err |= kErrRerouteOverAsk;
    w = T;
  }
  *home_out = home;
  *want_out = w;
  return err;
}

// The slot-list position of a route of rank `rank` among its home expert's counted routes: advances `pos` past the
// slots whose (cumulative, clamped) rank range ends at or before `rank`; `pos == last` means it stays home. A walker
// sees its expert's ranks in ascending order, so `pos` only moves forward.
template <typename I>
MOE_REROUTE_HD inline int64_t slot_position(int64_t rank, const I* end, int64_t last, int64_t pos) {
  while (pos < last && rank >= static_cast<int64_t>(end[pos])) ++pos;
  return pos;
}

struct RerouteProblem {
  int64_t num_tokens = 0;    // T
  int64_t num_experts = 0;   // E
  int64_t num_slots = 0;     // S
  const bool* routing_map = nullptr;       // [T, E]
  const void* probs = nullptr;             // [T, E]
  int prob_bytes = 4;                      // 2, 4 or 8
  const int64_t* tokens_to_spare = nullptr;  // [S]
  const void* offload_map = nullptr;       // [E, S] bool, int32 or int64 ("> 0")
  int offload_bytes = 1;
  bool* out_map = nullptr;                 // [T, E+S]
  void* out_probs = nullptr;               // [T, E+S]
  int32_t* error_flag = nullptr;           // host flag (CPU) or device flag (CUDA)
};

struct RerouteIndexProblem {
  int64_t num_tokens = 0;   // T
  int64_t topk = 0;         // K
  int64_t num_experts = 0;  // E
  int64_t num_slots = 0;    // S
  const int64_t* indices = nullptr;          // [T, K]
  const bool* valid = nullptr;               // [T, K] or null (all valid)
  const int64_t* tokens_to_spare = nullptr;  // [S]
  const void* offload_map = nullptr;         // [E, S] bool, int32 or int64 ("> 0")
  int offload_bytes = 1;
  int64_t* out_indices = nullptr;            // [T, K]
  int64_t* slot_home = nullptr;              // [S]
  int32_t* error_flag = nullptr;             // host flag (CPU) or device flag (CUDA)
};

// Runs body(begin, end) over [0, n) split into chunks, possibly in parallel (the torch glue passes
// at::parallel_for); chunks must be disjoint and cover [0, n).
using ParallelFor = std::function<void(int64_t n, const std::function<void(int64_t, int64_t)>& body)>;

// CPU implementation. `parallel_for` may be empty (then everything runs on the calling thread).
void reroute_tokens_host(const RerouteProblem& p, const ParallelFor& parallel_for);
void reroute_indices_host(const RerouteIndexProblem& p, const ParallelFor& parallel_for);

#ifdef MOE_GRAPH_WITH_CUDA
// Rows per tile of the CUDA kernels (the workspace depends on it).
constexpr int kRerouteTileRows = 64;
// int32 elements of device workspace reroute_tokens_cuda needs for a problem (caller allocates it).
// (Both forms use the same workspace.)
int64_t reroute_workspace_elems(int64_t num_tokens, int64_t num_experts, int64_t num_slots);
// Largest S the CUDA path supports: the slot tables live in two [E, S] int32 workspaces (E = 1024, S = 4096:
// 32 MiB), so S is capped (S = R * k spare slots: 512 EP ranks with 8 spare slots each).
constexpr int64_t kRerouteMaxSlots = 1 << 12;
// Launches the kernels on `stream`; no host synchronization, fixed launch configuration for fixed shapes.
cudaError_t reroute_tokens_cuda_launch(const RerouteProblem& p, int32_t* workspace, cudaStream_t stream);
// Largest E the index form supports on CUDA (a tile's per-expert counts live in shared memory).
constexpr int64_t kRerouteIndexMaxExperts = 1 << 13;
// Largest K the index form supports on CUDA (a tile's routes are staged in shared memory: 64 * K int32).
constexpr int64_t kRerouteIndexMaxTopk = 128;
cudaError_t reroute_indices_cuda_launch(const RerouteIndexProblem& p, int32_t* workspace, cudaStream_t stream);
#endif

}  // namespace reroute
}  // namespace moe_graph
