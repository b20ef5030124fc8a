// One launcher body for every CUTLASS grouped kernel the library instantiates (both architectures, 16-bit here and
// FP8 in fp8/scaled_launch.cuh): the CUTLASS arguments from the per-expert argument arrays (grouped_arguments and
// the two epilogues), status checks and the run (checked_run); the 16-bit launches' workspace carve-up and
// argument kernel (grouped_args.cuh).
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

// The CUTLASS arguments of every grouped launch: grouped mode, the per-expert problem shapes, A / B / D pointers and
// strides from the argument arrays `arr` (GroupedArrays, fp8's ScaledArrays), the hardware; the epilogue's
// fusion and source are set by one of the two functions below.
template <class Gemm, class Arr>
typename Gemm::Arguments grouped_arguments(const Arr& arr, int e, const LaunchEnv& env) {
  typename Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {e, arr.shapes, nullptr};
  args.mainloop.ptr_A = arr.ptr_a;
  args.mainloop.dA = arr.stride_a;
  args.mainloop.ptr_B = arr.ptr_b;
  args.mainloop.dB = arr.stride_b;
  args.epilogue.ptr_D = arr.ptr_d;
  args.epilogue.dD = arr.stride_d;
  args.hw_info = hardware_info<Gemm>(env);
  return args;
}

// Forward / dgrad epilogue (BiasEpilogue, fp8's ScaledBiasEpilogue): D = round(acc + bias row of the expert), the
// per-expert bias pointers `ptr_bias` (a null array adds `zero`); no source.
template <class Args, class BiasPtrs, class Zero>
void set_bias_epilogue(Args& args, BiasPtrs ptr_bias, Zero zero) {
  args.epilogue.thread = {{}, {ptr_bias, zero, {}}, {}};  // acc, bias row broadcast, plus
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = nullptr;
}

// Wgrad epilogue (LinearCombination, alpha 1): kAccumulate D = acc + C with C aliasing D (beta 1, arr's C
// pointers and strides); else D = acc without a source.
template <class GemmKernel, bool kAccumulate, class Args, class Arr>
void set_wgrad_epilogue(Args& args, const Arr& arr) {
  auto& fusion = args.epilogue.thread;
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
  args.epilogue.ptr_C = ptr_c;
  args.epilogue.dC = stride_c;
}

// Forward / dgrad launch of configuration `Gemm` (bias fused in the epilogue, BiasEpilogue).
template <class Gemm, bool kBKMajor>
void launch_forward(const ForwardProblem& p, const LaunchEnv& env, const void* const* b_table, int64_t* offsets,
                    const char* name) {
  using GemmKernel = typename Gemm::GemmKernel;
  using Arr = GroupedArrays<GemmKernel, ForwardTags<kBKMajor>>;
  const int e = p.splits.num_experts;
  auto arr = alloc_arguments<Arr>(env, e, p.bias != nullptr);
  auto args = grouped_arguments<Gemm>(arr, e, env);
  set_bias_epilogue(args, arr.ptr_bias, typename GemmKernel::ElementD(0));
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
  auto args = grouped_arguments<Gemm>(arr, e, env);
  set_wgrad_epilogue<GemmKernel, kAccumulate>(args, arr);
  checked_run<Gemm>(args, env, name, [&] {
    enqueue_wgrad_args<GemmKernel>(arr, p, env, out_table, offsets);
    after_args();
  });
}

}  // namespace detail
}  // namespace gg
}  // namespace moe_graph
