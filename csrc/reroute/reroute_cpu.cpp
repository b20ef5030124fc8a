// CPU implementation of token rerouting (semantics in reroute.h). Torch-free.
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
      while (i < last && r >= table.end[i]) ++i;
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

}  // namespace

void reroute_tokens_host(const RerouteProblem& p, const ParallelFor& parallel_for) {
  const int64_t T = p.num_tokens, E = p.num_experts, S = p.num_slots;
  auto run = [&](int64_t n, const std::function<void(int64_t, int64_t)>& body) {
    if (parallel_for)
      parallel_for(n, body);
    else if (n > 0)
      body(0, n);
  };
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
  for (int64_t e = 0; e < E; ++e) {
    int64_t run_sum = 0;
    for (int64_t c = 0; c <= chunks; ++c) {
      const int64_t v = (c < chunks) ? counts[c * E + e] : 0;
      counts[c * E + e] = run_sum;
      run_sum += v;
    }
  }
  const int64_t* totals = counts.data() + chunks * E;

  // slot homes and requests
  int32_t err = 0;
  std::vector<int64_t> home(S, -1), want(S, 0);
  for (int64_t j = 0; j < S; ++j) {
    for (int64_t e = 0; e < E; ++e) {
      if (p.offload_map[e * S + j]) {
        if (home[j] < 0)
          home[j] = e;
        else
          err |= kErrPlanInvalid;
      }
    }
    int64_t w = p.tokens_to_spare[j];
    if (w < 0) {
      err |= kErrPlanInvalid;
      w = 0;
    }
    if (home[j] < 0 && w > 0) err |= kErrRerouteOverAsk;
    want[j] = w;
  }
  SlotTable table;
  table.begin.assign(E + 1, 0);
  for (int64_t j = 0; j < S; ++j)
    if (home[j] >= 0) table.begin[home[j] + 1]++;
  for (int64_t e = 0; e < E; ++e) table.begin[e + 1] += table.begin[e];
  table.slot.resize(table.begin[E]);
  table.end.resize(table.begin[E]);
  {
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
  }
  if (err) set_host_error(p.error_flag, err);

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

}  // namespace reroute
}  // namespace moe_graph
