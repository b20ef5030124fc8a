// CPU implementation of the tile quantizer (semantics in fp8/quantize.h), torch-free: each tile walked twice (amax,
// then quantize) with the per-element functions the CUDA kernel uses (the torch glue splits the tiles over threads);
// the fused backward's row-scale gradient by the activation backward's CPU rows (its column-order sums).
#include <algorithm>
#include <cstring>

#include "common/error_flag.h"
#include "fp8/quantize.h"

namespace moe_graph {
namespace fp8 {
namespace {

template <class L>
void tiles(const QuantizeProblem& p, const L& load, int64_t t0, int64_t t1) {
  const int64_t TC = col_tile_width(p);
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t ct = t % p.col_tiles;
    const int64_t rt = (t / p.col_tiles) % p.row_tiles;
    const int64_t b = t / (p.col_tiles * p.row_tiles);
    const TileRows tr = locate_tile(p, rt);
    const int64_t c0 = ct * TC, c1 = std::min(p.cols, c0 + TC);
    if (tr.nrows == 0 && p.tile_rows != 0) {  // a scale entry of no tile (a one-per-group tile always has one)
      write_unused_scale(p, b, rt, ct);
      continue;
    }
    float amax = 0.0f;
    for (int64_t r = tr.row0; r < tr.row0 + tr.nrows; ++r)
      for (int64_t c = c0; c < c1; ++c) amax = amax_update(amax, load(p, b, r, c));
    const float mult = tile_scale(p, amax, b, rt, ct);
    for (int64_t r = tr.row0; r < tr.row0 + tr.nrows; ++r)
      for (int64_t c = c0; c < c1; ++c) quantize_value(p, load(p, b, r, c), mult, b, r, c);
  }
}

}  // namespace

void quantize_tiles_cpu(const QuantizeProblem& p, int64_t t0, int64_t t1) {
  with_loader(p, [&](auto load) { tiles(p, load, t0, t1); });
}

void quantize_tail_cpu(const QuantizeProblem& p) {
  int32_t bits = 0;
  const int64_t used_rows = grouped_rows(p, &bits);
  if (bits) set_host_error(p.error_flag, bits);
  // Rows past sum(m_splits): zero (B == 1 with m_splits only).
  if (used_rows < p.rows) {
    if (!p.transpose) {
      std::memset(p.q + used_rows * p.cols, 0, static_cast<size_t>((p.rows - used_rows) * p.cols));
    } else {
      for (int64_t c = 0; c < p.cols; ++c)
        std::memset(p.q + c * p.rows + used_rows, 0, static_cast<size_t>(p.rows - used_rows));
    }
  }
}

void quantize_row_dots_cpu(const QuantizeProblem& p, int64_t r0, int64_t r1) {
  if (!row_dot(p)) return;
  activation::ActivationProblem a = p.act;  // expert_activation_backward without grad_h: the scale gradient only
  a.grad_h = nullptr;
  activation::activation_backward_rows(a, r0, r1);
}

void quantize_cpu(const QuantizeProblem& p) {
  quantize_tiles_cpu(p, 0, p.batch * p.row_tiles * p.col_tiles);
  quantize_row_dots_cpu(p, 0, p.rows);
  quantize_tail_cpu(p);
}

}  // namespace fp8
}  // namespace moe_graph
