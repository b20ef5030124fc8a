// CUDA implementation of dispatch_layout / receive_layout (semantics in dispatch_layout.h). Torch-free.
//
// dispatch_layout is two stable multi-block counting sorts. A tile is kLayoutTile consecutive sequence positions
// owned by one warp, which walks it in chunks of 32: within a chunk __match_any_sync groups the lanes by key, a lane's
// rank is the tile's running count of its key plus its peers in lower lanes, and the highest peer writes the running
// count back. Each warp owns its tile's column of the key-major histograms ([key][tile]), so no two warps ever write
// one entry and every result is independent of scheduling (the only atomics are the order-free column counts).
//   init    route_of_slot = n, column_counts = 0, histograms = 0
//   keys1   drop order: the destination of each route (R: not live) per position; histogram; route_slot = -1
//   scan    per key, exclusive scan over tiles (one warp per key) and the key's total
//   keep    drop order: rank among the destination's live routes -> route_slot = destination if rank < its limit
//           (capacity, or its quota in quota mode)
//   keys2   route order: (destination, local expert) of each kept route (R * Lc: none); histogram
//   scan    the same over these keys
//   bases   one block: within each destination the exclusive prefix over local experts of the totals, each rounded
//           up to a multiple of align (and send_counts, aligned_counts), in quota mode the kept routes of the
//           destinations before each one; drops, largest load and the counters
//   place   route order: position = base + tile offset + rank -> route_slot, route_of_slot
// receive_layout: one block builds the clamped counts and both prefix tables (the groups' starts rounded up to
// multiples of align), then one thread per receive row finds its local expert by binary search and writes both index
// maps; one thread per expert row past its group's rows writes the padding sentinel.
#include <cstdint>

#include "common/error_flag.h"
#include "common/launch.cuh"
#include "permute/dispatch_layout.h"
#include "permute/dispatch_layout_impl.h"

