// Row expansion and reduction over a route index (torch-free). Semantics, shared by the CPU and CUDA implementations:
//
//   expand_rows   src [n, H], route_of_row [m] int64, K, weights [n, K] or none  ->  out [m, H]
//                 out[i] = w[r] * src[r / K] with r = route_of_row[i] (no weights: a copy of the row);
//                 r == n*K (the sentinel): a zero row.
//   reduce_rows   src [m, H], route_rows [n, K] int64, weights [n, K] or none  ->  out [n, H]
//                 out[j] = sum over k ascending of w[j, k] * src[route_rows[j, k]], accumulated in Acc (float for
//                 16-bit and fp32 data, double for fp64) from +0; route_rows[j, k] == m (the sentinel): skipped.
//   route_dot     rows [n, H], src [m, H], route_rows [n, K] int64  ->  out [n, K] of Acc
//                 out[j, k] = dot(rows[j], src[route_rows[j, k]]) in Acc; the sentinel m: 0.
//
// The two index tensors of one routing are inverses: route_rows.view(-1)[r] is the row of route r (m: none) and
// route_of_row[i] the route of row i (n*K: none). With them the ops are adjoint: the gradient of expand_rows is
// reduce_rows with the same weights and vice versa, and route_dot gives the weights' gradient of both.
// Weights are read as Acc (the torch glue converts them). An index outside [0, sentinel] reads as the sentinel;
// the CPU functions report its position (the glue raises), the CUDA kernels set kErrIndexOutOfRange.
#pragma once
#include <cstdint>

#ifdef MOE_GRAPH_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace moe_graph {
namespace permute {

enum class DType { kFloat, kDouble, kBFloat16, kHalf };

enum class RouteOp { kExpand, kReduce, kDot };

// One routing of n tokens with K routes each onto m rows, and the data of one op; pointers an op does not use are
// null. All tensors are contiguous (row-major).
struct RouteProblem {
  DType dtype = DType::kFloat;  // of the data and the output (route_dot: its Acc)
  int64_t tokens = 0;           // n
  int64_t topk = 0;             // K
  int64_t rows = 0;             // m
  int64_t hidden = 0;           // H
  const void* token_data = nullptr;        // [n, H]: expand's src, route_dot's rows
  const void* row_data = nullptr;          // [m, H]: reduce's src, route_dot's src
  const int64_t* route_rows = nullptr;     // [n, K]: reduce, route_dot
  const int64_t* route_of_row = nullptr;   // [m]: expand
  const void* weights = nullptr;           // [n, K] of Acc, or null (a copy / a plain sum)
  void* out = nullptr;                     // expand [m, H], reduce [n, H], route_dot [n, K] of Acc
};

// Output rows an op produces: m for expand, n for reduce and route_dot.
inline int64_t output_rows(RouteOp op, const RouteProblem& p) { return op == RouteOp::kExpand ? p.rows : p.tokens; }

// CPU: output rows [begin, end) (callers split the rows over threads). Returns the smallest flat position in the
// range (into route_of_row for expand, into route_rows otherwise) whose index is out of range, or -1.
int64_t route_op_host(RouteOp op, const RouteProblem& p, int64_t begin, int64_t end);

#ifdef MOE_GRAPH_WITH_CUDA
// One launch on `stream` (none for an empty output); no host synchronization, fixed launch configuration for fixed
// shapes and pointer alignments (capturable). `error_flag`: the device flag.
cudaError_t route_op_cuda_launch(RouteOp op, const RouteProblem& p, int32_t* error_flag, cudaStream_t stream);
#endif

}  // namespace permute
}  // namespace moe_graph
