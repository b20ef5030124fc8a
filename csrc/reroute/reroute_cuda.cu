// CUDA implementation of token rerouting, dense and index form (semantics in reroute.h). Torch-free: raw
// pointers and a stream.
//
// Dense form: four launches, fixed configuration for fixed shapes (capturable), no host synchronization:
//   A  count    grid = tiles of kRerouteTileRows rows; each thread owns columns and counts routed tokens per
//               (tile, expert) with row-major, coalesced reads.
//   B1 slots    one thread per slot: its home expert (first true of the column), its request (clamped), flags.
//   B2 experts  one warp per expert: exclusive scan over tiles (rank of each tile's first routed token) and the
//               expert's slot list with cumulative (clamped) rank ends, by warp ballot + scan over slots.
//   C  apply    grid = tiles; first zero the tile's spare columns, then each thread walks its column down the
//               tile's rows keeping the running rank: a routed token whose rank falls in a slot's range moves
//               there (map + exact probability bits), everything else is copied. Row-major, coalesced.
// Index form: the same four steps; A counts a tile's routes per expert in shared memory (integer atomics: the
// counts do not depend on their order), C first copies the tile's indices, then one thread per expert that has
// slots walks the tile's routes (staged in shared memory) in row-major order with its running rank and rewrites
// the moved ones.
#include <cstdint>

#include "common/error_flag.h"
#include "common/launch.cuh"
#include "reroute/reroute.h"

