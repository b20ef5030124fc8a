// SM90 (Hopper) grouped GEMM: CUTLASS TMA warp-specialized ptr-array kernels, ping-pong for small groups and
// cooperative for large ones (choose_forward_config), cooperative for wgrad.
#include "grouped_gemm/grouped_configs.h"

#if defined(MOE_GRAPH_BUILD_SM90)

#include "grouped_gemm/grouped_kernel.cuh"

namespace moe_graph {
namespace gg {
namespace detail {
namespace {

using namespace cute;

struct Sm90Cooperative {
  using Tile = Shape<_128, _256, _64>;
  using CtaTile = Tile;
  using Cluster = Shape<_1, _2, _1>;
  using Mainloop = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
  static constexpr const char* name = "sm90_cooperative_128x256x64_c1x2";
};

struct Sm90Pingpong {
  using Tile = Shape<_64, _128, _64>;
  using CtaTile = Tile;
  using Cluster = Shape<_1, _2, _1>;
  using Mainloop = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
  static constexpr const char* name = "sm90_pingpong_64x128x64_c1x2";
};

static_assert(decltype(size(Sm90Cooperative::Cluster{}))::value == cluster_size(Config::kSm90Cooperative));
static_assert(decltype(size(Sm90Pingpong::Cluster{}))::value == cluster_size(Config::kSm90Pingpong));

using Sm90Kernels = ArchKernels<cutlass::arch::Sm90, Config::kSm90Pingpong, Sm90Pingpong, Config::kSm90Cooperative,
                                Sm90Cooperative, Sm90Cooperative, Sm90Cooperative>;

}  // namespace

bool forward_sm90(const ForwardProblem& p, const LaunchEnv& env, Config cfg, const void* const* b_table,
                  int64_t* offsets) {
  return Sm90Kernels::forward(p, env, cfg, b_table, offsets);
}

bool wgrad_sm90(const WgradProblem& p, const LaunchEnv& env, WgradKernel kernel, void* const* out_table,
                int64_t* offsets, const Hook& after_args) {
  return Sm90Kernels::wgrad(p, env, kernel, out_table, offsets, after_args);
}

}  // namespace detail
}  // namespace gg
}  // namespace moe_graph

#endif  // MOE_GRAPH_BUILD_SM90
