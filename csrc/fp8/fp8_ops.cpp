// Torch glue of the FP8 ops: argument checks that name the tensor, allocation, stream.
#include "fp8/fp8_ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <stdexcept>
#include <vector>

#include "activation/activation_ops.h"
#include "common/error_flag_torch.h"
#include "common/torch_checks.h"
#include "fp8/quantize.h"
#include "fp8/scaled_gemm.h"
#include "fp8/scaled_plan.h"

#ifdef MOE_GRAPH_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "fp8/scaled_gemm_cuda.h"
#include "grouped_gemm/grouped_gemm_ops.h"
#endif

namespace moe_graph {
namespace {

constexpr const char* kOp = "fp8_quantize";

struct Quantized {
  fp8::QuantizeProblem p;
  at::Tensor q, scale;
};

// `act`: x is the fused activation's input h [M, W] and the values are act(h) * s (K = act->cols), or with
// act->grad_y the activation backward's grad_h (K = W).
Quantized describe(const at::Tensor& x, const std::optional<at::Tensor>& m_splits, int64_t tile_rows,
                   int64_t tile_cols, at::ScalarType fp8_dtype, bool mx, double eps, bool pow2, bool transpose,
                   const std::optional<at::Tensor>& x_scale,
                   const activation::ActivationProblem* act = nullptr) {
  check_defined(x, kOp, "x");
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3, kOp, ": x must be a 2-D tensor [M, K] or a 3-D tensor [B, M, K], got "
              "shape ", shape_str(x));
  const bool fp8_in = x.scalar_type() == at::kFloat8_e4m3fn || x.scalar_type() == at::kFloat8_e5m2;
  check_dtype(x, {at::kFloat, at::kBFloat16, at::kHalf, at::kFloat8_e4m3fn, at::kFloat8_e5m2}, kOp, "x");
  check_contiguous(x, kOp, "x");
  const bool has_x_scale = x_scale.has_value() && x_scale->defined();
  TORCH_CHECK(fp8_in == has_x_scale, kOp, ": x_scale (the rowwise scales of FP8 x) goes with an FP8 x, and an FP8 x "
              "needs it; got x of dtype ", c10::toString(x.scalar_type()), (has_x_scale ? " with" : " without"),
              " x_scale");
  if (fp8_in) {
    const at::Tensor& xs = *x_scale;
    TORCH_CHECK(x.dim() == 2, kOp, ": an FP8 x must be 2-D [M, K], got shape ", shape_str(x));
    check_dtype(xs, {at::kFloat, at::kFloat8_e8m0fnu}, kOp, "x_scale");
    check_device(xs, x.device(), kOp, "x_scale");
    check_contiguous(xs, kOp, "x_scale");
    const int64_t tile = xs.scalar_type() == at::kFloat ? 128 : 32;  // 1 x 128 fp32 scale_inv, MXFP8's 1 x 32 E8M0
    check_shape(xs, {x.size(0), (x.size(1) + tile - 1) / tile}, kOp, "x_scale");
  }
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
  p.cols = act && act->grad_y == nullptr ? act->cols : x.size(-1);
  if (act) {
    p.has_act = true;
    p.act_grad = act->grad_y != nullptr;
    p.act = *act;
  }
  p.in_type = x.scalar_type() == at::kFloat ? fp8::InType::kF32
              : x.scalar_type() == at::kBFloat16 ? fp8::InType::kBF16
              : x.scalar_type() == at::kHalf ? fp8::InType::kF16
              : x.scalar_type() == at::kFloat8_e4m3fn ? fp8::InType::kE4M3 : fp8::InType::kE5M2;
  if (fp8_in) {
    p.x_scale = x_scale->data_ptr();
    p.x_scale_e8m0 = x_scale->scalar_type() == at::kFloat8_e8m0fnu;
    p.x_scale_cols = x_scale->size(1);
  }
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
  fp8::set_tiling(p, tile_rows, tile_cols, mx, eps, pow2, transpose, x.scalar_type() == at::kFloat || fp8_in,
                  x.scalar_type() == at::kBFloat16);
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
  p.nonfinite_flag = nonfinite_flag_ptr(x.device());
  return out;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> fp8_quantize_cpu(const at::Tensor& x, const std::optional<at::Tensor>& m_splits,
                                                    int64_t tile_rows, int64_t tile_cols, at::ScalarType fp8_dtype,
                                                    bool mx, double eps, bool pow2, bool transpose,
                                                    const std::optional<at::Tensor>& x_scale) {
  Quantized o = describe(x, m_splits, tile_rows, tile_cols, fp8_dtype, mx, eps, pow2, transpose, x_scale);
  const fp8::QuantizeProblem& p = o.p;
  const int64_t tile = (p.tile_rows ? p.tile_rows : p.rows) * fp8::col_tile_width(p);
  at::parallel_for(0, p.batch * p.row_tiles * p.col_tiles, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, tile)),
                   [&](int64_t t0, int64_t t1) { fp8::quantize_tiles_cpu(p, t0, t1); });
  fp8::quantize_tail_cpu(p);
  return {o.q, o.scale};
}

