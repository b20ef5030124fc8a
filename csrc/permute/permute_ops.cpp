// Torch glue of the permute ops: argument checks that name the tensor, allocation, the CPU thread split (raising on
// an out-of-range index) and the CUDA launch on the current stream (flagging it instead: no sync).
#include "permute/permute_ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>

#include "common/error_flag_torch.h"
#include "common/torch_checks.h"
#include "permute/expand_quantize.h"
#include "permute/permute.h"

#ifdef MOE_GRAPH_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace moe_graph {
namespace {

constexpr const char* kExpand = "expand_rows";
constexpr const char* kReduce = "reduce_rows";
constexpr const char* kDot = "route_dot";

permute::DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kDouble: return permute::DType::kDouble;
    case at::kBFloat16: return permute::DType::kBFloat16;
    case at::kHalf: return permute::DType::kHalf;
    default: return permute::DType::kFloat;
  }
}

// The accumulation dtype of data of `t`'s dtype: float64 for float64, float32 otherwise.
at::ScalarType acc_dtype(const at::Tensor& t) { return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

void check_data(const at::Tensor& t, const char* op, const char* name, const char* layout) {
  check_defined(t, op, name);
  check_dim(t, 2, op, name, layout);
  check_dtype(t, {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble}, op, name);
}

void check_index(const at::Tensor& t, int64_t dim, const at::Tensor& src, const char* op, const char* name,
                 const char* layout) {
  check_defined(t, op, name);
  check_dim(t, dim, op, name, layout);
  check_dtype(t, {at::kLong}, op, name);
  check_device(t, src.device(), op, name);
}

// Weights [n, K] of src's dtype or float32, converted to the accumulation dtype; or undefined.
at::Tensor prepare_weights(const c10::optional<at::Tensor>& weights, const at::Tensor& src, int64_t n, int64_t K,
                           const char* op) {
  if (!weights.has_value() || !weights->defined()) return at::Tensor();
  const at::Tensor& w = *weights;
  check_dim(w, 2, op, "weights", "[n, K]");
  const std::vector<int64_t> expected{n, K};
  check_shape(w, expected, op, "weights");
  check_device(w, src.device(), op, "weights");
  TORCH_CHECK(w.scalar_type() == src.scalar_type() || w.scalar_type() == at::kFloat, op,
              ": weights must have the dtype of src (", c10::toString(src.scalar_type()), ") or Float, got ",
              c10::toString(w.scalar_type()));
  return w.to(acc_dtype(src)).contiguous();
}

// A prepared op: the contiguous operands (kept alive), the output and the kernel's view of them.
struct Prepared {
  permute::RouteOp op;
  at::Tensor tokens, rows, route_rows, route_of_row, weights, out;
  permute::RouteProblem p;
};

// Fills p from the prepared tensors (undefined ones stay null); n, K, m come from the caller.
void fill(Prepared& x, const at::Tensor& data, int64_t n, int64_t K, int64_t m) {
  auto ptr = [](const at::Tensor& t) -> const void* { return t.defined() ? t.data_ptr() : nullptr; };
  x.p.dtype = dtype_of(data);
  x.p.tokens = n;
  x.p.topk = K;
  x.p.rows = m;
  x.p.hidden = data.size(1);
  x.p.token_data = ptr(x.tokens);
  x.p.row_data = ptr(x.rows);
  x.p.route_rows = x.route_rows.defined() ? x.route_rows.data_ptr<int64_t>() : nullptr;
  x.p.route_of_row = x.route_of_row.defined() ? x.route_of_row.data_ptr<int64_t>() : nullptr;
  x.p.weights = ptr(x.weights);
  x.p.out = x.out.data_ptr();
}

Prepared prepare_expand(const at::Tensor& src, const at::Tensor& route_of_row, int64_t K,
                        const c10::optional<at::Tensor>& weights) {
  check_data(src, kExpand, "src", "[n, H]");
  check_index(route_of_row, 1, src, kExpand, "route_of_row", "[m]");
  TORCH_CHECK(K >= 0, kExpand, ": K must be >= 0, got ", K);
  Prepared x{permute::RouteOp::kExpand};
  x.tokens = src.contiguous();
  x.route_of_row = route_of_row.contiguous();
  x.weights = prepare_weights(weights, src, src.size(0), K, kExpand);
  x.out = at::empty({route_of_row.size(0), src.size(1)}, src.options());
  fill(x, src, src.size(0), K, route_of_row.size(0));
  return x;
}

Prepared prepare_reduce(const at::Tensor& src, const at::Tensor& route_rows, const c10::optional<at::Tensor>& weights) {
  check_data(src, kReduce, "src", "[m, H]");
  check_index(route_rows, 2, src, kReduce, "route_rows", "[n, K]");
  const int64_t n = route_rows.size(0), K = route_rows.size(1);
  Prepared x{permute::RouteOp::kReduce};
  x.rows = src.contiguous();
  x.route_rows = route_rows.contiguous();
  x.weights = prepare_weights(weights, src, n, K, kReduce);
  x.out = at::empty({n, src.size(1)}, src.options());
  fill(x, src, n, K, src.size(0));
  return x;
}

Prepared prepare_dot(const at::Tensor& rows, const at::Tensor& src, const at::Tensor& route_rows) {
  check_data(rows, kDot, "rows", "[n, H]");
  check_data(src, kDot, "src", "[m, H]");
  check_same_dtype(src, rows, kDot, "src", "rows");
  check_device(src, rows.device(), kDot, "src");
  check_index(route_rows, 2, rows, kDot, "route_rows", "[n, K]");
  TORCH_CHECK(src.size(1) == rows.size(1), kDot, ": src must have shape [m, H] with H = ", rows.size(1),
              " (the columns of rows), got shape ", shape_str(src));
  TORCH_CHECK(route_rows.size(0) == rows.size(0), kDot, ": route_rows must have shape [n, K] with n = ",
              rows.size(0), " (the rows of rows), got shape ", shape_str(route_rows));
  Prepared x{permute::RouteOp::kDot};
  x.tokens = rows.contiguous();
  x.rows = src.contiguous();
  x.route_rows = route_rows.contiguous();
  x.out = at::empty({route_rows.size(0), route_rows.size(1)}, rows.options().dtype(acc_dtype(rows)));
  fill(x, rows, route_rows.size(0), route_rows.size(1), src.size(0));
  return x;
}

// Runs the op on torch's CPU threads; raises on the first out-of-range index, naming it.
at::Tensor run_cpu(const Prepared& x, const char* op) {
  const permute::RouteProblem& p = x.p;
  std::atomic<int64_t> first_bad{-1};
  const int64_t cost = std::max<int64_t>(1, p.hidden * (x.op == permute::RouteOp::kExpand ? 1 : p.topk));
  at::parallel_for(0, permute::output_rows(x.op, p), std::max<int64_t>(1, 32768 / cost), [&](int64_t b, int64_t e) {
    const int64_t bad = permute::route_op_host(x.op, p, b, e);
    int64_t cur = first_bad.load();
    while (bad >= 0 && (cur < 0 || bad < cur) && !first_bad.compare_exchange_weak(cur, bad)) {
    }
  });
  const int64_t pos = first_bad.load();
  if (pos < 0) return x.out;
  const bool expand = x.op == permute::RouteOp::kExpand;
  const at::Tensor& index = expand ? x.route_of_row : x.route_rows;
  const int64_t sentinel = expand ? p.tokens * p.topk : p.rows;
  TORCH_CHECK(false, op, ": ", expand ? "route_of_row" : "route_rows", " holds ", index.reshape(-1)[pos].item<int64_t>(),
              " at flat position ", pos, ", outside [0, ", sentinel, "] (", sentinel,
              expand ? " = n*K is the sentinel: a zero row)" : " = m, the rows of src, is the sentinel: skipped)");
  return x.out;
}

// ------------------------------------------------------------------------------------------- expand_quantize --
constexpr const char* kExpandQuantize = "expand_quantize_pair";

struct QuantizedCopy {
  fp8::QuantizeProblem p;
  at::Tensor q, scale;
};

struct ExpandQuantizePrepared {
  at::Tensor src, route_of_row, m_splits, weights;  // weights: fp32 [n, K] or undefined
  permute::ExpandRoutes e;
  QuantizedCopy rows, cols;  // the rowwise copy [m, H] and the columnwise (transposed) copy [H, m]
};

// One copy of expand_rows(src, route_of_row, K) [m, H] as fp8_quantize describes it (fp8/quantize.h): the tiles,
// fp8_dtype, scales and TE's infinite-scale rule of fp8_quantize's glue (the input dtype's largest value for
// blockwise tiles, fp32's per tensor).
QuantizedCopy describe_copy(const ExpandQuantizePrepared& x, int64_t tile_rows, int64_t tile_cols,
                            at::ScalarType fp8_dtype, bool mx, double eps, bool pow2, bool transpose) {
  TORCH_CHECK(tile_rows >= 0 && tile_cols >= 0, kExpandQuantize, ": tiles must be >= 0 (0: all rows of a group / "
              "all columns), got ", tile_rows, " x ", tile_cols);
  TORCH_CHECK(!mx || (tile_rows >= 1 && tile_cols >= 1), kExpandQuantize, ": MX (E8M0) scales need tiles of at "
              "least 1 x 1, got ", tile_rows, " x ", tile_cols);
  QuantizedCopy out;
  fp8::QuantizeProblem& p = out.p;
  const at::ScalarType dt = x.src.scalar_type();
  const bool packed = x.e.packed.src != nullptr;  // packed FP8 rows: the values are dequantized in fp32
  p.rows = x.route_of_row.defined() ? x.route_of_row.size(0) : x.src.size(0);
  p.cols = packed ? x.e.packed.cols : x.src.size(1);
  p.in_type = packed ? (x.e.packed.format == fp8::Format::kE4M3 ? fp8::InType::kE4M3 : fp8::InType::kE5M2)
              : dt == at::kFloat ? fp8::InType::kF32 : dt == at::kBFloat16 ? fp8::InType::kBF16 : fp8::InType::kF16;
  p.format = fp8_dtype == at::kFloat8_e4m3fn ? fp8::Format::kE4M3 : fp8::Format::kE5M2;
  p.x = x.src.data_ptr();
  if (x.m_splits.defined()) {
    p.m_splits = x.m_splits.data_ptr();
    p.splits_i64 = x.m_splits.scalar_type() == at::kLong;
    p.groups = x.m_splits.size(0);
  }
  fp8::set_tiling(p, tile_rows, tile_cols, mx, eps, pow2, transpose, packed || dt == at::kFloat,
                  !packed && dt == at::kBFloat16);
  const at::TensorOptions o = x.src.options();
  p.error_flag = error_flag_ptr(x.src.device());
  p.nonfinite_flag = nonfinite_flag_ptr(x.src.device());
  if (x.e.packed.out != nullptr) return out;  // the packed rows are the output (prepare_expand_pack)
  out.q = at::empty(transpose ? std::vector<int64_t>{p.cols, p.rows} : std::vector<int64_t>{p.rows, p.cols},
                    o.dtype(fp8_dtype));
  out.scale = at::empty(transpose ? std::vector<int64_t>{p.col_tiles, p.row_tiles}
                                  : std::vector<int64_t>{p.row_tiles, p.col_tiles},
                        o.dtype(mx ? at::kFloat8_e8m0fnu : at::kFloat));
  p.q = static_cast<uint8_t*>(out.q.data_ptr());
  p.scale = out.scale.data_ptr();
  return out;
}

// Bytes of a packed FP8 row of H elements (ops/fp8.py packed_row_bytes).
int64_t packed_row_bytes(int64_t H, bool mx) { return H + (mx ? (H + 31) / 32 : 4 * ((H + 127) / 128)); }

void check_fp8_options(const char* op, at::ScalarType fp8_dtype, double eps) {
  TORCH_CHECK(fp8_dtype == at::kFloat8_e4m3fn || fp8_dtype == at::kFloat8_e5m2, op,
              ": fp8_dtype must be Float8_e4m3fn or Float8_e5m2, got ", c10::toString(fp8_dtype));
  TORCH_CHECK(eps >= 0, op, ": eps must be >= 0, got ", eps);
}

void set_packed_layout(permute::PackedRows& k, int64_t H, at::ScalarType fp8_dtype, bool mx) {
  k.cols = H;
  k.stride = packed_row_bytes(H, mx);
  k.format = fp8_dtype == at::kFloat8_e4m3fn ? fp8::Format::kE4M3 : fp8::Format::kE5M2;
  k.e8m0 = mx;
}

// The rows' routes of expand_quantize_pair / expand_quantize_pack: route_of_row [m] (expand_rows' index) checked and
// kept in x, or None: row i is src's row i (K must be 1).
void set_routes(ExpandQuantizePrepared& x, const c10::optional<at::Tensor>& route_of_row, int64_t K,
                const at::Tensor& src, const char* op) {
  const bool routed = route_of_row.has_value() && route_of_row->defined();
  if (routed) check_index(*route_of_row, 1, src, op, "route_of_row", "[m]");
  TORCH_CHECK(routed ? K >= 0 : K == 1, op, ": K must be ", routed ? ">= 0" : "1 without route_of_row", ", got ", K);
  if (routed) {
    x.route_of_row = route_of_row->contiguous();
    x.e.route_of_row = x.route_of_row.data_ptr<int64_t>();
  }
  x.e.tokens = src.size(0);
  x.e.topk = K;
}

ExpandQuantizePrepared prepare_expand_quantize(const at::Tensor& src, const c10::optional<at::Tensor>& route_of_row,
                                               int64_t K,
                                               const at::Tensor& m_splits, at::IntArrayRef tiles,
                                               at::ScalarType fp8_dtype, bool mx, double eps, bool pow2,
                                               const c10::optional<at::Tensor>& weights, int64_t packed_cols,
                                               bool plus_zero) {
  const char* op = kExpandQuantize;
  check_defined(src, op, "src");
  TORCH_CHECK(packed_cols >= 0, op, ": packed_cols must be >= 0 (0: src holds the values), got ", packed_cols);
  TORCH_CHECK(packed_cols == 0 || !(weights.has_value() && weights->defined()), op,
              ": weights must be None with packed_cols (packed FP8 rows are copied, not weighted)");
  if (packed_cols > 0) {  // packed FP8 rows (expand_quantize.h): the rowwise tiles are the rows' own
    check_dim(src, 2, op, "src", "[n, packed_cols + scale bytes] (packed FP8 rows)");
    check_dtype(src, {at::kByte}, op, "src");
    const int64_t B = packed_row_bytes(packed_cols, mx);
    TORCH_CHECK(src.size(1) == B, op, ": src must be packed rows of ", B, " bytes (", packed_cols, " FP8 bytes and ",
                "their ", mx ? "E8M0" : "fp32", " scales), got ", src.size(1), " bytes per row");
    TORCH_CHECK(tiles.size() == 4 && tiles[0] == 1 && tiles[1] == (mx ? 32 : 128), op, ": with packed_cols the "
                "rowwise tiles must be the packed rows' own (1 x ", mx ? 32 : 128, "), got ",
                tiles.size() ? tiles[0] : 0, " x ", tiles.size() > 1 ? tiles[1] : 0);
  } else {
    check_dim(src, 2, op, "src", "[n, H]");
    check_dtype(src, {at::kFloat, at::kBFloat16, at::kHalf}, op, "src");
  }
  check_defined(m_splits, op, "m_splits");
  check_dim(m_splits, 1, op, "m_splits", "[E]");
  check_dtype(m_splits, {at::kInt, at::kLong}, op, "m_splits");
  check_device(m_splits, src.device(), op, "m_splits");
  TORCH_CHECK(tiles.size() == 4, op, ": tiles must be [rowwise tile rows, rowwise tile cols, columnwise tile rows, "
              "columnwise tile cols], got ", tiles.size(), " values");
  check_fp8_options(op, fp8_dtype, eps);
  TORCH_CHECK(!(plus_zero && weights.has_value() && weights->defined()), op,
              ": plus_zero (reduce_rows' one-route read) takes no weights");
  TORCH_CHECK(!(plus_zero && packed_cols > 0), op, ": plus_zero reads 16-bit / fp32 rows, not packed ones");
  ExpandQuantizePrepared x;
  set_routes(x, route_of_row, K, src, op);
  x.src = src.contiguous();
  x.m_splits = m_splits.contiguous();
  x.weights = prepare_weights(weights, src, src.size(0), K, op);  // src's dtype (fp32 / 16-bit) or fp32 -> fp32
  x.e.weights = x.weights.defined() ? x.weights.data_ptr<float>() : nullptr;
  if (packed_cols > 0) {
    set_packed_layout(x.e.packed, packed_cols, fp8_dtype, mx);
    x.e.packed.src = x.src.data_ptr<uint8_t>();
  }
  x.e.plus_zero = plus_zero;
  x.rows = describe_copy(x, tiles[0], tiles[1], fp8_dtype, mx, eps, pow2, false);
  x.cols = describe_copy(x, tiles[2], tiles[3], fp8_dtype, mx, eps, pow2, true);
  return x;
}

constexpr const char* kExpandPack = "expand_quantize_pack";

// expand_quantize_pack: one rowwise problem (tiles 1 x 128 fp32 / 1 x 32 E8M0, no groups) writing packed rows.
struct ExpandPackPrepared {
  ExpandQuantizePrepared x;
  at::Tensor out;  // [m, stride] uint8
};

ExpandPackPrepared prepare_expand_pack(const at::Tensor& src, const c10::optional<at::Tensor>& route_of_row,
                                       int64_t K, at::ScalarType fp8_dtype, bool mx, double eps, bool pow2) {
  const char* op = kExpandPack;
  check_defined(src, op, "src");
  check_dim(src, 2, op, "src", "[n, H]");
  check_dtype(src, {at::kFloat, at::kBFloat16, at::kHalf}, op, "src");
  check_fp8_options(op, fp8_dtype, eps);
  ExpandPackPrepared y;
  ExpandQuantizePrepared& x = y.x;
  set_routes(x, route_of_row, K, src, op);
  x.src = src.contiguous();
  set_packed_layout(x.e.packed, src.size(1), fp8_dtype, mx);
  const int64_t m = x.route_of_row.defined() ? x.route_of_row.size(0) : src.size(0);
  y.out = at::empty({m, x.e.packed.stride}, src.options().dtype(at::kByte));
  x.e.packed.out = y.out.data_ptr<uint8_t>();
  x.rows = describe_copy(x, 1, mx ? 32 : 128, fp8_dtype, mx, eps, pow2, false);
  return y;
}

void check_routes_cpu(const char* op, const at::Tensor& route_of_row, int64_t sentinel) {
  if (!route_of_row.defined()) return;
  const at::Tensor bad = (route_of_row < 0) | (route_of_row > sentinel);
  if (bad.any().item<bool>()) {  // nothing written yet
    const int64_t pos = bad.nonzero()[0][0].item<int64_t>();
    TORCH_CHECK(false, op, ": route_of_row holds ", route_of_row[pos].item<int64_t>(), " at flat position ", pos,
                ", outside [0, ", sentinel, "] (", sentinel, " = n*K is the sentinel: a zero row)");
  }
}

void run_expand_quantize_cpu(const fp8::QuantizeProblem& p, const permute::ExpandRoutes& e) {
  const int64_t tile = (p.tile_rows ? p.tile_rows : p.rows) * fp8::col_tile_width(p);
  at::parallel_for(0, p.row_tiles * p.col_tiles, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, tile)),
                   [&](int64_t t0, int64_t t1) { permute::expand_quantize_tiles_host(p, e, t0, t1); });
  fp8::quantize_tail_cpu(p);
}

