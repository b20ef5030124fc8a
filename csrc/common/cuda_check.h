// Torch-free CUDA error checks for launchers: throw std::runtime_error naming the step.
#pragma once
#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

namespace moe_graph {

inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string("moe_graph: ") + what + " failed: " + cudaGetErrorString(err));
}

// Call right after a launch (common/launch.cuh).
inline void check_launch(const char* kernel) { check_cuda(cudaGetLastError(), kernel); }

}  // namespace moe_graph