namespace {

constexpr const char* kGemm = "fp8_scaled_grouped_gemm";
constexpr const char* kWgrad = "fp8_scaled_grouped_wgrad_out";

fp8::Operand operand(const at::Tensor& q, const at::Tensor& scale, const char* op, const char* qn, const char* sn) {
  check_defined(q, op, qn);
  check_dtype(q, {at::kFloat8_e4m3fn, at::kFloat8_e5m2}, op, qn);
  check_contiguous(q, op, qn);
  check_defined(scale, op, sn);
  check_dtype(scale, {at::kFloat, at::kFloat8_e8m0fnu}, op, sn);
  check_device(scale, q.device(), op, sn);
  check_contiguous(scale, op, sn);
  fp8::Operand o;
  o.q = static_cast<const uint8_t*>(q.data_ptr());
  o.format = q.scalar_type() == at::kFloat8_e4m3fn ? fp8::Format::kE4M3 : fp8::Format::kE5M2;
  o.scale = scale.data_ptr();
  o.e8m0 = scale.scalar_type() == at::kFloat8_e8m0fnu;
  return o;
}

void check_splits(const at::Tensor& m_splits, const at::Tensor& like, const char* op) {
  check_defined(m_splits, op, "m_splits");
  check_dim(m_splits, 1, op, "m_splits", "[E]");
  check_dtype(m_splits, {at::kInt, at::kLong}, op, "m_splits");
  check_device(m_splits, like.device(), op, "m_splits");
  check_contiguous(m_splits, op, "m_splits");
}

int64_t blocks(int64_t extent, int64_t block) { return block == 0 ? 1 : (extent + block - 1) / block; }

}  // namespace

namespace {

// The checks of both devices (nothing allocated or written before them), the problem in the op's compact layouts.
struct GemmArgs {
  fp8::ScaledGemmProblem p;
  at::Tensor bias32;
};

GemmArgs describe_gemm(const at::Tensor& a, const at::Tensor& a_scale, const at::Tensor& b, const at::Tensor& b_scale,
                       const at::Tensor& m_splits, int64_t block_k, int64_t block_n,
                       const std::optional<at::Tensor>& bias, at::ScalarType out_dtype) {
  GemmArgs g;
  fp8::ScaledGemmProblem& p = g.p;
  p.a = operand(a, a_scale, kGemm, "a", "a_scale");
  p.b = operand(b, b_scale, kGemm, "b", "b_scale");
  check_dim(a, 2, kGemm, "a", "[M, K]");
  check_dim(b, 3, kGemm, "b", "[E, N, K]");
  check_device(b, a.device(), kGemm, "b");
  check_splits(m_splits, a, kGemm);
  TORCH_CHECK(block_k >= 0 && block_n >= 0, kGemm, ": block_k and block_n must be >= 0 (0: whole extent)");
  p.rows = a.size(0);
  p.k = a.size(1);
  p.groups = b.size(0);
  p.n = b.size(1);
  check_shape(b, {p.groups, p.n, p.k}, kGemm, "b");
  check_shape(m_splits, {p.groups}, kGemm, "m_splits");
  check_shape(a_scale, {p.rows, blocks(p.k, block_k)}, kGemm, "a_scale");
  check_shape(b_scale, {p.groups, blocks(p.n, block_n), blocks(p.k, block_k)}, kGemm, "b_scale");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16 || out_dtype == at::kHalf, kGemm,
              ": out_dtype must be Float, BFloat16 or Half, got ", c10::toString(out_dtype));
  p.m_splits = m_splits.data_ptr();
  p.splits_i64 = m_splits.scalar_type() == at::kLong;
  p.block_k = block_k;
  p.block_n = block_n;
  if (bias.has_value() && bias->defined()) {
    check_shape(*bias, {p.groups, p.n}, kGemm, "bias");
    check_device(*bias, a.device(), kGemm, "bias");
    g.bias32 = bias->to(at::kFloat).contiguous();
    p.bias = g.bias32.data_ptr<float>();
  }
  p.error_flag = error_flag_ptr(a.device());
  return g;
}

