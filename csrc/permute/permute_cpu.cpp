// CPU implementation of the permute ops (semantics in permute.h): the per-row bodies of permute_impl.h over a range
// of output rows, one element per step (V = 1). 16-bit data are stored as c10::BFloat16 / c10::Half (header-only).
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "permute/permute.h"
#include "permute/permute_impl.h"

namespace moe_graph {
namespace permute {

template <>
struct Convert<c10::BFloat16> {
  using Acc = float;
  static inline float to_acc(c10::BFloat16 x) { return static_cast<float>(x); }
  static inline c10::BFloat16 from_acc(float a) { return c10::BFloat16(a); }  // round to nearest even
};

template <>
struct Convert<c10::Half> {
  using Acc = float;
  static inline float to_acc(c10::Half x) { return static_cast<float>(x); }
  static inline c10::Half from_acc(float a) { return c10::Half(a); }  // round to nearest even
};

namespace {

template <RouteOp op, typename T>
int64_t run_rows(const RouteProblem& p, int64_t begin, int64_t end) {
  using Acc = typename Convert<T>::Acc;
  int64_t first_bad = -1;
  for (int64_t x = begin; x < end; ++x) {
    if constexpr (op == RouteOp::kDot) {
      for (int64_t q = x * p.topk; q < (x + 1) * p.topk; ++q) {
        bool bad = false;
        static_cast<Acc*>(p.out)[q] = dot_part<T, 1>(p, q, 0, 1, bad);
        if (bad && first_bad < 0) first_bad = q;
      }
    } else if constexpr (op == RouteOp::kExpand) {
      if (expand_row<T, 1>(p, x, 0, 1) && first_bad < 0) first_bad = x;
    } else if (reduce_row<T, 1>(p, x, 0, 1) && first_bad < 0) {
      for (int64_t q = x * p.topk; first_bad < 0; ++q)
        if (out_of_range(p.route_rows[q], p.rows)) first_bad = q;
    }
  }
  return first_bad;
}

template <RouteOp op>
int64_t run_typed(const RouteProblem& p, int64_t begin, int64_t end) {
  switch (p.dtype) {
    case DType::kDouble: return run_rows<op, double>(p, begin, end);
    case DType::kBFloat16: return run_rows<op, c10::BFloat16>(p, begin, end);
    case DType::kHalf: return run_rows<op, c10::Half>(p, begin, end);
    default: return run_rows<op, float>(p, begin, end);
  }
}

}  // namespace

int64_t route_op_host(RouteOp op, const RouteProblem& p, int64_t begin, int64_t end) {
  switch (op) {
    case RouteOp::kExpand: return run_typed<RouteOp::kExpand>(p, begin, end);
    case RouteOp::kReduce: return run_typed<RouteOp::kReduce>(p, begin, end);
    default: return run_typed<RouteOp::kDot>(p, begin, end);
  }
}

}  // namespace permute
}  // namespace moe_graph
