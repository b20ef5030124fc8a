// One launcher template for every CUTLASS grouped kernel the library instantiates (both architectures):
// workspace carve-up, the argument kernel, CUTLASS arguments, status checks, run.
#pragma once

#include <cutlass/cutlass.h>
#include <cutlass/kernel_hardware_info.h>

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>

#include "common/cuda_check.h"
#include "grouped_gemm/grouped_args.cuh"
#include "grouped_gemm/grouped_gemm.h"
#include "grouped_gemm/grouped_plan.h"

namespace moe_graph {
namespace gg {
namespace detail {

inline void check_cutlass(cutlass::Status status, const char* step, const char* kernel) {
  if (status != cutlass::Status::kSuccess) {
    std::ostringstream os;
    os << "moe_graph grouped GEMM (" << kernel << "): CUTLASS " << step << " failed: "
       << cutlassGetStatusString(status);
    throw std::runtime_error(os.str());
  }
}

template <class Gemm>
cutlass::KernelHardwareInfo hardware_info(const LaunchEnv& env) {
  cutlass::KernelHardwareInfo hw;
  hw.device_id = env.device;
  // env.sm_count is already less torch's SM carve-out (effective_sm_count); whole clusters of it
  hw.sm_count = cluster_sm_count(env.sm_count, cute::size(typename Gemm::GemmKernel::ClusterShape{}));
  return hw;
}

// Everything that can fail on the host runs before the first kernel of the launch is enqueued: can_implement and
// the workspace size / allocation. Then the argument kernel (`enqueue_args`), initialize and run.
template <class Gemm, class EnqueueArgs>
void checked_run(const typename Gemm::Arguments& args, const LaunchEnv& env, const char* name,
                 EnqueueArgs&& enqueue_args) {
  Gemm gemm;
  check_cutlass(gemm.can_implement(args), "can_implement", name);
  const size_t ws_bytes = Gemm::get_workspace_size(args);
  void* ws = ws_bytes ? env.alloc(ws_bytes) : nullptr;
  enqueue_args();
  check_cutlass(gemm.initialize(args, ws, env.stream), "initialize", name);
  check_cutlass(gemm.run(env.stream), "run", name);
  check_launch(name);
}

// Forward / dgrad launch of configuration `Gemm` (bias fused in the epilogue, BiasEpilogue).
template <class Gemm, bool kBKMajor>
void launch_forward(const ForwardProblem& p, const LaunchEnv& env, const void* const* b_table, int64_t* offsets,
                    const char* name) {
  using GemmKernel = typename Gemm::GemmKernel;
  using Arr = GroupedArrays<GemmKernel, ForwardTags<kBKMajor>>;
  using ElementD = typename GemmKernel::ElementD;
  const int e = p.splits.num_experts;
  const bool with_bias = p.bias != nullptr;
  auto arr = alloc_arguments<Arr>(env, e, with_bias);

  typename Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {e, arr.shapes, nullptr};
  args.mainloop = {arr.ptr_a, arr.stride_a, arr.ptr_b, arr.stride_b};
  args.epilogue.thread = {{}, {arr.ptr_bias, ElementD(0), {}}, {}};  // acc, bias row broadcast, plus
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = nullptr;
  args.epilogue.ptr_D = arr.ptr_d;
  args.epilogue.dD = arr.stride_d;
  args.hw_info = hardware_info<Gemm>(env);

  checked_run<Gemm>(args, env, name,
                    [&] { enqueue_forward_args<GemmKernel, kBKMajor>(arr, p, env, b_table, offsets); });
}

// Wgrad launch of configuration `Gemm` (kAccumulate: C = D, beta = 1; else no source).
// `after_args` runs between the argument kernel and the GEMM (the zero-fill of overwritten experts needs the
// clamped offsets).
template <class Gemm, bool kAccumulate, class AfterArgs>
void launch_wgrad(const WgradProblem& p, const LaunchEnv& env, void* const* out_table, int64_t* offsets,
                  const char* name, AfterArgs&& after_args) {
  using GemmKernel = typename Gemm::GemmKernel;
  using Arr = GroupedArrays<GemmKernel, WgradTags>;
  const int e = p.splits.num_experts;
  auto arr = alloc_arguments<Arr>(env, e, false);

  typename Gemm::Arguments args;
  decltype(args.epilogue.thread) fusion;
  fusion.alpha = 1.0f;
  fusion.beta = kAccumulate ? 1.0f : 0.0f;
  fusion.alpha_ptr = nullptr;
  fusion.beta_ptr = nullptr;
  using ElementC = typename GemmKernel::CollectiveEpilogue::ElementC;
  const ElementC** ptr_c = nullptr;
  typename GemmKernel::InternalStrideC* stride_c = nullptr;
  if constexpr (kAccumulate) {
    ptr_c = reinterpret_cast<const ElementC**>(arr.ptr_c);
    stride_c = arr.stride_c;
  }
  args = typename Gemm::Arguments{cutlass::gemm::GemmUniversalMode::kGrouped,
                                  {e, arr.shapes, nullptr},
                                  {arr.ptr_a, arr.stride_a, arr.ptr_b, arr.stride_b},
                                  {fusion, ptr_c, stride_c, arr.ptr_d, arr.stride_d},
                                  hardware_info<Gemm>(env)};

  checked_run<Gemm>(args, env, name, [&] {
    enqueue_wgrad_args<GemmKernel>(arr, p, env, out_table, offsets);
    after_args();
  });
}

}  // namespace detail
}  // namespace gg
}  // namespace moe_graph