namespace moe_graph {
namespace dispatch {
namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kScanWarps = 8;
constexpr int kThreads = 256;
constexpr int kChunks = static_cast<int>(kLayoutTile / 32);
constexpr unsigned kFull = 0xffffffffu;
static_assert(kLayoutTile % 32 == 0, "a tile is whole chunks of 32 routes");

struct Workspace {
  int32_t* key_seq;  // [n] key of each sequence position
  int32_t* hist1;    // [R + 1, tiles]
  int32_t* tot1;     // [R + 1]
  int32_t* hist2;    // [R * Lc + 1, tiles]
  int32_t* tot2;     // [R * Lc + 1]
  int32_t* base2;    // [R * Lc]
  int32_t* dest_before;  // [R] kept routes of the destinations before d (quota mode's packed slots)
  int64_t tiles;
  int64_t zeroed;    // elements from hist1 on that start at zero (hist1, tot1, hist2, tot2)
};

__host__ __device__ inline int64_t num_tiles_of(int64_t n) { return (n + kLayoutTile - 1) / kLayoutTile; }

Workspace carve(int32_t* ws, int64_t n, int64_t R, int64_t Lc) {
  Workspace w;
  w.tiles = num_tiles_of(n);
  const int64_t k1 = R + 1, k2 = R * Lc + 1;
  w.key_seq = ws;
  w.hist1 = w.key_seq + n;
  w.tot1 = w.hist1 + k1 * w.tiles;
  w.hist2 = w.tot1 + k1;
  w.tot2 = w.hist2 + k2 * w.tiles;
  w.base2 = w.tot2 + k2;
  w.dest_before = w.base2 + R * Lc;
  w.zeroed = (k1 + k2) * (w.tiles + 1);
  return w;
}

__device__ __forceinline__ int lane_id() { return static_cast<int>(threadIdx.x & 31); }

__device__ __forceinline__ int64_t tile_of_warp() {
  return static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
}

// The route at drop-order position i (-1 and the error bit when route_order holds a value out of range).
__device__ __forceinline__ int64_t route_at(const LayoutProblem& p, int64_t i, int32_t* error_flag) {
  if (p.route_order == nullptr) return i;
  const int64_t r = p.route_order[i];
  if (r < 0 || r >= p.num_routes) {
    set_device_error(error_flag, kErrIndexOutOfRange);
    return -1;
  }
  return r;
}

// Adds the chunk's keys to the warp's histogram column. Inactive lanes group under key -1 and count nothing.
__device__ __forceinline__ void warp_count(int32_t* hist, int64_t tiles, int64_t tile, int32_t key, bool active) {
  const unsigned peers = __match_any_sync(kFull, active ? key : -1);
  if (active && lane_id() == 31 - __clz(peers)) hist[key * tiles + tile] += __popc(peers);
  __syncwarp();
}

// The stable rank of this lane's key: the running count of the warp's tile plus its peers in lower lanes; the
// highest peer advances the running count.
__device__ __forceinline__ int32_t warp_rank(int32_t* hist, int64_t tiles, int64_t tile, int32_t key, bool active) {
  const unsigned peers = __match_any_sync(kFull, active ? key : -1);
  const int lane = lane_id();
  const int32_t base = active ? hist[key * tiles + tile] : 0;
  __syncwarp();
  if (active && lane == 31 - __clz(peers)) hist[key * tiles + tile] = base + __popc(peers);
  __syncwarp();
  return base + __popc(peers & ((1u << lane) - 1u));
}

__global__ void init_kernel(LayoutProblem p, Workspace ws) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t N = num_slots(p);
  for (int64_t i = t0; i < N; i += stride) p.route_of_slot[i] = p.num_routes;
  for (int64_t i = t0; i < p.num_columns; i += stride) p.column_counts[i] = 0;
  for (int64_t i = t0; i < ws.zeroed; i += stride) ws.hist1[i] = 0;
}

__global__ void keys1_kernel(LayoutProblem p, Workspace ws, int32_t* error_flag) {
  const int64_t tile = tile_of_warp();
  if (tile >= ws.tiles) return;  // the whole warp leaves together
  const int64_t n = p.num_routes;
  for (int c = 0; c < kChunks; ++c) {
    const int64_t i = tile * kLayoutTile + c * 32 + lane_id();
    const bool active = i < n;
    int32_t key = static_cast<int32_t>(p.num_ranks);
    if (active) {
      p.route_slot[i] = -1;
      const int64_t r = route_at(p, i, error_flag);
      if (r >= 0) {
        int64_t local = -1;
        int err = LayoutError::kNone;
        key = static_cast<int32_t>(route_destination(p, r, &local, &err));
        if (err != LayoutError::kNone) set_device_error(error_flag, kErrIndexOutOfRange);
        if (local >= 0)
          atomicAdd(reinterpret_cast<unsigned long long*>(p.column_counts + p.indices[r]), 1ull);  // order-free
      }
      ws.key_seq[i] = key;
    }
    warp_count(ws.hist1, ws.tiles, tile, key, active);
  }
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

// One warp per key: the key's row becomes the exclusive prefix over tiles, tot[key] its total.
__global__ void scan_kernel(int32_t* hist, int32_t* tot, int64_t num_keys, int64_t tiles) {
  const int64_t key = static_cast<int64_t>(blockIdx.x) * kScanWarps + (threadIdx.x >> 5);
  if (key >= num_keys) return;
  const int lane = lane_id();
  int32_t* row = hist + key * tiles;
  int32_t carry = 0;
  for (int64_t base = 0; base < tiles; base += 32) {
    const int64_t idx = base + lane;
    const int32_t v = idx < tiles ? row[idx] : 0;
    const int32_t incl = warp_inclusive_scan(v, lane);
    if (idx < tiles) row[idx] = carry + incl - v;
    carry += __shfl_sync(kFull, incl, 31);
  }
  if (lane == 0) tot[key] = carry;
}

__global__ void keep_kernel(LayoutProblem p, Workspace ws) {
  const int64_t tile = tile_of_warp();
  if (tile >= ws.tiles) return;
  const int64_t n = p.num_routes;
  for (int c = 0; c < kChunks; ++c) {
    const int64_t i = tile * kLayoutTile + c * 32 + lane_id();
    const bool active = i < n;
    const int32_t key = active ? ws.key_seq[i] : static_cast<int32_t>(p.num_ranks);
    const int32_t rank = warp_rank(ws.hist1, ws.tiles, tile, key, active);
    if (active && key < p.num_ranks && rank < destination_limit(p, key)) {
      const int64_t r = route_at(p, i, nullptr);  // flagged by keys1 already
      if (r >= 0) p.route_slot[r] = key;
    }
  }
}

__global__ void keys2_kernel(LayoutProblem p, Workspace ws) {
  const int64_t tile = tile_of_warp();
  if (tile >= ws.tiles) return;
  const int64_t n = p.num_routes, none = p.num_ranks * p.num_local;
  for (int c = 0; c < kChunks; ++c) {
    const int64_t i = tile * kLayoutTile + c * 32 + lane_id();
    const bool active = i < n;
    int32_t key = static_cast<int32_t>(none);
    if (active) {
      const int64_t d = p.route_slot[i];  // a kept route's destination, else -1
      if (d >= 0) key = static_cast<int32_t>(d * p.num_local + p.column_local[p.indices[i]]);
      ws.key_seq[i] = key;
    }
    warp_count(ws.hist2, ws.tiles, tile, key, active);
  }
}

__global__ void bases_kernel(LayoutProblem p, Workspace ws) {
  const int64_t R = p.num_ranks, Lc = p.num_local;
  for (int64_t d = threadIdx.x; d < R; d += blockDim.x) {
    int32_t run = 0, kept = 0;  // aligned rows (the group starts), kept routes
    for (int64_t l = 0; l < Lc; ++l) {
      const int32_t v = ws.tot2[d * Lc + l];
      const int64_t padded = align_up(v, p.align);
      ws.base2[d * Lc + l] = run;
      p.send_counts[d * Lc + l] = v;
      p.aligned_counts[d * Lc + l] = padded;
      run += static_cast<int32_t>(padded);  // < 2^31: the op checks n + (align - 1) * Lc
      kept += v;
    }
    ws.dest_before[d] = kept;
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // exclusive prefix over destinations (R steps)
    int32_t before = 0;
    for (int64_t d = 0; d < R; ++d) {
      const int32_t total = ws.dest_before[d];
      ws.dest_before[d] = before;
      before += total;
    }
  }
  __shared__ long long s_drop[kThreads];
  __shared__ long long s_max[kThreads];
  long long drop = 0, most = 0;
  for (int64_t d = threadIdx.x; d < R; d += blockDim.x) {
    drop += over_capacity(ws.tot1[d], destination_limit(p, d));
    most = ws.tot1[d] > most ? ws.tot1[d] : most;
  }
  s_drop[threadIdx.x] = drop;
  s_max[threadIdx.x] = most;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w >>= 1) {
    if (threadIdx.x < w) {
      s_drop[threadIdx.x] += s_drop[threadIdx.x + w];
      s_max[threadIdx.x] = s_max[threadIdx.x + w] > s_max[threadIdx.x] ? s_max[threadIdx.x + w] : s_max[threadIdx.x];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) fold_statistics(p, s_drop[0], s_max[0]);
}

__global__ void place_kernel(LayoutProblem p, Workspace ws) {
  const int64_t tile = tile_of_warp();
  if (tile >= ws.tiles) return;
  const int64_t n = p.num_routes, none = p.num_ranks * p.num_local, N = num_slots(p);
  for (int c = 0; c < kChunks; ++c) {
    const int64_t i = tile * kLayoutTile + c * 32 + lane_id();
    const bool active = i < n;
    const int32_t key = active ? ws.key_seq[i] : static_cast<int32_t>(none);
    const int32_t rank = warp_rank(ws.hist2, ws.tiles, tile, key, active);
    if (!active) continue;
    if (key < none) {
      const int64_t d = key / p.num_local;
      const int64_t s = destination_base(p, d, ws.dest_before[d]) + static_cast<int64_t>(ws.base2[key]) + rank;
      p.route_slot[i] = s;
      p.route_of_slot[s] = i;
    } else {
      p.route_slot[i] = N;
    }
  }
}

unsigned blocks_for(int64_t items, int64_t per_block, int64_t cap = 1 << 16) {
  const int64_t b = (items + per_block - 1) / per_block;
  return static_cast<unsigned>(b < 1 ? 1 : (b > cap ? cap : b));
}

// ------------------------------------------------------------------------------------------ receive_layout --
struct RecvWorkspace {
  int64_t* cnt;        // [R, Lc] clamped counts
  int64_t* row_start;  // [R, Lc] first row of (s, l) in source block s
  int64_t* col_base;   // [R, Lc] first expert row of (s, l)
  int64_t* m_base;     // [Lc] first expert row of local expert l (a multiple of align)
};

RecvWorkspace carve_recv(int64_t* ws, int64_t R, int64_t Lc) {
  return RecvWorkspace{ws, ws + R * Lc, ws + 2 * R * Lc, ws + 3 * R * Lc};
}

__global__ void recv_tables_kernel(ReceiveProblem p, RecvWorkspace ws, int32_t* error_flag) {
  const int64_t R = p.num_ranks, Lc = p.num_local;
  for (int64_t s = threadIdx.x; s < R; s += blockDim.x) {
    int64_t used = 0;
    for (int64_t l = 0; l < Lc; ++l) {
      int err = LayoutError::kNone;
      const int64_t c = usable_count(p.recv_counts[s * Lc + l], used, p.capacity, &err);
      if (err == LayoutError::kNegativeCount) set_device_error(error_flag, kErrNegativeSplit);
      if (err == LayoutError::kCountOverflow) set_device_error(error_flag, kErrSplitsOverflow);
      ws.cnt[s * Lc + l] = c;
      ws.row_start[s * Lc + l] = used;
      used += c;
    }
  }
  __syncthreads();
  for (int64_t l = threadIdx.x; l < Lc; l += blockDim.x) {
    int64_t run = 0;
    for (int64_t s = 0; s < R; ++s) {
      ws.col_base[s * Lc + l] = run;
      run += ws.cnt[s * Lc + l];
    }
    p.m_splits[l] = run;
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // each group's first expert row: a multiple of align
    int64_t run = 0;
    for (int64_t l = 0; l < Lc; ++l) {
      const int64_t padded = align_up(p.m_splits[l], p.align);
      ws.m_base[l] = run;
      p.aligned_m_splits[l] = padded;
      run += padded;
    }
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < R * Lc; i += blockDim.x) ws.col_base[i] += ws.m_base[i % Lc];
}

// One thread per receive row j and per expert row j (P >= N): both index maps. An expert row past its group's rows
// (m_base[l] + m_splits[l]) is padding; the real ones are written by their receive rows.
__global__ void recv_rows_kernel(ReceiveProblem p, RecvWorkspace ws, int64_t P) {
  const int64_t N = p.num_ranks * p.capacity, Lc = p.num_local;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < P; j += stride) {
    if (local_of_position(ws.m_base, p.m_splits, Lc, j) < 0) p.expert_row_source[j] = N;  // padding rows
    if (j >= N) continue;
    const int64_t s = j / p.capacity, pos = j - s * p.capacity;
    const int64_t l = local_of_position(ws.row_start + s * Lc, ws.cnt + s * Lc, Lc, pos);
    if (l < 0) {
      p.recv_row_target[j] = P;
      continue;
    }
    const int64_t e = ws.col_base[s * Lc + l] + (pos - ws.row_start[s * Lc + l]);
    p.recv_row_target[j] = e;
    p.expert_row_source[e] = j;
  }
}

// ------------------------------------------------------------------------------------------ aligned_groups --
// One thread: the groups' running ends (G is the local expert count: small).
__global__ void aligned_tables_kernel(AlignProblem p, int64_t* end, int64_t* pend) {
  if (threadIdx.x == 0) aligned_group_tables(p, end, pend);
}

// One thread per padded row q and per source row q: both index maps (binary searches over the G ends).
__global__ void aligned_rows_kernel(AlignProblem p, const int64_t* end, const int64_t* pend, int64_t P) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t n = P > p.rows ? P : p.rows;
  for (int64_t q = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; q < n; q += stride) {
    if (q < P) p.source_of_padded[q] = aligned_source_of(p, end, pend, q);
    if (q < p.rows) p.padded_of_source[q] = aligned_target_of(p, end, pend, q, P);
  }
}

}  // namespace

