// The token dispatcher's index bookkeeping (torch-free). Semantics, shared by the CPU and CUDA implementations:
//
//   dispatch_layout  n = T*K routes (route r = token r / K, choice r % K) into C routing columns; column c lives on
//                    rank column_rank[c] of R as local expert column_local[c] of Lc; `capacity` routes at most go
//                    from this rank to each rank (send slots N = R * capacity, slot = destination * capacity +
//                    position).
//     live route     valid[r] (all when no mask) and 0 <= indices[r] < C; a valid route with an index (or a column
//                    table entry) out of range is an error: the CPU reports it, CUDA sets kErrIndexOutOfRange and
//                    treats the route as not live.
//     kept route     per destination, the first `capacity` live routes in drop order: route_order[0], [1], ...
//                    (a permutation of [0, n): the probability order of the "probs" policy) or, without it, route
//                    order (token, then k: the "position" policy). The others are dropped.
//     quota mode     with dest_quota [R] (the per-destination-capacity exchange): destination d keeps its first
//                    max(dest_quota[d], 0) live routes instead of `capacity`, and the send slots are packed: N = n,
//                    slot = (kept routes of smaller destinations) + position, no padding between destinations
//                    (empty slots after the last kept route). `capacity` is not used.
//     positions      within one destination the kept routes are ordered by (local expert, route): position p of a
//                    route = kept routes of that destination with a smaller local expert + kept routes of its local
//                    expert with a smaller route index. At R = 1 the send buffer is the expert input grouped by
//                    local expert, padding after the real rows.
//     aligned        with align > 1 (R = 1, not quota mode; the op refuses the others) every local expert's group
//                    starts at a multiple of `align` slots, zero rows after each group: the send buffer is the
//                    aligned expert input of aligned_groups(send_counts, capacity, align) below, its
//                    P = aligned_padded_rows(capacity, Lc, align) rows the send slots (N = R * P). The slot of a
//                    kept route = sum over smaller local experts l' of the aligned count of l' + its rank within its
//                    local expert. align = 1: P = capacity, the layout above.
//     outputs        route_slot [n] (N: dropped or not live), route_of_slot [N] (n: empty), send_counts [R, Lc]
//                    (kept routes per destination and local expert), column_counts [C] (live routes per column,
//                    before drops), dropped [1] (live routes over the capacity), aligned_counts [R, Lc] (send_counts
//                    rounded up to a multiple of align: the aligned groups' rows). When the counters are given:
//                    dropped_routes += dropped, step_dropped_routes += dropped, step_max_load_ratio =
//                    max(itself, max_d live_d * R / n) (n > 0).
//
//   receive_layout   recv_counts [R, Lc] (rows source rank s sent this rank per local expert, in the order above:
//                    block s of the receive buffer is [capacity] rows, grouped by local expert, padding after).
//     outputs        m_splits [Lc] = sum over s; the expert input groups the rows by local expert, then source rank,
//                    then the sender's order, padding rows last: expert_row_source [P] (the receive row of each
//                    expert-input row; N: padding) and recv_row_target [N] (its inverse; P: an empty receive row),
//                    aligned_m_splits [Lc] (m_splits rounded up to a multiple of `align`). With align > 1 every
//                    local expert's group starts at a multiple of `align` rows, zero rows after it: the expert input
//                    is aligned_groups(m_splits, N, align)'s regrouping of the align = 1 one, P =
//                    aligned_padded_rows(N, Lc, align) rows (align = 1: P = N, the groups back to back).
//                    A negative count reads as 0 (kErrNegativeSplit), counts of one source past `capacity` are
//                    clamped (kErrSplitsOverflow); the CPU reports both.
//
//   aligned_groups   m_splits [G] (rows per expert group, in order, over `rows` rows; a negative count reads as 0 and
//                    groups past `rows` are clamped, as the grouped GEMM reads them) regrouped so that every group
//                    starts at a multiple of `align` rows, zero rows after each group (the FP8 wgrad's 16-row group
//                    starts), in P = ceil((rows + (align - 1) * G) / align) * align rows.
//     outputs        padded_m_splits [G] = m_g rounded up to a multiple of align; source_of_padded [P] (the source
//                    row of each padded row; rows: a zero row) and padded_of_source [rows] (its inverse; P: a row
//                    past the groups).
#pragma once
#include <cstdint>

