// Torch glue of reroute_tokens and reroute_indices: argument checks that name the tensor, allocation, current stream.
#include "reroute/reroute_ops.h"

#include <ATen/Parallel.h>

#include <limits>

#include "common/error_flag.h"
#include "common/error_flag_torch.h"
#include "common/torch_checks.h"
#include "reroute/echo_plan.h"
#include "reroute/reroute.h"

#ifdef MOE_GRAPH_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace moe_graph {
namespace {

constexpr const char* kOp = "reroute_tokens";

struct Prepared {
  at::Tensor routing_map, probs, tokens_to_spare, offload_map;
  int64_t T, E, S;
};

Prepared check_and_prepare(const at::Tensor& routing_map, const at::Tensor& probs, const at::Tensor& tokens_to_spare,
                           const at::Tensor& offload_map) {
  check_defined(routing_map, kOp, "routing_map");
  check_defined(probs, kOp, "probs");
  check_defined(tokens_to_spare, kOp, "tokens_to_spare");
  check_defined(offload_map, kOp, "offload_map");
  check_dim(routing_map, 2, kOp, "routing_map", "[T, E]");
  check_dtype(routing_map, {at::kBool}, kOp, "routing_map");
  check_dim(probs, 2, kOp, "probs", "[T, E]");
  check_shape(probs, routing_map.sizes(), kOp, "probs");
  check_dtype(probs, {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble}, kOp, "probs");
  check_dim(offload_map, 2, kOp, "offload_map", "[E, S]");
  check_dtype(offload_map, {at::kBool}, kOp, "offload_map");
  const int64_t T = routing_map.size(0), E = routing_map.size(1), S = offload_map.size(1);
  TORCH_CHECK(offload_map.size(0) == E, kOp, ": offload_map must have shape [E, S] with E = ", E,
              " (the columns of routing_map), got shape ", shape_str(offload_map));
  check_dim(tokens_to_spare, 1, kOp, "tokens_to_spare", "[S]");
  check_dtype(tokens_to_spare, {at::kLong, at::kInt}, kOp, "tokens_to_spare");
  TORCH_CHECK(tokens_to_spare.size(0) == S, kOp, ": tokens_to_spare must have shape [S] with S = ", S,
              " (the columns of offload_map), got shape ", shape_str(tokens_to_spare));
  const auto dev = routing_map.device();
  check_device(probs, dev, kOp, "probs");
  check_device(tokens_to_spare, dev, kOp, "tokens_to_spare");
  check_device(offload_map, dev, kOp, "offload_map");
  TORCH_CHECK(T < std::numeric_limits<int32_t>::max(), kOp, ": routing_map has too many tokens (", T, ")");
  return Prepared{routing_map.contiguous(), probs.contiguous(), tokens_to_spare.to(at::kLong).contiguous(),
                  offload_map.contiguous(), T, E, S};
}

reroute::RerouteProblem make_problem(const Prepared& in, at::Tensor& out_map, at::Tensor& out_probs) {
  reroute::RerouteProblem p;
  p.num_tokens = in.T;
  p.num_experts = in.E;
  p.num_slots = in.S;
  p.routing_map = in.routing_map.data_ptr<bool>();
  p.probs = in.probs.data_ptr();
  p.prob_bytes = static_cast<int>(in.probs.element_size());
  p.tokens_to_spare = in.tokens_to_spare.data_ptr<int64_t>();
  p.offload_map = in.offload_map.data_ptr();
  p.offload_bytes = 1;
  p.out_map = out_map.data_ptr<bool>();
  p.out_probs = out_probs.data_ptr();
  return p;
}

constexpr const char* kBestFit = "echo_best_fit";

at::Tensor check_counts(const at::Tensor& counts, int64_t k) {
  check_defined(counts, kBestFit, "counts");
  check_dim(counts, 2, kBestFit, "counts", "[R, E]");
  check_dtype(counts, {at::kLong, at::kInt}, kBestFit, "counts");
  const int64_t R = counts.size(0), E = counts.size(1);
  TORCH_CHECK(R >= 1 && E % R == 0, kBestFit, ": counts must have shape [R, E] with E divisible by R, got shape ",
              shape_str(counts));
  TORCH_CHECK(k >= 1, kBestFit, ": num_spare_experts_per_ep_rank must be >= 1, got ", k);
  return counts.to(at::kLong).contiguous();
}

// Optional donor mask [R, R] bool on the counts' device (allowed[r, q]: a slot on rank r may host rank q's experts);
// returns a contiguous bool tensor or an undefined one (unconstrained).
at::Tensor check_donor_mask(const c10::optional<at::Tensor>& donor_mask, const at::Tensor& counts, const char* op) {
  if (!donor_mask.has_value() || !donor_mask->defined()) return at::Tensor();
  const at::Tensor& m = *donor_mask;
  const int64_t R = counts.size(0);
  TORCH_CHECK(m.dim() == 2 && m.size(0) == R && m.size(1) == R, op, ": donor_mask must have shape [R, R] = [", R, ", ",
              R, "], got ", shape_str(m));
  TORCH_CHECK(m.scalar_type() == at::kBool, op, ": donor_mask must be a bool tensor, got ", m.scalar_type());
  TORCH_CHECK(m.device() == counts.device(), op, ": donor_mask must be on the device of counts (", counts.device(),
              "), got ", m.device());
  return m.contiguous();
}

const bool* mask_ptr(const at::Tensor& m) { return m.defined() ? m.data_ptr<bool>() : nullptr; }

}  // namespace

