// SM90 (Hopper) grouped GEMM: CUTLASS TMA warp-specialized ptr-array kernels, cooperative and ping-pong.
// One config struct -> one kernel type (GroupedGemmSm90<...>); the dispatch below maps runtime choices
// (dtype, B layout, config, accumulate) to instantiations.
#include "grouped_gemm/grouped_configs.h"

#if defined(MOE_GRAPH_BUILD_SM90)

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

struct Sm90Cooperative {
  using Tile = Shape<_128, _256, _64>;
  using Cluster = Shape<_1, _2, _1>;
  using Mainloop = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
  static constexpr const char* name = "sm90_cooperative_128x256x64_c1x2";
};

struct Sm90Pingpong {
  using Tile = Shape<_64, _128, _64>;
  using Cluster = Shape<_1, _2, _1>;
  using Mainloop = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
  static constexpr const char* name = "sm90_pingpong_64x128x64_c1x2";
};

// Element: A/B type. LayoutA/LayoutB: CUTLASS layouts of the GEMM operands. ElementC: void (no source) or the
// type of D (accumulate into D). ElementD: output type.
template <class Cfg, class Element, class LayoutA, class LayoutB, class ElementC, class ElementD>
struct GroupedGemmSm90 {
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignAB = 128 / cutlass::sizeof_bits<Element>::value;
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;
  using ElementCEff = ElementC;
  static constexpr int kAlignC = std::is_void_v<ElementC> ? kAlignD : 128 / cutlass::sizeof_bits<ElementD>::value;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Cfg::Tile, typename Cfg::Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, LayoutD*, kAlignC, ElementD,
      LayoutD*, kAlignD, typename Cfg::Epilogue,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, ElementC, float>>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, kAlignAB, Element, LayoutB*, kAlignAB,
      float, typename Cfg::Tile, typename Cfg::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Cfg::Mainloop>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

using RowMajor = cutlass::layout::RowMajor;
using ColMajor = cutlass::layout::ColumnMajor;

template <class Element>
bool forward_typed(const ForwardProblem& p, const LaunchEnv& env, Config cfg, const void* const* b_table,
                   int64_t* offsets) {
  // b_k_major: B_e stored [n, k] -> CUTLASS ColumnMajor B (K contiguous); else [k, n] -> RowMajor B.
  if (cfg == Config::kSm90Pingpong) {
    if (p.b_k_major) {
      using G = GroupedGemmSm90<Sm90Pingpong, Element, RowMajor, ColMajor, void, Element>;
      launch_forward<typename G::Gemm>(p, env, b_table, offsets, Sm90Pingpong::name);
    } else {
      using G = GroupedGemmSm90<Sm90Pingpong, Element, RowMajor, RowMajor, void, Element>;
      launch_forward<typename G::Gemm>(p, env, b_table, offsets, Sm90Pingpong::name);
    }
  } else {
    if (p.b_k_major) {
      using G = GroupedGemmSm90<Sm90Cooperative, Element, RowMajor, ColMajor, void, Element>;
      launch_forward<typename G::Gemm>(p, env, b_table, offsets, Sm90Cooperative::name);
    } else {
      using G = GroupedGemmSm90<Sm90Cooperative, Element, RowMajor, RowMajor, void, Element>;
      launch_forward<typename G::Gemm>(p, env, b_table, offsets, Sm90Cooperative::name);
    }
  }
  return true;
}

// Wgrad operands: A = dy^T (dy is [rows, n] row-major: M-major, CUTLASS ColumnMajor A),
// B = a ([rows, k] row-major: N-major, CUTLASS RowMajor B).
template <class Element>
bool wgrad_typed(const WgradProblem& p, const LaunchEnv& env, bool acc, void* const* out_table, int64_t* offsets,
                 const Hook& after) {
  using Cfg = Sm90Cooperative;
  if (p.out_dtype == DType::kF32) {
    // fp32 out (main_grad) always uses the accumulating kernel; overwritten experts are zeroed first.
    using G = GroupedGemmSm90<Cfg, Element, ColMajor, RowMajor, float, float>;
    launch_wgrad<typename G::Gemm, true>(p, env, out_table, offsets, "sm90_wgrad_f32_accumulate", after);
  } else if (acc) {
    using G = GroupedGemmSm90<Cfg, Element, ColMajor, RowMajor, Element, Element>;
    launch_wgrad<typename G::Gemm, true>(p, env, out_table, offsets, "sm90_wgrad_accumulate", after);
  } else {
    using G = GroupedGemmSm90<Cfg, Element, ColMajor, RowMajor, void, Element>;
    launch_wgrad<typename G::Gemm, false>(p, env, out_table, offsets, "sm90_wgrad", after);
  }
  return true;
}

}  // namespace

bool forward_sm90(const ForwardProblem& p, const LaunchEnv& env, Config cfg, const void* const* b_table,
                  int64_t* offsets) {
  if (p.dtype == DType::kBF16) return forward_typed<cutlass::bfloat16_t>(p, env, cfg, b_table, offsets);
  if (p.dtype == DType::kF16) return forward_typed<cutlass::half_t>(p, env, cfg, b_table, offsets);
  return false;
}

bool wgrad_sm90(const WgradProblem& p, const LaunchEnv& env, bool accumulate_kernel, void* const* out_table,
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

#endif  // MOE_GRAPH_BUILD_SM90