#ifdef MOE_GRAPH_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace moe_graph {
namespace dispatch {

struct LayoutProblem {
  int64_t num_routes = 0;    // n = T * K
  int64_t num_columns = 0;   // C
  int64_t num_ranks = 0;     // R
  int64_t num_local = 0;     // Lc
  int64_t capacity = 0;      // per destination
  int64_t align = 1;         // group starts at multiples of align slots (R = 1, not quota mode)
  const int64_t* indices = nullptr;       // [n]
  const bool* valid = nullptr;            // [n] or null (all valid)
  const int64_t* column_rank = nullptr;   // [C]
  const int64_t* column_local = nullptr;  // [C]
  const int64_t* route_order = nullptr;   // [n] or null (route order)
  const int64_t* dest_quota = nullptr;    // [R] or null: quota mode (per-destination limits, packed slots)
  int64_t* route_slot = nullptr;          // [n]
  int64_t* route_of_slot = nullptr;       // [R * P], P = aligned_padded_rows(capacity, Lc, align)
  int64_t* send_counts = nullptr;         // [R, Lc]
  int64_t* aligned_counts = nullptr;      // [R, Lc]
  int64_t* column_counts = nullptr;       // [C]
  int64_t* dropped = nullptr;             // [1]
  int64_t* dropped_routes = nullptr;      // [1] or null (no counting)
  int64_t* step_dropped_routes = nullptr; // [1] or null
  double* step_max_load_ratio = nullptr;  // [1] or null
};

struct ReceiveProblem {
  int64_t num_ranks = 0;  // R
  int64_t num_local = 0;  // Lc
  int64_t capacity = 0;
  const int64_t* recv_counts = nullptr;  // [R, Lc]
  int64_t* expert_row_source = nullptr;  // [P], P = aligned_padded_rows(R * capacity, Lc, align)
  int64_t* recv_row_target = nullptr;    // [R * capacity]
  int64_t* m_splits = nullptr;           // [Lc]
  int64_t align = 1;                     // group starts at multiples of align rows
  int64_t* aligned_m_splits = nullptr;   // [Lc]
};

struct AlignProblem {
  int64_t num_groups = 0;  // G
  int64_t rows = 0;
  int64_t align = 1;
  const int64_t* m_splits = nullptr;   // [G]
  int64_t* padded_m_splits = nullptr;  // [G]
  int64_t* source_of_padded = nullptr; // [P]
  int64_t* padded_of_source = nullptr; // [rows]
};

// What the CPU functions found wrong (the glue raises with it): kind 0 none; otherwise the first offending position.
struct LayoutError {
  enum Kind { kNone = 0, kIndex, kColumnRank, kColumnLocal, kOrderRange, kOrderRepeat, kNegativeCount,
              kCountOverflow };
  Kind kind = kNone;
  int64_t where = -1;  // route, column or [s, l] flat position
  int64_t value = 0;
};

LayoutError dispatch_layout_host(const LayoutProblem& p);
LayoutError receive_layout_host(const ReceiveProblem& p);
void aligned_groups_host(const AlignProblem& p);

#ifdef MOE_GRAPH_WITH_CUDA
// Routes per tile of the CUDA kernels (one warp per tile); the workspace depends on it.
constexpr int64_t kLayoutTile = 256;
// int32 elements of device workspace dispatch_layout_cuda_launch needs (the caller allocates it).
int64_t dispatch_layout_workspace_elems(int64_t num_routes, int64_t num_ranks, int64_t num_local);
// int64 elements of device workspace receive_layout_cuda_launch needs.
int64_t receive_layout_workspace_elems(int64_t num_ranks, int64_t num_local);
// Fixed launch configuration for fixed shapes, no host synchronization (capturable), deterministic.
cudaError_t dispatch_layout_cuda_launch(const LayoutProblem& p, int32_t* workspace, int32_t* error_flag,
                                        cudaStream_t stream);
cudaError_t receive_layout_cuda_launch(const ReceiveProblem& p, int64_t* workspace, int32_t* error_flag,
                                       cudaStream_t stream);
// int64 elements of device workspace aligned_groups_cuda_launch needs (2 G); two launches.
int64_t aligned_groups_workspace_elems(int64_t num_groups);
cudaError_t aligned_groups_cuda_launch(const AlignProblem& p, int64_t* workspace, cudaStream_t stream);
#endif

}  // namespace dispatch
}  // namespace moe_graph
