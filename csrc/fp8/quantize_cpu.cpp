// CPU implementation of the tile quantizer (semantics in fp8/quantize.h): threads over the tiles, each tile walked
// twice (amax, then quantize) with the per-element functions the CUDA kernel uses.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "common/error_flag.h"
#include "fp8/quantize.h"

namespace moe_graph {
namespace fp8 {

void quantize_cpu(const QuantizeProblem& p) {
  int32_t bits = 0;
  const int64_t used_rows = grouped_rows(p, &bits);
  if (bits) set_host_error(p.error_flag, bits);
  const int64_t TC = col_tile_width(p);
  const int64_t tiles = p.batch * p.row_tiles * p.col_tiles;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, (p.tile_rows ? p.tile_rows : p.rows) * TC));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t ct = t % p.col_tiles;
      const int64_t rt = (t / p.col_tiles) % p.row_tiles;
      const int64_t b = t / (p.col_tiles * p.row_tiles);
      const TileRows tr = locate_tile(p, rt);
      const int64_t c0 = ct * TC, c1 = std::min(p.cols, c0 + TC);
      if (tr.nrows == 0 && !(p.tile_rows == 0 && rt < (p.groups ? p.groups : 1))) {
        write_unused_scale(p, b, rt, ct);
        continue;
      }
      float amax = 0.0f;
      for (int64_t r = tr.row0; r < tr.row0 + tr.nrows; ++r)
        for (int64_t c = c0; c < c1; ++c) amax = amax_update(amax, load_x(p, b, r, c));
      const float mult = tile_scale(p, amax, b, rt, ct);
      for (int64_t r = tr.row0; r < tr.row0 + tr.nrows; ++r)
        for (int64_t c = c0; c < c1; ++c) quantize_store(p, mult, b, r, c);
    }
  });
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

}  // namespace fp8
}  // namespace moe_graph