struct WgradArgs {
  fp8::ScaledWgradProblem p;
};

WgradArgs describe_wgrad(const at::Tensor& a_t, const at::Tensor& a_scale, const at::Tensor& b_t,
                         const at::Tensor& b_scale, const at::Tensor& m_splits, int64_t block_m, const at::Tensor& out,
                         bool accumulate) {
  WgradArgs w;
  fp8::ScaledWgradProblem& p = w.p;
  p.a = operand(a_t, a_scale, kWgrad, "a_t", "a_scale");
  p.b = operand(b_t, b_scale, kWgrad, "b_t", "b_scale");
  check_dim(a_t, 2, kWgrad, "a_t", "[N, M]");
  check_dim(b_t, 2, kWgrad, "b_t", "[K, M]");
  check_device(b_t, a_t.device(), kWgrad, "b_t");
  check_splits(m_splits, a_t, kWgrad);
  TORCH_CHECK(block_m >= 0, kWgrad, ": block_m must be >= 0 (0: one tile per group)");
  p.n = a_t.size(0);
  p.rows = a_t.size(1);
  p.k = b_t.size(0);
  p.groups = m_splits.size(0);
  check_shape(b_t, {p.k, p.rows}, kWgrad, "b_t");
  p.row_tiles = fp8::row_tile_capacity(p.rows, p.groups, block_m);
  check_shape(a_scale, {p.n, p.row_tiles}, kWgrad, "a_scale");
  check_shape(b_scale, {p.k, p.row_tiles}, kWgrad, "b_scale");
  check_defined(out, kWgrad, "out");
  check_shape(out, {p.groups, p.n, p.k}, kWgrad, "out");
  check_dtype(out, {at::kFloat}, kWgrad, "out");
  check_device(out, a_t.device(), kWgrad, "out");
  check_contiguous(out, kWgrad, "out");
  check_writable(out, kWgrad, "out");
  p.m_splits = m_splits.data_ptr();
  p.splits_i64 = m_splits.scalar_type() == at::kLong;
  p.block_m = block_m;
  p.accumulate = accumulate;
  p.out = out.data_ptr<float>();
  p.error_flag = error_flag_ptr(a_t.device());
  return w;
}

}  // namespace

at::Tensor fp8_scaled_grouped_gemm_cpu(const at::Tensor& a, const at::Tensor& a_scale, const at::Tensor& b,
                                       const at::Tensor& b_scale, const at::Tensor& m_splits, int64_t block_k,
                                       int64_t block_n, const std::optional<at::Tensor>& bias,
                                       at::ScalarType out_dtype) {
  GemmArgs g = describe_gemm(a, a_scale, b, b_scale, m_splits, block_k, block_n, bias, out_dtype);
  at::Tensor out = at::empty({g.p.rows, g.p.n}, a.options().dtype(at::kFloat));
  g.p.out = out.data_ptr<float>();
  fp8::scaled_gemm_cpu(g.p);
  return out_dtype == at::kFloat ? out : out.to(out_dtype);  // one rounding (nearest even)
}

void fp8_scaled_grouped_wgrad_out_cpu(const at::Tensor& a_t, const at::Tensor& a_scale, const at::Tensor& b_t,
                                      const at::Tensor& b_scale, const at::Tensor& m_splits, int64_t block_m,
                                      const at::Tensor& out, bool accumulate) {
  fp8::scaled_wgrad_cpu(describe_wgrad(a_t, a_scale, b_t, b_scale, m_splits, block_m, out, accumulate).p);
}