int64_t dispatch_layout_workspace_elems(int64_t n, int64_t R, int64_t Lc) {
  const int64_t tiles = num_tiles_of(n);
  return n + (R + 1 + R * Lc + 1) * (tiles + 1) + R * Lc + R;
}

int64_t receive_layout_workspace_elems(int64_t R, int64_t Lc) { return 3 * R * Lc + Lc; }

cudaError_t dispatch_layout_cuda_launch(const LayoutProblem& p, int32_t* workspace, int32_t* error_flag,
                                        cudaStream_t stream) {
  const int64_t n = p.num_routes, R = p.num_ranks, Lc = p.num_local;
  Workspace ws = carve(workspace, n, R, Lc);
  const int64_t N = num_slots(p);
  int64_t widest = N > ws.zeroed ? N : ws.zeroed;
  widest = widest > p.num_columns ? widest : p.num_columns;
  moe_graph::launch(init_kernel, blocks_for(widest, kThreads), kThreads, 0, stream, p, ws);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;  // blame each launch on its own
  const unsigned tile_blocks = blocks_for(ws.tiles, kWarpsPerBlock, int64_t(1) << 31);
  const int tile_threads = 32 * kWarpsPerBlock;
  if (ws.tiles > 0) moe_graph::launch(keys1_kernel, tile_blocks, tile_threads, 0, stream, p, ws, error_flag);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  moe_graph::launch(scan_kernel, blocks_for(R + 1, kScanWarps, int64_t(1) << 31), 32 * kScanWarps, 0, stream, ws.hist1,
      ws.tot1, R + 1, ws.tiles);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (ws.tiles > 0) moe_graph::launch(keep_kernel, tile_blocks, tile_threads, 0, stream, p, ws);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (ws.tiles > 0) moe_graph::launch(keys2_kernel, tile_blocks, tile_threads, 0, stream, p, ws);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  moe_graph::launch(scan_kernel, blocks_for(R * Lc + 1, kScanWarps, int64_t(1) << 31), 32 * kScanWarps, 0, stream,
      ws.hist2, ws.tot2, R * Lc + 1, ws.tiles);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  moe_graph::launch(bases_kernel, 1, kThreads, 0, stream, p, ws);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  if (ws.tiles > 0) moe_graph::launch(place_kernel, tile_blocks, tile_threads, 0, stream, p, ws);
  return cudaGetLastError();
}

