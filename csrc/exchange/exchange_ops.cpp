// Torch glue of the fused exchange: argument checks that name the tensor, allocation, the host reference over all
// ranks (CPU) and one rank's CUDA launch on the current stream (symmetric buffers prepared by
// python/moe_graph/ops/nvlink.py).
#include "exchange/exchange_ops.h"

#include "common/error_flag_torch.h"
#include "common/torch_checks.h"
#include "exchange/exchange.h"

#ifdef MOE_GRAPH_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace moe_graph {
namespace {

namespace ex = exchange;

constexpr const char* kDispatch = "exchange_dispatch";
constexpr const char* kCombine = "exchange_combine";
constexpr const char* kGather = "exchange_gather";

ex::DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kDouble: return ex::DType::kDouble;
    case at::kBFloat16: return ex::DType::kBFloat16;
    case at::kHalf: return ex::DType::kHalf;
    default: return ex::DType::kFloat;
  }
}

// Bytes of one row of t [rows, *X].
int64_t row_bytes_of(const at::Tensor& t) {
  int64_t b = static_cast<int64_t>(t.element_size());
  for (int64_t i = 1; i < t.dim(); ++i) b *= t.size(i);
  return b;
}

std::vector<int64_t> with_rows(const at::Tensor& like, int64_t rows) {
  std::vector<int64_t> s(like.sizes().begin(), like.sizes().end());
  s[0] = rows;
  return s;
}

void check_rows(const at::Tensor& t, const char* op, const char* name) {
  check_defined(t, op, name);
  TORCH_CHECK(t.dim() >= 1, op, ": ", name, " must have a row dimension [rows, ...], got a 0-D tensor");
  check_contiguous(t, op, name);
}

void check_index(const at::Tensor& t, int64_t dim, const char* op, const char* name, const char* layout) {
  check_defined(t, op, name);
  check_dim(t, dim, op, name, layout);
  check_dtype(t, {at::kLong}, op, name);
  check_contiguous(t, op, name);
}

// align in [1, 2^20] and the padded rows far from overflow (as aligned_groups checks them).
void check_align(int64_t align, int64_t capacity, int64_t Lc, const char* op) {
  TORCH_CHECK(align >= 1 && align <= (int64_t(1) << 20), op, ": align must be in [1, 2^20], got ", align);
  TORCH_CHECK(capacity <= (int64_t(1) << 40) && Lc <= (int64_t(1) << 20), op, ": capacity (", capacity,
              ") or the local experts (", Lc, ") too large for the aligned layout");
}

}  // namespace

std::vector<int64_t> exchange_layout(int64_t num_ranks, int64_t num_local, int64_t capacity, int64_t row_bytes,
                                     int64_t align) {
  TORCH_CHECK(num_ranks >= 1 && num_local >= 1 && capacity >= 0 && row_bytes >= 0,
              "exchange_layout: expected num_ranks >= 1, num_local >= 1, capacity >= 0, row_bytes >= 0, got ",
              num_ranks, ", ", num_local, ", ", capacity, ", ", row_bytes);
  check_align(align, capacity, num_local, "exchange_layout");
  const int64_t P = ex::receive_rows(capacity, num_local, align);
  return {ex::Control::words(num_ranks, num_local), ex::receive_bytes(P, row_bytes),
          ex::receive_weights_offset(P, row_bytes), ex::kEpochWords, ex::kMaxChunks, P};
}

std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
           std::vector<at::Tensor>>
