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
struct Collectives {
  using SC = ScaleConfig<kGranN>;
  using RowMajor = cutlass::layout::RowMajor;
  using ColMajor = cutlass::layout::ColumnMajor;
  using Epilogue = gg::detail::GroupedEpilogue<cutlass::arch::Sm90, Tile, Cluster,
                                               cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative, ElementC,
                                               ElementD, Fusion>;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Fp8,
      cute::tuple<RowMajor*, decltype(SC::deduce_layoutSFA())*>, 16, Fp8,
      cute::tuple<ColMajor*, decltype(SC::deduce_layoutSFB())*>, 16, float, Tile, Cluster,
      gg::detail::StagesAfter<Epilogue>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8BlockScaledAccum>::CollectiveOp;
};

template <int kGranN, class ElementC, class ElementD, class Fusion,
          class C = Collectives<kGranN, ElementC, ElementD, Fusion>>
using Kernel = ScaledKernelOf<typename C::Mainloop, typename C::Epilogue, typename C::SC, ElementD, float>;

}  // namespace

template <>
struct ScaledKernels<ScaledKernel::kSm90Blockwise> {
  using Forward = Kernel<128, void, cutlass::bfloat16_t, ScaledBiasEpilogue<Tile>>;
  using Wgrad = Kernel<1, float, float, ScaledWgradEpilogue>;
  static constexpr const char* kForwardName = "sm90_fp8_blockwise_forward_128x128x128_c1x2";
  static constexpr const char* kWgradName = "sm90_fp8_blockwise_wgrad_128x128x128_c1x2";
};

template struct ScaledArch<ScaledKernel::kSm90Blockwise>;

}  // namespace detail
}  // namespace fp8
}  // namespace moe_graph

#endif  // MOE_GRAPH_BUILD_SM90