cudaError_t receive_layout_cuda_launch(const ReceiveProblem& p, int64_t* workspace, int32_t* error_flag,
                                       cudaStream_t stream) {
  RecvWorkspace ws = carve_recv(workspace, p.num_ranks, p.num_local);
  moe_graph::launch(recv_tables_kernel, 1, kThreads, 0, stream, p, ws, error_flag);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  const int64_t P = aligned_padded_rows(p.num_ranks * p.capacity, p.num_local, p.align);
  moe_graph::launch(recv_rows_kernel, blocks_for(P, kThreads), kThreads, 0, stream, p, ws, P);
  return cudaGetLastError();
}

int64_t aligned_groups_workspace_elems(int64_t num_groups) { return 2 * num_groups; }

cudaError_t aligned_groups_cuda_launch(const AlignProblem& p, int64_t* workspace, cudaStream_t stream) {
  const int64_t G = p.num_groups, P = aligned_padded_rows(p.rows, G, p.align);
  int64_t* end = workspace;
  int64_t* pend = workspace + G;
  if (G > 0) moe_graph::launch(aligned_tables_kernel, 1, 32, 0, stream, p, end, pend);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  const int64_t n = P > p.rows ? P : p.rows;
  if (n > 0) moe_graph::launch(aligned_rows_kernel, blocks_for(n, kThreads), kThreads, 0, stream, p, end, pend, P);
  return cudaGetLastError();
}

}  // namespace dispatch
}  // namespace moe_graph
