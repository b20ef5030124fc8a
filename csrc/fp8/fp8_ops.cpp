// Torch glue of the FP8 ops: argument checks that name the tensor, allocation, stream.
#include "fp8/fp8_ops.h"

#include <cfloat>

#include "common/error_flag_torch.h"
#include "common/torch_checks.h"
#include "fp8/quantize.h"

#ifdef MOE_GRAPH_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace moe_graph {
namespace {

constexpr const char* kOp = "fp8_quantize";

struct Quantized {
  fp8::QuantizeProblem p;
  at::Tensor q, scale;
};

Quantized describe(const at::Tensor& x, const std::optional<at::Tensor>& m_splits, int64_t tile_rows,
                   int64_t tile_cols, at::ScalarType fp8_dtype, bool mx, double eps, bool pow2, bool transpose) {
  check_defined(x, kOp, "x");
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3, kOp, ": x must be a 2-D tensor [M, K] or a 3-D tensor [B, M, K], got "
              "shape ", shape_str(x));
  check_dtype(x, {at::kFloat, at::kBFloat16, at::kHalf}, kOp, "x");
  check_contiguous(x, kOp, "x");
  TORCH_CHECK(fp8_dtype == at::kFloat8_e4m3fn || fp8_dtype == at::kFloat8_e5m2, kOp,
              ": fp8_dtype must be Float8_e4m3fn or Float8_e5m2, got ", c10::toString(fp8_dtype));
  TORCH_CHECK(tile_rows >= 0 && tile_cols >= 0, kOp, ": tile_rows and tile_cols must be >= 0 (0: all rows of a "
              "group / all columns), got ", tile_rows, " x ", tile_cols);
  TORCH_CHECK(!mx || (tile_rows >= 1 && tile_cols >= 1), kOp, ": MX (E8M0) scales need tiles of at least 1 x 1, "
              "got ", tile_rows, " x ", tile_cols);
  TORCH_CHECK(eps >= 0, kOp, ": eps must be >= 0, got ", eps);
  Quantized out;
  fp8::QuantizeProblem& p = out.p;
  p.batch = x.dim() == 3 ? x.size(0) : 1;
  p.rows = x.size(-2);
  p.cols = x.size(-1);
  p.in_type = x.scalar_type() == at::kFloat ? fp8::InType::kF32
              : x.scalar_type() == at::kBFloat16 ? fp8::InType::kBF16 : fp8::InType::kF16;
  p.format = fp8_dtype == at::kFloat8_e4m3fn ? fp8::Format::kE4M3 : fp8::Format::kE5M2;
  p.x = x.data_ptr();
  if (m_splits.has_value() && m_splits->defined()) {
    const at::Tensor& s = *m_splits;
    TORCH_CHECK(x.dim() == 2, kOp, ": m_splits groups the rows of a 2-D x; x has shape ", shape_str(x));
    check_dim(s, 1, kOp, "m_splits", "[E]");
    check_dtype(s, {at::kInt, at::kLong}, kOp, "m_splits");
    check_device(s, x.device(), kOp, "m_splits");
    check_contiguous(s, kOp, "m_splits");
    p.m_splits = s.data_ptr();
    p.splits_i64 = s.scalar_type() == at::kLong;
    p.groups = s.size(0);
  }
  p.tile_rows = tile_rows;
  p.tile_cols = tile_cols;
  p.row_tiles = fp8::row_tile_capacity(p.rows, p.groups, tile_rows);
  p.col_tiles = tile_cols == 0 ? 1 : (p.cols + tile_cols - 1) / tile_cols;
  p.mx = mx;
  p.eps = static_cast<float>(eps);
  p.pow2 = pow2;
  // TE's references: an infinite scale becomes the largest finite value of the input dtype (blockwise tiles) or of
  // fp32 (per-tensor current scaling).
  const bool per_tensor = tile_rows == 0 && tile_cols == 0;
  p.inf_scale = per_tensor || x.scalar_type() == at::kFloat ? FLT_MAX
                : x.scalar_type() == at::kBFloat16 ? 3.38953139e38f : 65504.0f;
  p.transpose = transpose;
  std::vector<int64_t> qshape, sshape;
  if (x.dim() == 3) {
    qshape.push_back(p.batch);
    sshape.push_back(p.batch);
  }
  qshape.push_back(transpose ? p.cols : p.rows);
  qshape.push_back(transpose ? p.rows : p.cols);
  sshape.push_back(transpose ? p.col_tiles : p.row_tiles);
  sshape.push_back(transpose ? p.row_tiles : p.col_tiles);
  out.q = at::empty(qshape, x.options().dtype(fp8_dtype));
  out.scale = at::empty(sshape, x.options().dtype(mx ? at::kFloat8_e8m0fnu : at::kFloat));
  p.q = static_cast<uint8_t*>(out.q.data_ptr());
  p.scale = out.scale.data_ptr();
  p.error_flag = error_flag_ptr(x.device());
  return out;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> fp8_quantize_cpu(const at::Tensor& x, const std::optional<at::Tensor>& m_splits,
                                                    int64_t tile_rows, int64_t tile_cols, at::ScalarType fp8_dtype,
                                                    bool mx, double eps, bool pow2, bool transpose) {
  Quantized o = describe(x, m_splits, tile_rows, tile_cols, fp8_dtype, mx, eps, pow2, transpose);
  fp8::quantize_cpu(o.p);
  return {o.q, o.scale};
}

#ifdef MOE_GRAPH_WITH_CUDA
std::tuple<at::Tensor, at::Tensor> fp8_quantize_cuda(const at::Tensor& x, const std::optional<at::Tensor>& m_splits,
                                                     int64_t tile_rows, int64_t tile_cols, at::ScalarType fp8_dtype,
                                                     bool mx, double eps, bool pow2, bool transpose) {
  c10::cuda::CUDAGuard guard(x.device());
  Quantized o = describe(x, m_splits, tile_rows, tile_cols, fp8_dtype, mx, eps, pow2, transpose);
  C10_CUDA_CHECK(fp8::quantize_cuda(o.p, at::cuda::getCurrentCUDAStream(x.device().index()).stream()));
  return {o.q, o.scale};
}
#endif

}  // namespace moe_graph
