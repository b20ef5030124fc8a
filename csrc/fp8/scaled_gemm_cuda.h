// Torch-free interface of the CUDA scaled (FP8) grouped GEMM (semantics: scaled_gemm.h; launch decisions:
// scaled_plan.h). Operands and scales in the op's compact layouts; m_splits on the device, never read by the host.
#pragma once

#include <cstdint>

#include "fp8/scaled_plan.h"
#include "grouped_gemm/grouped_gemm.h"

namespace moe_graph {
namespace fp8 {

// out [rows, n] bf16 = per expert a [start:start+count, :k] x b[e]^T (scales per K block; b's per block_n rows)
// + bias[e] (fp32 [E, n] or null); rows past the clamped sum(m_splits) zero. E4M3 operands.
struct ScaledForwardCuda {
  int64_t rows = 0, n = 0, k = 0, block_k = 128, block_n = 128;
  bool e8m0 = false;
  const void* a = nullptr;        // [rows, k] fp8
  const void* a_scale = nullptr;  // [rows, k / block_k]
  const void* b = nullptr;        // [E, n, k] fp8
  const void* b_scale = nullptr;  // [E, ceil(n / block_n), k / block_k]
  const float* bias = nullptr;    // [E, n] or null
  void* out = nullptr;            // [rows, n] bf16
  gg::Splits splits;
};

// out [E, n, k] fp32 (+)= per expert a_t[:, tokens] x b_t[:, tokens]^T, scales per tile of block_m tokens of the
// expert (a_scale [n, RT], b_scale [k, RT]). E4M3 operands.
struct ScaledWgradCuda {
  int64_t rows = 0, n = 0, k = 0, block_m = 128;
  bool e8m0 = false;
  const void* a_t = nullptr;      // [n, rows] fp8
  const void* a_scale = nullptr;  // [n, RT]
  const void* b_t = nullptr;      // [k, rows] fp8
  const void* b_scale = nullptr;  // [k, RT]
  float* out = nullptr;           // [E, n, k]
  bool accumulate = false;
  gg::Splits splits;
};

// Throw std::runtime_error (plan errors, no kernel for the architecture in this build, CUTLASS status) before
// anything is enqueued where the host can know it.
void run_scaled_forward(const ScaledForwardCuda& p, const gg::LaunchEnv& env);
void run_scaled_wgrad(const ScaledWgradCuda& p, const gg::LaunchEnv& env);

namespace detail {
// The per-architecture CUTLASS launches of a kernel family (argument kernel, relayouts, GEMM): one body for both
// (scaled_launch.cuh, from the family's ScaledKernels), instantiated by scaled_gemm_sm90.cu (kSm90Blockwise) and
// scaled_gemm_sm100.cu (kSm100Mxfp8).
template <ScaledKernel kKernel>
struct ScaledArch {
  static void forward(const ScaledForwardCuda& p, const ScaledForwardPlan& plan, const gg::LaunchEnv& env,
                      int64_t* offsets);
  static void wgrad(const ScaledWgradCuda& p, const ScaledWgradPlan& plan, const gg::LaunchEnv& env,
                    int64_t* offsets);
};
#if defined(MOE_GRAPH_EMULATE)
// The emulator build replaces the CUTLASS launches with stand-ins (tests/emulator/harness_scaled.cpp): explicit
// specializations, declared here so that every translation unit that calls them sees them before the call.
template <> void ScaledArch<ScaledKernel::kSm90Blockwise>::forward(const ScaledForwardCuda&, const ScaledForwardPlan&,
                                                                   const gg::LaunchEnv&, int64_t*);
template <> void ScaledArch<ScaledKernel::kSm90Blockwise>::wgrad(const ScaledWgradCuda&, const ScaledWgradPlan&,
                                                                 const gg::LaunchEnv&, int64_t*);
template <> void ScaledArch<ScaledKernel::kSm100Mxfp8>::forward(const ScaledForwardCuda&, const ScaledForwardPlan&,
                                                                const gg::LaunchEnv&, int64_t*);
template <> void ScaledArch<ScaledKernel::kSm100Mxfp8>::wgrad(const ScaledWgradCuda&, const ScaledWgradPlan&,
                                                              const gg::LaunchEnv&, int64_t*);
#endif
}  // namespace detail

}  // namespace fp8
}  // namespace moe_graph
