// Torch-level token rerouting op (schema in csrc/bindings.cpp; semantics in reroute/reroute.h).
#pragma once
#include <ATen/ATen.h>

#include <c10/util/Optional.h>

#include <tuple>

namespace moe_graph {

// routing_map [T, E] bool, probs [T, E] floating, tokens_to_spare [S] int32/int64, offload_map [E, S] bool
// -> (rerouted_routing_map [T, E+S] bool, rerouted_probs [T, E+S] of probs' dtype).
std::tuple<at::Tensor, at::Tensor> reroute_tokens_cpu(const at::Tensor& routing_map, const at::Tensor& probs,
                                                      const at::Tensor& tokens_to_spare,
                                                      const at::Tensor& offload_map);

// indices [T, K] int64, tokens_to_spare [S] int32/int64, offload_map [E, S] bool/int32/int64 ("> 0"),
// valid [T, K] bool or undefined -> (rerouted indices [T, K] int64 in [0, E+S), slot_home [S] int64, E: none).
std::tuple<at::Tensor, at::Tensor> reroute_indices_cpu(const at::Tensor& indices, const at::Tensor& tokens_to_spare,
                                                       const at::Tensor& offload_map,
                                                       const c10::optional<at::Tensor>& valid);

// counts [R, E] int32/int64 -> home_to_spare [E, R*k] int64: the best-fit placement of
// moe_graph.planner.best_fit_assignment (semantics in reroute/echo_plan.h).
// donor_mask: optional [R, R] bool (allowed[r, q]: a slot on rank r may host rank q's experts; undefined: all).
at::Tensor echo_best_fit_cpu(const at::Tensor& counts, int64_t num_spare_experts_per_ep_rank,
                             const c10::optional<at::Tensor>& donor_mask);
// counts [R, E] -> (home_to_spare [E, R*k], allocation [R, R*k]) int64: gen_assignment(mode) + gen_allocation of
// moe_graph.planner in one native step. mode: 0 auto, 1 greedy, 2 best_fit.
std::tuple<at::Tensor, at::Tensor> echo_plan_cpu(const at::Tensor& counts, int64_t num_spare_experts_per_ep_rank,
                                                 int64_t mode, const c10::optional<at::Tensor>& donor_mask);

#ifdef MOE_GRAPH_WITH_CUDA
at::Tensor echo_best_fit_cuda(const at::Tensor& counts, int64_t num_spare_experts_per_ep_rank,
                              const c10::optional<at::Tensor>& donor_mask);
std::tuple<at::Tensor, at::Tensor> echo_plan_cuda(const at::Tensor& counts, int64_t num_spare_experts_per_ep_rank,
                                                  int64_t mode, const c10::optional<at::Tensor>& donor_mask);
std::tuple<at::Tensor, at::Tensor> reroute_indices_cuda(const at::Tensor& indices, const at::Tensor& tokens_to_spare,
                                                        const at::Tensor& offload_map,
                                                        const c10::optional<at::Tensor>& valid);
std::tuple<at::Tensor, at::Tensor> reroute_tokens_cuda(const at::Tensor& routing_map, const at::Tensor& probs,
                                                       const at::Tensor& tokens_to_spare,
                                                       const at::Tensor& offload_map);
#endif

}  // namespace moe_graph
