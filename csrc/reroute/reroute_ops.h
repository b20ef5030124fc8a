// Torch-level token rerouting op (schema in csrc/bindings.cpp; semantics in reroute/reroute.h).
#pragma once
#include <ATen/ATen.h>

#include <tuple>

namespace moe_graph {

// routing_map [T, E] bool, probs [T, E] floating, tokens_to_spare [S] int32/int64, home_to_spare_map [E, S] bool
// -> (rerouted_routing_map [T, E+S] bool, rerouted_probs [T, E+S] of probs' dtype).
std::tuple<at::Tensor, at::Tensor> reroute_tokens_cpu(const at::Tensor& routing_map, const at::Tensor& probs,
                                                      const at::Tensor& tokens_to_spare,
                                                      const at::Tensor& home_to_spare_map);

#ifdef MOE_GRAPH_WITH_CUDA
std::tuple<at::Tensor, at::Tensor> reroute_tokens_cuda(const at::Tensor& routing_map, const at::Tensor& probs,
                                                       const at::Tensor& tokens_to_spare,
                                                       const at::Tensor& home_to_spare_map);
#endif

}  // namespace moe_graph
