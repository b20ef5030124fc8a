// Torch-level dispatch_layout / receive_layout / aligned_groups ops (schemas in csrc/bindings.cpp; semantics in
// permute/dispatch_layout.h).
#pragma once
#include <ATen/ATen.h>

#include <c10/util/Optional.h>

#include <tuple>

namespace moe_graph {

// indices [T, K] int32/int64, valid [T, K] bool or None, column_rank / column_local [C] int64, route_order [T*K]
// int64 or None -> (route_slot [T*K], route_of_slot [R*capacity], send_counts [R, Lc], column_counts [C],
// dropped [], aligned_counts [R, Lc]) int64. align > 1 (R = 1, no dest_quota): each local expert's group starts at a
// multiple of align slots, route_of_slot is [aligned_padded_rows(capacity, Lc, align)]. The three counters (one element each; int64, int64, float64) are updated in place when given.
// dest_quota [R] int64 or None: quota mode (per-destination limits, packed send slots: route_of_slot is [T*K]).
// CPU tensors: host loops (errors raise); CUDA tensors: kernels on the current stream (errors set the device flag).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> dispatch_layout(
    const at::Tensor& indices, const c10::optional<at::Tensor>& valid, const at::Tensor& column_rank,
    const at::Tensor& column_local, const c10::optional<at::Tensor>& route_order, int64_t num_ep_ranks,
    int64_t num_local_columns, int64_t capacity, const c10::optional<at::Tensor>& dropped_routes,
    const c10::optional<at::Tensor>& step_dropped_routes, const c10::optional<at::Tensor>& step_max_load_ratio,
    const c10::optional<at::Tensor>& dest_quota, int64_t align);

// recv_counts [R, Lc] int64 -> (expert_row_source [P], recv_row_target [R*capacity], m_splits [Lc],
// aligned_m_splits [Lc]) int64, P = aligned_padded_rows(R*capacity, Lc, align) (align = 1: R*capacity).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> receive_layout(const at::Tensor& recv_counts,
                                                                          int64_t capacity, int64_t align);

// m_splits [G] int64, rows, align -> (padded_m_splits [G], source_of_padded [P], padded_of_source [rows]) int64,
// P = ceil((rows + (align - 1) * G) / align) * align.
std::tuple<at::Tensor, at::Tensor, at::Tensor> aligned_groups(const at::Tensor& m_splits, int64_t rows, int64_t align);

}  // namespace moe_graph
