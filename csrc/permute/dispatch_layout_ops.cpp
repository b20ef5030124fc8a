// Torch glue of dispatch_layout / receive_layout / aligned_groups: argument checks that name the argument,
// allocation, current stream.
#include "permute/dispatch_layout_ops.h"

#include <c10/core/DeviceGuard.h>

#include <algorithm>
#include <limits>

#include "common/error_flag_torch.h"
#include "common/torch_checks.h"
#include "permute/dispatch_layout.h"
#include "permute/dispatch_layout_impl.h"

#ifdef MOE_GRAPH_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace moe_graph {

using Outputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using ReceiveOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

namespace {

constexpr const char* kOp = "dispatch_layout";
constexpr const char* kRecv = "receive_layout";
constexpr const char* kAlign = "aligned_groups";


struct Prepared {
  at::Tensor indices, valid, column_rank, column_local, route_order, dest_quota;
  at::Tensor counters[3];
  int64_t T, K, C, R, Lc, cap, align;
};

// align in [1, 2^20], and the aligned rows of `rows` rows in G groups within int64 (/ 4: the sentinels' room).
void check_align(int64_t align, int64_t rows, int64_t G, const char* op) {
  TORCH_CHECK(align >= 1 && align <= (int64_t(1) << 20), op, ": align must be in [1, 2^20], got ", align);
  TORCH_CHECK(rows <= std::numeric_limits<int64_t>::max() / 4 &&
                  G <= (std::numeric_limits<int64_t>::max() / 4 - rows) / align,
              op, ": the padded rows overflow int64");
}

// A statistics counter the op adds to in place: one element of `dtype` on the device of the indices.
at::Tensor check_counter(const c10::optional<at::Tensor>& t, at::ScalarType dtype, const at::Device& dev,
                         const char* name) {
  if (!t.has_value() || !t->defined()) return at::Tensor();
  TORCH_CHECK(t->numel() == 1, kOp, ": ", name, " must hold one element, got shape ", shape_str(*t));
  check_dtype(*t, {dtype}, kOp, name);
  check_device(*t, dev, kOp, name);
  check_writable(*t, kOp, name);
  return *t;
}

Prepared check_and_prepare(const at::Tensor& indices, const c10::optional<at::Tensor>& valid,
                           const at::Tensor& column_rank, const at::Tensor& column_local,
                           const c10::optional<at::Tensor>& route_order, int64_t R, int64_t Lc, int64_t cap,
                           const c10::optional<at::Tensor>& dropped_routes,
                           const c10::optional<at::Tensor>& step_dropped_routes,
                           const c10::optional<at::Tensor>& step_max_load_ratio,
                           const c10::optional<at::Tensor>& dest_quota, int64_t align) {
  check_defined(indices, kOp, "indices");
  check_dim(indices, 2, kOp, "indices", "[T, K]");
  check_dtype(indices, {at::kLong, at::kInt}, kOp, "indices");
  const auto dev = indices.device();
  const int64_t T = indices.size(0), K = indices.size(1), n = T * K;
  TORCH_CHECK(n < std::numeric_limits<int32_t>::max(), kOp, ": indices has too many routes (", n, " >= 2**31 - 1)");
  TORCH_CHECK(R >= 1, kOp, ": num_ep_ranks must be >= 1, got ", R);
  TORCH_CHECK(Lc >= 1, kOp, ": num_local_columns must be >= 1, got ", Lc);
  TORCH_CHECK(R * Lc < std::numeric_limits<int32_t>::max(), kOp, ": num_ep_ranks * num_local_columns is too large (",
              R * Lc, ")");
  TORCH_CHECK(cap >= 1, kOp, ": capacity must be >= 1, got ", cap);
  TORCH_CHECK(cap <= std::numeric_limits<int64_t>::max() / R, kOp, ": capacity * num_ep_ranks overflows int64");
  if (align != 1) {  // the aligned send buffer is the expert input: one rank, padded blocks
    check_align(align, cap, Lc, kOp);
    TORCH_CHECK(R == 1, kOp, ": align > 1 needs num_ep_ranks == 1 (the send buffer is the expert input; at R > 1 "
                "receive_layout aligns it), got align=", align, " and num_ep_ranks=", R);
    TORCH_CHECK(!(dest_quota.has_value() && dest_quota->defined()), kOp,
                ": align > 1 needs dest_quota None (quota mode packs the send slots), got align=", align);
    TORCH_CHECK((align - 1) * Lc < std::numeric_limits<int32_t>::max() - n, kOp, ": align=", align,
                " with num_local_columns=", Lc, " and T*K=", n, " routes is too large (2**31 - 1 aligned rows)");
  }
  check_defined(column_rank, kOp, "column_rank");
  check_defined(column_local, kOp, "column_local");
  check_dim(column_rank, 1, kOp, "column_rank", "[C]");
  check_dtype(column_rank, {at::kLong}, kOp, "column_rank");
  check_dtype(column_local, {at::kLong}, kOp, "column_local");
  check_shape(column_local, column_rank.sizes(), kOp, "column_local");
  check_device(column_rank, dev, kOp, "column_rank");
  check_device(column_local, dev, kOp, "column_local");
  Prepared p;
  if (valid.has_value() && valid->defined()) {
    check_shape(*valid, indices.sizes(), kOp, "valid");
    check_dtype(*valid, {at::kBool}, kOp, "valid");
    check_device(*valid, dev, kOp, "valid");
    p.valid = valid->contiguous();
  }
  if (route_order.has_value() && route_order->defined()) {
    check_shape(*route_order, {n}, kOp, "route_order");
    check_dtype(*route_order, {at::kLong}, kOp, "route_order");
    check_device(*route_order, dev, kOp, "route_order");
    p.route_order = route_order->contiguous();
  }
  if (dest_quota.has_value() && dest_quota->defined()) {
    check_shape(*dest_quota, {R}, kOp, "dest_quota");
    check_dtype(*dest_quota, {at::kLong}, kOp, "dest_quota");
    check_device(*dest_quota, dev, kOp, "dest_quota");
    p.dest_quota = dest_quota->contiguous();
  }
  p.counters[0] = check_counter(dropped_routes, at::kLong, dev, "dropped_routes");
  p.counters[1] = check_counter(step_dropped_routes, at::kLong, dev, "step_dropped_routes");
  p.counters[2] = check_counter(step_max_load_ratio, at::kDouble, dev, "step_max_load_ratio");
  p.indices = indices.to(at::kLong).contiguous();
  p.column_rank = column_rank.contiguous();
  p.column_local = column_local.contiguous();
  p.T = T;
  p.K = K;
  p.C = column_rank.size(0);
  p.R = R;
  p.Lc = Lc;
  p.cap = cap;
  p.align = align;
  return p;
}

template <typename V>
V* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<V>() : nullptr;
}

