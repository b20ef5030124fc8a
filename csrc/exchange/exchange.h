// The fused ("nvlink") token exchange between R ranks (torch-free). Semantics, shared by the host reference
// (exchange_cpu.cpp: all R ranks in one process) and the CUDA kernels on symmetric memory (exchange_cuda.cu):
//
//   inputs of rank s   rows [T_s, B bytes] (any dtype: the row is bytes), route_of_slot [N_s] int64 (the packed send
//                      slots of dispatch_layout's quota mode: route t*K + k, or T_s*K for an empty slot; slots by
//                      destination, then local expert, then drop order), send_counts [R, Lc] int64 (the slots of
//                      each (destination, local expert) chunk, in that order), weights [T_s*K] fp32 or none.
//   counts table       every rank sees every rank's send_counts: table[(s*R + d)*Lc + l] (source s, destination d,
//                      local expert l). A negative count reads as 0 (and sets kErrExchangeCounts).
//   capacity cut       at destination d the chunks are taken in source-major order (s, then l) and cut where the
//                      running sum reaches `capacity`: fit[s][d][l] rows of chunk (s, d, l) arrive, the rest are not
//                      sent (kErrExchangeCounts on d), as HostSizedExchange's rule.
//   receive layout     `align` >= 1 (1: groups back to back; 16: the FP8 grouped GEMM's group starts). d's expert
//                      input groups the fitted rows by local expert l, then source s, then the sender's slot order;
//                      counts[l] = sum_s fit[s][d][l] (the rows that arrived per local expert), group l starts at
//                      start[l] = sum_{l' < l} align_up(counts[l'], align) and chunk (s, d, l) at base = start[l] +
//                      sum_{s' < s} fit[s'][d][l]. The buffer has P = aligned_padded_rows(capacity, Lc, align) rows
//                      (common/row_align.h; P = capacity at align 1); every row not holding a fitted row (after a
//                      group's counts[l] rows up to the next aligned start, past the last group) is zero. Which rows
//                      arrive does not depend on `align` (the cut counts `capacity` real rows).
//   dispatch outputs   on d: expert_in [P, B], m_splits [Lc] = align_up(counts[l], align) (what the grouped GEMM
//                      reads), counts [Lc], row_weights [P] fp32 (the route's weight beside its row; 0 on every zero
//                      row and without weights); on s: route_row [T_s*K] = d*P + row for each sent route, -1 for the
//                      others. A fitted slot past N_s or whose route is out of [0, T_s*K) carries a zero row and
//                      weight 0 (kErrExchangeCounts / kErrIndexOutOfRange unless it is the empty-slot value T_s*K).
//   combine            out_s[t] = sum over k ascending of w[t*K+k] * expert_out_d[row] for route_row = d*P + row
//                      (expert_out [P, X] on every rank; fp32 accumulation, fp64 for fp64 data, from +0; w = 1
//                      without weights); -1 adds nothing, another value outside [0, R*P) too (kErrIndexOutOfRange).
//   gather_routes      out_s[q] = expert_out_d[row] (bytes) for route_row[q] = d*P + row; zeros for -1.
#pragma once
#include <cstdint>

#include "common/host_device.h"
#include "common/row_align.h"

