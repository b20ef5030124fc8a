// Device error flag: errors that can only be known on the device (a bad m_splits, a plan that asks for
// more tokens than exist) set a bit here instead of reading or writing out of bounds. The flag lives in
// device memory (one int32 per device, plus one in host memory for the CPU kernels) and is read and cleared
// only by moe_graph.check_errors(), the one call that syncs by design.
//
// This header is torch-free: kernels include it and receive the flag as a plain `int32_t*`.
#pragma once
#include <cstdint>

namespace moe_graph {

enum ErrorCode : int32_t {
  kErrSplitsOverflow = 1 << 0,   // sum(m_splits) > rows of the buffer: clamped
  kErrNegativeSplit = 1 << 1,    // an m_splits entry < 0: treated as 0
  kErrRerouteOverAsk = 1 << 2,   // reroute plan asked to move more tokens than are routed locally: clamped
  kErrPlanInvalid = 1 << 3,      // other inconsistent plan input (e.g. negative token counts)
  // 1 << 4 is retired (it was "tokens dropped past a static capacity"): drops are statistics of normal training,
  // counted on the device by the dispatcher and read without an error, so check_errors() never raises on them.
  kErrIndexOutOfRange = 1 << 5,  // a row/route/column index out of range (permute, dispatch layout): the sentinel
  kErrExchangeCounts = 1 << 6,   // per-destination exchange counts inconsistent (set from Python): clamped
  kErrUnalignedSplit = 1 << 7,   // FP8 wgrad on the GPU: an expert's first token not a multiple of 16 (skipped)
};

// Human-readable text for each bit, used by check_errors().
inline const char* error_text(int32_t bit) {
  switch (bit) {
    case kErrSplitsOverflow:
      return "sum(m_splits) exceeded the number of rows of the input/output buffer (rows past the buffer were "
             "not computed)";
    case kErrNegativeSplit:
      return "m_splits contained a negative count (treated as 0)";
    case kErrRerouteOverAsk:
      return "reroute_tokens: the plan asked to move more tokens of a home expert than are routed to it locally "
             "(clamped)";
    case kErrPlanInvalid:
      return "an offloading plan input was inconsistent (negative counts)";
    case kErrIndexOutOfRange:
      return "expand_rows/reduce_rows/dispatch_layout: a row, route or column index was outside its range (read as "
             "the sentinel: no row, no route)";
    case kErrExchangeCounts:
      return "the per-destination exchange's counts were inconsistent (negative, past the routes a rank has, "
             "disagreeing between ranks, or past a receive buffer): clamped";
    case kErrUnalignedSplit:
      return "FP8 scaled grouped wgrad (CUDA): an expert's rows started at a token offset that is not a multiple of "
             "16 (TMA needs 16-byte aligned starts of the transposed FP8 copies; pad m_splits to multiples of 16, as "
             "TransformerEngine's FP8 padding does): that expert's gradient was not computed (zero, or unchanged "
             "when accumulating)";
    default:
      return "unknown error bit";
  }
}

#if defined(__CUDACC__) || defined(MOE_GRAPH_EMULATE)
__device__ __forceinline__ void set_device_error(int32_t* flag, int32_t code) {
  if (flag != nullptr) atomicOr(flag, code);
}
#endif

inline void set_host_error(int32_t* flag, int32_t code) {
  if (flag != nullptr) __atomic_fetch_or(flag, code, __ATOMIC_RELAXED);
}

}  // namespace moe_graph