dispatch::LayoutProblem make_problem(const Prepared& in, Outputs& out) {
  const auto opt = in.indices.options().dtype(at::kLong);
  const int64_t n = in.T * in.K;
  // packed slots in quota mode, else one block of the aligned rows of `capacity` per destination
  const int64_t N = in.dest_quota.defined() ? n : in.R * dispatch::aligned_padded_rows(in.cap, in.Lc, in.align);
  out = Outputs{at::empty({n}, opt), at::empty({N}, opt), at::empty({in.R, in.Lc}, opt),
                at::empty({in.C}, opt), at::empty({}, opt), at::empty({in.R, in.Lc}, opt)};
  dispatch::LayoutProblem p;
  p.num_routes = n;
  p.num_columns = in.C;
  p.num_ranks = in.R;
  p.num_local = in.Lc;
  p.capacity = in.cap;
  p.align = in.align;
  p.indices = in.indices.data_ptr<int64_t>();
  p.valid = ptr_or_null<bool>(in.valid);
  p.column_rank = in.column_rank.data_ptr<int64_t>();
  p.column_local = in.column_local.data_ptr<int64_t>();
  p.route_order = ptr_or_null<int64_t>(in.route_order);
  p.dest_quota = ptr_or_null<int64_t>(in.dest_quota);
  p.route_slot = std::get<0>(out).data_ptr<int64_t>();
  p.route_of_slot = std::get<1>(out).data_ptr<int64_t>();
  p.send_counts = std::get<2>(out).data_ptr<int64_t>();
  p.column_counts = std::get<3>(out).data_ptr<int64_t>();
  p.dropped = std::get<4>(out).data_ptr<int64_t>();
  p.aligned_counts = std::get<5>(out).data_ptr<int64_t>();
  p.dropped_routes = ptr_or_null<int64_t>(in.counters[0]);
  p.step_dropped_routes = ptr_or_null<int64_t>(in.counters[1]);
  p.step_max_load_ratio = ptr_or_null<double>(in.counters[2]);
  return p;
}