std::vector<int64_t> fp8_scaled_plan_probe(bool wgrad, int64_t arch, int64_t rows, int64_t num_experts, int64_t n,
                                           int64_t k, int64_t block_k, int64_t block_n, bool e8m0, bool flag) {
  try {
    if (wgrad) {
      const fp8::ScaledWgradPlan p = fp8::plan_scaled_wgrad(static_cast<int>(arch), rows,
                                                            static_cast<int>(num_experts), n, k, block_k, e8m0, flag);
      return {static_cast<int64_t>(p.kernel), p.run_offsets, p.run_gemm, p.zero_fill,
              static_cast<int64_t>(p.offsets_bytes), static_cast<int64_t>(p.argument_bytes),
              static_cast<int64_t>(p.sfa_bytes), static_cast<int64_t>(p.sfb_bytes)};
    }
    const fp8::ScaledForwardPlan p = fp8::plan_scaled_forward(static_cast<int>(arch), rows,
                                                              static_cast<int>(num_experts), n, k, block_k, block_n,
                                                              e8m0, flag);
    return {static_cast<int64_t>(p.kernel), p.run_offsets, p.run_gemm, p.arg_tail_blocks,
            static_cast<int64_t>(p.offsets_bytes), static_cast<int64_t>(p.argument_bytes),
            static_cast<int64_t>(p.sfa_bytes), static_cast<int64_t>(p.sfb_bytes)};
  } catch (const std::runtime_error& e) {
    TORCH_CHECK(false, e.what());
  }
}

#ifdef MOE_GRAPH_WITH_CUDA
namespace {

// The CUDA kernels' operand rules beyond the shared checks (the plan checks shapes and the recipe per arch).
void check_cuda_operands(const fp8::Operand& a, const fp8::Operand& b, const char* op) {
  TORCH_CHECK(a.format == fp8::Format::kE4M3 && b.format == fp8::Format::kE4M3, op,
              ": the CUDA kernels take E4M3 operands (Float8_e4m3fn); E5M2 (the HYBRID format's gradients) runs on "
              "the CPU only");
  TORCH_CHECK(a.e8m0 == b.e8m0, op, ": both scales must be fp32 or both float8_e8m0fnu");
}

}  // namespace

at::Tensor fp8_scaled_grouped_gemm_cuda(const at::Tensor& a, const at::Tensor& a_scale, const at::Tensor& b,
                                        const at::Tensor& b_scale, const at::Tensor& m_splits, int64_t block_k,
                                        int64_t block_n, const std::optional<at::Tensor>& bias,
                                        at::ScalarType out_dtype) {
  c10::cuda::CUDAGuard guard(a.device());
  GemmArgs g = describe_gemm(a, a_scale, b, b_scale, m_splits, block_k, block_n, bias, out_dtype);
  check_cuda_operands(g.p.a, g.p.b, kGemm);
  TORCH_CHECK(out_dtype == at::kBFloat16, kGemm, ": the CUDA kernels write BFloat16 (out_dtype), got ",
              c10::toString(out_dtype));
  fp8::ScaledForwardCuda p;
  p.rows = g.p.rows;
  p.n = g.p.n;
  p.k = g.p.k;
  p.block_k = block_k;
  p.block_n = block_n;
  p.e8m0 = g.p.a.e8m0;
  p.a = g.p.a.q;
  p.a_scale = g.p.a.scale;
  p.b = g.p.b.q;
  p.b_scale = g.p.b.scale;
  p.bias = g.p.bias;
  p.splits = to_splits(m_splits);
  std::vector<at::Tensor> keep;
  gg::LaunchEnv env = make_env(a, keep);
  // the plan's errors (recipe, arch, shapes) before the output is allocated
  run_guarded(kGemm, [&] {
    (void)fp8::plan_scaled_forward(env.arch, p.rows, p.splits.num_experts, p.n, p.k, p.block_k, p.block_n, p.e8m0,
                                   p.bias != nullptr);
  });
  at::Tensor out = at::empty({p.rows, p.n}, a.options().dtype(at::kBFloat16));
  p.out = out.data_ptr();
  run_guarded(kGemm, [&] { fp8::run_scaled_forward(p, env); });
  return out;
}

void fp8_scaled_grouped_wgrad_out_cuda(const at::Tensor& a_t, const at::Tensor& a_scale, const at::Tensor& b_t,
                                       const at::Tensor& b_scale, const at::Tensor& m_splits, int64_t block_m,
                                       const at::Tensor& out, bool accumulate) {
  c10::cuda::CUDAGuard guard(a_t.device());
  WgradArgs w = describe_wgrad(a_t, a_scale, b_t, b_scale, m_splits, block_m, out, accumulate);
  check_cuda_operands(w.p.a, w.p.b, kWgrad);
  fp8::ScaledWgradCuda p;
  p.rows = w.p.rows;
  p.n = w.p.n;
  p.k = w.p.k;
  p.block_m = block_m;
  p.e8m0 = w.p.a.e8m0;
  p.a_t = w.p.a.q;
  p.a_scale = w.p.a.scale;
  p.b_t = w.p.b.q;
  p.b_scale = w.p.b.scale;
  p.out = w.p.out;
  p.accumulate = accumulate;
  p.splits = to_splits(m_splits);
  std::vector<at::Tensor> keep;
  gg::LaunchEnv env = make_env(a_t, keep);
  run_guarded(kWgrad, [&] { fp8::run_scaled_wgrad(p, env); });
}
#endif

