// CUDA kernels of the fused exchange on symmetric memory (semantics in exchange.h; primitives in
// common/peer_memory.cuh). Torch-free: raw pointers, the device arrays of peer pointers, a stream.
//
// dispatch, two kernels:
//   count_kernel   block 0 advances the dispatch epoch e and stores this rank's send_counts [R, Lc] into every
//                  peer's count table (parity e % 2), then signals each peer (release store of e); all blocks set
//                  route_row to -1. (A kernel boundary orders that fill before the data kernel's scatter in every
//                  block, and publishes the epoch, without a grid barrier.)
//   data_kernel    every block waits for the R count signals (acquire, >= e), derives the chunk layout from the
//                  table in shared memory (chunk_layout, one thread per destination), then its warps take the fitted
//                  send slots in turn: the token row is read once from `rows` and stored at its final row of the
//                  destination's receive buffer, the weight beside it, route_row set. Each block then signals every
//                  destination (release add of 1); the own buffer's rows that hold no fitted row (after each group's
//                  rows up to the next multiple of `align`, past the last group) are zeroed; block 0 writes m_splits
//                  and counts and waits until every source's G blocks have signalled (>= e * G).
//   The table is double-buffered by epoch parity: a rank writes table e + 1 only after its data kernel e saw every
//   peer's count signal e, so no peer still reads table e - 1.
// combine / gather_routes, one kernel each: block 0 signals "my expert-output buffer is ready" (epoch e) to every
// peer, every block waits for the R ready signals, its warps pull each route's row from the destination's buffer
// (combine: weighted fp32 sum over k ascending, written once), every block signals "done reading" to every peer and
// block 0 waits for all of them (>= e * G) before the kernel ends, so no rank overwrites a buffer a peer still reads.
// Every rank must launch the same sequence with the same number of blocks.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/error_flag.h"
#include "common/launch.cuh"
#include "common/peer_memory.cuh"
#include "exchange/exchange.h"

