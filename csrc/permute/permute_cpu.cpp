// CPU implementation of the permute ops (semantics in permute.h): the per-row bodies of permute_impl.h over a range
// of output rows, one element per step (V = 1). 16-bit data are stored as c10::BFloat16 / c10::Half (header-only).
// expand_quantize (expand_quantize.h): the quantizer's tiles, each walked twice (amax, then quantize), the elements
// read through LoadRoute.
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>

#include "permute/expand_quantize.h"
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

bool expand_quantize_tiles_host(const fp8::QuantizeProblem& p, const ExpandRoutes& e, int64_t t0, int64_t t1) {
  const LoadRoute load{e};
  const int64_t TC = fp8::col_tile_width(p), sentinel = e.tokens * e.topk;
  bool bad = false;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t ct = t % p.col_tiles, rt = t / p.col_tiles;
    const fp8::TileRows tr = fp8::locate_tile(p, rt);
    if (tr.nrows == 0 && p.tile_rows != 0) {  // a scale entry of no tile (a one-per-group tile always has one)
      fp8::write_unused_scale(p, 0, rt, ct);
      continue;
    }
    const int64_t c0 = ct * TC, c1 = std::min(p.cols, c0 + TC);
    for (int64_t r = tr.row0; r < tr.row0 + tr.nrows; ++r) bad |= !route_in_range(row_route(e, r), sentinel);
    if (e.packed.src && !p.transpose) {  // the source row's bytes and scale (a tile of one row)
      copy_packed_scale(p, e, tr.row0, rt, ct);
      for (int64_t c = c0; c < c1; ++c) copy_packed_byte(p, e, tr.row0, c);
      continue;
    }
    float amax = 0.0f;
    for (int64_t r = tr.row0; r < tr.row0 + tr.nrows; ++r)
      for (int64_t c = c0; c < c1; ++c) amax = fp8::amax_update(amax, load(p, 0, r, c));
    const float mult = e.packed.out ? pack_tile_scale(p, e, amax, tr.row0, ct) : fp8::tile_scale(p, amax, 0, rt, ct);
    for (int64_t r = tr.row0; r < tr.row0 + tr.nrows; ++r)
      for (int64_t c = c0; c < c1; ++c) expand_quantize_value(p, e, load(p, 0, r, c), mult, r, c);
  }
  return bad;
}

}  // namespace permute
}  // namespace moe_graph
