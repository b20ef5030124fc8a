// SM100 (Blackwell) scaled grouped GEMM, TransformerEngine's MXFP8BlockScaling: CUTLASS's ptr-array block-scaled
// tcgen05 kernel (OpClassBlockScaledTensorOp, mx_float8_t<e4m3>: the tensor core applies one E8M0 scale per 32
// elements of K to each operand), 1-SM 128x128x128 MMA tile. Two instantiations: forward / dgrad (fp32 bias fused in
// the epilogue, bf16 out) and wgrad (fp32 D = acc + C on main_grad). Scales in CUTLASS's Sm1xxBlkScaledConfig
// layout, written per group by the relayout kernels of scaled_args.cuh.
#include "fp8/scaled_gemm_cuda.h"

#if defined(MOE_GRAPH_BUILD_SM100)

#include <cutlass/cutlass.h>
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
using MxFp8 = cutlass::mx_float8_t<Fp8>;
using Sf = cutlass::float_ue8m0_t;
using Tile = Shape<_128, _128, _128>;
using Cluster = Shape<_1, _1, _1>;

template <class ElementC, class ElementD, class Fusion>
struct Collectives {
  using RowMajor = cutlass::layout::RowMajor;
  using ColMajor = cutlass::layout::ColumnMajor;
  using Epilogue = gg::detail::GroupedEpilogue<cutlass::arch::Sm100, Tile, Cluster,
                                               cutlass::epilogue::PtrArrayTmaWarpSpecialized1Sm, ElementC, ElementD,
                                               Fusion>;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm100, cutlass::arch::OpClassBlockScaledTensorOp, MxFp8, RowMajor*, 16, MxFp8, ColMajor*, 16,
      float, Tile, Cluster, gg::detail::StagesAfter<Epilogue>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecialized1SmMxf8f6f4Sm100>::CollectiveOp;
  using SC = typename Mainloop::Sm1xxBlkScaledConfig;
  static_assert(SC::SFVecSize == 32, "MXFP8: one E8M0 scale per 32 elements of K");
  static_assert(std::is_same_v<typename Mainloop::ElementSF, Sf>);
};

template <class ElementC, class ElementD, class Fusion, class C = Collectives<ElementC, ElementD, Fusion>>
using Kernel = ScaledKernelOf<typename C::Mainloop, typename C::Epilogue, typename C::SC, ElementD, Sf>;

}  // namespace

template <>
struct ScaledKernels<ScaledKernel::kSm100Mxfp8> {
  using Forward = Kernel<void, cutlass::bfloat16_t, ScaledBiasEpilogue<Tile>>;
  using Wgrad = Kernel<float, float, ScaledWgradEpilogue>;
  static constexpr const char* kForwardName = "sm100_mxfp8_forward_1sm_128x128x128";
  static constexpr const char* kWgradName = "sm100_mxfp8_wgrad_1sm_128x128x128";
};

template struct ScaledArch<ScaledKernel::kSm100Mxfp8>;

}  // namespace detail
}  // namespace fp8
}  // namespace moe_graph

#endif  // MOE_GRAPH_BUILD_SM100
