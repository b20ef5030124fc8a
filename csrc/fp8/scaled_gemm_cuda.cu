// Arch-neutral part of the CUDA scaled (FP8) grouped GEMM: executes the host plans (scaled_plan.cpp) and dispatches
// to the per-architecture CUTLASS launches (scaled_gemm_sm90.cu, scaled_gemm_sm100.cu). Torch-free; the emulator
// runs it with stand-ins for the CUTLASS launches (tests/emulator/harness_scaled.cpp).
#include <cuda_runtime.h>

#include <sstream>
#include <stdexcept>

#include "common/cuda_check.h"
#include "common/launch.cuh"
#include "fp8/scaled_args.cuh"
#include "fp8/scaled_gemm_cuda.h"
#include "fp8/scaled_plan.h"
#include "grouped_gemm/grouped_args.cuh"

namespace moe_graph {
namespace fp8 {
namespace {

__global__ void __launch_bounds__(detail::kArgThreads)
    scaled_offsets_kernel(const void* splits, bool is_int64, int num_experts, int64_t rows, int64_t* offsets,
                          int32_t* error_flag) {
  gg::detail::for_each_expert_span(splits, is_int64, num_experts, rows, error_flag, offsets,
                                   [](int, int64_t, int64_t) {});
}

void launch_offsets(const gg::Splits& s, int64_t rows, int64_t* offsets, const gg::LaunchEnv& env) {
  moe_graph::launch(scaled_offsets_kernel, 1, detail::kArgThreads, 0, env.stream, s.ptr, s.is_int64, s.num_experts,
                    rows, offsets, env.error_flag);
  check_launch("scaled_offsets_kernel");
}

[[noreturn]] void not_built(ScaledKernel k) {
  std::ostringstream os;
  os << "moe_graph FP8 scaled grouped GEMM: this build has no " << scaled_kernel_name(k)
     << " kernel (compiled for: " << gg::compiled_archs()
     << "); rebuild with MOE_GRAPH_ARCHS including the GPU (90a for Hopper, 100a for B200/GB200)";
  throw std::runtime_error(os.str());
}

}  // namespace

void run_scaled_forward(const ScaledForwardCuda& p, const gg::LaunchEnv& env) {
  const ScaledForwardPlan plan = plan_scaled_forward(env.arch, p.rows, p.splits.num_experts, p.n, p.k, p.block_k,
                                                     p.block_n, p.e8m0, p.bias != nullptr);
  auto* offsets = static_cast<int64_t*>(env.alloc(plan.offsets_bytes));
  if (plan.run_offsets) launch_offsets(p.splits, p.rows, offsets, env);
  if (!plan.run_gemm) return;
  if (plan.kernel == ScaledKernel::kSm90Blockwise) {
#if defined(MOE_GRAPH_BUILD_SM90)
    detail::ScaledArch<ScaledKernel::kSm90Blockwise>::forward(p, plan, env, offsets);
    return;
#endif
  } else {
#if defined(MOE_GRAPH_BUILD_SM100)
    detail::ScaledArch<ScaledKernel::kSm100Mxfp8>::forward(p, plan, env, offsets);
    return;
#endif
  }
  not_built(plan.kernel);
}

void run_scaled_wgrad(const ScaledWgradCuda& p, const gg::LaunchEnv& env) {
  const ScaledWgradPlan plan = plan_scaled_wgrad(env.arch, p.rows, p.splits.num_experts, p.n, p.k, p.block_m,
                                                 p.e8m0, p.accumulate);
  auto* offsets = static_cast<int64_t*>(env.alloc(plan.offsets_bytes));
  if (plan.run_offsets) {
    launch_offsets(p.splits, p.rows, offsets, env);
    if (plan.zero_fill) detail::enqueue_wgrad_zero(p.out, p.splits.num_experts, p.n * p.k, env.stream);
  }
  if (!plan.run_gemm) return;
  if (plan.kernel == ScaledKernel::kSm90Blockwise) {
#if defined(MOE_GRAPH_BUILD_SM90)
    detail::ScaledArch<ScaledKernel::kSm90Blockwise>::wgrad(p, plan, env, offsets);
    return;
#endif
  } else {
#if defined(MOE_GRAPH_BUILD_SM100)
    detail::ScaledArch<ScaledKernel::kSm100Mxfp8>::wgrad(p, plan, env, offsets);
    return;
#endif
  }
  not_built(plan.kernel);
}

}  // namespace fp8
}  // namespace moe_graph
