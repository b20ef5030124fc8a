// Scaled (FP8) grouped GEMM semantics (torch-free): the CPU implementation defines them, the GPU kernels (CUTLASS
// SM90 blockwise, SM100 block-scaled MXFP8) apply scales in the same order along K.
//
//   Forward / dgrad (ScaledGemmProblem):  out[r, n] = sum_{kb} ( sum_{k in kb} A[r, k] * B[e, n, k] )
//                                                      * sa[r, kb] * sb[e, n / BN, kb]
//     A [M, K] FP8 bytes (rows grouped by m_splits [E]; rows past sum(m_splits): out = 0), B [E, N, K] FP8 bytes,
//     sa [M, ceil(K / BK)] and sb [E, ceil(N / BN), ceil(K / BK)] fp32 scale_inv or E8M0 bytes (BK or BN 0: the
//     whole extent). Each K block's products are summed in fp32 in k order (the products of two FP8 values are
//     exact in fp32), the block sum is multiplied by sa * sb (one fp32 product, then one multiply) and added to the
//     fp32 accumulator, blocks in increasing order; bias [E, N] (fp32) is added last; the caller rounds once to
//     the output dtype.
//
//   Wgrad (ScaledWgradProblem):  out[e, n, k] (+)= sum_{t in tiles(e)} ( sum_{m in t} A[n, m] * B[k, m] )
//                                                     * sa[n, t] * sb[k, t]
//     A = dy^T [N, M], B = x^T [K, M] (the transposed columnwise copies), sa [N, RT], sb [K, RT]: tiles of BM rows
//     of each group, numbered as fp8::locate_tile numbers them (BM 0: one tile per group). fp32 out [E, N, K];
//     the tiles are summed in fp32 as above; accumulate then adds the sum to out in one fp32 add (the epilogue's
//     D = acc + C on fp32 main_grad), else out is overwritten (zero-token experts: 0, or unchanged).
#pragma once
#include <cstdint>

#include "fp8/fp8_math.h"
#include "fp8/quantize.h"

namespace moe_graph {
namespace fp8 {

struct Operand {
  const uint8_t* q = nullptr;
  Format format = Format::kE4M3;
  const void* scale = nullptr;
  bool e8m0 = false;
};

MOE_GRAPH_HD float decode(Format f, uint8_t b) {
  return f == Format::kE4M3 ? decode_fp8<Format::kE4M3>(b) : decode_fp8<Format::kE5M2>(b);
}

MOE_GRAPH_HD float load_scale(const Operand& o, int64_t i) {
  return o.e8m0 ? e8m0_value(static_cast<const uint8_t*>(o.scale)[i]) : static_cast<const float*>(o.scale)[i];
}

struct ScaledGemmProblem {
  int64_t rows = 0, n = 0, k = 0, groups = 0;  // M, N, K, E
  const void* m_splits = nullptr;
  bool splits_i64 = false;
  Operand a, b;
  int64_t block_k = 128, block_n = 128;  // BK, BN (0: whole extent)
  const float* bias = nullptr;           // [E, N] or nullptr
  float* out = nullptr;                  // [M, N] fp32
  int32_t* error_flag = nullptr;
};

struct ScaledWgradProblem {
  int64_t rows = 0, n = 0, k = 0, groups = 0;  // M (tokens), N, K, E
  const void* m_splits = nullptr;
  bool splits_i64 = false;
  Operand a, b;            // a = dy^T [N, M], b = x^T [K, M]
  int64_t block_m = 128;   // BM (0: one tile per group)
  int64_t row_tiles = 0;   // RT (columns of sa / sb)
  bool accumulate = false;
  float* out = nullptr;    // [E, N, K] fp32
  int32_t* error_flag = nullptr;
};

void scaled_gemm_cpu(const ScaledGemmProblem& p);
void scaled_wgrad_cpu(const ScaledWgradProblem& p);

}  // namespace fp8
}  // namespace moe_graph