namespace moe_graph {
namespace reroute {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlockB2 = 8;
constexpr unsigned kFull = 0xffffffffu;

struct Workspace {
  int32_t* tile_rank;   // [(tiles + 1), E]: counts, then exclusive scan; last row = totals
  int32_t* slot_home;   // [S] home expert or -1
  int32_t* slot_want;   // [S] request clamped to [0, T]
  int32_t* num_slots;   // [E]
  int32_t* slot_list;   // [E, S]
  int32_t* slot_end;    // [E, S]
};

__host__ __device__ inline int64_t num_tiles_of(int64_t T) { return (T + kRerouteTileRows - 1) / kRerouteTileRows; }

Workspace carve(int32_t* ws, int64_t T, int64_t E, int64_t S) {
  Workspace w;
  int32_t* p = ws;
  w.tile_rank = p;
  p += (num_tiles_of(T) + 1) * E;
  w.slot_home = p;
  p += S;
  w.slot_want = p;
  p += S;
  w.num_slots = p;
  p += E;
  w.slot_list = p;
  p += E * S;
  w.slot_end = p;
  return w;
}

__global__ void count_kernel(const bool* __restrict__ map, int64_t T, int64_t E, int32_t* __restrict__ tile_rank) {
  const int64_t tile = blockIdx.x;
  const int64_t t0 = tile * kRerouteTileRows;
  const int64_t t1 = min(T, t0 + kRerouteTileRows);
  for (int64_t c = threadIdx.x; c < E; c += blockDim.x) {
    int32_t n = 0;
#pragma unroll 8
    for (int64_t t = t0; t < t1; ++t) n += map[t * E + c] ? 1 : 0;
    tile_rank[tile * E + c] = n;
  }
}

// slot_home_out: optional [S] int64 (E: none), the index form's second output.
__global__ void slots_kernel(const void* __restrict__ offload_map, int offload_bytes,
                             const int64_t* __restrict__ tokens_to_spare, int64_t T, int64_t E, int64_t S,
                             int32_t* __restrict__ slot_home, int32_t* __restrict__ slot_want,
                             int64_t* __restrict__ slot_home_out, int32_t* error_flag) {
  const int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (j >= S) return;
  int64_t home = -1, want = 0;
  const int32_t err = slot_request(offload_map, offload_bytes, tokens_to_spare, T, E, S, j, &home, &want);
  slot_home[j] = static_cast<int32_t>(home);
  slot_want[j] = static_cast<int32_t>(want);
  if (slot_home_out != nullptr) slot_home_out[j] = home < 0 ? E : home;
  if (err) set_device_error(error_flag, err);
}

template <typename V>
__device__ __forceinline__ V warp_inclusive_scan(V v, int lane) {
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const V u = __shfl_up_sync(kFull, v, d);
    if (lane >= d) v += u;
  }
  return v;
}

__global__ void experts_kernel(int64_t T, int64_t E, int64_t S, Workspace ws, int32_t* error_flag) {
  const int lane = threadIdx.x & 31;
  const int64_t e = blockIdx.x * int64_t(kWarpsPerBlockB2) + (threadIdx.x >> 5);
  if (e >= E) return;  // whole warp leaves together
  const int64_t tiles = num_tiles_of(T);

  // exclusive scan of the per-tile counts of expert e
  long long carry = 0;
  for (int64_t base = 0; base < tiles; base += 32) {
    const int64_t idx = base + lane;
    const long long v = idx < tiles ? ws.tile_rank[idx * E + e] : 0;
    const long long incl = warp_inclusive_scan(v, lane);
    if (idx < tiles) ws.tile_rank[idx * E + e] = static_cast<int32_t>(carry + incl - v);
    carry += __shfl_sync(kFull, incl, 31);
  }
  const long long total = carry;
  if (lane == 0) ws.tile_rank[tiles * E + e] = static_cast<int32_t>(total);

  // the slots of expert e, in ascending order, with clamped cumulative ends
  int32_t n = 0;
  long long acc = 0;
  for (int64_t base = 0; base < S; base += 32) {
    const int64_t j = base + lane;
    const bool mine = j < S && ws.slot_home[j] == static_cast<int32_t>(e);
    const long long w = mine ? ws.slot_want[j] : 0;
    const long long incl = warp_inclusive_scan(w, lane);
    const unsigned ballot = __ballot_sync(kFull, mine);
    if (mine) {
      const int32_t pos = n + __popc(ballot & ((1u << lane) - 1u));
      const long long end = acc + incl;
      ws.slot_list[e * S + pos] = static_cast<int32_t>(j);
      ws.slot_end[e * S + pos] = static_cast<int32_t>(end < total ? end : total);
    }
    acc += __shfl_sync(kFull, incl, 31);
    n += __popc(ballot);
  }
  if (lane == 0) {
    ws.num_slots[e] = n;
    if (acc > total) set_device_error(error_flag, kErrRerouteOverAsk);
  }
}

template <typename P>
__global__ void apply_kernel(const bool* __restrict__ map, const P* __restrict__ probs, int64_t T, int64_t E,
                             int64_t S, Workspace ws, bool* __restrict__ out_map, P* __restrict__ out_probs) {
  const int64_t W = E + S;
  const int64_t tile = blockIdx.x;
  const int64_t t0 = tile * kRerouteTileRows;
  const int64_t t1 = min(T, t0 + kRerouteTileRows);
  // phase 1: spare columns of this tile's rows start empty
  const int64_t spare = (t1 - t0) * S;
  for (int64_t idx = threadIdx.x; idx < spare; idx += blockDim.x) {
    const int64_t t = t0 + idx / S;
    const int64_t j = idx - (t - t0) * S;
    out_map[t * W + E + j] = false;
    out_probs[t * W + E + j] = P(0);
  }
  __syncthreads();
  // phase 2: each thread walks its home columns down the tile, kBatch rows of loads in flight at a time
  constexpr int kBatch = 8;
  for (int64_t c = threadIdx.x; c < E; c += blockDim.x) {
    const int32_t n = ws.num_slots[c];
    const int32_t* list = ws.slot_list + c * S;
    const int32_t* end = ws.slot_end + c * S;
    int32_t rank = ws.tile_rank[tile * E + c];
    int32_t i = 0;
    for (int64_t tb = t0; tb < t1; tb += kBatch) {
      bool m[kBatch];
      P v[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int64_t t = tb + b;
        m[b] = t < t1 ? map[t * E + c] : false;
        v[b] = t < t1 ? probs[t * E + c] : P(0);
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int64_t t = tb + b;
        if (t >= t1) break;
        bool moved = false;
        if (m[b] && n > 0) {
          i = static_cast<int32_t>(slot_position(rank, end, n, i));
          if (i < n) {
            const int64_t j = list[i];
            out_map[t * W + E + j] = true;
            out_probs[t * W + E + j] = v[b];
            moved = true;
          }
          ++rank;
        }
        out_map[t * W + c] = m[b] && !moved;
        out_probs[t * W + c] = moved ? P(0) : v[b];
      }
    }
  }
}

// A route of the index form that counts: valid and a home expert in [0, E).
__device__ __forceinline__ bool counted(const int64_t* indices, const bool* valid, int64_t r, int64_t E,
                                        int64_t* e_out) {
  const int64_t e = indices[r];
  *e_out = e;
  return (valid == nullptr || valid[r]) && e >= 0 && e < E;
}

__global__ void count_indices_kernel(const int64_t* __restrict__ indices, const bool* __restrict__ valid, int64_t T,
                                     int64_t K, int64_t E, int32_t* __restrict__ tile_rank) {
  int32_t* hist = dynamic_smem<int32_t>();  // [E]
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const int64_t tile = blockIdx.x;
  const int64_t r0 = tile * kRerouteTileRows * K;
  const int64_t r1 = min(T, (tile + 1) * kRerouteTileRows) * K;
  for (int64_t r = r0 + threadIdx.x; r < r1; r += blockDim.x) {
    int64_t e;
    if (counted(indices, valid, r, E, &e)) atomicAdd(&hist[e], 1);
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) tile_rank[tile * E + e] = hist[e];
}

// Shared memory of apply_indices_kernel: the tile's experts (-1: not counted), kRerouteTileRows * K int32.
__global__ void apply_indices_kernel(const int64_t* __restrict__ indices, const bool* __restrict__ valid, int64_t T,
                                     int64_t K, int64_t E, int64_t S, Workspace ws,
                                     int64_t* __restrict__ out_indices) {
  int32_t* expert_of = dynamic_smem<int32_t>();  // [(t1 - t0) * K]
  const int64_t tile = blockIdx.x;
  const int64_t r0 = tile * kRerouteTileRows * K;
  const int64_t n = min(T, (tile + 1) * kRerouteTileRows) * K - r0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    int64_t e;
    const bool c = counted(indices, valid, r0 + i, E, &e);
    expert_of[i] = c ? static_cast<int32_t>(e) : -1;
    out_indices[r0 + i] = e;
  }
  __syncthreads();
  for (int64_t c = threadIdx.x; c < E; c += blockDim.x) {
    const int32_t last = ws.num_slots[c];
    if (last == 0) continue;
    const int32_t* list = ws.slot_list + c * S;
    const int32_t* end = ws.slot_end + c * S;
    int64_t rank = ws.tile_rank[tile * E + c];
    int64_t pos = 0;
    for (int64_t i = 0; i < n && pos < last; ++i) {
      if (expert_of[i] != c) continue;
      pos = slot_position(rank++, end, last, pos);
      if (pos < last) out_indices[r0 + i] = E + list[pos];
    }
  }
}

