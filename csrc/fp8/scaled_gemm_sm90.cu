// SM90 (Hopper) scaled grouped GEMM, TransformerEngine's Float8BlockScaling (DeepSeek-V3's recipe): CUTLASS's
// ptr-array TMA warp-specialized cooperative kernel with blockwise-scaled accumulation (the MMA results of each
// 128-deep K tile are multiplied by a_scale * b_scale and added to fp32 accumulators: scaled_gemm.h's order), tile
// 128x128x128, cluster 1x2. Two instantiations: forward / dgrad (1x128 x 128x128 scales, fp32 bias fused in the
// epilogue, bf16 out) and wgrad (1x128 x 1x128 scales along the tokens, fp32 D = acc + C on main_grad).
#include "fp8/scaled_gemm_cuda.h"

#if defined(MOE_GRAPH_BUILD_SM90)

#include <cutlass/cutlass.h>
#include <cutlass/detail/blockwise_scale_layout.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include <type_traits>

#include "fp8/scaled_launch.cuh"

namespace moe_graph {
namespace fp8 {
namespace detail {
namespace {

using namespace cute;

using Fp8 = cutlass::float_e4m3_t;
using Tile = Shape<_128, _128, _128>;
using Cluster = Shape<_1, _2, _1>;
static_assert(decltype(size(Cluster{}))::value == 2);

// Scales: 1 row x 128 K of A (MN-major grids), `kGranN` columns x 128 K of B.
template <int kGranN>
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, kGranN, 128>;

template <int kGranN, class ElementC, class ElementD, class Fusion>
struct Kernel {
  using SC = ScaleConfig<kGranN>;
  using LayoutSFA = decltype(SC::deduce_layoutSFA());
  using LayoutSFB = decltype(SC::deduce_layoutSFB());
  using RowMajor = cutlass::layout::RowMajor;
  using ColMajor = cutlass::layout::ColumnMajor;
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, RowMajor*, kAlignD, ElementD, RowMajor*,
      kAlignD, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative, Fusion>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Fp8, cute::tuple<RowMajor*, LayoutSFA*>, 16, Fp8,
      cute::tuple<ColMajor*, LayoutSFB*>, 16, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8BlockScaledAccum>::CollectiveOp;

  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<cutlass::gemm::GroupProblemShape<Shape<int, int, int>>,
                                                          Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  using X = ScaledExpert<SC, Fp8, Fp8, ElementD, float>;

  // The argument function computes exactly the kernel's stride and layout types (scaled_expert_args.h).
  static_assert(std::is_same_v<typename GemmKernel::InternalStrideA, KMajorStride>);
  static_assert(std::is_same_v<typename GemmKernel::InternalStrideB, KMajorStride>);
  static_assert(std::is_same_v<typename GemmKernel::InternalStrideD, KMajorStride>);
  static_assert(std::is_same_v<typename Mainloop::InternalLayoutSFA, typename X::LayoutSFA>);
  static_assert(std::is_same_v<typename Mainloop::InternalLayoutSFB, typename X::LayoutSFB>);
};

using Forward = Kernel<128, void, cutlass::bfloat16_t, ScaledBiasEpilogue<Tile>>;
using Wgrad = Kernel<1, float, float, ScaledWgradEpilogue>;

constexpr const char* kForwardName = "sm90_fp8_blockwise_forward_128x128x128_c1x2";
constexpr const char* kWgradName = "sm90_fp8_blockwise_wgrad_128x128x128_c1x2";

}  // namespace

void scaled_forward_sm90(const ScaledForwardCuda& p, const ScaledForwardPlan& plan, const gg::LaunchEnv& env,
                         int64_t* offsets) {
  ScaledLaunch<Forward>::forward(p, plan, env, offsets, kForwardName);
}

void scaled_wgrad_sm90(const ScaledWgradCuda& p, const ScaledWgradPlan& plan, const gg::LaunchEnv& env,
                       int64_t* offsets) {
  ScaledLaunch<Wgrad>::wgrad(p, plan, env, offsets, kWgradName);
}

}  // namespace detail
}  // namespace fp8
}  // namespace moe_graph

#endif  // MOE_GRAPH_BUILD_SM90
