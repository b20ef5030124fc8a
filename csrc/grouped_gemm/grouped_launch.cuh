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

// Carves the argument arrays out of one allocation.
template <class GemmKernel>
struct ArgLayout {
  using Arr = GroupedArrays<GemmKernel>;
  static size_t bytes(int e) {
    size_t s = 0;
    s += align_up(sizeof(typename Arr::ProblemShape) * e);
    s += 4 * align_up(sizeof(void*) * e);
    s += align_up(sizeof(typename Arr::StrideA) * e) + align_up(sizeof(typename Arr::StrideB) * e);
    s += align_up(sizeof(typename Arr::StrideC) * e) + align_up(sizeof(typename Arr::StrideD) * e);
    return s;
  }
  static Arr carve(char* base, int e) {
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
    a.stride_a = reinterpret_cast<typename Arr::StrideA*>(take(sizeof(typename Arr::StrideA) * e));
    a.stride_b = reinterpret_cast<typename Arr::StrideB*>(take(sizeof(typename Arr::StrideB) * e));
    a.stride_c = reinterpret_cast<typename Arr::StrideC*>(take(sizeof(typename Arr::StrideC) * e));
    a.stride_d = reinterpret_cast<typename Arr::StrideD*>(take(sizeof(typename Arr::StrideD) * e));
    return a;
  }
};

// kHasSource: D = A.B + C (C aliases D: accumulation); otherwise D = A.B.
template <class Gemm, bool kHasSource>
void run_cutlass(const GroupedArrays<typename Gemm::GemmKernel>& arr, int num_experts, const LaunchEnv& env,
                 const char* name) {
  using GemmKernel = typename Gemm::GemmKernel;
  cutlass::KernelHardwareInfo hw;
  hw.device_id = env.device;
  hw.sm_count = env.sm_count;

  typename Gemm::Arguments args;
  decltype(args.epilogue.thread) fusion;
  fusion.alpha = 1.0f;
  fusion.beta = kHasSource ? 1.0f : 0.0f;
  fusion.alpha_ptr = nullptr;
  fusion.beta_ptr = nullptr;

  using ElementC = typename GemmKernel::CollectiveEpilogue::ElementC;
  const ElementC** ptr_c = nullptr;
  typename GemmKernel::InternalStrideC* stride_c = nullptr;
  if constexpr (kHasSource) {
    ptr_c = reinterpret_cast<const ElementC**>(arr.ptr_c);
    stride_c = arr.stride_c;
  }
  args = typename Gemm::Arguments{cutlass::gemm::GemmUniversalMode::kGrouped,
                                  {num_experts, arr.shapes, nullptr},
                                  {arr.ptr_a, arr.stride_a, arr.ptr_b, arr.stride_b},
                                  {fusion, ptr_c, stride_c, arr.ptr_d, arr.stride_d},
                                  hw};

  Gemm gemm;
  check_cutlass(gemm.can_implement(args), "can_implement", name);
  const size_t ws_bytes = Gemm::get_workspace_size(args);
  void* ws = ws_bytes ? env.alloc(ws_bytes) : nullptr;
  check_cutlass(gemm.initialize(args, ws, env.stream), "initialize", name);
  check_cutlass(gemm.run(env.stream), "run", name);
  check_launch(name);
}

// Forward / dgrad launch of configuration `Gemm`.
template <class Gemm>
void launch_forward(const ForwardProblem& p, const LaunchEnv& env, const void* const* b_table, int64_t* offsets,
                    const char* name) {
  using GemmKernel = typename Gemm::GemmKernel;
  using L = ArgLayout<GemmKernel>;
  const int e = p.splits.num_experts;
  auto arr = L::carve(static_cast<char*>(env.alloc(L::bytes(e))), e);
  forward_args_kernel<GemmKernel><<<1, kArgThreads, 0, env.stream>>>(
      arr, p.splits.ptr, p.splits.is_int64, e, p.rows, static_cast<int>(p.n), static_cast<int>(p.k),
      static_cast<const typename GemmKernel::ElementA*>(p.a),
      static_cast<const typename GemmKernel::ElementB*>(p.b.base), p.b.expert_stride, b_table,
      static_cast<typename GemmKernel::ElementD*>(p.out), offsets, env.error_flag);
  check_launch("forward_args_kernel");
  run_cutlass<Gemm, false>(arr, e, env, name);
}

// Wgrad launch of configuration `Gemm` (kAccumulate: C = D, beta = 1).
// `after_args` runs between the argument kernel and the GEMM (the zero-fill of overwritten experts needs the
// clamped offsets).
template <class Gemm, bool kAccumulate, class AfterArgs>
void launch_wgrad(const WgradProblem& p, const LaunchEnv& env, void* const* out_table, int64_t* offsets,
                  const char* name, AfterArgs&& after_args) {
  using GemmKernel = typename Gemm::GemmKernel;
  using L = ArgLayout<GemmKernel>;
  const int e = p.splits.num_experts;
  auto arr = L::carve(static_cast<char*>(env.alloc(L::bytes(e))), e);
  wgrad_args_kernel<GemmKernel><<<1, kArgThreads, 0, env.stream>>>(
      arr, p.splits.ptr, p.splits.is_int64, e, p.rows, static_cast<int>(p.n), static_cast<int>(p.k),
      static_cast<const typename GemmKernel::ElementA*>(p.dy),
      static_cast<const typename GemmKernel::ElementB*>(p.a),
      static_cast<typename GemmKernel::ElementD*>(const_cast<void*>(p.out.base)), p.out.expert_stride, out_table,
      offsets, env.error_flag);
  check_launch("wgrad_args_kernel");
  after_args();
  run_cutlass<Gemm, kAccumulate>(arr, e, env, name);
}

}  // namespace detail
}  // namespace gg
}  // namespace moe_graph
