// Test-only entry points of the grouped GEMM's host logic (registered in csrc/bindings.cpp as
// moe_graph::_grouped_*), so that CPU tests pin what a CUDA launch would do without a GPU.
#pragma once
#include <ATen/ATen.h>

#include <string>
#include <tuple>
#include <vector>

namespace moe_graph {

// plan_forward / plan_wgrad as integer lists (field order: grouped_probe.cpp, decoded in the tests).
std::vector<int64_t> grouped_plan_forward_probe(int64_t arch, int64_t rows, int64_t num_experts, int64_t n, int64_t k,
                                                bool has_bias, bool b_is_list, int64_t config);
std::vector<int64_t> grouped_plan_wgrad_probe(int64_t arch, int64_t rows, int64_t num_experts, int64_t n, int64_t k,
                                              int64_t out_dtype, bool accumulate_all, bool has_mask, bool out_is_list,
                                              int64_t config);
std::string grouped_config_name_probe(int64_t config);
// The SM count a launch of `config` (kAuto: no cluster rounding) gives CUTLASS under torch's SM carve-out.
int64_t grouped_effective_sm_count_probe(int64_t sm_count, int64_t carveout, int64_t config);

// The per-expert arguments of the argument kernel computed on the host (grouped_expert_args.h) for m_splits
// (CPU int64), then CuTe's operand layouts evaluated at `coords` ([P, 4] int64: expert e, GEMM m, n, k):
// returns (shapes [E, 3] = GEMM (M, N, K) per expert, offsets [P, 4] = element offsets of A(m, k), B(n, k),
// D(m, n), bias(m, n) from the base of their tensor, -1 for no bias). kind: 0 forward with b [E, n, k],
// 1 forward with b [E, k, n], 2 wgrad. b_list: per-expert pointers, expert e's tensor placed at element offset
// (E - 1 - e) * n * k of the base (reversed, so that a base + e * stride bug shows).
std::tuple<at::Tensor, at::Tensor> grouped_args_probe(const at::Tensor& m_splits, int64_t rows, int64_t n, int64_t k,
                                                      int64_t kind, bool b_list, bool has_bias,
                                                      const at::Tensor& coords);

}  // namespace moe_graph