using QuantizedPair = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

#ifdef MOE_GRAPH_WITH_CUDA
at::Tensor run_cuda(const Prepared& x, const at::Device& device) {
  auto stream = at::cuda::getCurrentCUDAStream(device.index()).stream();
  C10_CUDA_CHECK(permute::route_op_cuda_launch(x.op, x.p, error_flag_ptr(device), stream));
  return x.out;
}
#endif

}  // namespace

at::Tensor expand_rows_cpu(const at::Tensor& src, const at::Tensor& route_of_row, int64_t K,
                           const c10::optional<at::Tensor>& weights) {
  return run_cpu(prepare_expand(src, route_of_row, K, weights), kExpand);
}

at::Tensor reduce_rows_cpu(const at::Tensor& src, const at::Tensor& route_rows,
                           const c10::optional<at::Tensor>& weights) {
  return run_cpu(prepare_reduce(src, route_rows, weights), kReduce);
}

at::Tensor route_dot_cpu(const at::Tensor& rows, const at::Tensor& src, const at::Tensor& route_rows) {
  return run_cpu(prepare_dot(rows, src, route_rows), kDot);
}

QuantizedPair expand_quantize_pair_cpu(const at::Tensor& src, const c10::optional<at::Tensor>& route_of_row,
                                       int64_t K,
                                       const at::Tensor& m_splits, at::IntArrayRef tiles, at::ScalarType fp8_dtype,
                                       bool mx, double eps, bool pow2,
                                       const c10::optional<at::Tensor>& weights, int64_t packed_cols,
                                       bool plus_zero) {
  ExpandQuantizePrepared x = prepare_expand_quantize(src, route_of_row, K, m_splits, tiles, fp8_dtype, mx, eps, pow2,
                                                     weights, packed_cols, plus_zero);
  check_routes_cpu(kExpandQuantize, x.route_of_row, x.e.tokens * x.e.topk);
  for (const fp8::QuantizeProblem* p : {&x.rows.p, &x.cols.p}) run_expand_quantize_cpu(*p, x.e);
  return {x.rows.q, x.rows.scale, x.cols.q, x.cols.scale};
}

