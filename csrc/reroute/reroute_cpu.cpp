// CPU implementation of token rerouting, dense and index form (semantics in reroute.h). Torch-free.
//
// Rows are processed in chunks: (1) count each expert's routed tokens per chunk (parallel over chunks), (2) an
// exclusive scan over chunks gives each chunk the rank of its first routed token per expert, and the slot table
// says which ranks go to which slot, (3) each chunk copies its rows and moves the routes whose rank falls into a
// slot's range (parallel over chunks). Every row is read row-major, so the work is cache-friendly and the result
// does not depend on the chunking.
#include <algorithm>
#include <cstring>
#include <vector>

#include "common/error_flag.h"
#include "reroute/reroute.h"

namespace moe_graph {
namespace reroute {
namespace {

constexpr int64_t kChunkRows = 2048;

// Per home expert: its slots in ascending order and the (clamped) end of each slot's rank range.
struct SlotTable {
  std::vector<int64_t> begin;  // [E + 1] offsets into slot/end
  std::vector<int64_t> slot;   // slot ids
  std::vector<int64_t> end;    // exclusive end rank per listed slot (non-decreasing per expert)
};

template <typename P>
void apply_chunk(const RerouteProblem& p, const SlotTable& table, const int64_t* first_rank, int64_t t0, int64_t t1) {
  const int64_t E = p.num_experts, S = p.num_slots, W = E + S;
  const P* probs = static_cast<const P*>(p.probs);
  P* out_probs = static_cast<P*>(p.out_probs);
  std::vector<int64_t> rank(first_rank, first_rank + E);
  std::vector<int64_t> ptr(E);
  for (int64_t e = 0; e < E; ++e) ptr[e] = table.begin[e];
  for (int64_t t = t0; t < t1; ++t) {
    const bool* m_in = p.routing_map + t * E;
    const P* p_in = probs + t * E;
    bool* m_out = p.out_map + t * W;
    P* p_out = out_probs + t * W;
    std::memcpy(m_out, m_in, static_cast<size_t>(E) * sizeof(bool));
    std::memcpy(p_out, p_in, static_cast<size_t>(E) * sizeof(P));
    std::memset(m_out + E, 0, static_cast<size_t>(S) * sizeof(bool));
    std::memset(p_out + E, 0, static_cast<size_t>(S) * sizeof(P));
    for (int64_t e = 0; e < E; ++e) {
      if (!m_in[e]) continue;
      const int64_t r = rank[e]++;
      int64_t& i = ptr[e];
      const int64_t last = table.begin[e + 1];
      i = slot_position(r, table.end.data(), last, i);
      if (i < last) {
        const int64_t j = table.slot[i];
        m_out[e] = false;
        p_out[e] = P(0);
        m_out[E + j] = true;
        p_out[E + j] = p_in[e];
      }
    }
  }
}

void run_chunks(const ParallelFor& parallel_for, int64_t n, const std::function<void(int64_t, int64_t)>& body) {
  if (parallel_for)
    parallel_for(n, body);
  else if (n > 0)
    body(0, n);
}

// The slot table from the plan and each expert's routed total; returns the error bits. slot_home (optional, [S]):
// each slot's home expert, E for none.
int32_t build_slot_table(const void* offload_map, int offload_bytes, const int64_t* tokens_to_spare, int64_t T,
                         int64_t E, int64_t S, const int64_t* totals, SlotTable& table, int64_t* slot_home) {
  int32_t err = 0;
  std::vector<int64_t> home(S, -1), want(S, 0);
  for (int64_t j = 0; j < S; ++j) {
    err |= slot_request(offload_map, offload_bytes, tokens_to_spare, T, E, S, j, &home[j], &want[j]);
    if (slot_home != nullptr) slot_home[j] = home[j] < 0 ? E : home[j];
  }
  table.begin.assign(E + 1, 0);
  for (int64_t j = 0; j < S; ++j)
    if (home[j] >= 0) table.begin[home[j] + 1]++;
  for (int64_t e = 0; e < E; ++e) table.begin[e + 1] += table.begin[e];
  table.slot.resize(table.begin[E]);
  table.end.resize(table.begin[E]);
  std::vector<int64_t> fill(table.begin.begin(), table.begin.end() - 1);
  std::vector<int64_t> acc(E, 0);
  for (int64_t j = 0; j < S; ++j) {
    const int64_t e = home[j];
    if (e < 0) continue;
    acc[e] += want[j];
    if (acc[e] > totals[e]) {
      err |= kErrRerouteOverAsk;
      acc[e] = totals[e];  // clamp; later slots of e get nothing
    }
    table.slot[fill[e]] = j;
    table.end[fill[e]] = acc[e];
    fill[e]++;
  }
  return err;
}

// Exclusive scan over chunks of counts [(chunks + 1), E] (row c: chunk c's counts); the last row gets the totals.
void scan_chunks(std::vector<int64_t>& counts, int64_t chunks, int64_t E) {
  for (int64_t e = 0; e < E; ++e) {
    int64_t run_sum = 0;
    for (int64_t c = 0; c <= chunks; ++c) {
      const int64_t v = (c < chunks) ? counts[c * E + e] : 0;
      counts[c * E + e] = run_sum;
      run_sum += v;
    }
  }
}

// A route of the index form that counts: valid and a home expert in [0, E).
inline bool counted(const RerouteIndexProblem& p, int64_t r) {
  const int64_t e = p.indices[r];
  return (p.valid == nullptr || p.valid[r]) && e >= 0 && e < p.num_experts;
}

}  // namespace

void reroute_tokens_host(const RerouteProblem& p, const ParallelFor& parallel_for) {
  const int64_t T = p.num_tokens, E = p.num_experts, S = p.num_slots;
  auto run = [&](int64_t n, const std::function<void(int64_t, int64_t)>& body) { run_chunks(parallel_for, n, body); };
  const int64_t chunks = (T + kChunkRows - 1) / kChunkRows;

  // (1) routed tokens per (chunk, expert)
  std::vector<int64_t> counts(static_cast<size_t>(chunks * E + E), 0);
  run(chunks, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t* row = counts.data() + c * E;
      const int64_t t1 = std::min(T, (c + 1) * kChunkRows);
      for (int64_t t = c * kChunkRows; t < t1; ++t) {
        const bool* m = p.routing_map + t * E;
        for (int64_t e = 0; e < E; ++e) row[e] += m[e] ? 1 : 0;
      }
    }
  });
  // (2) exclusive scan over chunks; the last row holds the totals
  scan_chunks(counts, chunks, E);
  const int64_t* totals = counts.data() + chunks * E;

