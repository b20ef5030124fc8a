// One launcher for the scaled grouped kernels of both architectures (scaled_gemm_sm90.cu, scaled_gemm_sm100.cu) on
// the 16-bit one's body (grouped_gemm/grouped_launch.cuh): workspace carve-up (scaled_plan.cpp's sizes), the
// CUTLASS arguments from the per-expert arrays (gg::detail::grouped_arguments, the two epilogues) plus the scale
// factors, and gg::detail::checked_run (can_implement and the workspace before anything is enqueued, then the
// argument kernel and the relayouts of scaled_args.cuh, then the GEMM). `K` provides Gemm and X (the ScaledExpert
// of its types): ScaledKernelOf.
#pragma once

#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>

#include <type_traits>

#include "fp8/scaled_args.cuh"
#include "fp8/scaled_gemm_cuda.h"
#include "grouped_gemm/grouped_expert_args.h"
#include "grouped_gemm/grouped_kernel.cuh"
#include "grouped_gemm/grouped_launch.cuh"

namespace moe_graph {
namespace fp8 {
namespace detail {

// The forward epilogue of both architectures: D = round(acc + bias_e[n]) with an fp32 bias row per expert (a null
// pointer array adds zero), one rounding to bf16.
template <class Tile>
using ScaledBiasEpilogue = cutlass::epilogue::fusion::Sm90EVT<
    cutlass::epilogue::fusion::Sm90Compute<cutlass::plus, cutlass::bfloat16_t, float,
                                           cutlass::FloatRoundStyle::round_to_nearest>,
    cutlass::epilogue::fusion::Sm90AccFetch,
    cutlass::epilogue::fusion::Sm90RowBroadcast<0, Tile, float*, float, gg::detail::BiasStride, 4>>;

// The wgrad epilogue of both: D = acc + C in fp32.
using ScaledWgradEpilogue = cutlass::epilogue::fusion::LinearCombination<float, float, float, float>;

// The CUTLASS kernel of a scaled launch from its two collectives (the epilogue: gg::detail::GroupedEpilogue) and the
// ScaledExpert of its types (E4M3 operands); the argument functions (scaled_expert_args.h) compute exactly its
// stride and scale-layout types.
template <class Mainloop, class Epilogue, class ScaleConfig, class ElementD, class ElementSF>
struct ScaledKernelOf {
  using GemmKernel = gg::detail::GroupedKernelOf<Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  using X = ScaledExpert<ScaleConfig, cutlass::float_e4m3_t, cutlass::float_e4m3_t, ElementD, ElementSF>;
  static_assert(std::is_same_v<typename GemmKernel::InternalStrideA, KMajorStride>);
  static_assert(std::is_same_v<typename GemmKernel::InternalStrideB, KMajorStride>);
  static_assert(std::is_same_v<typename GemmKernel::InternalStrideD, KMajorStride>);
  static_assert(std::is_same_v<typename Mainloop::InternalLayoutSFA, typename X::LayoutSFA>);
  static_assert(std::is_same_v<typename Mainloop::InternalLayoutSFB, typename X::LayoutSFB>);
};

template <class K>
struct ScaledLaunch {
  using Gemm = typename K::Gemm;
  using X = typename K::X;
  using Arr = ScaledArrays<X>;
  using ESF = typename X::ElementSF;

  // gg::detail::grouped_arguments and the scale factors of both operands.
  static typename Gemm::Arguments arguments(const Arr& arr, int e, const gg::LaunchEnv& env) {
    auto args = gg::detail::grouped_arguments<Gemm>(arr, e, env);
    args.mainloop.ptr_SFA = arr.ptr_sfa;
    args.mainloop.layout_SFA = arr.layout_sfa;
    args.mainloop.ptr_SFB = arr.ptr_sfb;
    args.mainloop.layout_SFB = arr.layout_sfb;
    return args;
  }

  // Forward / dgrad: bias row broadcast (null array: + 0) fused in the epilogue, no source.
  static void forward(const ScaledForwardCuda& p, const ScaledForwardPlan& plan, const gg::LaunchEnv& env,
                      int64_t* offsets, const char* name) {
    const int e = p.splits.num_experts;
    const Arr arr = gg::detail::carve_arguments<Arr>(static_cast<char*>(env.alloc(plan.argument_bytes)), e,
                                                p.bias != nullptr);
    auto* sfa = static_cast<ESF*>(env.alloc(plan.sfa_bytes));
    auto* sfb = static_cast<ESF*>(env.alloc(plan.sfb_bytes));
    auto args = arguments(arr, e, env);
    gg::detail::set_bias_epilogue(args, arr.ptr_bias, 0.0f);
    gg::detail::checked_run<Gemm>(args, env, name, [&] {
      enqueue_scaled_forward_args<X>(arr, p, plan, env, offsets, sfa, sfb);
    });
  }

  // Wgrad: D = acc + C with C aliasing D (an overwrite zeroed D first: scaled_plan.h).
  static void wgrad(const ScaledWgradCuda& p, const ScaledWgradPlan& plan, const gg::LaunchEnv& env,
                    int64_t* offsets, const char* name) {
    const int e = p.splits.num_experts;
    const Arr arr = gg::detail::carve_arguments<Arr>(static_cast<char*>(env.alloc(plan.argument_bytes)), e, false);
    auto* sfa = static_cast<ESF*>(env.alloc(plan.sfa_bytes));
    auto* sfb = static_cast<ESF*>(env.alloc(plan.sfb_bytes));
    auto args = arguments(arr, e, env);
    gg::detail::set_wgrad_epilogue<typename Gemm::GemmKernel, true>(args, arr);
    gg::detail::checked_run<Gemm>(args, env, name, [&] {
      enqueue_scaled_wgrad_args<X>(arr, p, plan, env, offsets, sfa, sfb);
    });
  }
};

// The kernels of a family, specialized by its per-architecture file: Forward and Wgrad (ScaledKernelOf) and their
// names.
template <ScaledKernel kKernel>
struct ScaledKernels;

template <ScaledKernel kKernel>
void ScaledArch<kKernel>::forward(const ScaledForwardCuda& p, const ScaledForwardPlan& plan, const gg::LaunchEnv& env,
                                  int64_t* offsets) {
  using K = ScaledKernels<kKernel>;
  ScaledLaunch<typename K::Forward>::forward(p, plan, env, offsets, K::kForwardName);
}

template <ScaledKernel kKernel>
void ScaledArch<kKernel>::wgrad(const ScaledWgradCuda& p, const ScaledWgradPlan& plan, const gg::LaunchEnv& env,
                                int64_t* offsets) {
  using K = ScaledKernels<kKernel>;
  ScaledLaunch<typename K::Wgrad>::wgrad(p, plan, env, offsets, K::kWgradName);
}

}  // namespace detail
}  // namespace fp8
}  // namespace moe_graph
