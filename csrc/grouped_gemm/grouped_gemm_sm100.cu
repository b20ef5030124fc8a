// SM100 (Blackwell) grouped GEMM: CUTLASS ptr-array kernels on tcgen05: 1-SM 64x256 for fine-grained experts,
// 1-SM 128x256 for small groups and 2-SM (256x256 tile on an SM pair, cluster 2x1) for large ones
// (choose_forward_config), 2-SM for wgrad.
#include "grouped_gemm/grouped_configs.h"

#if defined(MOE_GRAPH_BUILD_SM100)

#include "grouped_gemm/grouped_kernel.cuh"

namespace moe_graph {
namespace gg {
namespace detail {
namespace {

using namespace cute;

// Experts with <= 64 rows on average: a 64-row MMA (tcgen05 M = 64 on one SM) instead of wasting half of 128.
struct Sm100OneSmM64 {
  using Tile = Shape<_64, _256, _64>;
  using CtaTile = Tile;
  using Cluster = Shape<_1, _1, _1>;
  using Mainloop = cutlass::gemm::KernelPtrArrayTmaWarpSpecialized1SmSm100;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecialized1Sm;
  static constexpr const char* name = "sm100_1sm_64x256x64";
};

struct Sm100OneSm {
  using Tile = Shape<_128, _256, _64>;
  using CtaTile = Tile;
  using Cluster = Shape<_1, _1, _1>;
  using Mainloop = cutlass::gemm::KernelPtrArrayTmaWarpSpecialized1SmSm100;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecialized1Sm;
  static constexpr const char* name = "sm100_1sm_128x256x64";
};

struct Sm100TwoSm {
  using Tile = Shape<_256, _256, _64>;
  using CtaTile = Shape<_128, _256, _64>;  // each SM of the pair owns half of the MMA tile's rows
  using Cluster = Shape<_2, _1, _1>;
  using Mainloop = cutlass::gemm::KernelPtrArrayTmaWarpSpecialized2SmSm100;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecialized2Sm;
  static constexpr const char* name = "sm100_2sm_256x256x64";
};

static_assert(decltype(size(Sm100OneSmM64::Cluster{}))::value == cluster_size(Config::kSm100OneSmM64));
static_assert(decltype(size(Sm100OneSm::Cluster{}))::value == cluster_size(Config::kSm100OneSm));
static_assert(decltype(size(Sm100TwoSm::Cluster{}))::value == cluster_size(Config::kSm100TwoSm));

using Sm100Kernels = ArchKernels<cutlass::arch::Sm100, Config::kSm100OneSmM64, Sm100OneSmM64, Config::kSm100OneSm,
                                 Sm100OneSm, Sm100TwoSm, Sm100TwoSm>;

}  // namespace

bool forward_sm100(const ForwardProblem& p, const LaunchEnv& env, Config cfg, const void* const* b_table,
                   int64_t* offsets) {
  return Sm100Kernels::forward(p, env, cfg, b_table, offsets);
}

bool wgrad_sm100(const WgradProblem& p, const LaunchEnv& env, WgradKernel kernel, void* const* out_table,
                 int64_t* offsets, const Hook& after_args) {
  return Sm100Kernels::wgrad(p, env, kernel, out_table, offsets, after_args);
}

}  // namespace detail
}  // namespace gg
}  // namespace moe_graph

#endif  // MOE_GRAPH_BUILD_SM100
