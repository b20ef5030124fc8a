// Host-side launch decisions of the CUDA scaled grouped GEMM (see scaled_plan.h). Compiled in every build (no CUDA).
#include "fp8/scaled_plan.h"

#include <algorithm>
#include <limits>
#include <sstream>
#include <stdexcept>

#include "fp8/quantize.h"

namespace moe_graph {
namespace fp8 {

const char* scaled_kernel_name(ScaledKernel k) {
  switch (k) {
    case ScaledKernel::kSm90Blockwise:
      return "sm90_blockwise";
    case ScaledKernel::kSm100Mxfp8:
      return "sm100_mxfp8";
    default:
      return "none";
  }
}

namespace {

constexpr const char* kFwd = "fp8_scaled_grouped_gemm (CUDA)";
constexpr const char* kWg = "fp8_scaled_grouped_wgrad_out (CUDA)";

size_t align128(size_t x) { return (x + 127) / 128 * 128; }

[[noreturn]] void fail(const std::ostringstream& os) { throw std::runtime_error(os.str()); }

// The kernel family of (recipe, arch): blockwise fp32 scales with 128-blocks -> sm_90a, MXFP8 (E8M0, 32-blocks,
// one scale per weight row) -> sm_100a; anything else is refused with what exists.
ScaledKernel family(const char* op, int arch, bool e8m0, bool blockwise_blocks, bool mx_blocks,
                    const char* blocks_text) {
  const ScaledKernel want = (!e8m0 && blockwise_blocks) ? ScaledKernel::kSm90Blockwise
                            : (e8m0 && mx_blocks)       ? ScaledKernel::kSm100Mxfp8
                                                        : ScaledKernel::kNone;
  std::ostringstream os;
  if (want == ScaledKernel::kNone) {
    os << op << ": no kernel for " << blocks_text << " with " << (e8m0 ? "E8M0" : "fp32")
       << " scales; the CUDA kernels run Float8BlockScaling (fp32 scales, block_k = block_n = block_m = 128) on "
          "sm_90 and MXFP8BlockScaling (E8M0 scales, block_k = 32, block_n = 1, block_m = 32) on sm_100 (the CPU "
          "implementation runs every block size)";
    fail(os);
  }
  const int fam = arch / 10;
  if (want == ScaledKernel::kSm90Blockwise && fam != 9) {
    os << op << ": the blockwise FP8 kernel (Float8BlockScaling) is built for sm_90a (Hopper); compute capability "
       << arch / 10 << "." << arch % 10 << " has no kernel for it"
       << (fam == 10 ? " (on sm_100 use MXFP8BlockScaling)" : "");
    fail(os);
  }
  if (want == ScaledKernel::kSm100Mxfp8 && fam != 10) {
    os << op << ": the MXFP8 kernel (MXFP8BlockScaling) needs sm_100a (B200/GB200); compute capability " << arch / 10
       << "." << arch % 10 << " has no kernel for it" << (fam == 9 ? " (on sm_90 use Float8BlockScaling)" : "");
    fail(os);
  }
  return want;
}

void check_multiple(const char* op, const char* what, int64_t v, int64_t m, const char* why) {
  if (v % m != 0) {
    std::ostringstream os;
    os << op << ": " << what << " must be a multiple of " << m << " (" << why << "), got " << v;
    fail(os);
  }
}

void check_int32(const char* op, const char* what, int64_t v) {
  if (v > std::numeric_limits<int32_t>::max()) {
    std::ostringstream os;
    os << op << ": " << what << " must be < 2^31 (CUTLASS problem sizes are int32), got " << v;
    fail(os);
  }
}

void check_experts(const char* op, int e) {
  if (e < 1 || e > 65535) {
    std::ostringstream os;
    os << op << ": the number of experts (m_splits.size(0)) must be in [1, 65535], got " << e;
    fail(os);
  }
}

}  // namespace

int64_t mx_sf_bytes(int64_t rows, int64_t kblocks) {
  return (rows + 127) / 128 * 128 * ((kblocks + 3) / 4 * 4);
}

size_t scaled_argument_bytes(int num_experts, bool with_bias) {
  const size_t e = static_cast<size_t>(std::max(num_experts, 0));
  return align128(3 * sizeof(int32_t) * e) + (with_bias ? 7 : 6) * align128(sizeof(void*) * e) +
         5 * align128(sizeof(int64_t) * e) + 2 * align128(kScaleLayoutBytes * e);
}

ScaledForwardPlan plan_scaled_forward(int arch, int64_t rows, int num_experts, int64_t n, int64_t k, int64_t block_k,
                                      int64_t block_n, bool e8m0, bool has_bias) {
  ScaledForwardPlan p;
  std::ostringstream blocks;
  blocks << "block_k = " << block_k << ", block_n = " << block_n;
  p.kernel = family(kFwd, arch, e8m0, block_k == 128 && block_n == 128, block_k == 32 && block_n == 1,
                    blocks.str().c_str());
  check_experts(kFwd, num_experts);
  if (k <= 0) {
    std::ostringstream os;
    os << kFwd << ": k (a.size(1)) must be > 0, got " << k;
    fail(os);
  }
  check_multiple(kFwd, "k (a.size(1))", k, block_k, "whole K blocks: the kernel applies one scale per K tile");
  check_multiple(kFwd, "n (b.size(1))", n, 8, "16-byte rows of the bfloat16 output");
  check_int32(kFwd, "rows (a.size(0))", rows);
  check_int32(kFwd, "n (b.size(1))", n);
  p.offsets_bytes = sizeof(int64_t) * (static_cast<size_t>(num_experts) + 1);
  if (rows == 0 || n == 0) {
    p.run_offsets = true;
    return p;
  }
  p.run_gemm = true;
  p.arg_tail_blocks = static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>(512, (rows * n + (int64_t(1) << 15) - 1) >> 15)));  // as gg::tail_zero_blocks
  p.argument_bytes = scaled_argument_bytes(num_experts, has_bias);
  const int64_t kb = k / block_k;
  if (p.kernel == ScaledKernel::kSm90Blockwise) {
    // A: per expert the MN-major [kb, count] grid (same size as [rows, kb]); B: per expert [kb, nb]
    p.sfa_bytes = align128(sizeof(float) * static_cast<size_t>(rows * kb));
    p.sfb_bytes = align128(sizeof(float) * static_cast<size_t>(num_experts * ((n + 127) / 128) * kb));
  } else {
    // A: per expert a 128-row padded block-scaled region, at most ceil(rows / 128) + E row blocks in all
    p.sfa_bytes = align128(static_cast<size_t>(mx_sf_bytes(128 * ((rows + 127) / 128 + num_experts), kb)));
    p.sfb_bytes = align128(static_cast<size_t>(num_experts * mx_sf_bytes(n, kb)));
  }
  return p;
}

