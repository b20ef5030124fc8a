// Row alignment of expert groups (the FP8 grouped GEMM's 16-row group starts), shared by the aligned_groups op
// (permute/dispatch_layout_impl.h) and the fused exchange (exchange/exchange.h).
#pragma once
#include <cstdint>

#include "common/host_device.h"

namespace moe_graph {

// m rounded up to a multiple of align (align >= 1).
MOE_GRAPH_HD int64_t align_up(int64_t m, int64_t align) { return (m + align - 1) / align * align; }

// The rows of G groups of `rows` rows in total laid out with each group starting at a multiple of `align` rows:
// ceil((rows + (align - 1) * G) / align) * align (an upper bound of sum_g align_up(m_g) over any split of `rows`).
MOE_GRAPH_HD int64_t aligned_padded_rows(int64_t rows, int64_t G, int64_t align) {
  return align_up(rows + (align - 1) * G, align);
}

}  // namespace moe_graph