at::Tensor expand_quantize_pack_cpu(const at::Tensor& src, const c10::optional<at::Tensor>& route_of_row, int64_t K,
                                    at::ScalarType fp8_dtype, bool mx, double eps, bool pow2) {
  ExpandPackPrepared y = prepare_expand_pack(src, route_of_row, K, fp8_dtype, mx, eps, pow2);
  check_routes_cpu(kExpandPack, y.x.route_of_row, y.x.e.tokens * y.x.e.topk);
  run_expand_quantize_cpu(y.x.rows.p, y.x.e);
  return y.out;
}

#ifdef MOE_GRAPH_WITH_CUDA
at::Tensor expand_rows_cuda(const at::Tensor& src, const at::Tensor& route_of_row, int64_t K,
                            const c10::optional<at::Tensor>& weights) {
  c10::cuda::CUDAGuard guard(src.device());
  return run_cuda(prepare_expand(src, route_of_row, K, weights), src.device());
}

at::Tensor reduce_rows_cuda(const at::Tensor& src, const at::Tensor& route_rows,
                            const c10::optional<at::Tensor>& weights) {
  c10::cuda::CUDAGuard guard(src.device());
  return run_cuda(prepare_reduce(src, route_rows, weights), src.device());
}

at::Tensor route_dot_cuda(const at::Tensor& rows, const at::Tensor& src, const at::Tensor& route_rows) {
  c10::cuda::CUDAGuard guard(rows.device());
  return run_cuda(prepare_dot(rows, src, route_rows), rows.device());
}

