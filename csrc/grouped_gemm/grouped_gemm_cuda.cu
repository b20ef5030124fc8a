// Arch-neutral part of the CUDA grouped GEMM: execution of the host launch plans (grouped_plan.h), dispatch to
// the per-arch CUTLASS instantiations, and the small kernels around them (pointer tables, the K = 0 fill,
// zero-fill of overwritten wgrad experts, bias gradient). Torch-free.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>

#include "common/cuda_check.h"
#include "common/error_flag.h"
#include "common/launch.cuh"
#include "grouped_gemm/grouped_args.cuh"
#include "grouped_gemm/grouped_configs.h"
#include "grouped_gemm/grouped_gemm.h"

namespace moe_graph {
namespace gg {

const char* compiled_archs() {
  return ""
#if defined(MOE_GRAPH_BUILD_SM90)
         "sm90a "
#endif
#if defined(MOE_GRAPH_BUILD_SM100)
         "sm100a"
#endif
      ;
}

bool arch_supported(int arch) {
#if defined(MOE_GRAPH_BUILD_SM90)
  if (arch == 90) return true;
#endif
#if defined(MOE_GRAPH_BUILD_SM100)
  if (arch == 100) return true;
#endif
  (void)arch;
  return false;
}

namespace {


constexpr int kPtrChunk = 256;  // 2 KB of pointers per launch: fits the kernel-parameter limit everywhere
struct PtrChunk {
  const void* p[kPtrChunk];
};

__global__ void copy_ptrs_kernel(PtrChunk chunk, int count, const void** dst) {
  const int i = threadIdx.x;
  if (i < count) dst[i] = chunk.p[i];
}

// Copies a host array of device pointers into device memory with by-value kernel arguments (capturable).
const void** device_ptr_table(const void* const* host, int n, const LaunchEnv& env) {
  auto* table = static_cast<const void**>(env.alloc(sizeof(void*) * std::max(n, 1)));
  for (int base = 0; base < n; base += kPtrChunk) {
    PtrChunk chunk{};
    const int count = std::min(kPtrChunk, n - base);
    for (int i = 0; i < count; ++i) chunk.p[i] = host[base + i];
    moe_graph::launch(copy_ptrs_kernel, 1, kPtrChunk, 0, env.stream, chunk, count, table + base);
    check_launch("copy_ptrs_kernel");
  }
  return table;
}

using detail::expert_of_row;

// Explicit conversions: torch builds define __CUDA_NO_HALF_CONVERSIONS__ / __CUDA_NO_BFLOAT16_CONVERSIONS__.
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
struct alignas(16) Vec16 {
  uint32_t w[4];
};

// K == 0 (no GEMM ran): rows of expert e become bias[e] (or zero without bias), rows past the clamped total
// zero. 16-bit types, n % 8 == 0.
template <class T>
__global__ void rows_fill_kernel(T* out, const T* bias, const int64_t* offsets, int num_experts, int64_t rows,
                                 int n) {
  const int64_t total = offsets[num_experts];
  const int vec_per_row = n / 8;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    Vec16* row = reinterpret_cast<Vec16*>(out + r * n);
    if (r >= total || bias == nullptr) {
      for (int v = threadIdx.x; v < vec_per_row; v += blockDim.x) row[v] = Vec16{{0u, 0u, 0u, 0u}};
    } else {
      const int e = expert_of_row(offsets, num_experts, r);
      const Vec16* b = reinterpret_cast<const Vec16*>(bias + static_cast<int64_t>(e) * n);
      for (int v = threadIdx.x; v < vec_per_row; v += blockDim.x) row[v] = b[v];
    }
  }
}

// Zeroes out_e for experts whose result overwrites (mask false / !accumulate_all) when either `all_overwritten`
// (the accumulating kernel runs and adds into out_e, or no GEMM runs) or the expert has no rows (no GEMM tile
// writes it).
__global__ void wgrad_zero_kernel(void* out_base, int64_t expert_bytes, void* const* out_table,
                                  const int64_t* offsets, const bool* mask, bool accumulate_all,
                                  bool all_overwritten, int num_experts) {
  const int e = blockIdx.y;
  if (e >= num_experts) return;
  const bool acc = mask ? mask[e] : accumulate_all;
  const bool empty = offsets[e + 1] == offsets[e];
  if (acc || !(all_overwritten || empty)) return;
  char* base = out_table ? static_cast<char*>(out_table[e]) : static_cast<char*>(out_base) + e * expert_bytes;
  Vec16* p = reinterpret_cast<Vec16*>(base);
  const int64_t nvec = expert_bytes / 16;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < nvec; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = Vec16{{0u, 0u, 0u, 0u}};
}

__global__ void __launch_bounds__(detail::kArgThreads)
    offsets_kernel(const void* splits, bool is_int64, int num_experts, int64_t rows, int64_t* offsets,
                   int32_t* error_flag) {
  detail::for_each_expert_span(splits, is_int64, num_experts, rows, error_flag, offsets,
                               [](int, int64_t, int64_t) {});
}

// Deterministic bias gradient in two passes, no atomics. Rows are cut into fixed chunks; the non-empty pieces
// (chunk c) x (expert e) are ordered by row, and moving to the next piece increments c or e (or both), so c + e
// is a unique slot id for each piece: pass 1 writes each piece's column sums to partial[c + e, :], pass 2 adds
// the pieces of every expert in chunk order. Same result for the same input, whatever the scheduling.
constexpr int64_t kBiasRowsPerChunk = 256;

template <class T>
__global__ void bias_grad_partial_kernel(const T* dy, const int64_t* offsets, int num_experts, int64_t num_chunks,
                                         int n, float* partial) {
  const int col = blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= n) return;
  const int64_t total = offsets[num_experts];
  for (int64_t c = blockIdx.y; c < num_chunks; c += gridDim.y) {
    const int64_t r0 = c * kBiasRowsPerChunk;
    const int64_t r1 = min(total, r0 + kBiasRowsPerChunk);
    if (r0 >= r1) break;  // chunks past the clamped total are empty, and so are all later ones
    int e = expert_of_row(offsets, num_experts, r0);
    int64_t next = offsets[e + 1];
    float acc = 0.f;
    for (int64_t r = r0; r < r1; ++r) {
      while (r >= next) {  // crossed into the next non-empty expert: the piece (c, e) is complete
        partial[(c + e) * n + col] = acc;
        acc = 0.f;
        ++e;
        next = offsets[e + 1];
      }
      acc += to_f32(dy[r * n + col]);
    }
    partial[(c + e) * n + col] = acc;
  }
}

__global__ void bias_grad_reduce_kernel(const float* partial, const int64_t* offsets, int n, float* db) {
  const int col = blockIdx.x * blockDim.x + threadIdx.x;
  const int e = blockIdx.y;
  if (col >= n) return;
  const int64_t begin = offsets[e], end = offsets[e + 1];
  float acc = 0.f;
  if (end > begin) {
    for (int64_t c = begin / kBiasRowsPerChunk; c <= (end - 1) / kBiasRowsPerChunk; ++c)
      acc += partial[(c + e) * n + col];
  }
  db[static_cast<int64_t>(e) * n + col] = acc;
}

void check_family(int arch) {
  if (!arch_supported(arch)) {
    std::ostringstream os;
    os << "moe_graph grouped GEMM: no kernel for compute capability " << arch / 10 << "." << arch % 10
       << " in this build (compiled for: " << compiled_archs()
       << "); rebuild with MOE_GRAPH_ARCHS including this GPU (90a for Hopper, 100a for B200/GB200)";
    throw std::runtime_error(os.str());
  }
}

template <class T>
void launch_rows_fill(const ForwardProblem& p, const LaunchEnv& env, const int64_t* offsets) {
  const int blocks = static_cast<int>(std::min<int64_t>(p.rows, int64_t(env.sm_count) * 8));
  const int threads = static_cast<int>(std::min<int64_t>(256, std::max<int64_t>(32, p.n / 8)));
  moe_graph::launch(rows_fill_kernel<T>, blocks, threads, 0, env.stream, static_cast<T*>(p.out),
      static_cast<const T*>(p.bias), offsets, p.splits.num_experts, p.rows, static_cast<int>(p.n));
  check_launch("rows_fill_kernel");
}

void launch_offsets(const Splits& s, int64_t rows, int64_t* offsets, const LaunchEnv& env) {
  moe_graph::launch(offsets_kernel, 1, detail::kArgThreads, 0, env.stream, s.ptr, s.is_int64, s.num_experts, rows,
      offsets, env.error_flag);
  check_launch("offsets_kernel");
}

void check_dtype_kernel(DType t, const char* what) {
  if (t != DType::kBF16 && t != DType::kF16)
    throw std::runtime_error(std::string("moe_graph grouped ") + what + ": no kernel for dtype " + dtype_name(t));
}

}  // namespace