exchange_dispatch_reference(at::TensorList rows, at::TensorList route_of_slot, at::TensorList send_counts,
                            at::TensorList weights, int64_t topk, int64_t capacity, int64_t align) {
  const char* op = "exchange_dispatch_reference";
  const int64_t R = static_cast<int64_t>(rows.size());
  TORCH_CHECK(R >= 1, op, ": rows must list one tensor per rank, got none");
  TORCH_CHECK(static_cast<int64_t>(route_of_slot.size()) == R && static_cast<int64_t>(send_counts.size()) == R, op,
              ": rows, route_of_slot and send_counts must list one tensor per rank (", R, "), got ",
              route_of_slot.size(), " and ", send_counts.size());
  TORCH_CHECK(weights.empty() || static_cast<int64_t>(weights.size()) == R, op,
              ": weights must be empty or list one tensor per rank (", R, "), got ", weights.size());
  TORCH_CHECK(topk >= 1 && capacity >= 0, op, ": expected topk >= 1 and capacity >= 0, got ", topk, ", ", capacity);
  for (int64_t s = 0; s < R; ++s) check_rows(rows[s], op, "rows");
  const int64_t B = row_bytes_of(rows[0]);
  const int64_t Lc = send_counts[0].dim() == 2 ? send_counts[0].size(1) : 0;
  for (int64_t s = 0; s < R; ++s) {
    check_same_dtype(rows[s], rows[0], op, "rows", "rows[0]");
    TORCH_CHECK(rows[s].sizes().slice(1) == rows[0].sizes().slice(1), op,
                ": every rank's rows must have the row shape of rows[0], got ", shape_str(rows[s]));
    check_index(route_of_slot[s], 1, op, "route_of_slot", "[N]");
    check_index(send_counts[s], 2, op, "send_counts", "[R, Lc]");
    const std::vector<int64_t> sc{R, Lc};
    check_shape(send_counts[s], sc, op, "send_counts");
    if (!weights.empty()) {
      check_dtype(weights[s], {at::kFloat}, op, "weights");
      check_contiguous(weights[s], op, "weights");
      const std::vector<int64_t> ws{rows[s].size(0) * topk};
      check_shape(weights[s], ws, op, "weights");
    }
  }
  TORCH_CHECK(Lc >= 1, op, ": send_counts must have at least one local column");
  check_align(align, capacity, Lc, op);
  const int64_t P = ex::receive_rows(capacity, Lc, align);
  std::vector<at::Tensor> expert_in, m_splits, row_weights, route_row, counts;
  std::vector<ex::RankDispatch> ranks(R);
  const auto i64 = rows[0].options().dtype(at::kLong);
  for (int64_t s = 0; s < R; ++s) {
    expert_in.push_back(at::empty(with_rows(rows[0], P), rows[0].options()));
    m_splits.push_back(at::empty({Lc}, i64));
    counts.push_back(at::empty({Lc}, i64));
    row_weights.push_back(at::empty({P}, rows[0].options().dtype(at::kFloat)));
    route_row.push_back(at::empty({rows[s].size(0) * topk}, i64));
    ex::RankDispatch& r = ranks[s];
    r.rows = rows[s].data_ptr();
    r.tokens = rows[s].size(0);
    r.route_of_slot = route_of_slot[s].data_ptr<int64_t>();
    r.slots = route_of_slot[s].numel();
    r.send_counts = send_counts[s].data_ptr<int64_t>();
    r.weights = weights.empty() ? nullptr : weights[s].data_ptr<float>();
    r.expert_in = expert_in.back().data_ptr();
    r.m_splits = m_splits.back().data_ptr<int64_t>();
    r.counts = counts.back().data_ptr<int64_t>();
    r.row_weights = row_weights.back().data_ptr<float>();
    r.route_row = route_row.back().data_ptr<int64_t>();
    r.error_flag = error_flag_ptr(rows[s].device());
  }
  ex::dispatch_host(ranks.data(), R, Lc, topk, capacity, B, align);
  return {expert_in, m_splits, row_weights, route_row, counts};
}

namespace {

// Shared checks of the combine / gather references: one expert_out [capacity, *X] and route_row [T*K] per rank.
int64_t check_pull(at::TensorList expert_out, at::TensorList route_row, const char* op) {
  const int64_t R = static_cast<int64_t>(expert_out.size());
  TORCH_CHECK(R >= 1 && static_cast<int64_t>(route_row.size()) == R, op,
              ": expert_out and route_row must list one tensor per rank, got ", expert_out.size(), " and ",
              route_row.size());
  for (int64_t s = 0; s < R; ++s) {
    check_rows(expert_out[s], op, "expert_out");
    check_same_dtype(expert_out[s], expert_out[0], op, "expert_out", "expert_out[0]");
    TORCH_CHECK(expert_out[s].sizes() == expert_out[0].sizes(), op,
                ": every rank's expert_out must have the shape of expert_out[0], got ", shape_str(expert_out[s]));
    check_index(route_row[s], 1, op, "route_row", "[T*K]");
  }
  return R;
}

}  // namespace

