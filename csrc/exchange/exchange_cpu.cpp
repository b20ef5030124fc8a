// Host reference of the fused exchange (semantics in exchange.h): all R ranks in one process, plain loops. It
// defines what the CUDA kernels (exchange_cuda.cu) must produce bit for bit; the emulator harness and the Python
// tests compare with it.
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstring>
#include <vector>

#include "common/error_flag.h"
#include "exchange/exchange.h"

namespace moe_graph {
namespace exchange {

void dispatch_host(RankDispatch* ranks, int64_t R, int64_t Lc, int64_t topk, int64_t capacity, int64_t row_bytes,
                   int64_t align) {
  const int64_t C = R * Lc, P = receive_rows(capacity, Lc, align);
  std::vector<int64_t> table(R * C);
  for (int64_t s = 0; s < R; ++s) std::memcpy(table.data() + s * C, ranks[s].send_counts, C * sizeof(int64_t));
  std::vector<int64_t> fit(Lc), base(Lc), col(Lc);
  // receivers: m_splits, counts, zero rows (every row first; the senders then place the fitted ones)
  for (int64_t d = 0; d < R; ++d) {
    RankDispatch& r = ranks[d];
    bool cut = false;
    chunk_layout(table.data(), R, Lc, capacity, align, d, 0, fit.data(), base.data(), col.data(), &cut);
    for (int64_t l = 0; l < Lc; ++l) {
      r.m_splits[l] = align_up(col[l], align);
      r.counts[l] = col[l];
    }
    std::memset(r.expert_in, 0, P * row_bytes);
    if (r.row_weights != nullptr)
      for (int64_t i = 0; i < P; ++i) r.row_weights[i] = 0.f;
    if (cut) set_host_error(r.error_flag, kErrExchangeCounts);
  }
  // senders: each fitted slot's row at its final place
  for (int64_t s = 0; s < R; ++s) {
    const RankDispatch& r = ranks[s];
    const int64_t n = r.tokens * topk;
    for (int64_t q = 0; q < n; ++q) r.route_row[q] = -1;
    int64_t slot0 = 0;  // first slot of the chunk
    bool bad = false;
    for (int64_t d = 0; d < R; ++d) {
      bool cut = false;
      chunk_layout(table.data(), R, Lc, capacity, align, d, s, fit.data(), base.data(), col.data(), &cut);
      RankDispatch& dst = ranks[d];
      for (int64_t l = 0; l < Lc; ++l) {
        for (int64_t j = 0; j < fit[l]; ++j) {
          const int64_t slot = slot0 + j, row = base[l] + j;
          const int64_t q = slot < r.slots ? r.route_of_slot[slot] : n;
          if (slot >= r.slots) bad = true;
          if (q != n && (q < 0 || q > n)) set_host_error(r.error_flag, kErrIndexOutOfRange);
          unsigned char* out = static_cast<unsigned char*>(dst.expert_in) + row * row_bytes;
          const bool live = q >= 0 && q < n;
          if (live)
            std::memcpy(out, static_cast<const unsigned char*>(r.rows) + (q / topk) * row_bytes, row_bytes);
          else
            std::memset(out, 0, row_bytes);
          if (dst.row_weights != nullptr) dst.row_weights[row] = live && r.weights != nullptr ? r.weights[q] : 0.f;
          if (live) r.route_row[q] = d * P + row;
        }
        slot0 += clamp_count(table[(s * R + d) * Lc + l], &bad);
      }
    }
    if (bad) set_host_error(r.error_flag, kErrExchangeCounts);
  }
}

namespace {

template <class T>
struct Acc {
  using type = float;
  static float to(T x) { return static_cast<float>(x); }
  static T from(float a) { return T(a); }
};
template <>
struct Acc<double> {
  using type = double;
  static double to(double x) { return x; }
  static double from(double a) { return a; }
};

template <class T>
void combine_typed(RankCombine* ranks, int64_t R, int64_t topk, int64_t rows, int64_t hidden) {
  using A = typename Acc<T>::type;
  std::vector<A> acc(hidden);
  for (int64_t s = 0; s < R; ++s) {
    const RankCombine& r = ranks[s];
    const A* w = static_cast<const A*>(r.weights);
    for (int64_t t = 0; t < r.tokens; ++t) {
      for (int64_t h = 0; h < hidden; ++h) acc[h] = A(0);
      for (int64_t k = 0; k < topk; ++k) {
        const int64_t q = t * topk + k, rr = r.route_row[q];
        if (rr == -1) continue;
        if (rr < 0 || rr >= R * rows) {
          set_host_error(r.error_flag, kErrIndexOutOfRange);
          continue;
        }
        const T* x = static_cast<const T*>(ranks[rr / rows].expert_out) + (rr % rows) * hidden;
        if (w == nullptr) {
          for (int64_t h = 0; h < hidden; ++h) acc[h] += Acc<T>::to(x[h]);
        } else {
          const A wk = w[q];
          for (int64_t h = 0; h < hidden; ++h) acc[h] += wk * Acc<T>::to(x[h]);
        }
      }
      T* o = static_cast<T*>(r.out) + t * hidden;
      for (int64_t h = 0; h < hidden; ++h) o[h] = Acc<T>::from(acc[h]);
    }
  }
}

}  // namespace

void combine_host(RankCombine* ranks, int64_t R, int64_t topk, int64_t rows, int64_t hidden, DType dtype) {
  switch (dtype) {
    case DType::kFloat: return combine_typed<float>(ranks, R, topk, rows, hidden);
    case DType::kDouble: return combine_typed<double>(ranks, R, topk, rows, hidden);
    case DType::kBFloat16: return combine_typed<c10::BFloat16>(ranks, R, topk, rows, hidden);
    case DType::kHalf: return combine_typed<c10::Half>(ranks, R, topk, rows, hidden);
  }
}

void gather_host(RankCombine* ranks, int64_t R, int64_t topk, int64_t rows, int64_t row_bytes) {
  for (int64_t s = 0; s < R; ++s) {
    const RankCombine& r = ranks[s];
    for (int64_t q = 0; q < r.tokens * topk; ++q) {
      const int64_t rr = r.route_row[q];
      unsigned char* o = static_cast<unsigned char*>(r.out) + q * row_bytes;
      if (rr < 0 || rr >= R * rows) {
        if (rr != -1) set_host_error(r.error_flag, kErrIndexOutOfRange);
        std::memset(o, 0, row_bytes);
        continue;
      }
      std::memcpy(o, static_cast<const unsigned char*>(ranks[rr / rows].expert_out) + (rr % rows) * row_bytes,
                  row_bytes);
    }
  }
}

}  // namespace exchange
}  // namespace moe_graph