void raise_layout_error(const dispatch::LayoutError& e, const Prepared& in) {
  using E = dispatch::LayoutError;
  switch (e.kind) {
    case E::kNone: return;
    case E::kIndex:
      TORCH_CHECK(false, kOp, ": indices must be in [0, ", in.C, ") (the routing columns) for valid routes; "
                  "indices[", e.where / in.K, ", ", e.where % in.K, "] = ", e.value);
    case E::kColumnRank:
      TORCH_CHECK(false, kOp, ": column_rank values must be in [0, num_ep_ranks=", in.R, "); column_rank[", e.where,
                  "] = ", e.value);
    case E::kColumnLocal:
      TORCH_CHECK(false, kOp, ": column_local values must be in [0, num_local_columns=", in.Lc, "); column_local[",
                  e.where, "] = ", e.value);
    case E::kOrderRange:
      TORCH_CHECK(false, kOp, ": route_order must be a permutation of [0, T*K=", in.T * in.K, "); route_order[",
                  e.where, "] = ", e.value);
    case E::kOrderRepeat:
      TORCH_CHECK(false, kOp, ": route_order must be a permutation of [0, T*K=", in.T * in.K, "); route ", e.value,
                  " appears again at route_order[", e.where, "]");
    default:
      TORCH_CHECK(false, kOp, ": internal error ", static_cast<int>(e.kind));
  }
}

at::Tensor check_recv_counts(const at::Tensor& recv_counts, int64_t cap, int64_t align) {
  check_defined(recv_counts, kRecv, "recv_counts");
  check_dim(recv_counts, 2, kRecv, "recv_counts", "[R, num_local_columns]");
  check_dtype(recv_counts, {at::kLong}, kRecv, "recv_counts");
  TORCH_CHECK(recv_counts.size(0) >= 1 && recv_counts.size(1) >= 1, kRecv,
              ": recv_counts must have at least one rank and one local column, got shape ", shape_str(recv_counts));
  TORCH_CHECK(cap >= 1, kRecv, ": capacity must be >= 1, got ", cap);
  TORCH_CHECK(cap <= std::numeric_limits<int64_t>::max() / recv_counts.size(0), kRecv,
              ": capacity * R overflows int64");
  if (align != 1) check_align(align, recv_counts.size(0) * cap, recv_counts.size(1), kRecv);
  return recv_counts.contiguous();
}

dispatch::ReceiveProblem make_receive(const at::Tensor& c, int64_t cap, int64_t align, ReceiveOutputs& out) {
  const int64_t R = c.size(0), Lc = c.size(1), P = dispatch::aligned_padded_rows(R * cap, Lc, align);
  out = {at::empty({P}, c.options()), at::empty({R * cap}, c.options()), at::empty({Lc}, c.options()),
         at::empty({Lc}, c.options())};
  dispatch::ReceiveProblem p;
  p.num_ranks = R;
  p.num_local = Lc;
  p.capacity = cap;
  p.recv_counts = c.data_ptr<int64_t>();
  p.expert_row_source = std::get<0>(out).data_ptr<int64_t>();
  p.recv_row_target = std::get<1>(out).data_ptr<int64_t>();
  p.m_splits = std::get<2>(out).data_ptr<int64_t>();
  p.align = align;
  p.aligned_m_splits = std::get<3>(out).data_ptr<int64_t>();
  return p;
}

}  // namespace