#ifdef MOE_GRAPH_WITH_CUDA
namespace {
// The CUDA kernel's index math is 32-bit (fp8::index32_ok): a clear error instead of the launcher's
// cudaErrorInvalidValue.
void check_index32(const fp8::QuantizeProblem& p, const char* op) {
  TORCH_CHECK(fp8::index32_ok(p), op, ": the CUDA quantizer needs rows, columns, tile sizes and tile counts below "
              "2^31, got ", p.batch, " x ", p.rows, " x ", p.cols, " in ", p.tile_rows, " x ", p.tile_cols,
              " tiles (", p.row_tiles, " x ", p.col_tiles, " of them)");
}
}  // namespace

std::tuple<at::Tensor, at::Tensor> fp8_quantize_cuda(const at::Tensor& x, const std::optional<at::Tensor>& m_splits,
                                                     int64_t tile_rows, int64_t tile_cols, at::ScalarType fp8_dtype,
                                                     bool mx, double eps, bool pow2, bool transpose,
                                                     const std::optional<at::Tensor>& x_scale) {
  c10::cuda::CUDAGuard guard(x.device());
  Quantized o = describe(x, m_splits, tile_rows, tile_cols, fp8_dtype, mx, eps, pow2, transpose, x_scale);
  check_index32(o.p, kOp);
  C10_CUDA_CHECK(fp8::quantize_cuda(o.p, at::cuda::getCurrentCUDAStream(x.device().index()).stream()));
  return {o.q, o.scale};
}
#endif