namespace moe_graph {
namespace exchange {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// The barriers of combine / gather are calls: inlined, their divergent spin loops made ptxas spill a few bytes in
// the token loop (sm_90a and sm_100a).
#if defined(MOE_GRAPH_EMULATE)
#define MOE_EXCHANGE_NOINLINE
#else
#define MOE_EXCHANGE_NOINLINE __noinline__
#endif

// ------------------------------------------------------------------------------------------------- dispatch --
__global__ void __launch_bounds__(kThreads) count_kernel(DispatchArgs a) {
  const int64_t n = a.tokens * a.topk;
  for (int64_t q = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; q < n; q += int64_t(gridDim.x) * blockDim.x)
    a.route_row[q] = -1;
  if (blockIdx.x != 0) return;
  uint64_t* s_epoch = dynamic_smem<uint64_t>();
  if (threadIdx.x == 0) {
    const uint64_t e = a.epoch[kEpochDispatch] + 1;
    a.epoch[kEpochDispatch] = e;
    *s_epoch = e;
  }
  __syncthreads();
  const uint64_t e = *s_epoch;
  const int64_t C = a.R * a.Lc, off = Control::table(a.R, a.Lc, int64_t(e & 1)) + a.rank * C;
  for (int64_t i = threadIdx.x; i < a.R * C; i += blockDim.x) {
    const int64_t d = i / C, c = i % C;
    peer::store(peer::at<int64_t>(a.ctrl_ptrs, d, 0) + off + c, a.send_counts[c]);
  }
  __syncthreads();
  for (int64_t d = threadIdx.x; d < a.R; d += blockDim.x) {
    peer::fence_system();
    peer::signal_store(a.ctrl_ptrs, a.R, d, 0, Control::signal(Control::kCount, a.R, a.rank), e);
  }
}

// Shared tables: prefix [C + 1] of the fitted rows this rank sends over chunks (d, l), base [C] (first row at d),
// slot [C] (first send slot), col [C] (scratch: d's m_splits).
__global__ void __launch_bounds__(kThreads) data_kernel(DispatchArgs a) {
  const int64_t R = a.R, Lc = a.Lc, C = R * Lc, me = a.rank, K = a.topk, n = a.tokens * K;
  int64_t* prefix = dynamic_smem<int64_t>();
  int64_t* base = prefix + C + 1;
  int64_t* slot = base + C;
  int64_t* col = slot + C;
  int64_t* s_bad = col + C;  // a negative count of this rank, or a cut at this rank as the receiver
  const uint64_t e = a.epoch[kEpochDispatch];
  for (int64_t s = threadIdx.x; s < R; s += blockDim.x)
    peer::wait_at_least(a.ctrl_local + Control::signal(Control::kCount, R, s), e);
  if (threadIdx.x == 0) *s_bad = 0;
  __syncthreads();
  const int64_t* table = reinterpret_cast<const int64_t*>(a.ctrl_local) + Control::table(R, Lc, int64_t(e & 1));
  const int64_t cap = peer::guard_capacity(a.capacity);
  for (int64_t d = threadIdx.x; d < R; d += blockDim.x) {
    bool cut = false;
    chunk_layout(table, R, Lc, cap, a.align, d, me, prefix + 1 + d * Lc, base + d * Lc, col + d * Lc, &cut);
    if (cut && d == me) *s_bad = 1;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    bool bad = false;
    int64_t run = 0, slots = 0;
    prefix[0] = 0;
    for (int64_t c = 0; c < C; ++c) {
      run += prefix[c + 1];
      prefix[c + 1] = run;
      slot[c] = slots;
      slots += clamp_count(table[me * C + c], &bad);
    }
    if (bad) *s_bad = 1;
  }
  __syncthreads();
  // the fitted slots, one warp each
  const int64_t total = prefix[C];
  const int lane = threadIdx.x & 31;
  const int64_t warp = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5), warps = int64_t(gridDim.x) * kWarps;
  const int64_t P = receive_rows(a.capacity, Lc, a.align), woff = receive_weights_offset(P, a.row_bytes);
  bool bad_slot = false, bad_route = false;
  for (int64_t item = warp; item < total; item += warps) {
    int64_t lo = 0, hi = C;  // the chunk c with prefix[c] <= item < prefix[c + 1]
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      if (prefix[mid] <= item) lo = mid;
      else hi = mid;
    }
    const int64_t c = lo, d = c / Lc, j = item - prefix[c], row = base[c] + j, sl = slot[c] + j;
    const int64_t q = sl < a.slots ? a.route_of_slot[sl] : n;
    bad_slot |= sl >= a.slots;
    bad_route |= q != n && (q < 0 || q > n);
    const bool live = q >= 0 && q < n;
    unsigned char* dst = peer::at<unsigned char>(a.recv_ptrs, d, row * a.row_bytes);
    if (live)
      peer::store_bytes(dst, static_cast<const unsigned char*>(a.rows) + (q / K) * a.row_bytes, a.row_bytes, lane, 32);
    else
      peer::zero_bytes(dst, a.row_bytes, lane, 32);
    if (lane == 0) {
      peer::store(peer::at<float>(a.recv_ptrs, d, woff) + row, live && a.weights != nullptr ? a.weights[q] : 0.f);
      if (live) a.route_row[q] = d * P + row;
    }
  }
  if (bad_slot) set_device_error(a.error_flag, kErrExchangeCounts);
  if (bad_route) set_device_error(a.error_flag, kErrIndexOutOfRange);
  __syncthreads();
  for (int64_t d = threadIdx.x; d < R; d += blockDim.x) {
    peer::fence_system();
    peer::signal_add(a.ctrl_ptrs, R, d, 0, Control::signal(Control::kData, R, me), 1);
  }
  // this rank as the receiver: the rows no fitted row lands on are zeroed (plain local stores: no peer writes there
  // this epoch): each group's rows up to the next aligned start, then the rows past the last group
  auto* own = static_cast<unsigned char*>(a.recv_local);
  float* own_w = reinterpret_cast<float*>(own + woff);
  const auto zero_rows = [&](int64_t from, int64_t to) {
    for (int64_t row = from + warp; row < to; row += warps) {
      for (int64_t b = lane; b < a.row_bytes; b += 32) own[row * a.row_bytes + b] = 0;
      if (lane == 0) own_w[row] = 0.f;
    }
  };
  int64_t start = 0;  // group l's first row
  for (int64_t l = 0; l < Lc; ++l) {
    const int64_t end = start + col[me * Lc + l];
    start = align_up(end, a.align);
    zero_rows(end, start);
  }
  zero_rows(start, P);
  if (blockIdx.x != 0) return;
  for (int64_t l = threadIdx.x; l < Lc; l += blockDim.x) {
    a.m_splits[l] = align_up(col[me * Lc + l], a.align);
    a.counts[l] = col[me * Lc + l];
  }
  if (threadIdx.x == 0 && *s_bad != 0) set_device_error(a.error_flag, kErrExchangeCounts);
  for (int64_t s = threadIdx.x; s < R; s += blockDim.x)
    peer::wait_at_least(a.ctrl_local + Control::signal(Control::kData, R, s), e * gridDim.x);
}

