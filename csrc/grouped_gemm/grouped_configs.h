// Internal entry points between the arch-neutral dispatcher (grouped_gemm_cuda.cu) and the per-architecture
// CUTLASS instantiations (grouped_gemm_sm90.cu, grouped_gemm_sm100.cu).
#pragma once

#include <functional>

#include "grouped_gemm/grouped_gemm.h"

namespace moe_graph {
namespace gg {
namespace detail {

using Hook = std::function<void()>;

// Each returns false if this build has no kernel for (dtype, layout, config); throws on CUDA/CUTLASS errors.
bool forward_sm90(const ForwardProblem& p, const LaunchEnv& env, Config cfg, const void* const* b_table,
                  int64_t* offsets);
bool wgrad_sm90(const WgradProblem& p, const LaunchEnv& env, WgradKernel kernel, void* const* out_table,
                int64_t* offsets, const Hook& after_args);
bool forward_sm100(const ForwardProblem& p, const LaunchEnv& env, Config cfg, const void* const* b_table,
                   int64_t* offsets);
bool wgrad_sm100(const WgradProblem& p, const LaunchEnv& env, WgradKernel kernel, void* const* out_table,
                 int64_t* offsets, const Hook& after_args);

}  // namespace detail
}  // namespace gg
}  // namespace moe_graph