// One entry for both devices: checks, allocation, then the host loops or the kernels on the current stream.
Outputs dispatch_layout(const at::Tensor& indices, const c10::optional<at::Tensor>& valid,
                            const at::Tensor& column_rank, const at::Tensor& column_local,
                            const c10::optional<at::Tensor>& route_order, int64_t num_ep_ranks,
                            int64_t num_local_columns, int64_t capacity,
                            const c10::optional<at::Tensor>& dropped_routes,
                            const c10::optional<at::Tensor>& step_dropped_routes,
                            const c10::optional<at::Tensor>& step_max_load_ratio,
                            const c10::optional<at::Tensor>& dest_quota, int64_t align) {
  const at::OptionalDeviceGuard guard(at::device_of(indices));
  Prepared in = check_and_prepare(indices, valid, column_rank, column_local, route_order, num_ep_ranks,
                                  num_local_columns, capacity, dropped_routes, step_dropped_routes,
                                  step_max_load_ratio, dest_quota, align);
  Outputs out;
  dispatch::LayoutProblem p = make_problem(in, out);
  if (indices.device().is_cpu()) {
    raise_layout_error(dispatch::dispatch_layout_host(p), in);
    return out;
  }
#ifdef MOE_GRAPH_WITH_CUDA
  at::Tensor ws = at::empty({dispatch::dispatch_layout_workspace_elems(p.num_routes, in.R, in.Lc)},
                            in.indices.options().dtype(at::kInt));
  auto stream = at::cuda::getCurrentCUDAStream(indices.device().index()).stream();
  C10_CUDA_CHECK(dispatch::dispatch_layout_cuda_launch(p, ws.data_ptr<int32_t>(), error_flag_ptr(indices.device()),
                                                       stream));
#endif
  return out;
}

ReceiveOutputs receive_layout(const at::Tensor& recv_counts, int64_t capacity, int64_t align) {
  const at::OptionalDeviceGuard guard(at::device_of(recv_counts));
  at::Tensor c = check_recv_counts(recv_counts, capacity, align);
  ReceiveOutputs out;
  dispatch::ReceiveProblem p = make_receive(c, capacity, align, out);
  if (c.device().is_cpu()) {
    const dispatch::LayoutError e = dispatch::receive_layout_host(p);
    const int64_t Lc = c.size(1);
    TORCH_CHECK(e.kind != dispatch::LayoutError::kNegativeCount, kRecv, ": recv_counts must be >= 0; recv_counts[",
                e.where / Lc, ", ", e.where % Lc, "] = ", e.value);
    TORCH_CHECK(e.kind != dispatch::LayoutError::kCountOverflow, kRecv, ": each row of recv_counts must sum to at "
                "most capacity=", capacity, "; recv_counts[", e.where / Lc, ", ", e.where % Lc, "] = ", e.value,
                " goes past it");
    return out;
  }
#ifdef MOE_GRAPH_WITH_CUDA
  at::Tensor ws = at::empty({dispatch::receive_layout_workspace_elems(p.num_ranks, p.num_local)}, c.options());
  auto stream = at::cuda::getCurrentCUDAStream(c.device().index()).stream();
  C10_CUDA_CHECK(dispatch::receive_layout_cuda_launch(p, ws.data_ptr<int64_t>(), error_flag_ptr(c.device()), stream));
#endif
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> aligned_groups(const at::Tensor& m_splits, int64_t rows, int64_t align) {
  const at::OptionalDeviceGuard guard(at::device_of(m_splits));
  check_defined(m_splits, kAlign, "m_splits");
  check_dim(m_splits, 1, kAlign, "m_splits", "[G]");
  check_dtype(m_splits, {at::kLong}, kAlign, "m_splits");
  TORCH_CHECK(rows >= 0, kAlign, ": rows must be >= 0, got ", rows);
  const at::Tensor m = m_splits.contiguous();
  const int64_t G = m.size(0);
  check_align(align, rows, G, kAlign);
  dispatch::AlignProblem p;
  p.num_groups = G;
  p.rows = rows;
  p.align = align;
  const int64_t P = dispatch::aligned_padded_rows(rows, G, align);
  std::tuple<at::Tensor, at::Tensor, at::Tensor> out{at::empty({G}, m.options()), at::empty({P}, m.options()),
                                                     at::empty({rows}, m.options())};
  p.m_splits = m.data_ptr<int64_t>();
  p.padded_m_splits = std::get<0>(out).data_ptr<int64_t>();
  p.source_of_padded = std::get<1>(out).data_ptr<int64_t>();
  p.padded_of_source = std::get<2>(out).data_ptr<int64_t>();
  if (m.device().is_cpu()) {
    dispatch::aligned_groups_host(p);
    return out;
  }
#ifdef MOE_GRAPH_WITH_CUDA
  at::Tensor ws = at::empty({std::max<int64_t>(1, dispatch::aligned_groups_workspace_elems(G))}, m.options());
  auto stream = at::cuda::getCurrentCUDAStream(m.device().index()).stream();
  C10_CUDA_CHECK(dispatch::aligned_groups_cuda_launch(p, ws.data_ptr<int64_t>(), stream));
#endif
  return out;
}

}  // namespace moe_graph
