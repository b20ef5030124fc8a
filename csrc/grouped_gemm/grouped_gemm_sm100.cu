// SM100 (Blackwell) grouped GEMM: CUTLASS ptr-array kernels on tcgen05, 1-SM (128x256 tile) for small groups and
// 2-SM (256x256 tile on an SM pair, cluster 2x1) for large ones (choose_forward_config), 2-SM for wgrad.
#include "grouped_gemm/grouped_configs.h"

#if defined(MOE_GRAPH_BUILD_SM100)

#include "grouped_gemm/grouped_kernel.cuh"

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

using Sm100Kernels = ArchKernels<cutlass::arch::Sm100, Config::kSm100OneSm, Sm100OneSm, Sm100TwoSm, Sm100TwoSm>;

}  // namespace

bool forward_sm100(const ForwardProblem& p, const LaunchEnv& env, Config cfg, const void* const* b_table,
                   int64_t* offsets) {
  return Sm100Kernels::forward(p, env, cfg, b_table, offsets);
}

bool wgrad_sm100(const WgradProblem& p, const LaunchEnv& env, bool accumulate_kernel, void* const* out_table,
                 int64_t* offsets, const Hook& after_args) {
  return Sm100Kernels::wgrad(p, env, accumulate_kernel, out_table, offsets, after_args);
}

}  // namespace detail
}  // namespace gg
}  // namespace moe_graph

#endif  // MOE_GRAPH_BUILD_SM100