namespace {
constexpr const char* kPlan = "echo_plan";

echo_plan::PlanArgs plan_args(const at::Tensor& c, int64_t k, int64_t mode, const at::Tensor& mask, at::Tensor& h,
                              at::Tensor& alloc, at::Tensor& ws) {
  TORCH_CHECK(mode >= 0 && mode <= 2, kPlan, ": mode must be 0 (auto), 1 (greedy) or 2 (best_fit), got ", mode);
  const int64_t R = c.size(0), E = c.size(1);
  h = at::empty({E, R * k}, c.options());
  alloc = at::zeros({R, R * k}, c.options());  // stays zero when there is nothing to plan (E == 0)
  ws = at::empty({echo_plan::plan_workspace_elems(R, E, k)}, c.options());
  echo_plan::PlanArgs a;
  a.counts = c.data_ptr<int64_t>();
  a.R = R;
  a.E = E;
  a.k = k;
  a.mode = static_cast<int>(mode);
  a.allowed = mask_ptr(mask);
  a.home_to_spare = h.data_ptr<int64_t>();
  a.allocation = alloc.data_ptr<int64_t>();
  a.ws = ws.data_ptr<int64_t>();
  return a;
}
}  // namespace

std::tuple<at::Tensor, at::Tensor> echo_plan_cpu(const at::Tensor& counts, int64_t k, int64_t mode,
                                                 const c10::optional<at::Tensor>& donor_mask) {
  at::Tensor c = check_counts(counts, k), h, alloc, ws;
  at::Tensor m = check_donor_mask(donor_mask, counts, kPlan);
  echo_plan::PlanArgs a = plan_args(c, k, mode, m, h, alloc, ws);
  echo_plan::plan_host(a);
  return {h, alloc};
}

#ifdef MOE_GRAPH_WITH_CUDA
std::tuple<at::Tensor, at::Tensor> echo_plan_cuda(const at::Tensor& counts, int64_t k, int64_t mode,
                                                  const c10::optional<at::Tensor>& donor_mask) {
  c10::cuda::CUDAGuard guard(counts.device());
  at::Tensor c = check_counts(counts, k), h, alloc, ws;
  at::Tensor m = check_donor_mask(donor_mask, counts, kPlan);
  echo_plan::PlanArgs a = plan_args(c, k, mode, m, h, alloc, ws);
  auto stream = at::cuda::getCurrentCUDAStream(counts.device().index()).stream();
  C10_CUDA_CHECK(echo_plan::plan_cuda_launch(a, stream));
  return {h, alloc};
}
#endif

// The best-fit assignment is the plan's home_to_spare in best-fit mode (one algorithm, one implementation).
at::Tensor echo_best_fit_cpu(const at::Tensor& counts, int64_t k, const c10::optional<at::Tensor>& donor_mask) {
  return std::get<0>(echo_plan_cpu(counts, k, echo_plan::kPlanBestFit, donor_mask));
}