// Threads per block of the per-tile kernels: one per home column, rounded to warps, 64..256.
int tile_threads(int64_t E) {
  const int64_t t = (E + 31) / 32 * 32;
  return static_cast<int>(t < 64 ? 64 : (t > kThreads ? kThreads : t));
}

template <typename P>
void launch_apply(const RerouteProblem& p, const Workspace& ws, int64_t tiles, cudaStream_t stream) {
  moe_graph::launch(apply_kernel<P>, static_cast<unsigned>(tiles), tile_threads(p.num_experts), 0, stream,
      p.routing_map, static_cast<const P*>(p.probs), p.num_tokens, p.num_experts, p.num_slots, ws, p.out_map,
      static_cast<P*>(p.out_probs));
}

}  // namespace

int64_t reroute_workspace_elems(int64_t T, int64_t E, int64_t S) {
  return (num_tiles_of(T) + 1) * E + 2 * S + E + 2 * E * S;
}

cudaError_t reroute_tokens_cuda_launch(const RerouteProblem& p, int32_t* workspace, cudaStream_t stream) {
  const int64_t T = p.num_tokens, E = p.num_experts, S = p.num_slots;
  const int64_t tiles = num_tiles_of(T);
  Workspace ws = carve(workspace, T, E, S);
  if (tiles > 0 && E > 0)
    moe_graph::launch(count_kernel, static_cast<unsigned>(tiles), tile_threads(E), 0, stream, p.routing_map, T, E,
        ws.tile_rank);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;  // blame each launch on its own
  if (S > 0)
    moe_graph::launch(slots_kernel, static_cast<unsigned>((S + kThreads - 1) / kThreads), kThreads, 0, stream,
        p.offload_map, p.offload_bytes, p.tokens_to_spare, T, E, S, ws.slot_home, ws.slot_want, nullptr, p.error_flag);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (E > 0)
    moe_graph::launch(experts_kernel, static_cast<unsigned>((E + kWarpsPerBlockB2 - 1) / kWarpsPerBlockB2),
        32 * kWarpsPerBlockB2, 0, stream, T, E, S, ws, p.error_flag);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (tiles > 0) {
    switch (p.prob_bytes) {
      case 2: launch_apply<uint16_t>(p, ws, tiles, stream); break;
      case 4: launch_apply<uint32_t>(p, ws, tiles, stream); break;
      default: launch_apply<uint64_t>(p, ws, tiles, stream); break;
    }
  }
  return cudaGetLastError();
}

cudaError_t reroute_indices_cuda_launch(const RerouteIndexProblem& p, int32_t* workspace, cudaStream_t stream) {
  const int64_t T = p.num_tokens, K = p.topk, E = p.num_experts, S = p.num_slots;
  const int64_t tiles = num_tiles_of(T);
  Workspace ws = carve(workspace, T, E, S);
  const int threads = tile_threads(E);
  if (tiles > 0 && E > 0 && K > 0)
    moe_graph::launch(count_indices_kernel, static_cast<unsigned>(tiles), threads, E * sizeof(int32_t), stream,
        p.indices, p.valid, T, K, E, ws.tile_rank);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (S > 0)
    moe_graph::launch(slots_kernel, static_cast<unsigned>((S + kThreads - 1) / kThreads), kThreads, 0, stream,
        p.offload_map, p.offload_bytes, p.tokens_to_spare, T, E, S, ws.slot_home, ws.slot_want, p.slot_home,
        p.error_flag);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (E > 0)
    moe_graph::launch(experts_kernel, static_cast<unsigned>((E + kWarpsPerBlockB2 - 1) / kWarpsPerBlockB2),
        32 * kWarpsPerBlockB2, 0, stream, T, E, S, ws, p.error_flag);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (tiles > 0 && K > 0) {
    moe_graph::launch(apply_indices_kernel, static_cast<unsigned>(tiles), threads,
        kRerouteTileRows * K * sizeof(int32_t), stream, p.indices, p.valid, T, K, E, S, ws, p.out_indices);
  }
  return cudaGetLastError();
}

}  // namespace reroute
}  // namespace moe_graph
