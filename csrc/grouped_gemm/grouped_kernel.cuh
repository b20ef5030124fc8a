// One config struct -> one CUTLASS grouped (ptr-array) kernel type, and the runtime -> template dispatch shared
// by the per-architecture files. A config struct provides Tile (MMA tile), CtaTile (the tile of one CTA: Tile,
// or half of it along M for 2-SM MMAs), Cluster, Mainloop (kernel schedule), Epilogue (epilogue schedule) and a
// name.
#pragma once

#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include "grouped_gemm/grouped_configs.h"
#include "grouped_gemm/grouped_launch.cuh"

namespace moe_graph {
namespace gg {
namespace detail {

// Forward epilogue: D = round(acc + bias_e[n]) in fp32, one rounding (as cuBLASLt and TransformerEngine do).
// The bias is a per-group row broadcast from an array of pointers (one per expert); a null array adds zero.
template <class CtaTile, class ElementD>
using BiasEpilogue = cutlass::epilogue::fusion::Sm90EVT<
    cutlass::epilogue::fusion::Sm90Compute<cutlass::plus, ElementD, float, cutlass::FloatRoundStyle::round_to_nearest>,
    cutlass::epilogue::fusion::Sm90AccFetch,
    cutlass::epilogue::fusion::Sm90RowBroadcast<0, CtaTile, ElementD*, float, BiasStride,
                                                128 / cutlass::sizeof_bits<ElementD>::value>>;

// The epilogue collective of every grouped kernel (16-bit here, FP8 in fp8/scaled_gemm_sm90.cu / _sm100.cu): fp32
// accumulators and compute, row-major C / D with 16-byte aligned rows (ElementC void: no source), `Schedule` the
// epilogue schedule, `Fusion` its operation or callbacks.
template <class ArchTag, class Tile, class Cluster, class Schedule, class ElementC, class ElementD, class Fusion>
using GroupedEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    ArchTag, cutlass::arch::OpClassTensorOp, Tile, Cluster, cutlass::epilogue::collective::EpilogueTileAuto, float,
    float, ElementC, cutlass::layout::RowMajor*, 128 / cutlass::sizeof_bits<ElementD>::value, ElementD,
    cutlass::layout::RowMajor*, 128 / cutlass::sizeof_bits<ElementD>::value, Schedule, Fusion>::CollectiveOp;

// The mainloop's stage count: as many as the shared memory the epilogue leaves holds.
template <class Epilogue>
using StagesAfter =
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>;

// The grouped (ptr-array) GEMM of a mainloop and an epilogue collective, and its device adapter.
template <class Mainloop, class Epilogue>
using GroupedKernelOf =
    cutlass::gemm::kernel::GemmUniversal<cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>, Mainloop,
                                         Epilogue>;

// Element: A/B type. Tags: operand layouts (grouped_expert_args.h). ElementC: void (no source) or the type of D
// (D = A.B + C with C aliasing D). Fusion: the epilogue's fusion operation or callbacks. Row-major C/D.
template <class ArchTag, class Cfg, class Element, class Tags, class ElementC, class ElementD, class Fusion>
struct GroupedGemmKernel {
  static constexpr int kAlignAB = 128 / cutlass::sizeof_bits<Element>::value;

  using Epilogue = GroupedEpilogue<ArchTag, typename Cfg::Tile, typename Cfg::Cluster, typename Cfg::Epilogue, ElementC,
                                   ElementD, Fusion>;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      ArchTag, cutlass::arch::OpClassTensorOp, Element, typename Tags::A*, kAlignAB, Element, typename Tags::B*,
      kAlignAB, float, typename Cfg::Tile, typename Cfg::Cluster, StagesAfter<Epilogue>,
      typename Cfg::Mainloop>::CollectiveOp;