#ifdef MOE_GRAPH_WITH_CUDA
at::Tensor echo_best_fit_cuda(const at::Tensor& counts, int64_t k, const c10::optional<at::Tensor>& donor_mask) {
  return std::get<0>(echo_plan_cuda(counts, k, echo_plan::kPlanBestFit, donor_mask));
}
#endif

std::tuple<at::Tensor, at::Tensor> reroute_tokens_cpu(const at::Tensor& routing_map, const at::Tensor& probs,
                                                      const at::Tensor& tokens_to_spare,
                                                      const at::Tensor& offload_map) {
  Prepared in = check_and_prepare(routing_map, probs, tokens_to_spare, offload_map);
  at::Tensor out_map = at::empty({in.T, in.E + in.S}, in.routing_map.options());
  at::Tensor out_probs = at::empty({in.T, in.E + in.S}, in.probs.options());
  reroute::RerouteProblem p = make_problem(in, out_map, out_probs);
  p.error_flag = error_flag_ptr(routing_map.device());
  reroute::reroute_tokens_host(p, [](int64_t n, const std::function<void(int64_t, int64_t)>& body) {
    at::parallel_for(0, n, 1, body);
  });
  return {out_map, out_probs};
}

namespace {
constexpr const char* kIdx = "reroute_indices";

struct PreparedIndices {
  at::Tensor indices, valid, tokens_to_spare, offload_map;
  int64_t T, K, E, S;
};

PreparedIndices check_and_prepare_indices(const at::Tensor& indices, const at::Tensor& tokens_to_spare,
                                          const at::Tensor& offload_map, const c10::optional<at::Tensor>& valid) {
  check_defined(indices, kIdx, "indices");
  check_defined(tokens_to_spare, kIdx, "tokens_to_spare");
  check_defined(offload_map, kIdx, "offload_map");
  check_dim(indices, 2, kIdx, "indices", "[T, K]");
  check_dtype(indices, {at::kLong}, kIdx, "indices");
  check_dim(offload_map, 2, kIdx, "offload_map", "[E, S]");
  check_dtype(offload_map, {at::kBool, at::kInt, at::kLong}, kIdx, "offload_map");
  const int64_t T = indices.size(0), K = indices.size(1), E = offload_map.size(0), S = offload_map.size(1);
  check_dim(tokens_to_spare, 1, kIdx, "tokens_to_spare", "[S]");
  check_dtype(tokens_to_spare, {at::kLong, at::kInt}, kIdx, "tokens_to_spare");
  TORCH_CHECK(tokens_to_spare.size(0) == S, kIdx, ": tokens_to_spare must have shape [S] with S = ", S,
              " (the columns of offload_map), got shape ", shape_str(tokens_to_spare));
  const auto dev = indices.device();
  check_device(tokens_to_spare, dev, kIdx, "tokens_to_spare");
  check_device(offload_map, dev, kIdx, "offload_map");
  at::Tensor v;
  if (valid.has_value() && valid->defined()) {
    check_dtype(*valid, {at::kBool}, kIdx, "valid");
    check_shape(*valid, indices.sizes(), kIdx, "valid");
    check_device(*valid, dev, kIdx, "valid");
    v = valid->contiguous();
  }
  TORCH_CHECK(T < std::numeric_limits<int32_t>::max(), kIdx, ": indices has too many tokens (", T, ")");
  return PreparedIndices{indices.contiguous(), v, tokens_to_spare.to(at::kLong).contiguous(), offload_map.contiguous(),
                         T, K, E, S};
}

reroute::RerouteIndexProblem make_index_problem(const PreparedIndices& in, at::Tensor& out, at::Tensor& slot_home) {
  reroute::RerouteIndexProblem p;
  p.num_tokens = in.T;
  p.topk = in.K;
  p.num_experts = in.E;
  p.num_slots = in.S;
  p.indices = in.indices.data_ptr<int64_t>();
  p.valid = in.valid.defined() ? in.valid.data_ptr<bool>() : nullptr;
  p.tokens_to_spare = in.tokens_to_spare.data_ptr<int64_t>();
  p.offload_map = in.offload_map.data_ptr();
  p.offload_bytes = static_cast<int>(in.offload_map.element_size());
  p.out_indices = out.data_ptr<int64_t>();
  p.slot_home = slot_home.data_ptr<int64_t>();
  return p;
}
}  // namespace

