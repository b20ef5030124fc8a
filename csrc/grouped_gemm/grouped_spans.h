// The clamping rule of m_splits, shared by the CPU implementation, the device argument/offset kernels and the
// host tests (host and device; no CUDA or torch headers needed).
//
// Expert e covers rows [min(begin_e, rows), min(begin_e + m_e, rows)) of a buffer with `rows` rows, where
// begin_e = sum of the earlier counts and negative counts count as 0 (kErrNegativeSplit). A span cut by the end of
// the buffer sets kErrSplitsOverflow. Counts are first clamped to rows + 1, which changes none of the spans or flags
// (a count past rows + 1 already ends past the buffer) but keeps every running sum far from int64 overflow:
// with E <= 65535 experts and rows < 2^46 the sum stays below 2^62, so counts near 2^63 clamp instead of wrapping
// to a negative start.
#pragma once

#include <cstdint>

#include "common/host_device.h"

namespace moe_graph {
namespace gg {

struct ExpertSpan {
  int64_t start;  // first row (clamped to rows)
  int64_t count;  // rows of the expert inside the buffer
};

// One count, made safe for the running sum: negative -> 0 (sets *negative), > rows + 1 -> rows + 1.
MOE_GRAPH_HD int64_t clamp_split(int64_t m, int64_t rows, bool* negative) {
  *negative = m < 0;
  if (m < 0) return 0;
  return m > rows + 1 ? rows + 1 : m;
}

// The span of an expert whose (clamped) count is m and whose earlier counts sum to begin; *cut when the buffer
// end cut rows off.
MOE_GRAPH_HD ExpertSpan expert_span(int64_t begin, int64_t m, int64_t rows, bool* cut) {
  const int64_t start = begin < rows ? begin : rows;
  const int64_t end_raw = begin + m;
  const int64_t end = end_raw < rows ? end_raw : rows;
  *cut = end_raw > rows && m > 0;
  return ExpertSpan{start, end - start};
}

}  // namespace gg
}  // namespace moe_graph
