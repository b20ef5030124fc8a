// One config struct -> one CUTLASS grouped (ptr-array) kernel type, and the runtime -> template dispatch shared
// by the per-architecture files. A config struct provides Tile, Cluster, Mainloop (kernel schedule), Epilogue
// (epilogue schedule) and a name.
#pragma once

#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
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

// Element: A/B type. LayoutA/LayoutB: CUTLASS layouts of the GEMM operands. ElementC: void (no source) or the type
// of D (D = A.B + C with C aliasing D). ElementD: output type. Row-major C/D.
template <class ArchTag, class Cfg, class Element, class LayoutA, class LayoutB, class ElementC, class ElementD>
struct GroupedGemmKernel {
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignAB = 128 / cutlass::sizeof_bits<Element>::value;
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      ArchTag, cutlass::arch::OpClassTensorOp, typename Cfg::Tile, typename Cfg::Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, LayoutD*, kAlignD, ElementD, LayoutD*,
      kAlignD, typename Cfg::Epilogue,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, ElementC, float>>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      ArchTag, cutlass::arch::OpClassTensorOp, Element, LayoutA*, kAlignAB, Element, LayoutB*, kAlignAB, float,
      typename Cfg::Tile, typename Cfg::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Cfg::Mainloop>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

using RowMajor = cutlass::layout::RowMajor;
using ColMajor = cutlass::layout::ColumnMajor;

// Forward / dgrad with configuration Cfg: b_k_major (B_e stored [n, k]) -> CUTLASS ColumnMajor B (K contiguous);
// else ([k, n]) RowMajor B.
template <class ArchTag, class Cfg, class Element>
void forward_with(const ForwardProblem& p, const LaunchEnv& env, const void* const* b_table, int64_t* offsets) {
  if (p.b_k_major) {
    using G = GroupedGemmKernel<ArchTag, Cfg, Element, RowMajor, ColMajor, void, Element>;
    launch_forward<typename G::Gemm>(p, env, b_table, offsets, Cfg::name);
  } else {
    using G = GroupedGemmKernel<ArchTag, Cfg, Element, RowMajor, RowMajor, void, Element>;
    launch_forward<typename G::Gemm>(p, env, b_table, offsets, Cfg::name);
  }
}

// Wgrad with configuration Cfg. Operands: A = dy^T (dy is [rows, n] row-major: M-major, CUTLASS ColumnMajor A),
// B = a ([rows, k] row-major: N-major, CUTLASS RowMajor B). fp32 output (main_grad) always uses the accumulating
// kernel (overwritten experts are zeroed first by `after`); 16-bit output accumulates when `acc`.
template <class ArchTag, class Cfg, class Element>
void wgrad_with(const WgradProblem& p, const LaunchEnv& env, bool acc, void* const* out_table, int64_t* offsets,
                const Hook& after) {
  if (p.out_dtype == DType::kF32) {
    using G = GroupedGemmKernel<ArchTag, Cfg, Element, ColMajor, RowMajor, float, float>;
    launch_wgrad<typename G::Gemm, true>(p, env, out_table, offsets, Cfg::name, after);
  } else if (acc) {
    using G = GroupedGemmKernel<ArchTag, Cfg, Element, ColMajor, RowMajor, Element, Element>;
    launch_wgrad<typename G::Gemm, true>(p, env, out_table, offsets, Cfg::name, after);
  } else {
    using G = GroupedGemmKernel<ArchTag, Cfg, Element, ColMajor, RowMajor, void, Element>;
    launch_wgrad<typename G::Gemm, false>(p, env, out_table, offsets, Cfg::name, after);
  }
}

// The dispatch of one architecture: forward configs CfgSmall (picked by config == kSmall) and CfgLarge, wgrad
// config CfgWgrad; bf16 and fp16.
template <class ArchTag, Config kSmall, class CfgSmall, class CfgLarge, class CfgWgrad>
struct ArchKernels {
  template <class Element>
  static void forward_typed(const ForwardProblem& p, const LaunchEnv& env, Config cfg, const void* const* b_table,
                            int64_t* offsets) {
    if (cfg == kSmall)
      forward_with<ArchTag, CfgSmall, Element>(p, env, b_table, offsets);
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

  static bool wgrad(const WgradProblem& p, const LaunchEnv& env, bool accumulate_kernel, void* const* out_table,
                    int64_t* offsets, const Hook& after_args) {
    if (p.dtype == DType::kBF16)
      wgrad_with<ArchTag, CfgWgrad, cutlass::bfloat16_t>(p, env, accumulate_kernel, out_table, offsets, after_args);
    else if (p.dtype == DType::kF16)
      wgrad_with<ArchTag, CfgWgrad, cutlass::half_t>(p, env, accumulate_kernel, out_table, offsets, after_args);
    else
      return false;
    return true;
  }
};

}  // namespace detail
}  // namespace gg
}  // namespace moe_graph