// -------------------------------------------------------------------------------------- combine / gather --
template <typename T>
struct Conv {
  using Acc = float;
  static __device__ __forceinline__ float to(T x) { return static_cast<float>(x); }
  static __device__ __forceinline__ T from(float a) { return static_cast<T>(a); }
};
template <>
struct Conv<double> {
  using Acc = double;
  static __device__ __forceinline__ double to(double x) { return x; }
  static __device__ __forceinline__ double from(double a) { return a; }
};
template <>
struct Conv<__nv_bfloat16> {
  using Acc = float;
  static __device__ __forceinline__ float to(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 from(float a) { return __float2bfloat16_rn(a); }
};
template <>
struct Conv<__half> {
  using Acc = float;
  static __device__ __forceinline__ float to(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from(float a) { return __float2half_rn(a); }
};

template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

// The opening barrier: block 0 tells every peer that this rank's buffer is ready (epoch e); every block waits for
// all R.
__device__ MOE_EXCHANGE_NOINLINE void open_barrier(const CombineArgs& a, int64_t epoch_slot, int64_t kind) {
  const uint64_t e = a.epoch[epoch_slot] + 1;
  if (blockIdx.x == 0)
    for (int64_t d = threadIdx.x; d < a.R; d += blockDim.x) {
      peer::fence_system();
      peer::signal_store(a.ctrl_ptrs, a.R, d, 0, Control::signal(kind, a.R, a.rank), e);
    }
  for (int64_t s = threadIdx.x; s < a.R; s += blockDim.x)
    peer::wait_at_least(a.ctrl_local + Control::signal(kind, a.R, s), e);
  __syncthreads();
}

// The closing barrier: every block tells every peer it is done reading; block 0 waits for every peer's G blocks,
// then advances the epoch (every block of this rank has read it: their signals are among those awaited). The epoch
// is read again here (unchanged since the opening barrier: only this kernel's block 0 advances it, last).
__device__ MOE_EXCHANGE_NOINLINE void close_barrier(const CombineArgs& a, int64_t epoch_slot, int64_t kind) {
  __syncthreads();
  const uint64_t e = a.epoch[epoch_slot] + 1;
  for (int64_t d = threadIdx.x; d < a.R; d += blockDim.x) {
    peer::fence_system();
    peer::signal_add(a.ctrl_ptrs, a.R, d, 0, Control::signal(kind, a.R, a.rank), 1);
  }
  if (blockIdx.x != 0) return;
  for (int64_t s = threadIdx.x; s < a.R; s += blockDim.x)
    peer::wait_at_least(a.ctrl_local + Control::signal(kind, a.R, s), e * gridDim.x);
  __syncthreads();
  if (threadIdx.x == 0) a.epoch[epoch_slot] = e;
}

template <typename T, int V>
__global__ void __launch_bounds__(kThreads) combine_kernel(CombineArgs a) {
  using P = Pack<T, V>;
  using Acc = typename Conv<T>::Acc;
  open_barrier(a, kEpochCombine, Control::kReady);
  const int64_t K = a.topk, packs = a.hidden / V, limit = a.R * a.capacity;
  const int lane = threadIdx.x & 31;
  const int64_t warp = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5), warps = int64_t(gridDim.x) * kWarps;
  const Acc* w = static_cast<const Acc*>(a.weights);
  bool bad = false;
  // one warp per token; lane j < K holds route k0 + j's row and weight, shuffled to the warp for each route
  for (int64_t t = warp; t < a.tokens; t += warps) {
    P* o = reinterpret_cast<P*>(static_cast<T*>(a.out) + t * a.hidden);
    for (int64_t c0 = 0; c0 < packs; c0 += 32) {
      const int64_t c = c0 + lane;
      Acc acc[V];
#pragma unroll
      for (int v = 0; v < V; ++v) acc[v] = Acc(0);
      for (int64_t k0 = 0; k0 < K; k0 += 32) {
        // lane j: the destination and row of route k0 + j (-1: none), its weight
        int64_t mine_d = -1, mine_row = 0;
        Acc mine_w = Acc(1);
        if (k0 + lane < K) {
          const int64_t rr = a.route_row[t * K + k0 + lane];
          bad |= rr != -1 && (rr < 0 || rr >= limit);
          if (rr >= 0 && rr < limit) {  // R * capacity < 2^31 (checked on the host): a 32-bit division
            mine_d = uint32_t(rr) / uint32_t(a.capacity);
            mine_row = rr - mine_d * a.capacity;
          }
          if (w != nullptr) mine_w = w[t * K + k0 + lane];
        }
        const int kn = K - k0 < 32 ? int(K - k0) : 32;
        for (int j = 0; j < kn; ++j) {
          const int64_t d = __shfl_sync(0xffffffffu, mine_d, j), row = __shfl_sync(0xffffffffu, mine_row, j);
          const Acc wk = __shfl_sync(0xffffffffu, mine_w, j);
          if (d < 0 || c >= packs) continue;
          const P x = peer::load(peer::at<P>(a.src_ptrs, d, 0) + row * packs + c);
#pragma unroll
          for (int v = 0; v < V; ++v) {
            if (w == nullptr) acc[v] += Conv<T>::to(x.v[v]);
            else acc[v] += wk * Conv<T>::to(x.v[v]);
          }
        }
      }
      if (c < packs) {
        P y;
#pragma unroll
        for (int v = 0; v < V; ++v) y.v[v] = Conv<T>::from(acc[v]);
        o[c] = y;
      }
    }
  }
  if (bad) set_device_error(a.error_flag, kErrIndexOutOfRange);
  close_barrier(a, kEpochCombine, Control::kDone);
}

template <int V>
__global__ void __launch_bounds__(kThreads) gather_kernel(CombineArgs a) {
  using P = Pack<unsigned char, V>;
  open_barrier(a, kEpochGather, Control::kGatherReady);
  const int64_t n = a.tokens * a.topk, packs = a.row_bytes / V, limit = a.R * a.capacity;
  const int lane = threadIdx.x & 31;
  const int64_t warp = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5), warps = int64_t(gridDim.x) * kWarps;
  bool bad = false;
  for (int64_t q = warp; q < n; q += warps) {
    const int64_t rr = a.route_row[q];
    P* o = reinterpret_cast<P*>(static_cast<unsigned char*>(a.out) + q * a.row_bytes);
    const bool live = rr >= 0 && rr < limit;
    bad |= !live && rr != -1;
    const int64_t d = live ? int64_t(uint32_t(rr) / uint32_t(a.capacity)) : 0;
    const P* s = live ? peer::at<P>(a.src_ptrs, d, 0) + (rr - d * a.capacity) * packs : nullptr;
    for (int64_t c = lane; c < packs; c += 32) {
      P y{};
      if (live) y = peer::load(s + c);
      o[c] = y;
    }
  }
  if (bad) set_device_error(a.error_flag, kErrIndexOutOfRange);
  close_barrier(a, kEpochGather, Control::kGatherDone);
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <typename T>
void launch_combine(const CombineArgs& a, int ctas, cudaStream_t s) {
  constexpr int V = 16 / sizeof(T);
  if ((a.hidden * int64_t(sizeof(T))) % 16 == 0 && aligned16(a.out) && aligned16(a.src_local))
    launch(combine_kernel<T, V>, dim3(ctas), dim3(kThreads), 0, s, a);
  else
    launch(combine_kernel<T, 1>, dim3(ctas), dim3(kThreads), 0, s, a);
}

}  // namespace

void dispatch_cuda(const DispatchArgs& a, int num_ctas, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  const size_t smem = size_t(4 * a.R * a.Lc + 2) * sizeof(int64_t);
  launch(count_kernel, dim3(num_ctas), dim3(kThreads), sizeof(uint64_t), s, a);
  launch(data_kernel, dim3(num_ctas), dim3(kThreads), smem, s, a);
}

void combine_cuda(const CombineArgs& a, int num_ctas, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  switch (a.dtype) {
    case DType::kFloat: return launch_combine<float>(a, num_ctas, s);
    case DType::kDouble: return launch_combine<double>(a, num_ctas, s);
    case DType::kBFloat16: return launch_combine<__nv_bfloat16>(a, num_ctas, s);
    case DType::kHalf: return launch_combine<__half>(a, num_ctas, s);
  }
}

void gather_cuda(const CombineArgs& a, int num_ctas, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  if (a.row_bytes % 16 == 0 && aligned16(a.out) && aligned16(a.src_local))
    launch(gather_kernel<16>, dim3(num_ctas), dim3(kThreads), 0, s, a);
  else
    launch(gather_kernel<1>, dim3(num_ctas), dim3(kThreads), 0, s, a);
}

}  // namespace exchange
}  // namespace moe_graph