// ---------------------------------------------------------------------------------------------- quantize pair --
namespace {

constexpr const char* kPair = "fp8_quantize_pair";

struct Pair {
  Quantized rows, cols;
  std::optional<activation::ActivationProblem> act;
};

Pair describe_pair(const at::Tensor& x, const std::optional<at::Tensor>& m_splits, at::IntArrayRef tiles,
                   at::ScalarType fp8_dtype, bool mx, double eps, bool pow2,
                   const std::optional<c10::string_view>& activation, double alpha, double limit,
                   const std::optional<at::Tensor>& row_scale, const std::optional<at::Tensor>& grad_y,
                   const std::optional<at::Tensor>& grad_scale) {
  TORCH_CHECK(tiles.size() == 4, kPair, ": tiles must be [rowwise tile rows, rowwise tile cols, columnwise tile "
              "rows, columnwise tile cols], got ", tiles.size(), " values");
  Pair out;
  const bool has_scale = row_scale.has_value() && row_scale->defined();
  const bool has_grad = grad_y.has_value() && grad_y->defined();
  TORCH_CHECK(activation.has_value() || !has_scale, kPair, ": row_scale goes with an activation (the fused "
              "activation's row factor); got row_scale without activation");
  TORCH_CHECK(activation.has_value() || !has_grad, kPair, ": grad_y goes with an activation (the fused activation "
              "backward's output gradient); got grad_y without activation");
  if (activation.has_value()) {
    check_dtype(x, {at::kFloat, at::kBFloat16, at::kHalf}, kPair, "h (x, the activation's input)");
    out.act = describe_expert_activation(kPair, x, row_scale, *activation, alpha, limit);
    if (has_grad) {  // the activation backward's grad_h: grad_y [M, F] in h's dtype
      const at::Tensor& g = *grad_y;
      check_dim(g, 2, kPair, "grad_y", "[M, F]");
      check_shape(g, {out.act->rows, out.act->cols}, kPair, "grad_y");
      check_same_dtype(g, x, kPair, "grad_y", "h");
      check_device(g, x.device(), kPair, "grad_y");
      check_contiguous(g, kPair, "grad_y");
      out.act->grad_y = g.data_ptr();
    }
  }
  const bool has_ds = grad_scale.has_value() && grad_scale->defined();
  if (has_ds) {  // the row-scale gradient, written by the rowwise problem (fp8::row_dot)
    TORCH_CHECK(has_grad && has_scale, kPair, ": grad_scale (the row-scale gradient) goes with grad_y and row_scale "
                "(the fused activation backward with a row scale); got it without ", has_grad ? "row_scale" : "grad_y");
    TORCH_CHECK(tiles[0] == 1 && tiles[1] >= 1 && tiles[1] <= fp8::kRowDotMaxTileCols, kPair, ": grad_scale needs "
                "rowwise tiles of one row and 1 to ", fp8::kRowDotMaxTileCols, " columns (Float8BlockScaling's 1 x 128, "
                "MXFP8's 1 x 32), got ", tiles[0], " x ", tiles[1]);
    const at::Tensor& ds = *grad_scale;
    check_shape(ds, {out.act->rows}, kPair, "grad_scale");
    check_same_dtype(ds, *row_scale, kPair, "grad_scale", "row_scale");
    check_device(ds, x.device(), kPair, "grad_scale");
    check_contiguous(ds, kPair, "grad_scale");
  }
  const activation::ActivationProblem* act = out.act ? &*out.act : nullptr;
  out.rows = describe(x, m_splits, tiles[0], tiles[1], fp8_dtype, mx, eps, pow2, false, std::nullopt, act);
  out.cols = describe(x, m_splits, tiles[2], tiles[3], fp8_dtype, mx, eps, pow2, true, std::nullopt, act);
  TORCH_CHECK(x.dim() == 2, kPair, ": x must be 2-D [M, K] (or h [M, W] with an activation), got shape ",
              shape_str(x));
  if (has_ds) out.rows.p.act.grad_scale = grad_scale->data_ptr();  // the rowwise problem only
  return out;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fp8_quantize_pair_cpu(
    const at::Tensor& x, const std::optional<at::Tensor>& m_splits, at::IntArrayRef tiles, at::ScalarType fp8_dtype,
    bool mx, double eps, bool pow2, std::optional<c10::string_view> activation, double alpha, double limit,
    const std::optional<at::Tensor>& row_scale, const std::optional<at::Tensor>& grad_y,
    const std::optional<at::Tensor>& grad_scale) {
  Pair o = describe_pair(x, m_splits, tiles, fp8_dtype, mx, eps, pow2, activation, alpha, limit, row_scale, grad_y,
                         grad_scale);
  for (const fp8::QuantizeProblem* p : {&o.rows.p, &o.cols.p}) {
    const int64_t tile = (p->tile_rows ? p->tile_rows : p->rows) * fp8::col_tile_width(*p);
    at::parallel_for(0, p->batch * p->row_tiles * p->col_tiles,
                     std::max<int64_t>(1, 16384 / std::max<int64_t>(1, tile)),
                     [&](int64_t t0, int64_t t1) { fp8::quantize_tiles_cpu(*p, t0, t1); });
    if (fp8::row_dot(*p))
      at::parallel_for(0, p->rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, p->cols)),
                       [&](int64_t r0, int64_t r1) { fp8::quantize_row_dots_cpu(*p, r0, r1); });
    fp8::quantize_tail_cpu(*p);
  }
  return {o.rows.q, o.rows.scale, o.cols.q, o.cols.scale};
}

#ifdef MOE_GRAPH_WITH_CUDA
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fp8_quantize_pair_cuda(
    const at::Tensor& x, const std::optional<at::Tensor>& m_splits, at::IntArrayRef tiles, at::ScalarType fp8_dtype,
    bool mx, double eps, bool pow2, std::optional<c10::string_view> activation, double alpha, double limit,
    const std::optional<at::Tensor>& row_scale, const std::optional<at::Tensor>& grad_y,
    const std::optional<at::Tensor>& grad_scale) {
  c10::cuda::CUDAGuard guard(x.device());
  Pair o = describe_pair(x, m_splits, tiles, fp8_dtype, mx, eps, pow2, activation, alpha, limit, row_scale, grad_y,
                         grad_scale);
  check_index32(o.rows.p, kPair);
  check_index32(o.cols.p, kPair);
  C10_CUDA_CHECK(fp8::quantize_pair_cuda(o.rows.p, &o.cols.p, at::cuda::getCurrentCUDAStream(x.device().index()).stream()));
  return {o.rows.q, o.rows.scale, o.cols.q, o.cols.scale};
}
#endif

}  // namespace moe_graph