  SlotTable table;
  if (int32_t err = build_slot_table(p.offload_map, p.offload_bytes, p.tokens_to_spare, T, E, S, totals, table, nullptr))
    set_host_error(p.error_flag, err);

  // (3) copy + move, chunk by chunk
  run(chunks, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t t0 = c * kChunkRows, t1 = std::min(T, (c + 1) * kChunkRows);
      const int64_t* first = counts.data() + c * E;
      switch (p.prob_bytes) {
        case 2: apply_chunk<uint16_t>(p, table, first, t0, t1); break;
        case 4: apply_chunk<uint32_t>(p, table, first, t0, t1); break;
        default: apply_chunk<uint64_t>(p, table, first, t0, t1); break;
      }
    }
  });
}

void reroute_indices_host(const RerouteIndexProblem& p, const ParallelFor& parallel_for) {
  const int64_t T = p.num_tokens, K = p.topk, E = p.num_experts, S = p.num_slots;
  auto run = [&](int64_t n, const std::function<void(int64_t, int64_t)>& body) { run_chunks(parallel_for, n, body); };
  const int64_t chunks = (T + kChunkRows - 1) / kChunkRows;

  // (1) counted routes per (chunk, expert), (2) exclusive scan over chunks
  std::vector<int64_t> counts(static_cast<size_t>(chunks * E + E), 0);
  run(chunks, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t* row = counts.data() + c * E;
      const int64_t r1 = std::min(T, (c + 1) * kChunkRows) * K;
      for (int64_t r = c * kChunkRows * K; r < r1; ++r)
        if (counted(p, r)) row[p.indices[r]]++;
    }
  });
  scan_chunks(counts, chunks, E);
  SlotTable table;
  if (int32_t err = build_slot_table(p.offload_map, p.offload_bytes, p.tokens_to_spare, T, E, S,
                                     counts.data() + chunks * E, table, p.slot_home))
    set_host_error(p.error_flag, err);

  // (3) copy + move, chunk by chunk; only experts with slots keep a running rank
  run(chunks, [&](int64_t c0, int64_t c1) {
    std::vector<int64_t> rank(E), ptr(E);
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t* first = counts.data() + c * E;
      for (int64_t e = 0; e < E; ++e) {
        rank[e] = first[e];
        ptr[e] = table.begin[e];
      }
      const int64_t r0 = c * kChunkRows * K, r1 = std::min(T, (c + 1) * kChunkRows) * K;
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t e = p.indices[r];
        p.out_indices[r] = e;
        if (!counted(p, r)) continue;
        const int64_t last = table.begin[e + 1];
        if (ptr[e] == last) continue;  // no slot left for e
        ptr[e] = slot_position(rank[e]++, table.end.data(), last, ptr[e]);
        if (ptr[e] < last) p.out_indices[r] = E + table.slot[ptr[e]];
      }
    }
  });
}

}  // namespace reroute
}  // namespace moe_graph