ScaledWgradPlan plan_scaled_wgrad(int arch, int64_t rows, int num_experts, int64_t n, int64_t k, int64_t block_m,
                                  bool e8m0, bool accumulate) {
  ScaledWgradPlan p;
  std::ostringstream blocks;
  blocks << "block_m = " << block_m;
  p.kernel = family(kWg, arch, e8m0, block_m == 128, block_m == 32, blocks.str().c_str());
  check_experts(kWg, num_experts);
  check_multiple(kWg, "rows (a_t.size(1))", rows, 16, "16-byte aligned rows of the transposed FP8 copies (TMA)");
  check_multiple(kWg, "n (a_t.size(0))", n, 8, "16-byte rows of the fp32 output and of its TMA tiles");
  check_multiple(kWg, "k (b_t.size(0))", k, 8, "16-byte rows of the fp32 output and of its TMA tiles");
  check_int32(kWg, "rows (a_t.size(1))", rows);
  check_int32(kWg, "n (a_t.size(0))", n);
  check_int32(kWg, "k (b_t.size(0))", k);
  p.offsets_bytes = sizeof(int64_t) * (static_cast<size_t>(num_experts) + 1);
  if (n == 0 || k == 0) {
    p.run_offsets = true;
    return p;
  }
  if (rows == 0) {  // every expert is empty: overwritten -> 0, accumulated -> unchanged
    p.run_offsets = true;
    p.zero_fill = !accumulate;
    return p;
  }
  p.run_gemm = true;
  p.zero_fill = !accumulate;
  p.argument_bytes = scaled_argument_bytes(num_experts, false);
  const int64_t rt = row_tile_capacity(rows, num_experts, block_m);
  if (p.kernel == ScaledKernel::kSm90Blockwise) {  // [RT, n] and [RT, k]: the transposes of the compact grids
    p.sfa_bytes = align128(sizeof(float) * static_cast<size_t>(rt * n));
    p.sfb_bytes = align128(sizeof(float) * static_cast<size_t>(rt * k));
  } else {  // per expert a padded block-scaled region of ceil(count / 128) blocks of 4 K blocks
    const int64_t kb4 = (rows + 127) / 128 + num_experts;
    p.sfa_bytes = align128(static_cast<size_t>(mx_sf_bytes(n, 4 * kb4)));
    p.sfb_bytes = align128(static_cast<size_t>(mx_sf_bytes(k, 4 * kb4)));
  }
  return p;
}

}  // namespace fp8
}  // namespace moe_graph