namespace moe_graph {
namespace exchange {

enum class DType : int { kFloat = 0, kDouble = 1, kBFloat16 = 2, kHalf = 3 };

constexpr int64_t kMaxCount = int64_t(1) << 40;  // counts are clamped to this (no overflow of the running sums)

// A count as the exchange reads it: [0, kMaxCount]; a negative one sets *bad.
MOE_GRAPH_HD int64_t clamp_count(int64_t c, bool* bad) {
  if (c < 0) {
    *bad = true;
    return 0;
  }
  return c < kMaxCount ? c : kMaxCount;
}

// Destination d, source `src`: fit[l] (rows of chunk (src, d, l) that arrive), base[l] (d's expert-input row of
// its first row) and col[l] (= d's counts[l]) for l < Lc; returns sum_l align_up(col[l], align), the rows up to the
// end of d's last aligned group. src = R (no source) gives base[l] = start[l] + counts[l], the end of group l's
// rows. `*cut` is set when d receives a negative count or a row past the capacity.
MOE_GRAPH_HD int64_t chunk_layout(const int64_t* table, int64_t R, int64_t Lc, int64_t capacity, int64_t align,
                                  int64_t d, int64_t src, int64_t* fit, int64_t* base, int64_t* col, bool* cut) {
  for (int64_t l = 0; l < Lc; ++l) fit[l] = base[l] = col[l] = 0;
  int64_t cum = 0;  // rows of d before this chunk in source-major order (saturates at the capacity)
  for (int64_t s = 0; s < R; ++s) {
    for (int64_t l = 0; l < Lc; ++l) {
      const int64_t c = clamp_count(table[(s * R + d) * Lc + l], cut);
      const int64_t room = capacity - cum > 0 ? capacity - cum : 0;
      const int64_t f = c < room ? c : room;
      if (f != c) *cut = true;
      cum += f;
      if (s == src) fit[l] = f;
      if (s < src) base[l] += f;
      col[l] += f;
    }
  }
  int64_t run = 0;
  for (int64_t l = 0; l < Lc; ++l) {
    base[l] += run;
    run += align_up(col[l], align);
  }
  return run;
}

// Rows of a receive buffer: P = aligned_padded_rows(capacity, Lc, align) (capacity at align 1).
MOE_GRAPH_HD int64_t receive_rows(int64_t capacity, int64_t Lc, int64_t align) {
  return aligned_padded_rows(capacity, Lc, align);
}

// Words (uint64) of the symmetric control buffer: signals, then two count tables (by epoch parity) of R sources.
struct Control {
  static constexpr int64_t kCount = 0, kData = 1, kReady = 2, kDone = 3, kGatherReady = 4, kGatherDone = 5;
  static MOE_GRAPH_HD int64_t signal(int64_t kind, int64_t R, int64_t src) { return kind * R + src; }
  static MOE_GRAPH_HD int64_t table(int64_t R, int64_t Lc, int64_t parity) { return 6 * R + parity * R * R * Lc; }
  static MOE_GRAPH_HD int64_t words(int64_t R, int64_t Lc) { return 6 * R + 2 * R * R * Lc; }
};

// Bytes of a symmetric receive buffer: `rows` (receive_rows) rows of row_bytes (rounded up to 16), then `rows` fp32
// weights.
MOE_GRAPH_HD int64_t receive_weights_offset(int64_t rows, int64_t row_bytes) { return align_up(rows * row_bytes, 16); }
MOE_GRAPH_HD int64_t receive_bytes(int64_t rows, int64_t row_bytes) {
  return receive_weights_offset(rows, row_bytes) + align_up(rows * 4, 16);
}

// Local slots of the epoch counters (a uint64 [kEpochWords] tensor on each device, zero at creation).
constexpr int64_t kEpochDispatch = 0, kEpochCombine = 1, kEpochGather = 2, kEpochWords = 4;

// ------------------------------------------------------------------------------------------- host reference --
struct RankDispatch {
  // inputs
  const void* rows = nullptr;            // [tokens, row_bytes]
  int64_t tokens = 0;
  const int64_t* route_of_slot = nullptr;  // [slots]
  int64_t slots = 0;
  const int64_t* send_counts = nullptr;  // [R, Lc]
  const float* weights = nullptr;        // [tokens*K] or null
  // outputs
  void* expert_in = nullptr;    // [P, row_bytes]
  int64_t* m_splits = nullptr;  // [Lc] (aligned)
  int64_t* counts = nullptr;    // [Lc]
  float* row_weights = nullptr;  // [P] or null
  int64_t* route_row = nullptr;  // [tokens*K]
  int32_t* error_flag = nullptr;
};

struct RankCombine {
  const void* expert_out = nullptr;  // [P, hidden] (combine) or [P, row_bytes] (gather)
  const int64_t* route_row = nullptr;  // [tokens*K]
  const void* weights = nullptr;       // [tokens*K] float (double for kDouble) or null
  int64_t tokens = 0;
  void* out = nullptr;  // combine [tokens, hidden]; gather [tokens*K, row_bytes]
  int32_t* error_flag = nullptr;
};

// All R ranks' dispatch (ranks[0..R)).
void dispatch_host(RankDispatch* ranks, int64_t R, int64_t Lc, int64_t topk, int64_t capacity, int64_t row_bytes,
                   int64_t align);
// All R ranks' combine: hidden elements of dtype per row, `rows` (P) rows of expert_out per rank.
void combine_host(RankCombine* ranks, int64_t R, int64_t topk, int64_t rows, int64_t hidden, DType dtype);
// All R ranks' gather_routes (no reduction): row_bytes per row.
void gather_host(RankCombine* ranks, int64_t R, int64_t topk, int64_t rows, int64_t row_bytes);

// ------------------------------------------------------------------------------------------------- CUDA side --
// Symmetric pointers are int64 arrays [R] on the device (torch's buffer_ptrs_dev): rank r's copy of the buffer.
struct DispatchArgs {
  int64_t R = 0, rank = 0, Lc = 0, topk = 0, tokens = 0, slots = 0, capacity = 0, row_bytes = 0, align = 1;
  const void* rows = nullptr;
  const int64_t* route_of_slot = nullptr;
  const int64_t* send_counts = nullptr;
  const float* weights = nullptr;
  const int64_t* recv_ptrs = nullptr;  // receive buffers (receive_bytes(receive_rows(capacity, Lc, align), ...))
  const int64_t* ctrl_ptrs = nullptr;  // control buffers (Control::words(R, Lc) uint64 each, zero at creation)
  void* recv_local = nullptr;          // this rank's receive buffer (ctrl/recv_ptrs[rank] as a host-known pointer)
  uint64_t* ctrl_local = nullptr;
  int64_t* m_splits = nullptr;   // [Lc] (aligned)
  int64_t* counts = nullptr;     // [Lc]
  int64_t* route_row = nullptr;  // [tokens*K]
  uint64_t* epoch = nullptr;     // [kEpochWords] local
  int32_t* error_flag = nullptr;
};

struct CombineArgs {
  int64_t R = 0, rank = 0, topk = 0, tokens = 0;
  int64_t capacity = 0;   // rows of each expert-output buffer (the dispatch's P)
  int64_t hidden = 0;     // combine: elements per row
  int64_t row_bytes = 0;  // gather: bytes per row
  DType dtype = DType::kFloat;
  const int64_t* src_ptrs = nullptr;  // expert-output buffers (P rows each)
  const int64_t* ctrl_ptrs = nullptr;
  const void* src_local = nullptr;
  uint64_t* ctrl_local = nullptr;
  const int64_t* route_row = nullptr;  // [tokens*K]
  const void* weights = nullptr;       // [tokens*K] float (double for kDouble) or null
  void* out = nullptr;                 // combine [tokens, hidden]; gather [tokens*K, row_bytes]
  uint64_t* epoch = nullptr;
  int32_t* error_flag = nullptr;
};

// Largest R*Lc the dispatch kernel's shared tables hold (4 int64 per chunk in 48 KiB).
constexpr int64_t kMaxChunks = 1535;

#if defined(MOE_GRAPH_WITH_CUDA)
// Enqueue on `stream` with `num_ctas` blocks (the same on every rank); every rank must call the same sequence.
void dispatch_cuda(const DispatchArgs& a, int num_ctas, void* stream);
void combine_cuda(const CombineArgs& a, int num_ctas, void* stream);
void gather_cuda(const CombineArgs& a, int num_ctas, void* stream);
#endif

}  // namespace exchange
}  // namespace moe_graph
