// Torch-level ops of the fused exchange (schemas in csrc/bindings.cpp; semantics in exchange/exchange.h).
#pragma once
#include <ATen/ATen.h>

#include <c10/util/Optional.h>

#include <tuple>
#include <vector>

namespace moe_graph {

// [control words, receive-buffer bytes, weights offset in it, epoch words, largest R*Lc, receive rows P] for R
// ranks, Lc local columns, `capacity` real receive rows of `row_bytes` in groups aligned to `align` rows.
std::vector<int64_t> exchange_layout(int64_t num_ranks, int64_t num_local, int64_t capacity, int64_t row_bytes,
                                     int64_t align);

// Host reference over all R ranks in one process (CPU tensors, list index = rank).
std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
           std::vector<at::Tensor>>
exchange_dispatch_reference(at::TensorList rows, at::TensorList route_of_slot, at::TensorList send_counts,
                            at::TensorList weights, int64_t topk, int64_t capacity, int64_t align);
std::vector<at::Tensor> exchange_combine_reference(at::TensorList expert_out, at::TensorList route_row,
                                                   at::TensorList weights, int64_t topk);
std::vector<at::Tensor> exchange_gather_reference(at::TensorList expert_out, at::TensorList route_row);

#ifdef MOE_GRAPH_WITH_CUDA
// One rank's part (symmetric buffers and their device pointer arrays from torch's rendezvous) on the current stream.
std::tuple<at::Tensor, at::Tensor, at::Tensor> exchange_dispatch_cuda(
    const at::Tensor& rows, const at::Tensor& route_of_slot, const at::Tensor& send_counts,
    const c10::optional<at::Tensor>& weights, int64_t topk, int64_t capacity, int64_t rank, at::Tensor& recv_buffer,
    const at::Tensor& recv_ptrs, at::Tensor& ctrl_buffer, const at::Tensor& ctrl_ptrs, at::Tensor& epoch,
    int64_t num_ctas, int64_t align);
at::Tensor exchange_combine_cuda(const at::Tensor& expert_out, const at::Tensor& src_ptrs, at::Tensor& ctrl_buffer,
                                 const at::Tensor& ctrl_ptrs, at::Tensor& epoch, const at::Tensor& route_row,
                                 const c10::optional<at::Tensor>& weights, int64_t topk, int64_t rank,
                                 int64_t num_ctas);
at::Tensor exchange_gather_cuda(const at::Tensor& expert_out, const at::Tensor& src_ptrs, at::Tensor& ctrl_buffer,
                                const at::Tensor& ctrl_ptrs, at::Tensor& epoch, const at::Tensor& route_row,
                                int64_t rank, int64_t num_ctas);
#endif

}  // namespace moe_graph
