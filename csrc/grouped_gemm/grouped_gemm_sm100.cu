// SM100 (Blackwell) grouped GEMM: CUTLASS ptr-array kernels on tcgen05, 1-SM (128x256 tile) and 2-SM (256x256
// tile on an SM pair) configurations. Same dispatch shape as the SM90 file.
#include "grouped_gemm/grouped_configs.h"

#if defined(MOE_GRAPH_BUILD_SM100)

#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include "grouped_gemm/grouped_launch.cuh"

namespace moe_graph {
namespace gg {
namespace detail {
namespace {

using namespace cute;

struct Sm100OneSm {
  using Tile = Shape<_128, _256, _64>;
  using Cluster = Shape<_1, _1, _1>;
  using Mainloop = cutlass::gemm::KernelPtrArrayTmaWarpSpecialized1SmSm100;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecialized1Sm;
  static constexpr const char* name = "sm100_1sm_128x256x64";
};

struct Sm100TwoSm {
  using Tile = Shape<_256, _256, _64>;
  using Cluster = Shape<_2, _1, _1>;
  using Mainloop = cutlass::gemm::KernelPtrArrayTmaWarpSpecialized2SmSm100;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecialized2Sm;
  static constexpr const char* name = "sm100_2sm_256x256x64";
};

template <class Cfg, class Element, class LayoutA, class LayoutB, class ElementC, class ElementD>
struct GroupedGemmSm100 {
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignAB = 128 / cutlass::sizeof_bits<Element>::value;
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm100, cutlass::arch::OpClassTensorOp, typename Cfg::Tile, typename Cfg::Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, LayoutD*, kAlignD, ElementD,
      LayoutD*, kAlignD, typename Cfg::Epilogue,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, ElementC, float>>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm100, cutlass::arch::OpClassTensorOp, Element, LayoutA*, kAlignAB, Element, LayoutB*,
      kAlignAB, float, typename Cfg::Tile, typename Cfg::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Cfg::Mainloop>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

using RowMajor = cutlass::layout::RowMajor;
using ColMajor = cutlass::layout::ColumnMajor;

template <class Cfg, class Element>
void forward_cfg(const ForwardProblem& p, const LaunchEnv& env, const void* const* b_table, int64_t* offsets) {
  if (p.b_k_major) {
    using G = GroupedGemmSm100<Cfg, Element, RowMajor, ColMajor, void, Element>;
    launch_forward<typename G::Gemm>(p, env, b_table, offsets, Cfg::name);
  } else {
    using G = GroupedGemmSm100<Cfg, Element, RowMajor, RowMajor, void, Element>;
    launch_forward<typename G::Gemm>(p, env, b_table, offsets, Cfg::name);
  }
}

template <class Element>
bool wgrad_typed(const WgradProblem& p, const LaunchEnv& env, bool acc, void* const* out_table, int64_t* offsets,
                 const Hook& after) {
  using Cfg = Sm100TwoSm;
  if (p.out_dtype == DType::kF32) {
    using G = GroupedGemmSm100<Cfg, Element, ColMajor, RowMajor, float, float>;
    launch_wgrad<typename G::Gemm, true>(p, env, out_table, offsets, "sm100_wgrad_f32_accumulate", after);
  } else if (acc) {
    using G = GroupedGemmSm100<Cfg, Element, ColMajor, RowMajor, Element, Element>;
    launch_wgrad<typename G::Gemm, true>(p, env, out_table, offsets, "sm100_wgrad_accumulate", after);
  } else {
    using G = GroupedGemmSm100<Cfg, Element, ColMajor, RowMajor, void, Element>;
    launch_wgrad<typename G::Gemm, false>(p, env, out_table, offsets, "sm100_wgrad", after);
  }
  return true;
}

template <class Element>
bool forward_typed(const ForwardProblem& p, const LaunchEnv& env, Config cfg, const void* const* b_table,
                   int64_t* offsets) {
  if (cfg == Config::kSm100TwoSm)
    forward_cfg<Sm100TwoSm, Element>(p, env, b_table, offsets);
  else
    forward_cfg<Sm100OneSm, Element>(p, env, b_table, offsets);
  return true;
}

}  // namespace

bool forward_sm100(const ForwardProblem& p, const LaunchEnv& env, Config cfg, const void* const* b_table,
                   int64_t* offsets) {
  if (p.dtype == DType::kBF16) return forward_typed<cutlass::bfloat16_t>(p, env, cfg, b_table, offsets);
  if (p.dtype == DType::kF16) return forward_typed<cutlass::half_t>(p, env, cfg, b_table, offsets);
  return false;
}

bool wgrad_sm100(const WgradProblem& p, const LaunchEnv& env, bool accumulate_kernel, void* const* out_table,
                 int64_t* offsets, const Hook& after_args) {
  if (p.dtype == DType::kBF16)
    return wgrad_typed<cutlass::bfloat16_t>(p, env, accumulate_kernel, out_table, offsets, after_args);
  if (p.dtype == DType::kF16)
    return wgrad_typed<cutlass::half_t>(p, env, accumulate_kernel, out_table, offsets, after_args);
  return false;
}

}  // namespace detail
}  // namespace gg
}  // namespace moe_graph

#endif  // MOE_GRAPH_BUILD_SM100