QuantizedPair expand_quantize_pair_cuda(const at::Tensor& src, const c10::optional<at::Tensor>& route_of_row,
                                        int64_t K,
                                        const at::Tensor& m_splits, at::IntArrayRef tiles, at::ScalarType fp8_dtype,
                                        bool mx, double eps, bool pow2,
                                        const c10::optional<at::Tensor>& weights, int64_t packed_cols,
                                        bool plus_zero) {
  c10::cuda::CUDAGuard guard(src.device());
  ExpandQuantizePrepared x = prepare_expand_quantize(src, route_of_row, K, m_splits, tiles, fp8_dtype, mx, eps, pow2,
                                                     weights, packed_cols, plus_zero);
  TORCH_CHECK(permute::expand_quantize_ok(x.rows.p, x.e) && permute::expand_quantize_ok(x.cols.p, x.e),
              kExpandQuantize, ": the CUDA kernel needs rows, columns, tile sizes, tile counts and n*K below 2^31, "
              "got ", x.rows.p.rows, " rows x ", x.rows.p.cols, " columns, n*K = ", x.e.tokens * x.e.topk);
  C10_CUDA_CHECK(permute::expand_quantize_cuda_launch(x.rows.p, &x.cols.p, x.e, error_flag_ptr(src.device()),
                                                      at::cuda::getCurrentCUDAStream(src.device().index()).stream()));
  return {x.rows.q, x.rows.scale, x.cols.q, x.cols.scale};
}

at::Tensor expand_quantize_pack_cuda(const at::Tensor& src, const c10::optional<at::Tensor>& route_of_row, int64_t K,
                                     at::ScalarType fp8_dtype, bool mx, double eps, bool pow2) {
  c10::cuda::CUDAGuard guard(src.device());
  ExpandPackPrepared y = prepare_expand_pack(src, route_of_row, K, fp8_dtype, mx, eps, pow2);
  TORCH_CHECK(permute::expand_quantize_ok(y.x.rows.p, y.x.e), kExpandPack, ": the CUDA kernel needs rows, columns, "
              "tile counts and n*K below 2^31, got ", y.x.rows.p.rows, " rows x ", y.x.rows.p.cols,
              " columns, n*K = ", y.x.e.tokens * y.x.e.topk);
  C10_CUDA_CHECK(permute::expand_quantize_cuda_launch(y.x.rows.p, nullptr, y.x.e, error_flag_ptr(src.device()),
                                                      at::cuda::getCurrentCUDAStream(src.device().index()).stream()));
  return y.out;
}
#endif

}  // namespace moe_graph
