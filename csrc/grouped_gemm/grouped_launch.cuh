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
#include "common/launch.cuh"
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

inline size_t align_up(size_t x, size_t a = 128) { return (x + a - 1) / a * a; }

// Carves the argument arrays out of one allocation of argument_bytes(e, with_bias) (grouped_plan.cpp), in the
// order that formula counts them.
template <class Arr>
Arr carve_arguments(char* base, int e, bool with_bias) {
  Arr a;
  auto take = [&](size_t n) {
    char* p = base;
    base += align_up(n);
    return p;
  };
  a.shapes = reinterpret_cast<typename Arr::ProblemShape*>(take(sizeof(typename Arr::ProblemShape) * e));
  a.ptr_a = reinterpret_cast<const typename Arr::ElementA**>(take(sizeof(void*) * e));
  a.ptr_b = reinterpret_cast<const typename Arr::ElementB**>(take(sizeof(void*) * e));
  a.ptr_c = reinterpret_cast<const typename Arr::ElementD**>(take(sizeof(void*) * e));
  a.ptr_d = reinterpret_cast<typename Arr::ElementD**>(take(sizeof(void*) * e));
  a.ptr_bias = with_bias ? reinterpret_cast<const typename Arr::ElementD**>(take(sizeof(void*) * e)) : nullptr;
  a.stride_a = reinterpret_cast<typename Arr::StrideA*>(take(sizeof(typename Arr::StrideA) * e));
  a.stride_b = reinterpret_cast<typename Arr::StrideB*>(take(sizeof(typename Arr::StrideB) * e));
  a.stride_c = reinterpret_cast<typename Arr::StrideC*>(take(sizeof(typename Arr::StrideC) * e));
  a.stride_d = reinterpret_cast<typename Arr::StrideD*>(take(sizeof(typename Arr::StrideD) * e));
  return a;
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
  auto arr = carve_arguments<Arr>(static_cast<char*>(env.alloc(argument_bytes(e, with_bias))), e, with_bias);

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

  const int tail_blocks = tail_zero_blocks(p.rows, p.n);  // plan_forward's arg_tail_blocks
  checked_run<Gemm>(args, env, name, [&] {
    moe_graph::launch(forward_args_kernel<GemmKernel, kBKMajor>, 1 + tail_blocks, kArgThreads, 0, env.stream, arr,
        p.splits.ptr, p.splits.is_int64, e, p.rows, static_cast<int>(p.n), static_cast<int>(p.k),
        static_cast<const typename GemmKernel::ElementA*>(p.a),
        static_cast<const typename GemmKernel::ElementB*>(p.b.base), p.b.expert_stride, b_table,
        static_cast<ElementD*>(p.out), static_cast<const ElementD*>(p.bias), offsets, env.error_flag);
    check_launch("forward_args_kernel");
  });
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
  auto arr = carve_arguments<Arr>(static_cast<char*>(env.alloc(argument_bytes(e, false))), e, false);

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
    moe_graph::launch(wgrad_args_kernel<GemmKernel>, 1, kArgThreads, 0, env.stream, arr, p.splits.ptr,
        p.splits.is_int64, e, p.rows, static_cast<int>(p.n), static_cast<int>(p.k),
        static_cast<const typename GemmKernel::ElementA*>(p.dy), static_cast<const typename GemmKernel::ElementB*>(p.a),
        static_cast<typename GemmKernel::ElementD*>(const_cast<void*>(p.out.base)), p.out.expert_stride, out_table,
        offsets, env.error_flag);
    check_launch("wgrad_args_kernel");
    after_args();
  });
}

}  // namespace detail
}  // namespace gg
}  // namespace moe_graph