  using Kernel = GroupedKernelOf<Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

template <class ElementC, class ElementD>
using LinComb = cutlass::epilogue::fusion::LinearCombination<ElementD, float, ElementC, float>;

// Forward / dgrad with configuration Cfg, bias fused in the epilogue. b_k_major (B_e stored [n, k]) -> CUTLASS
// ColumnMajor B (K contiguous); else ([k, n]) RowMajor B.
template <class ArchTag, class Cfg, class Element, bool kBKMajor>
void forward_with_layout(const ForwardProblem& p, const LaunchEnv& env, const void* const* b_table,
                         int64_t* offsets) {
  using G = GroupedGemmKernel<ArchTag, Cfg, Element, ForwardTags<kBKMajor>, void, Element,
                              BiasEpilogue<typename Cfg::CtaTile, Element>>;
  launch_forward<typename G::Gemm, kBKMajor>(p, env, b_table, offsets, Cfg::name);
}

template <class ArchTag, class Cfg, class Element>
void forward_with(const ForwardProblem& p, const LaunchEnv& env, const void* const* b_table, int64_t* offsets) {
  if (p.b_k_major)
    forward_with_layout<ArchTag, Cfg, Element, true>(p, env, b_table, offsets);
  else
    forward_with_layout<ArchTag, Cfg, Element, false>(p, env, b_table, offsets);
}

// Wgrad with configuration Cfg (operands: grouped_expert_args.h). kAccumulate: D = A.B + D (C aliases D, beta 1);
// kOverwrite: D = A.B without reading D, for fp32 (main_grad) and 16-bit outputs alike.
template <class ArchTag, class Cfg, class Element>
void wgrad_with(const WgradProblem& p, const LaunchEnv& env, WgradKernel kernel, void* const* out_table,
                int64_t* offsets, const Hook& after) {
  const bool acc = kernel == WgradKernel::kAccumulate;
  if (p.out_dtype == DType::kF32) {
    if (acc) {
      using G = GroupedGemmKernel<ArchTag, Cfg, Element, WgradTags, float, float, LinComb<float, float>>;
      launch_wgrad<typename G::Gemm, true>(p, env, out_table, offsets, Cfg::name, after);
    } else {
      using G = GroupedGemmKernel<ArchTag, Cfg, Element, WgradTags, void, float, LinComb<void, float>>;
      launch_wgrad<typename G::Gemm, false>(p, env, out_table, offsets, Cfg::name, after);
    }
  } else if (acc) {
    using G = GroupedGemmKernel<ArchTag, Cfg, Element, WgradTags, Element, Element, LinComb<Element, Element>>;
    launch_wgrad<typename G::Gemm, true>(p, env, out_table, offsets, Cfg::name, after);
  } else {
    using G = GroupedGemmKernel<ArchTag, Cfg, Element, WgradTags, void, Element, LinComb<void, Element>>;
    launch_wgrad<typename G::Gemm, false>(p, env, out_table, offsets, Cfg::name, after);
  }
}

// The dispatch of one architecture: forward configs CfgSmall (config == kSmall), CfgMid (config == kMid) and
// CfgLarge (otherwise), wgrad config CfgWgrad; bf16 and fp16.
template <class ArchTag, Config kSmall, class CfgSmall, Config kMid, class CfgMid, class CfgLarge, class CfgWgrad>
struct ArchKernels {
  template <class Element>
  static void forward_typed(const ForwardProblem& p, const LaunchEnv& env, Config cfg, const void* const* b_table,
                            int64_t* offsets) {
    if (cfg == kSmall)
      forward_with<ArchTag, CfgSmall, Element>(p, env, b_table, offsets);
    else if (cfg == kMid)
      forward_with<ArchTag, CfgMid, Element>(p, env, b_table, offsets);
    else
      forward_with<ArchTag, CfgLarge, Element>(p, env, b_table, offsets);
  }

  static bool forward(const ForwardProblem& p, const LaunchEnv& env, Config cfg, const void* const* b_table,
                      int64_t* offsets) {
    if (p.dtype == DType::kBF16)
      forward_typed<cutlass::bfloat16_t>(p, env, cfg, b_table, offsets);
    else if (p.dtype == DType::kF16)
      forward_typed<cutlass::half_t>(p, env, cfg, b_table, offsets);
    else
      return false;
    return true;
  }

  static bool wgrad(const WgradProblem& p, const LaunchEnv& env, WgradKernel kernel, void* const* out_table,
                    int64_t* offsets, const Hook& after_args) {
    if (p.dtype == DType::kBF16)
      wgrad_with<ArchTag, CfgWgrad, cutlass::bfloat16_t>(p, env, kernel, out_table, offsets, after_args);
    else if (p.dtype == DType::kF16)
      wgrad_with<ArchTag, CfgWgrad, cutlass::half_t>(p, env, kernel, out_table, offsets, after_args);
    else
      return false;
    return true;
  }
};

}  // namespace detail
}  // namespace gg
}  // namespace moe_graph