// Executes plan_forward (grouped_plan.cpp): every decision is made there, on the host, from host-known shapes.
void run_forward(const ForwardProblem& p, const LaunchEnv& env) {
  check_family(env.arch);
  check_dtype_kernel(p.dtype, "GEMM");
  const int e = p.splits.num_experts;
  const ForwardPlan plan = plan_forward(env.arch, p.rows, e, p.n, p.k, p.bias != nullptr, p.b.list != nullptr,
                                        p.config);
  auto* offsets = static_cast<int64_t*>(env.alloc(plan.offsets_bytes));
  if (plan.run_offsets) launch_offsets(p.splits, p.rows, offsets, env);
  if (plan.run_gemm) {
    const void* const* b_table = p.b.list ? device_ptr_table(p.b.list, e, env) : nullptr;
    bool ran = false;
#if defined(MOE_GRAPH_BUILD_SM90)
    if (env.arch / 10 == 9) ran = detail::forward_sm90(p, env, plan.config, b_table, offsets);
#endif
#if defined(MOE_GRAPH_BUILD_SM100)
    if (env.arch / 10 == 10) ran = detail::forward_sm100(p, env, plan.config, b_table, offsets);
#endif
    if (!ran) throw std::runtime_error(std::string("moe_graph grouped GEMM: no kernel for dtype ") + dtype_name(p.dtype));
  }
  if (plan.run_rows_fill) {  // with a GEMM the argument kernel zeroes the tail
    if (p.dtype == DType::kBF16)
      launch_rows_fill<__nv_bfloat16>(p, env, offsets);
    else
      launch_rows_fill<__half>(p, env, offsets);
  }
}