std::vector<at::Tensor> exchange_combine_reference(at::TensorList expert_out, at::TensorList route_row,
                                                   at::TensorList weights, int64_t topk) {
  const char* op = "exchange_combine_reference";
  const int64_t R = check_pull(expert_out, route_row, op);
  check_dtype(expert_out[0], {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}, op, "expert_out");
  TORCH_CHECK(topk >= 1, op, ": topk must be >= 1, got ", topk);
  TORCH_CHECK(weights.empty() || static_cast<int64_t>(weights.size()) == R, op,
              ": weights must be empty or list one tensor per rank (", R, "), got ", weights.size());
  const at::ScalarType acc = expert_out[0].scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  std::vector<at::Tensor> out, w;
  std::vector<ex::RankCombine> ranks(R);
  const int64_t capacity = expert_out[0].size(0);
  for (int64_t s = 0; s < R; ++s) {
    TORCH_CHECK(route_row[s].numel() % topk == 0, op, ": route_row must hold T*K entries (K = ", topk, "), got ",
                route_row[s].numel());
    const int64_t T = route_row[s].numel() / topk;
    if (!weights.empty()) {
      const std::vector<int64_t> ws{T * topk};
      check_shape(weights[s], ws, op, "weights");
      w.push_back(weights[s].to(acc).contiguous());
    }
    out.push_back(at::empty(with_rows(expert_out[0], T), expert_out[0].options()));
    ex::RankCombine& r = ranks[s];
    r.expert_out = expert_out[s].data_ptr();
    r.route_row = route_row[s].data_ptr<int64_t>();
    r.weights = weights.empty() ? nullptr : w.back().data_ptr();
    r.tokens = T;
    r.out = out.back().data_ptr();
    r.error_flag = error_flag_ptr(expert_out[s].device());
  }
  const int64_t hidden = row_bytes_of(expert_out[0]) / static_cast<int64_t>(expert_out[0].element_size());
  ex::combine_host(ranks.data(), R, topk, capacity, hidden, dtype_of(expert_out[0]));
  return out;
}

std::vector<at::Tensor> exchange_gather_reference(at::TensorList expert_out, at::TensorList route_row) {
  const char* op = "exchange_gather_reference";
  const int64_t R = check_pull(expert_out, route_row, op);
  std::vector<at::Tensor> out;
  std::vector<ex::RankCombine> ranks(R);
  for (int64_t s = 0; s < R; ++s) {
    out.push_back(at::empty(with_rows(expert_out[0], route_row[s].numel()), expert_out[0].options()));
    ex::RankCombine& r = ranks[s];
    r.expert_out = expert_out[s].data_ptr();
    r.route_row = route_row[s].data_ptr<int64_t>();
    r.tokens = route_row[s].numel();
    r.out = out.back().data_ptr();
    r.error_flag = error_flag_ptr(expert_out[s].device());
  }
  ex::gather_host(ranks.data(), R, 1, expert_out[0].size(0), row_bytes_of(expert_out[0]));
  return out;
}

