// Host-side launch decisions of the CUDA grouped GEMM, torch- and CUDA-free so that CPU tests pin them: which
// configuration runs, which of the small kernels around the CUTLASS call run, and the workspace the launcher
// carves. grouped_gemm_cuda.cu executes exactly these plans; tests/test_grouped_launch_logic.py checks them.
#pragma once

#include <cstddef>
#include <cstdint>

namespace moe_graph {
namespace gg {

enum class DType : int { kBF16 = 0, kF16 = 1, kF32 = 2 };

// Which CUTLASS configuration runs. kAuto picks from shapes known on the host (rows / num_experts, n, k),
// never from the counts themselves.
enum class Config : int {
  kAuto = 0,
  kSm90Cooperative = 1,  // 128x256x64 tile, cluster 1x2: large groups
  kSm90Pingpong = 2,     // 64x128x64 tile, cluster 1x2: small groups (fine-grained experts)
  kSm100OneSm = 3,       // 128x256 MMA tile on one SM
  kSm100TwoSm = 4,       // 256x256 MMA tile on an SM pair (cluster 2x1)
  kSm100OneSmM64 = 5,    // 64x256 MMA tile on one SM: launches where no expert can have more than 64 rows
};

// CTAs per thread-block cluster of a configuration (1 for kAuto); the CUTLASS instantiations static_assert their
// cluster shapes against it.
constexpr int cluster_size(Config c) {
  return (c == Config::kSm90Cooperative || c == Config::kSm90Pingpong || c == Config::kSm100TwoSm) ? 2 : 1;
}

const char* config_name(Config c);
const char* dtype_name(DType t);

// Picks the configuration that kAuto resolves to for a problem.
Config choose_forward_config(int arch, int64_t rows, int num_experts, int64_t n, int64_t k);
Config choose_wgrad_config(int arch, int64_t rows, int num_experts, int64_t n, int64_t k);

// Multiprocessors the persistent kernels may use: the device's minus torch's SM carve-out (at least 1; a
// negative carve-out counts as 0).
int effective_sm_count(int device_sm_count, int carveout);

// The SM count a persistent launch with clusters of `cluster` CTAs is given (KernelHardwareInfo::sm_count):
// `sm_count` rounded down to whole clusters, at least one cluster. CUTLASS sizes the grid from it, and a grid
// that is not a multiple of the cluster shape cannot launch (an odd count below 18 SMs with a 1x2 cluster).
int cluster_sm_count(int sm_count, int cluster);

// Blocks of the forward argument kernel that zero the rows past the clamped sum(m_splits) while block 0 builds
// the GEMM arguments: enough for a tail as large as the whole [rows, n] output (16-bit elements).
int tail_zero_blocks(int64_t rows, int64_t n);

// Bytes of the per-expert argument arrays one grouped launch carves from its workspace: problem shapes
// (3 x int32), pointers A/B/C/D (+ bias when `with_bias_ptrs`) and strides A/B/C/D (one int64 each; the
// launcher static_asserts these sizes against the CUTLASS kernel's types), each array 128-byte aligned.
size_t argument_bytes(int num_experts, bool with_bias_ptrs);

struct ForwardPlan {
  Config config = Config::kAuto;  // the CUTLASS configuration (when run_gemm)
  bool run_offsets = false;       // offsets scan of m_splits without a GEMM (flags + the fill below)
  bool run_gemm = false;          // argument kernel + CUTLASS grouped GEMM, bias fused in its epilogue
  bool fill_rows = false;         // K == 0: rows of expert e become bias[e] (or zero); no GEMM can produce them
  bool zero_tail = false;         // rows past the clamped sum(m_splits) are zeroed
  bool run_rows_fill = false;     // the rows-fill kernel runs (fill_rows, or zero_tail without the GEMM)
  int arg_tail_blocks = 0;        // with run_gemm: blocks of the argument kernel that zero the tail (no own launch)
  size_t offsets_bytes = 0;       // int64 [E + 1]
  size_t ptr_table_bytes = 0;     // device copy of a per-expert weight pointer list
  size_t argument_bytes = 0;      // argument arrays of the GEMM
};

// The problem as the host knows it (never the counts). `requested` is kAuto or a configuration to force; an
// unusable request throws std::runtime_error.
ForwardPlan plan_forward(int arch, int64_t rows, int num_experts, int64_t n, int64_t k, bool has_bias,
                         bool b_is_list, Config requested);

// Which wgrad GEMM kernel runs: D = A.B (no source read) or D = A.B + C with C aliasing D (accumulation).
enum class WgradKernel : int { kNone = 0, kOverwrite = 1, kAccumulate = 2 };

struct WgradPlan {
  Config config = Config::kAuto;
  bool run_offsets = false;       // offsets scan without a GEMM (empty output: flags only)
  WgradKernel kernel = WgradKernel::kNone;
  bool zero_fill = false;         // wgrad_zero_kernel: overwritten experts that the GEMM does not fully write
  bool zero_fill_all_overwritten = false;  // ... all overwritten experts (accumulating kernel), not just empty ones
  size_t offsets_bytes = 0;
  size_t ptr_table_bytes = 0;
  size_t argument_bytes = 0;
};

WgradPlan plan_wgrad(int arch, int64_t rows, int num_experts, int64_t n, int64_t k, DType out_dtype,
                     bool accumulate_all, bool has_mask, bool out_is_list, Config requested);

}  // namespace gg
}  // namespace moe_graph