// Executes plan_wgrad (grouped_plan.cpp).
void run_wgrad(const WgradProblem& p, const LaunchEnv& env) {
  check_family(env.arch);
  check_dtype_kernel(p.dtype, "wgrad");
  const int e = p.splits.num_experts;
  const WgradPlan plan = plan_wgrad(env.arch, p.rows, e, p.n, p.k, p.out_dtype, p.accumulate_all,
                                    p.accumulate_mask != nullptr, p.out.list != nullptr, p.config);
  auto* offsets = static_cast<int64_t*>(env.alloc(plan.offsets_bytes));
  void* const* out_table = nullptr;
  if (plan.ptr_table_bytes)
    out_table = const_cast<void* const*>(reinterpret_cast<const void* const*>(device_ptr_table(p.out.list, e, env)));
  const int64_t elem = p.out_dtype == DType::kF32 ? 4 : 2;
  const int64_t expert_bytes = p.n * p.k * elem;
  auto zero_fill = [&]() {
    if (!plan.zero_fill) return;
    const int64_t nvec = expert_bytes / 16;
    const int bx = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(64, (nvec + 255) / 256)));
    dim3 grid(bx, e);
    moe_graph::launch(wgrad_zero_kernel, grid, 256, 0, env.stream, const_cast<void*>(p.out.base), expert_bytes,
        out_table, offsets, p.accumulate_mask, p.accumulate_all, plan.zero_fill_all_overwritten, e);
    check_launch("wgrad_zero_kernel");
  };
  if (plan.run_offsets) {
    launch_offsets(p.splits, p.rows, offsets, env);
    zero_fill();
  }
  if (plan.kernel == WgradKernel::kNone) return;
  bool ran = false;
#if defined(MOE_GRAPH_BUILD_SM90)
  if (env.arch / 10 == 9) ran = detail::wgrad_sm90(p, env, plan.kernel, out_table, offsets, zero_fill);
#endif
#if defined(MOE_GRAPH_BUILD_SM100)
  if (env.arch / 10 == 10) ran = detail::wgrad_sm100(p, env, plan.kernel, out_table, offsets, zero_fill);
#endif
  if (!ran) throw std::runtime_error(std::string("moe_graph grouped wgrad: no kernel for dtype ") + dtype_name(p.dtype));
}

void run_bias_grad(const BiasGradProblem& p, const LaunchEnv& env) {
  const int e = p.splits.num_experts;
  auto* offsets = static_cast<int64_t*>(env.alloc(sizeof(int64_t) * (e + 1)));
  launch_offsets(p.splits, p.rows, offsets, env);
  if (p.n == 0 || e == 0) return;
  const int64_t chunks = (p.rows + kBiasRowsPerChunk - 1) / kBiasRowsPerChunk;
  // one slot per (chunk, expert) piece: ids c + e < chunks + E
  auto* partial = static_cast<float*>(env.alloc(sizeof(float) * static_cast<size_t>((chunks + e) * p.n)));
  const unsigned col_blocks = static_cast<unsigned>((p.n + 127) / 128);
  if (chunks > 0) {
    dim3 grid(col_blocks, static_cast<unsigned>(std::min<int64_t>(chunks, 65535)));
    if (p.dtype == DType::kBF16)
      moe_graph::launch(bias_grad_partial_kernel<__nv_bfloat16>, grid, 128, 0, env.stream,
          static_cast<const __nv_bfloat16*>(p.dy), offsets, e, chunks, static_cast<int>(p.n), partial);
    else
      moe_graph::launch(bias_grad_partial_kernel<__half>, grid, 128, 0, env.stream, static_cast<const __half*>(p.dy),
          offsets, e, chunks, static_cast<int>(p.n), partial);
    check_launch("bias_grad_partial_kernel");
  }
  moe_graph::launch(bias_grad_reduce_kernel, dim3(col_blocks, static_cast<unsigned>(e)), 128, 0, env.stream, partial,
      offsets, static_cast<int>(p.n), p.out);
  check_launch("bias_grad_reduce_kernel");
}

}  // namespace gg
}  // namespace moe_graph