#ifdef MOE_GRAPH_WITH_CUDA
namespace {

// The symmetric state every CUDA exchange op takes: pointer arrays [R] int64 on the device, the local control
// buffer and the epoch words.
void check_symmetric(const at::Tensor& ptrs, const char* pname, const at::Tensor& ctrl, const at::Tensor& ctrl_ptrs,
                     const at::Tensor& epoch, int64_t R, int64_t Lc, int64_t rank, const at::Device& dev,
                     const char* op) {
  TORCH_CHECK(rank >= 0 && rank < R, op, ": rank must be in [0, ", R, "), got ", rank);
  for (auto [t, name] : {std::pair<const at::Tensor&, const char*>{ptrs, pname}, {ctrl_ptrs, "ctrl_ptrs"}}) {
    check_index(t, 1, op, name, "[R]");
    const std::vector<int64_t> s{R};
    check_shape(t, s, op, name);
    check_device(t, dev, op, name);
  }
  check_dtype(ctrl, {at::kLong}, op, "ctrl_buffer");
  check_contiguous(ctrl, op, "ctrl_buffer");
  check_device(ctrl, dev, op, "ctrl_buffer");
  TORCH_CHECK(ctrl.numel() >= ex::Control::words(R, Lc), op, ": ctrl_buffer must hold at least ",
              ex::Control::words(R, Lc), " int64 words (exchange_layout), got ", ctrl.numel());
  check_dtype(epoch, {at::kLong}, op, "epoch");
  const std::vector<int64_t> es{ex::kEpochWords};
  check_shape(epoch, es, op, "epoch");
  check_device(epoch, dev, op, "epoch");
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> exchange_dispatch_cuda(
    const at::Tensor& rows, const at::Tensor& route_of_slot, const at::Tensor& send_counts,
    const c10::optional<at::Tensor>& weights, int64_t topk, int64_t capacity, int64_t rank, at::Tensor& recv_buffer,
    const at::Tensor& recv_ptrs, at::Tensor& ctrl_buffer, const at::Tensor& ctrl_ptrs, at::Tensor& epoch,
    int64_t num_ctas, int64_t align) {
  const char* op = kDispatch;
  check_rows(rows, op, "rows");
  const at::Device dev = rows.device();
  check_index(route_of_slot, 1, op, "route_of_slot", "[N]");
  check_index(send_counts, 2, op, "send_counts", "[R, Lc]");
  check_device(route_of_slot, dev, op, "route_of_slot");
  check_device(send_counts, dev, op, "send_counts");
  const int64_t R = send_counts.size(0), Lc = send_counts.size(1), B = row_bytes_of(rows);
  TORCH_CHECK(R >= 1 && Lc >= 1, op, ": send_counts must be [R, Lc] with R, Lc >= 1, got ", shape_str(send_counts));
  TORCH_CHECK(R * Lc <= ex::kMaxChunks, op, ": R * Lc = ", R * Lc, " exceeds ", ex::kMaxChunks,
              " (the dispatch kernel's shared tables)");
  TORCH_CHECK(topk >= 1 && capacity >= 0, op, ": expected topk >= 1 and capacity >= 0, got ", topk, ", ", capacity);
  TORCH_CHECK(num_ctas >= 1 && num_ctas <= 1024, op, ": num_ctas must be in [1, 1024], got ", num_ctas);
  check_align(align, capacity, Lc, op);
  const int64_t P = ex::receive_rows(capacity, Lc, align);
  TORCH_CHECK(R * P < (int64_t(1) << 31), op, ": R * receive rows must be below 2^31, got ", R * P);
  check_symmetric(recv_ptrs, "recv_ptrs", ctrl_buffer, ctrl_ptrs, epoch, R, Lc, rank, dev, op);
  check_device(recv_buffer, dev, op, "recv_buffer");
  check_contiguous(recv_buffer, op, "recv_buffer");
  TORCH_CHECK(recv_buffer.nbytes() >= static_cast<size_t>(ex::receive_bytes(P, B)), op,
              ": recv_buffer must hold at least ", ex::receive_bytes(P, B), " bytes (exchange_layout), got ",
              recv_buffer.nbytes());
  at::Tensor w;
  if (weights.has_value() && weights->defined()) {
    w = *weights;
    check_dtype(w, {at::kFloat}, op, "weights");
    check_contiguous(w, op, "weights");
    check_device(w, dev, op, "weights");
    const std::vector<int64_t> ws{rows.size(0) * topk};
    check_shape(w, ws, op, "weights");
  }
  const c10::cuda::CUDAGuard guard(dev);
  at::Tensor m_splits = at::empty({Lc}, send_counts.options());
  at::Tensor counts = at::empty({Lc}, send_counts.options());
  at::Tensor route_row = at::empty({rows.size(0) * topk}, send_counts.options());
  ex::DispatchArgs a;
  a.R = R, a.rank = rank, a.Lc = Lc, a.topk = topk, a.tokens = rows.size(0), a.slots = route_of_slot.numel();
  a.capacity = capacity, a.row_bytes = B, a.align = align;
  a.rows = rows.data_ptr();
  a.route_of_slot = route_of_slot.data_ptr<int64_t>();
  a.send_counts = send_counts.data_ptr<int64_t>();
  a.weights = w.defined() ? w.data_ptr<float>() : nullptr;
  a.recv_ptrs = recv_ptrs.data_ptr<int64_t>();
  a.ctrl_ptrs = ctrl_ptrs.data_ptr<int64_t>();
  a.recv_local = recv_buffer.data_ptr();
  a.ctrl_local = reinterpret_cast<uint64_t*>(ctrl_buffer.data_ptr<int64_t>());
  a.m_splits = m_splits.data_ptr<int64_t>();
  a.counts = counts.data_ptr<int64_t>();
  a.route_row = route_row.data_ptr<int64_t>();
  a.epoch = reinterpret_cast<uint64_t*>(epoch.data_ptr<int64_t>());
  a.error_flag = error_flag_ptr(dev);
  ex::dispatch_cuda(a, static_cast<int>(num_ctas), at::cuda::getCurrentCUDAStream(dev.index()).stream());
  return {m_splits, route_row, counts};
}

namespace {

at::Tensor pull_cuda(const at::Tensor& expert_out, const at::Tensor& src_ptrs, at::Tensor& ctrl_buffer,
                     const at::Tensor& ctrl_ptrs, at::Tensor& epoch, const at::Tensor& route_row,
                     const c10::optional<at::Tensor>& weights, int64_t topk, int64_t rank, int64_t num_ctas,
                     bool combine) {
  const char* op = combine ? kCombine : kGather;
  check_rows(expert_out, op, "expert_out");
  const at::Device dev = expert_out.device();
  if (combine) check_dtype(expert_out, {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}, op, "expert_out");
  check_index(route_row, 1, op, "route_row", "[T*K]");
  check_device(route_row, dev, op, "route_row");
  TORCH_CHECK(topk >= 1 && route_row.numel() % topk == 0, op, ": route_row must hold T*K entries (K = ", topk,
              "), got ", route_row.numel());
  TORCH_CHECK(num_ctas >= 1 && num_ctas <= 1024, op, ": num_ctas must be in [1, 1024], got ", num_ctas);
  const int64_t R = src_ptrs.dim() == 1 ? src_ptrs.size(0) : 0;
  check_symmetric(src_ptrs, "src_ptrs", ctrl_buffer, ctrl_ptrs, epoch, R, 1, rank, dev, op);
  const int64_t T = route_row.numel() / topk, capacity = expert_out.size(0);
  TORCH_CHECK(R * capacity < (int64_t(1) << 31), op, ": R * capacity must be below 2^31, got ", R * capacity);
  at::Tensor w;
  if (combine && weights.has_value() && weights->defined()) {
    const std::vector<int64_t> ws{T * topk};
    check_shape(*weights, ws, op, "weights");
    check_device(*weights, dev, op, "weights");
    w = weights->to(expert_out.scalar_type() == at::kDouble ? at::kDouble : at::kFloat).contiguous();
  }
  const c10::cuda::CUDAGuard guard(dev);
  at::Tensor out = at::empty(with_rows(expert_out, combine ? T : T * topk), expert_out.options());
  ex::CombineArgs a;
  a.R = R, a.rank = rank, a.topk = topk, a.tokens = T, a.capacity = capacity;
  a.row_bytes = row_bytes_of(expert_out);
  a.hidden = a.row_bytes / static_cast<int64_t>(expert_out.element_size());
  a.dtype = dtype_of(expert_out);
  a.src_ptrs = src_ptrs.data_ptr<int64_t>();
  a.ctrl_ptrs = ctrl_ptrs.data_ptr<int64_t>();
  a.src_local = expert_out.data_ptr();
  a.ctrl_local = reinterpret_cast<uint64_t*>(ctrl_buffer.data_ptr<int64_t>());
  a.route_row = route_row.data_ptr<int64_t>();
  a.weights = w.defined() ? w.data_ptr() : nullptr;
  a.out = out.data_ptr();
  a.epoch = reinterpret_cast<uint64_t*>(epoch.data_ptr<int64_t>());
  a.error_flag = error_flag_ptr(dev);
  auto stream = at::cuda::getCurrentCUDAStream(dev.index()).stream();
  if (combine) ex::combine_cuda(a, static_cast<int>(num_ctas), stream);
  else ex::gather_cuda(a, static_cast<int>(num_ctas), stream);
  return out;
}

}  // namespace

at::Tensor exchange_combine_cuda(const at::Tensor& expert_out, const at::Tensor& src_ptrs, at::Tensor& ctrl_buffer,
                                 const at::Tensor& ctrl_ptrs, at::Tensor& epoch, const at::Tensor& route_row,
                                 const c10::optional<at::Tensor>& weights, int64_t topk, int64_t rank,
                                 int64_t num_ctas) {
  return pull_cuda(expert_out, src_ptrs, ctrl_buffer, ctrl_ptrs, epoch, route_row, weights, topk, rank, num_ctas,
                   true);
}

at::Tensor exchange_gather_cuda(const at::Tensor& expert_out, const at::Tensor& src_ptrs, at::Tensor& ctrl_buffer,
                                const at::Tensor& ctrl_ptrs, at::Tensor& epoch, const at::Tensor& route_row,
                                int64_t rank, int64_t num_ctas) {
  return pull_cuda(expert_out, src_ptrs, ctrl_buffer, ctrl_ptrs, epoch, route_row, c10::nullopt, 1, rank, num_ctas,
                   false);
}
#endif

}  // namespace moe_graph
