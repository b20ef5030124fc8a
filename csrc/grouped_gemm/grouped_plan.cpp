// Host-side launch decisions of the CUDA grouped GEMM (see grouped_plan.h). Compiled in every build (no CUDA).
#include "grouped_gemm/grouped_plan.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>

namespace moe_graph {
namespace gg {

const char* config_name(Config c) {
  switch (c) {
    case Config::kAuto:
      return "auto";
    case Config::kSm90Cooperative:
      return "sm90_cooperative";
    case Config::kSm90Pingpong:
      return "sm90_pingpong";
    case Config::kSm100OneSm:
      return "sm100_1sm";
    case Config::kSm100TwoSm:
      return "sm100_2sm";
    case Config::kSm100OneSmM64:
      return "sm100_1sm_m64";
  }
  return "?";
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kBF16:
      return "bfloat16";
    case DType::kF16:
      return "float16";
    default:
      return "float32";
  }
}

// The heuristics see only host-known shapes: the capacity `rows`, the expert count and n/k. SM90: experts with
// <= 64 rows on average waste half of a 128-row tile, so 64-row ping-pong tiles there (as torch's GroupMM does).
// SM100: the 64-row MMA tile only where it holds for every expert, hot ones included: `rows` <= 64 bounds each
// expert's rows. With skewed routing the hot experts set the time and an average says nothing about them.
Config choose_forward_config(int arch, int64_t rows, int num_experts, int64_t n, int64_t k) {
  (void)k;
  const int64_t avg_rows = num_experts > 0 ? rows / num_experts : rows;
  if (arch / 10 == 9) return avg_rows <= 64 ? Config::kSm90Pingpong : Config::kSm90Cooperative;
  if (rows <= 64) return Config::kSm100OneSmM64;
  return (avg_rows >= 256 && n >= 256) ? Config::kSm100TwoSm : Config::kSm100OneSm;
}

// Wgrad GEMMs are (n x k) per expert with the expert's rows as the reduction: large tiles always.
Config choose_wgrad_config(int arch, int64_t, int, int64_t, int64_t) {
  return arch / 10 == 9 ? Config::kSm90Cooperative : Config::kSm100TwoSm;
}

int effective_sm_count(int device_sm_count, int carveout) {
  return std::max(1, device_sm_count - std::max(0, carveout));
}

int cluster_sm_count(int sm_count, int cluster) {
  const int c = std::max(1, cluster);
  return std::max(c, sm_count / c * c);
}

int tail_zero_blocks(int64_t rows, int64_t n) {
  constexpr int64_t kElemsPerBlock = 1 << 15;  // 64 KB of 16-bit elements per block at the largest tail
  constexpr int64_t kMaxBlocks = 512;
  const int64_t elems = std::max<int64_t>(0, rows) * std::max<int64_t>(0, n);
  return static_cast<int>(std::max<int64_t>(1, std::min(kMaxBlocks, (elems + kElemsPerBlock - 1) / kElemsPerBlock)));
}

namespace {

size_t align128(size_t x) { return (x + 127) / 128 * 128; }

void check_config(Config cfg, int arch, bool forward) {
  const bool sm90 = cfg == Config::kSm90Cooperative || cfg == Config::kSm90Pingpong;
  const bool sm100 = cfg == Config::kSm100OneSm || cfg == Config::kSm100TwoSm || cfg == Config::kSm100OneSmM64;
  const bool wgrad_ok = cfg == Config::kSm90Cooperative || cfg == Config::kSm100TwoSm;
  if ((arch / 10 == 9 && !sm90) || (arch / 10 == 10 && !sm100) || (arch / 10 != 9 && arch / 10 != 10) ||
      (!forward && !wgrad_ok)) {
    std::ostringstream os;
    os << "moe_graph grouped GEMM: config " << config_name(cfg) << " cannot run " << (forward ? "forward" : "wgrad")
       << " on compute capability " << arch / 10 << "." << arch % 10;
    throw std::runtime_error(os.str());
  }
}

}  // namespace

size_t argument_bytes(int num_experts, bool with_bias_ptrs) {
  const size_t e = static_cast<size_t>(std::max(num_experts, 0));
  const size_t shapes = align128(3 * sizeof(int32_t) * e);
  const size_t ptrs = (with_bias_ptrs ? 5 : 4) * align128(sizeof(void*) * e);
  const size_t strides = 4 * align128(sizeof(int64_t) * e);
  return shapes + ptrs + strides;
}

ForwardPlan plan_forward(int arch, int64_t rows, int num_experts, int64_t n, int64_t k, bool has_bias,
                         bool b_is_list, Config requested) {
  ForwardPlan p;
  p.config = requested == Config::kAuto ? choose_forward_config(arch, rows, num_experts, n, k) : requested;
  check_config(p.config, arch, true);
  p.offsets_bytes = sizeof(int64_t) * (static_cast<size_t>(std::max(num_experts, 0)) + 1);
  if (rows == 0 || n == 0) {  // empty output: only the m_splits flags
    p.run_offsets = true;
    return p;
  }
  if (k == 0) {  // a GEMM with an empty reduction never zeroes its accumulators: no GEMM at all
    p.run_offsets = true;
    p.fill_rows = true;
    p.zero_tail = true;
    p.run_rows_fill = true;
    return p;
  }
  p.run_gemm = true;
  p.zero_tail = true;  // by the argument kernel's extra blocks: no launch of its own
  p.arg_tail_blocks = tail_zero_blocks(rows, n);
  p.ptr_table_bytes = b_is_list ? sizeof(void*) * static_cast<size_t>(std::max(num_experts, 1)) : 0;
  p.argument_bytes = argument_bytes(num_experts, has_bias);
  return p;
}

WgradPlan plan_wgrad(int arch, int64_t rows, int num_experts, int64_t n, int64_t k, DType out_dtype,
                     bool accumulate_all, bool has_mask, bool out_is_list, Config requested) {
  (void)out_dtype;  // fp32 and 16-bit outputs follow the same rule (issue 13.2: no zero pass for fp32 overwrite)
  WgradPlan p;
  p.config = requested == Config::kAuto ? choose_wgrad_config(arch, rows, num_experts, n, k) : requested;
  check_config(p.config, arch, false);
  p.offsets_bytes = sizeof(int64_t) * (static_cast<size_t>(std::max(num_experts, 0)) + 1);
  const bool some_overwrite = has_mask || !accumulate_all;
  if (n == 0 || k == 0) {  // empty output
    p.run_offsets = true;
    return p;
  }
  p.ptr_table_bytes = out_is_list ? sizeof(void*) * static_cast<size_t>(std::max(num_experts, 1)) : 0;
  if (rows == 0) {  // every expert is empty: overwritten ones become zero, accumulated ones stay
    p.run_offsets = true;
    p.zero_fill = some_overwrite;
    p.zero_fill_all_overwritten = true;
    return p;
  }
  // The accumulating kernel reads C (= D) for every expert, so a mask that mixes modes needs overwritten experts
  // zeroed first (a per-expert beta would still read C, and 0 * NaN from an uninitialised main_grad is NaN).
  p.kernel = (has_mask || accumulate_all) ? WgradKernel::kAccumulate : WgradKernel::kOverwrite;
  p.zero_fill = some_overwrite;  // empty overwritten experts get no GEMM tile
  p.zero_fill_all_overwritten = p.kernel == WgradKernel::kAccumulate;
  p.argument_bytes = argument_bytes(num_experts, false);
  return p;
}

}  // namespace gg
}  // namespace moe_graph
