// The one place where moe_graph's torch ops are declared (schemas) and their CPU / CUDA implementations are
// registered. Kernels live in csrc/<family>/ and know nothing of torch; the torch-level glue (argument checks,
// allocation, stream) lives next to them in <family>_ops.cpp and is declared in <family>_ops.h.
#include <torch/library.h>

#include "activation/activation_ops.h"
#include "common/error_flag_torch.h"
#include "exchange/exchange_ops.h"
#include "fp8/fp8_ops.h"
#include "grouped_gemm/grouped_gemm_ops.h"
#include "grouped_gemm/grouped_probe.h"
#include "permute/permute_ops.h"
#include "permute/dispatch_layout_ops.h"
#include "reroute/reroute_ops.h"

namespace moe_graph {
namespace {

int64_t check_errors_impl(const at::Tensor& device_like) { return read_and_clear_error_flag(device_like.device()); }

}  // namespace
}  // namespace moe_graph

TORCH_LIBRARY(moe_graph, m) {
  // ---- device error flag -------------------------------------------------------------------------------
  // Reads and clears the flag of the device of `device_like` (any tensor on that device). Syncs by design.
  m.def("read_error_flag(Tensor device_like) -> int");
  // The flag itself (int32 [1], aliasing global state) so that Python code can set bits from device tensors.
  m.def("error_flag(Tensor device_like) -> Tensor");
  m.def("fp8_nonfinite_flag(Tensor device_like) -> Tensor");

  // ---- grouped GEMM ------------------------------------------------------------------------------------
  // a [M, K]; b: one [E, N, K] (trans_b) / [E, K, N] tensor, or E 2-D tensors; m_splits int32/int64 [E];
  // bias [E, N] or None. Rows past sum(m_splits) are zero.
  m.def("grouped_gemm(Tensor a, Tensor[] b, Tensor m_splits, bool trans_b, Tensor? bias) -> Tensor");
  m.def("grouped_gemm_out(Tensor a, Tensor[] b, Tensor m_splits, bool trans_b, Tensor? bias, Tensor(a!) out) -> ()");
  // dW_e = dy_e^T @ a_e -> [E, N, K] in `out_dtype` (default: a's dtype).
  m.def("grouped_gemm_wgrad(Tensor a, Tensor dy, Tensor m_splits, ScalarType? out_dtype) -> Tensor");
  // In place into `out` (one [E, N, K] tensor or E [N, K] tensors, fp32 or a's dtype). accumulate_mask: bool
  // [E] on the device (accumulate where true, overwrite where false); None means `accumulate` for all.
  m.def(
      "grouped_gemm_wgrad_out(Tensor a, Tensor dy, Tensor m_splits, Tensor(a!)[] out, bool accumulate, "
      "Tensor? accumulate_mask) -> ()");
  // Bias gradient: db[e] = sum of dy rows of expert e -> [E, N] fp32.
  m.def("grouped_bias_grad(Tensor dy, Tensor m_splits) -> Tensor");

  // ---- grouped GEMM host logic, test-only (csrc/grouped_gemm/grouped_probe.h) ---------------------------
  m.def("_grouped_plan_forward(int arch, int rows, int num_experts, int n, int k, bool has_bias, bool b_is_list, "
        "int config) -> int[]",
        &moe_graph::grouped_plan_forward_probe);
  m.def("_grouped_plan_wgrad(int arch, int rows, int num_experts, int n, int k, int out_dtype, bool accumulate_all, "
        "bool has_mask, bool out_is_list, int config) -> int[]",
        &moe_graph::grouped_plan_wgrad_probe);
  m.def("_grouped_config_name(int config) -> str", &moe_graph::grouped_config_name_probe);
  m.def("_grouped_effective_sm_count(int sm_count, int carveout, int config=0) -> int",
        &moe_graph::grouped_effective_sm_count_probe);
  m.def("_grouped_args_probe(Tensor m_splits, int rows, int n, int k, int kind, bool b_list, bool has_bias, "
        "Tensor coords) -> (Tensor, Tensor)",
        &moe_graph::grouped_args_probe);

  // ---- token rerouting (echo experts) ------------------------------------------------------------------
  // routing_map [T, E] bool, probs [T, E], tokens_to_spare [S] int, offload_map [E, S] bool
  // -> (rerouted_routing_map [T, E+S] bool, rerouted_probs [T, E+S]); see csrc/reroute/reroute.h.
  m.def(
      "reroute_tokens(Tensor routing_map, Tensor probs, Tensor tokens_to_spare, Tensor offload_map) -> "
      "(Tensor, Tensor)");
  // indices [T, K] int64, tokens_to_spare [S], offload_map [E, S] bool/int ("> 0"), valid [T, K] bool
  // -> (rerouted indices [T, K] in [0, E+S), slot_home [S] int64, E: none); the same rule as reroute_tokens.
  m.def(
      "reroute_indices(Tensor indices, Tensor tokens_to_spare, Tensor offload_map, Tensor? valid=None) -> "
      "(Tensor, Tensor)");
  // counts [R, E] -> home_to_spare [E, R*k] int64: best-fit placement of rank overload (reroute/echo_plan.h).
  // donor_mask: optional [R, R] bool, a slot on rank r may host rank q's experts only where donor_mask[r, q].
  m.def("echo_best_fit(Tensor counts, int num_spare_experts_per_ep_rank, Tensor? donor_mask=None) -> Tensor");
  // counts [R, E] -> (home_to_spare [E, R*k], allocation [R, R*k]): the whole plan in one step; mode 0 auto,
  // 1 greedy, 2 best_fit (reroute/echo_plan_impl.h).
  m.def(
      "echo_plan(Tensor counts, int num_spare_experts_per_ep_rank, int mode, Tensor? donor_mask=None) -> "
      "(Tensor, Tensor)");

  // ---- row expansion / reduction over a route index (csrc/permute/permute.h) ------------------------------
  // out[i] = weights[r] * src[r // K] with r = route_of_row[i]; r == n*K: a zero row. -> [m, H]
  m.def("expand_rows(Tensor src, Tensor route_of_row, int K, Tensor? weights=None) -> Tensor");
  // out[j] = sum_k weights[j, k] * src[route_rows[j, k]] (k ascending, fp32 accumulation); == m: skipped. -> [n, H]
  m.def("reduce_rows(Tensor src, Tensor route_rows, Tensor? weights=None) -> Tensor");
  // out[j, k] = dot(rows[j], src[route_rows[j, k]]) -> [n, K] fp32 (fp64 for fp64 data); == m: 0.
  m.def("route_dot(Tensor rows, Tensor src, Tensor route_rows) -> Tensor");
  // the FP8 copies of expand_rows(src, route_of_row, K, weights) (csrc/permute/expand_quantize.h):
  // fp8_quantize_pair's results for the expanded rows, without them in memory -> (q [m, H], scale, q_t [H, m],
  // scale_t); plus_zero: each element read as +0 + x (reduce_rows with one route: the combine's backward at EP > 1)
  m.def("expand_quantize_pair(Tensor src, Tensor? route_of_row, int K, Tensor m_splits, int[] tiles, "
        "ScalarType fp8_dtype, bool mx, float eps, bool pow2, Tensor? weights=None, int packed_cols=0, "
        "bool plus_zero=False) -> (Tensor, Tensor, Tensor, Tensor)");
  // route_of_row None: row i is src's row i (K 1). packed_cols > 0: src is packed FP8 rows (pack_rows' layout),
  // weights None. plus_zero: each element read as +0 + x (reduce_rows' one-route sum: -0 reads as +0), weights None.
  // expand_quantize_pack: pack_rows of expand_rows(src, route_of_row, K) (None: src's rows) -> uint8 [m, B]
  m.def("expand_quantize_pack(Tensor src, Tensor? route_of_row, int K, ScalarType fp8_dtype, bool mx, float eps, "
        "bool pow2) -> Tensor");

  // ---- the token dispatcher's layout (csrc/permute/dispatch_layout.h) -------------------------------------
  // indices [T, K] -> (route_slot [T*K], route_of_slot [R*capacity], send_counts [R, Lc], column_counts [C],
  // dropped [], aligned_counts [R, Lc]) int64; the given counters take this call's drops and load ratio in place;
  // with dest_quota [R]: per-destination limits and packed send slots (route_of_slot [T*K]); align > 1 (R = 1): the
  // local experts' groups start at multiples of align slots (route_of_slot [aligned_padded_rows(capacity, Lc, align)]).
  m.def(
      "dispatch_layout(Tensor indices, Tensor? valid, Tensor column_rank, Tensor column_local, Tensor? route_order, "
      "int num_ep_ranks, int num_local_columns, int capacity, Tensor(a!)? dropped_routes=None, "
      "Tensor(b!)? step_dropped_routes=None, Tensor(c!)? step_max_load_ratio=None, Tensor? dest_quota=None, "
      "int align=1) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  // recv_counts [R, Lc] -> (expert_row_source [P], recv_row_target [R*capacity], m_splits [Lc], aligned_m_splits
  // [Lc]) int64, the local experts' groups starting at multiples of align rows, P = aligned_padded_rows(R*capacity,
  // Lc, align).
  m.def("receive_layout(Tensor recv_counts, int capacity, int align=1) -> (Tensor, Tensor, Tensor, Tensor)");
  // m_splits [G] int64 -> (padded_m_splits [G], source_of_padded [P], padded_of_source [rows]) int64: every group
  // starting at a multiple of align rows (permute/dispatch_layout.h).
  m.def("aligned_groups(Tensor m_splits, int rows, int align) -> (Tensor, Tensor, Tensor)");

  // ---- fused expert activation (expert MLPs) -------------------------------------------------------------
  // h [N, 2F] (gated: gate half, then up half) or [N, F] (plain), row_scale [N] (fp32 or h's dtype) or None,
  // activation (kinds, alpha and limit: csrc/activation/activation_math.h) -> act(h) * row_scale[:, None] [N, F].
  m.def("expert_activation(Tensor h, Tensor? row_scale, str activation, float alpha, float limit) -> Tensor");
  // -> (grad_h like h, grad_row_scale [N] in row_scale's dtype; [0] without row_scale). write_grad_h=False: grad_h
  // not written ([0]), the row-scale gradient only (beside the FP8 quantizer's fused backward producer).
  m.def(
      "expert_activation_backward(Tensor grad_y, Tensor h, Tensor? row_scale, str activation, float alpha, "
      "float limit, bool write_grad_h=True) -> (Tensor, Tensor)");
  // ---- FP8 quantization (csrc/fp8/quantize.h) -----------------------------------------------------------
  // x [M, K] (grouped by m_splits [E]) or [B, M, K]; tiles tile_rows x tile_cols per group (0: all) -> (q, scale):
  // fp32 scale_inv (TE's blockwise / current scaling) or E8M0 (mx); transpose writes q [K, M] and its scales.
  // x_scale: x is FP8 [M, K] with these rowwise scales, requantized from its dequantization.
  m.def("fp8_quantize(Tensor x, Tensor? m_splits, int tile_rows, int tile_cols, ScalarType fp8_dtype, bool mx, "
        "float eps, bool pow2, bool transpose, Tensor? x_scale=None) -> (Tensor, Tensor)");
  // Both copies in one pass (one launch on CUDA): (q, scale) in tiles[0] x tiles[1] and the transposed (q_t,
  // scale_t) in tiles[2] x tiles[3]; with activation, of act(h) * row_scale for h = x (expert_activation's values,
  // without them in memory: the fused producer of fc2's FP8 input); with activation and grad_y, of
  // expert_activation_backward's grad_h (the fused producer of fc1's FP8 dy); with grad_scale [M] too, its row-scale
  // gradient written there (rowwise tiles of one row).
  m.def("fp8_quantize_pair(Tensor x, Tensor? m_splits, int[] tiles, ScalarType fp8_dtype, bool mx, float eps, "
        "bool pow2, str? activation, float alpha, float limit, Tensor? row_scale, Tensor? grad_y=None, "
        "Tensor(a!)? grad_scale=None) -> (Tensor, Tensor, Tensor, Tensor)");
  // Scaled grouped GEMM (csrc/fp8/scaled_gemm.h): per-K-block fp32 sums times a_scale * b_scale, fp32 accumulation.
  m.def("fp8_scaled_grouped_gemm(Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, Tensor m_splits, int block_k, "
        "int block_n, Tensor? bias, ScalarType out_dtype) -> Tensor");
  m.def("fp8_scaled_grouped_wgrad_out(Tensor a_t, Tensor a_scale, Tensor b_t, Tensor b_scale, Tensor m_splits, "
        "int block_m, Tensor(a!) out, bool accumulate) -> ()");
  // ---- the fused ("nvlink") exchange on symmetric memory (csrc/exchange/exchange.h) ------------------------
  // -> [control words, receive-buffer bytes, weights offset, epoch words, largest R*Lc, receive rows P].
  m.def("exchange_layout(int num_ranks, int num_local, int capacity, int row_bytes, int align=1) -> int[]",
        &moe_graph::exchange_layout);
  // The host reference over all R ranks (list index = rank): -> (expert_in, m_splits, row_weights, route_row,
  // counts); align: every local expert's group starts at a multiple of align rows (m_splits the padded counts).
  m.def("exchange_dispatch_reference(Tensor[] rows, Tensor[] route_of_slot, Tensor[] send_counts, Tensor[] weights, "
        "int topk, int capacity, int align=1) -> (Tensor[], Tensor[], Tensor[], Tensor[], Tensor[])");
  m.def("exchange_combine_reference(Tensor[] expert_out, Tensor[] route_row, Tensor[] weights, int topk) -> Tensor[]");
  m.def("exchange_gather_reference(Tensor[] expert_out, Tensor[] route_row) -> Tensor[]");
  // One rank (CUDA): rows [T, *X] -> (m_splits [Lc], route_row [T*K], counts [Lc]); expert_in and row_weights land
  // in the symmetric recv_buffer of every destination (python/moe_graph/ops/nvlink.py).
  m.def("exchange_dispatch(Tensor rows, Tensor route_of_slot, Tensor send_counts, Tensor? weights, int topk, "
        "int capacity, int rank, Tensor(a!) recv_buffer, Tensor recv_ptrs, Tensor(b!) ctrl_buffer, Tensor ctrl_ptrs, "
        "Tensor(c!) epoch, int num_ctas, int align=1) -> (Tensor, Tensor, Tensor)");
  // expert_out [P, *X]: this rank's symmetric buffer -> [T, *X] (combine) / [T*K, *X] (gather).
  m.def("exchange_combine(Tensor expert_out, Tensor src_ptrs, Tensor(a!) ctrl_buffer, Tensor ctrl_ptrs, "
        "Tensor(b!) epoch, Tensor route_row, Tensor? weights, int topk, int rank, int num_ctas) -> Tensor");
  m.def("exchange_gather(Tensor expert_out, Tensor src_ptrs, Tensor(a!) ctrl_buffer, Tensor ctrl_ptrs, "
        "Tensor(b!) epoch, Tensor route_row, int rank, int num_ctas) -> Tensor");
  // Test-only: the CUDA scaled GEMM's launch plan (csrc/fp8/scaled_plan.h, field order in fp8/fp8_ops.h).
  m.def("_fp8_scaled_plan(bool wgrad, int arch, int rows, int num_experts, int n, int k, int block_k, int block_n, "
        "bool e8m0, bool flag) -> int[]",
        &moe_graph::fp8_scaled_plan_probe);
}

TORCH_LIBRARY_IMPL(moe_graph, CompositeExplicitAutograd, m) {
  m.impl("read_error_flag", &moe_graph::check_errors_impl);
  m.impl("error_flag", [](const at::Tensor& t) { return moe_graph::error_flag_tensor(t.device()); });
  m.impl("fp8_nonfinite_flag", [](const at::Tensor& t) { return moe_graph::nonfinite_flag_tensor(t.device()); });
}

TORCH_LIBRARY_IMPL(moe_graph, CPU, m) {
  m.impl("grouped_gemm", &moe_graph::grouped_gemm_cpu);
  m.impl("grouped_gemm_out", &moe_graph::grouped_gemm_out_cpu);
  m.impl("grouped_gemm_wgrad", &moe_graph::grouped_gemm_wgrad_cpu);
  m.impl("grouped_gemm_wgrad_out", &moe_graph::grouped_gemm_wgrad_out_cpu);
  m.impl("grouped_bias_grad", &moe_graph::grouped_bias_grad_cpu);
  m.impl("reroute_tokens", &moe_graph::reroute_tokens_cpu);
  m.impl("reroute_indices", &moe_graph::reroute_indices_cpu);
  m.impl("echo_best_fit", &moe_graph::echo_best_fit_cpu);
  m.impl("echo_plan", &moe_graph::echo_plan_cpu);
  m.impl("expand_rows", &moe_graph::expand_rows_cpu);
  m.impl("reduce_rows", &moe_graph::reduce_rows_cpu);
  m.impl("route_dot", &moe_graph::route_dot_cpu);
  m.impl("expand_quantize_pair", &moe_graph::expand_quantize_pair_cpu);
  m.impl("expand_quantize_pack", &moe_graph::expand_quantize_pack_cpu);
  m.impl("dispatch_layout", &moe_graph::dispatch_layout);
  m.impl("receive_layout", &moe_graph::receive_layout);
  m.impl("aligned_groups", &moe_graph::aligned_groups);
  m.impl("expert_activation", &moe_graph::expert_activation_cpu);
  m.impl("expert_activation_backward", &moe_graph::expert_activation_backward_cpu);
  m.impl("fp8_quantize", &moe_graph::fp8_quantize_cpu);
  m.impl("fp8_quantize_pair", &moe_graph::fp8_quantize_pair_cpu);
  m.impl("fp8_scaled_grouped_gemm", &moe_graph::fp8_scaled_grouped_gemm_cpu);
  m.impl("fp8_scaled_grouped_wgrad_out", &moe_graph::fp8_scaled_grouped_wgrad_out_cpu);
  m.impl("exchange_dispatch_reference", &moe_graph::exchange_dispatch_reference);
  m.impl("exchange_combine_reference", &moe_graph::exchange_combine_reference);
  m.impl("exchange_gather_reference", &moe_graph::exchange_gather_reference);
}

#ifdef MOE_GRAPH_WITH_CUDA
TORCH_LIBRARY_IMPL(moe_graph, CUDA, m) {
  m.impl("grouped_gemm", &moe_graph::grouped_gemm_cuda);
  m.impl("grouped_gemm_out", &moe_graph::grouped_gemm_out_cuda);
  m.impl("grouped_gemm_wgrad", &moe_graph::grouped_gemm_wgrad_cuda);
  m.impl("grouped_gemm_wgrad_out", &moe_graph::grouped_gemm_wgrad_out_cuda);
  m.impl("grouped_bias_grad", &moe_graph::grouped_bias_grad_cuda);
  m.impl("reroute_tokens", &moe_graph::reroute_tokens_cuda);
  m.impl("reroute_indices", &moe_graph::reroute_indices_cuda);
  m.impl("echo_best_fit", &moe_graph::echo_best_fit_cuda);
  m.impl("echo_plan", &moe_graph::echo_plan_cuda);
  m.impl("expand_rows", &moe_graph::expand_rows_cuda);
  m.impl("reduce_rows", &moe_graph::reduce_rows_cuda);
  m.impl("route_dot", &moe_graph::route_dot_cuda);
  m.impl("expand_quantize_pair", &moe_graph::expand_quantize_pair_cuda);
  m.impl("expand_quantize_pack", &moe_graph::expand_quantize_pack_cuda);
  m.impl("dispatch_layout", &moe_graph::dispatch_layout);
  m.impl("receive_layout", &moe_graph::receive_layout);
  m.impl("aligned_groups", &moe_graph::aligned_groups);
  m.impl("expert_activation", &moe_graph::expert_activation_cuda);
  m.impl("expert_activation_backward", &moe_graph::expert_activation_backward_cuda);
  m.impl("fp8_quantize", &moe_graph::fp8_quantize_cuda);
  m.impl("fp8_quantize_pair", &moe_graph::fp8_quantize_pair_cuda);
  m.impl("fp8_scaled_grouped_gemm", &moe_graph::fp8_scaled_grouped_gemm_cuda);
  m.impl("fp8_scaled_grouped_wgrad_out", &moe_graph::fp8_scaled_grouped_wgrad_out_cuda);
  m.impl("exchange_dispatch", &moe_graph::exchange_dispatch_cuda);
  m.impl("exchange_combine", &moe_graph::exchange_combine_cuda);
  m.impl("exchange_gather", &moe_graph::exchange_gather_cuda);
}
#endif

// Python module `moe_graph._C`: importing it runs the registrations above.
#include <Python.h>
static struct PyModuleDef moe_graph_c_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&moe_graph_c_module); }
