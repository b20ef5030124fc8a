// CPU implementation of the scaled grouped GEMM (semantics in fp8/scaled_gemm.h): it defines the order in which
// the GPU kernels apply the scales along K. Threads over output rows (forward) or (expert, n) rows (wgrad).
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "common/error_flag.h"
#include "fp8/scaled_gemm.h"

namespace moe_graph {
namespace fp8 {
namespace {

// Group sizes (negative -> 0, clipped at `rows`) and the error bits of m_splits.
std::vector<int64_t> group_sizes(const void* splits, bool i64, int64_t groups, int64_t rows, int32_t* flag) {
  std::vector<int64_t> m(groups);
  int64_t start = 0;
  int32_t bits = 0;
  for (int64_t g = 0; g < groups; ++g) {
    int64_t v = i64 ? static_cast<const int64_t*>(splits)[g] : static_cast<const int32_t*>(splits)[g];
    if (v < 0) {
      bits |= kErrNegativeSplit;
      v = 0;
    }
    if (start + v > rows) {
      bits |= kErrSplitsOverflow;
      v = rows - start;
    }
    m[g] = v;
    start += v;
  }
  if (bits) set_host_error(flag, bits);
  return m;
}

// Decoded operand rows (fp32, exact) to keep the inner loops simple.
std::vector<float> decode_rows(const Operand& o, int64_t row0, int64_t nrows, int64_t cols) {
  std::vector<float> v(static_cast<size_t>(nrows * cols));
  for (int64_t i = 0; i < nrows * cols; ++i) v[i] = decode(o.format, o.q[row0 * cols + i]);
  return v;
}

}  // namespace

void scaled_gemm_cpu(const ScaledGemmProblem& p) {
  const std::vector<int64_t> m = group_sizes(p.m_splits, p.splits_i64, p.groups, p.rows, p.error_flag);
  const int64_t BK = p.block_k ? p.block_k : std::max<int64_t>(p.k, 1);
  const int64_t BN = p.block_n ? p.block_n : std::max<int64_t>(p.n, 1);
  const int64_t kb_count = (p.k + BK - 1) / BK;
  const int64_t nb_count = (p.n + BN - 1) / BN;
  std::vector<int64_t> start(p.groups + 1, 0);
  for (int64_t g = 0; g < p.groups; ++g) start[g + 1] = start[g] + m[g];
  std::fill(p.out + start[p.groups] * p.n, p.out + p.rows * p.n, 0.0f);
  for (int64_t g = 0; g < p.groups; ++g) {
    if (m[g] == 0) continue;
    const std::vector<float> b = decode_rows(p.b, g * p.n, p.n, p.k);
    at::parallel_for(start[g], start[g + 1], std::max<int64_t>(1, 4096 / std::max<int64_t>(1, p.n)),
                     [&](int64_t r0, int64_t r1) {
      std::vector<float> a(static_cast<size_t>(p.k));
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = 0; c < p.k; ++c) a[c] = decode(p.a.format, p.a.q[r * p.k + c]);
        for (int64_t j = 0; j < p.n; ++j) {
          float acc = 0.0f;
          for (int64_t kb = 0; kb < kb_count; ++kb) {
            float part = 0.0f;
            const int64_t c1 = std::min(p.k, (kb + 1) * BK);
            for (int64_t c = kb * BK; c < c1; ++c) part += a[c] * b[j * p.k + c];
            const float s = load_scale(p.a, r * kb_count + kb) *
                            load_scale(p.b, (g * nb_count + j / BN) * kb_count + kb);
            acc += part * s;
          }
          if (p.bias) acc += p.bias[g * p.n + j];
          p.out[r * p.n + j] = acc;
        }
      }
    });
  }
}

void scaled_wgrad_cpu(const ScaledWgradProblem& p) {
  const std::vector<int64_t> m = group_sizes(p.m_splits, p.splits_i64, p.groups, p.rows, p.error_flag);
  const int64_t BM = p.block_m;
  at::parallel_for(0, p.groups * p.n, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t g = i / p.n, j = i % p.n;
      int64_t start = 0, tile0 = 0;
      for (int64_t h = 0; h < g; ++h) {
        start += m[h];
        tile0 += BM == 0 ? 1 : (m[h] + BM - 1) / BM;
      }
      const int64_t tiles = BM == 0 ? 1 : (m[g] + BM - 1) / BM;
      const int64_t tm = BM == 0 ? std::max<int64_t>(m[g], 1) : BM;
      float* out = p.out + (g * p.n + j) * p.k;
      for (int64_t c = 0; c < p.k; ++c) {
        float acc = 0.0f;
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t r0 = start + t * tm, r1 = std::min(start + m[g], r0 + tm);
          float part = 0.0f;
          for (int64_t r = r0; r < r1; ++r)
            part += decode(p.a.format, p.a.q[j * p.rows + r]) * decode(p.b.format, p.b.q[c * p.rows + r]);
          const float s = load_scale(p.a, j * p.row_tiles + tile0 + t) * load_scale(p.b, c * p.row_tiles + tile0 + t);
          acc += part * s;
        }
        out[c] = p.accumulate ? out[c] + acc : acc;  // the epilogue's D = acc + C
      }
    }
  });
}

}  // namespace fp8
}  // namespace moe_graph
