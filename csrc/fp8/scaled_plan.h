// Host-side launch decisions of the CUDA scaled (FP8) grouped GEMM, torch- and CUDA-free so that CPU tests pin them
// (tests/test_fp8_launch_logic.py): which kernel family runs for a recipe on an architecture, the shape rules the
// CUTLASS kernels need (checked before anything is enqueued, with a message naming the argument), which of the
// small kernels around the CUTLASS call run, and the workspace the launcher carves. scaled_gemm_cuda.cu executes
// exactly these plans.
#pragma once

#include <cstddef>
#include <cstdint>

namespace moe_graph {
namespace fp8 {

// The kernel family of a recipe (semantics of both: scaled_gemm.h).
enum class ScaledKernel : int {
  kNone = 0,
  kSm90Blockwise = 1,  // Float8BlockScaling: 1x128 activation tiles x 128x128 weight blocks, fp32 scales (sm_90a)
  kSm100Mxfp8 = 2,     // MXFP8BlockScaling: 1x32 blocks, E8M0 scales (sm_100a)
};

const char* scaled_kernel_name(ScaledKernel k);

// Upper bound of sizeof(CUTLASS scale-factor layout) of one group; the launchers static_assert it.
constexpr size_t kScaleLayoutBytes = 32;

struct ScaledForwardPlan {
  ScaledKernel kernel = ScaledKernel::kNone;
  bool run_offsets = false;   // only the offsets scan (empty output: the m_splits flags)
  bool run_gemm = false;      // argument kernel (+ tail zeroing) -> scale relayout -> CUTLASS grouped GEMM
  int arg_tail_blocks = 0;    // blocks of the argument kernel that zero the rows past the clamped total
  size_t offsets_bytes = 0;   // int64 [E + 1]
  size_t argument_bytes = 0;  // per-expert arrays (scaled_args.cuh, carve order there)
  size_t sfa_bytes = 0;       // A's scales in the kernel's layout (written by the relayout kernel)
  size_t sfb_bytes = 0;       // B's scales in the kernel's layout (written by the relayout kernel)
};

// Forward / dgrad: out [rows, n] (bfloat16) = grouped a [rows, k] x b [E, n, k]^T with scales of blocks
// (block_k along K, block_n along N of b), `e8m0` scales or fp32. Throws std::runtime_error naming what is not
// supported: the recipe on this architecture, k not a positive multiple of the K block, n % 8, the int32 limits.
ScaledForwardPlan plan_scaled_forward(int arch, int64_t rows, int num_experts, int64_t n, int64_t k, int64_t block_k,
                                      int64_t block_n, bool e8m0, bool has_bias);

struct ScaledWgradPlan {
  ScaledKernel kernel = ScaledKernel::kNone;
  bool run_offsets = false;   // only the offsets scan (+ zero fill): empty output or no rows
  bool run_gemm = false;      // zero fill (overwrite) -> argument kernel -> scale relayout -> CUTLASS grouped GEMM
  // One kernel (D = acc + C, C aliasing D) for both modes: an overwrite zeroes the whole output first (one fp32
  // write pass, one CUTLASS instantiation fewer to compile); experts without a GEMM tile then stay zero.
  bool zero_fill = false;     // !accumulate: out = 0 before the GEMM
  size_t offsets_bytes = 0;
  size_t argument_bytes = 0;
  size_t sfa_bytes = 0, sfb_bytes = 0;  // the scales of a_t / b_t in the kernel's layout
};

// Wgrad: out [E, n, k] fp32 (+)= per group a_t [n, rows] x b_t [k, rows]^T over the group's tokens, scales per
// tile of block_m tokens. Throws std::runtime_error as plan_scaled_forward (rows % 16: the transposed copies' row
// stride; n % 8, k % 8).
ScaledWgradPlan plan_scaled_wgrad(int arch, int64_t rows, int num_experts, int64_t n, int64_t k, int64_t block_m,
                                  bool e8m0, bool accumulate);

// Bytes of the per-expert argument arrays: shapes (3 x int32), pointers A, B, C, D, SFA, SFB (+ bias), strides
// A, B, C, D (int64 each: one dynamic stride), SFA / SFB layouts (kScaleLayoutBytes each), the first token tile
// (int64); every array 128-byte aligned.
size_t scaled_argument_bytes(int num_experts, bool with_bias);

// MXFP8 scale factors in the sm_100 layout (CUTLASS's Sm1xxBlkScaledConfig<32>): blocks of 128 rows x 4 K blocks
// (512 bytes); `rows` x `kblocks` scales of one group occupy ceil(rows / 128) * 128 * ceil(kblocks / 4) * 4 bytes.
int64_t mx_sf_bytes(int64_t rows, int64_t kblocks);

}  // namespace fp8
}  // namespace moe_graph
