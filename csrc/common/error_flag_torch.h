// Torch-level access to the per-device error flag (see error_flag.h).
#pragma once
#include <ATen/ATen.h>

#include <cstdint>

namespace moe_graph {

// Pointer to the int32 error flag of `device` (device memory for CUDA, host memory for CPU). The CUDA flag is
// allocated on first use through PyTorch's allocator and lives for the process; call ensure_error_flag() (the
// Python wrappers do, outside of graph capture) before capturing.
int32_t* error_flag_ptr(const at::Device& device);

// The flag of `device` as an int32 tensor of one element (an alias: in-place ops on it set bits from device-side
// conditions, e.g. flag.bitwise_or_(cond * bit), without a sync).
at::Tensor error_flag_tensor(const at::Device& device);

// The FP8 quantizers' non-finite flag of `device` (one int32 beside the error flag, allocated with it): set to 1 by
// a tile whose amax is inf or NaN; read (and cleared) on the device by the optimizer's inf/nan check.
int32_t* nonfinite_flag_ptr(const at::Device& device);
at::Tensor nonfinite_flag_tensor(const at::Device& device);

// Reads and clears the flag of `device`; returns the bits that were set. Syncs the device (by design).
int64_t read_and_clear_error_flag(const at::Device& device);

}  // namespace moe_graph