std::tuple<at::Tensor, at::Tensor> reroute_indices_cpu(const at::Tensor& indices, const at::Tensor& tokens_to_spare,
                                                       const at::Tensor& offload_map,
                                                       const c10::optional<at::Tensor>& valid) {
  PreparedIndices in = check_and_prepare_indices(indices, tokens_to_spare, offload_map, valid);
  at::Tensor out = at::empty({in.T, in.K}, in.indices.options());
  at::Tensor slot_home = at::empty({in.S}, in.indices.options());
  reroute::RerouteIndexProblem p = make_index_problem(in, out, slot_home);
  p.error_flag = error_flag_ptr(indices.device());
  reroute::reroute_indices_host(p, [](int64_t n, const std::function<void(int64_t, int64_t)>& body) {
    at::parallel_for(0, n, 1, body);
  });
  return {out, slot_home};
}

#ifdef MOE_GRAPH_WITH_CUDA
std::tuple<at::Tensor, at::Tensor> reroute_indices_cuda(const at::Tensor& indices, const at::Tensor& tokens_to_spare,
                                                        const at::Tensor& offload_map,
                                                        const c10::optional<at::Tensor>& valid) {
  c10::cuda::CUDAGuard guard(indices.device());
  PreparedIndices in = check_and_prepare_indices(indices, tokens_to_spare, offload_map, valid);
  TORCH_CHECK(in.S <= reroute::kRerouteMaxSlots, kIdx, ": offload_map has too many spare slots (", in.S, " > ",
              reroute::kRerouteMaxSlots, ")");
  TORCH_CHECK(in.E <= reroute::kRerouteIndexMaxExperts, kIdx, ": offload_map has too many experts (", in.E, " > ",
              reroute::kRerouteIndexMaxExperts, ")");
  TORCH_CHECK(in.K <= reroute::kRerouteIndexMaxTopk, kIdx, ": indices has too many routes per token (", in.K, " > ",
              reroute::kRerouteIndexMaxTopk, ")");
  at::Tensor out = at::empty({in.T, in.K}, in.indices.options());
  at::Tensor slot_home = at::empty({in.S}, in.indices.options());
  at::Tensor workspace =
      at::empty({reroute::reroute_workspace_elems(in.T, in.E, in.S)}, in.indices.options().dtype(at::kInt));
  reroute::RerouteIndexProblem p = make_index_problem(in, out, slot_home);
  p.error_flag = error_flag_ptr(indices.device());
  auto stream = at::cuda::getCurrentCUDAStream(indices.device().index()).stream();
  C10_CUDA_CHECK(reroute::reroute_indices_cuda_launch(p, workspace.data_ptr<int32_t>(), stream));
  return {out, slot_home};
}
#endif

#ifdef MOE_GRAPH_WITH_CUDA
std::tuple<at::Tensor, at::Tensor> reroute_tokens_cuda(const at::Tensor& routing_map, const at::Tensor& probs,
                                                       const at::Tensor& tokens_to_spare,
                                                       const at::Tensor& offload_map) {
  c10::cuda::CUDAGuard guard(routing_map.device());
  Prepared in = check_and_prepare(routing_map, probs, tokens_to_spare, offload_map);
  TORCH_CHECK(in.S <= reroute::kRerouteMaxSlots, kOp, ": offload_map has too many spare slots (", in.S,
              " > ", reroute::kRerouteMaxSlots, ")");
  at::Tensor out_map = at::empty({in.T, in.E + in.S}, in.routing_map.options());
  at::Tensor out_probs = at::empty({in.T, in.E + in.S}, in.probs.options());
  at::Tensor workspace =
      at::empty({reroute::reroute_workspace_elems(in.T, in.E, in.S)}, in.routing_map.options().dtype(at::kInt));
  reroute::RerouteProblem p = make_problem(in, out_map, out_probs);
  p.error_flag = error_flag_ptr(routing_map.device());
  auto stream = at::cuda::getCurrentCUDAStream(routing_map.device().index()).stream();
  C10_CUDA_CHECK(reroute::reroute_tokens_cuda_launch(p, workspace.data_ptr<int32_t>(), stream));
  return {out_map, out_probs};
}
#endif

}  // namespace moe_graph
