// The fused exchange's kernels (csrc/exchange/exchange_cuda.cu) on R emulated devices (the multi-device mode of
// moe_emu.h), compared bit for bit with the host reference over all R ranks (exchange_cpu.cpp).
//
// Each case builds every rank's packed send slots by the per-destination quota rule (keep the first quota[d] live
// routes to destination d in route order; slots by destination, local expert, route), then runs on the same
// symmetric buffers (control words, receive buffers, epochs kept between sessions):
//   session 1  dispatch                                   -> expert_in, row_weights, m_splits, counts, route_row,
//                                                            flags (align 16 cases: the groups at 16-row starts)
//   session 2  dispatch of other rows and other weights   (epoch 2: the other count table)
//   session 3  expert outputs written (a producer kernel per device, tracked stores), combine, gather_routes,
//              other expert outputs written, combine, gather_routes (the closing barriers keep the second producer
//              from overwriting a buffer a peer still reads)
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/launch.cuh"
#include "common/peer_memory.cuh"
#include "exchange/exchange.h"
#include "harness.h"

namespace emu_test {
namespace {

namespace ex = moe_graph::exchange;

__global__ void produce_kernel(const unsigned char* src, int64_t bytes, unsigned char* dst) {
  moe_graph::peer::store_bytes(dst, src, bytes, threadIdx.x, blockDim.x);
}

struct Case {
  std::string name;
  int64_t R, Lc, T, K, row_bytes, capacity;
  int mode;          // 0 uniform, 1 zero-token experts (only even local experts), 2 one expert takes everything
  double quota;      // per-destination quota as a fraction of the routes (<= 0: no quota, all kept)
  double invalid;    // fraction of routes not live
  bool weights;
  ex::DType dtype;   // combine's dtype
  int64_t hidden;    // combine's elements per row
  int ctas;
  int64_t align = 1;  // the receive groups' row alignment
  int64_t rows() const { return ex::receive_rows(capacity, Lc, align); }  // P
};

size_t dsize(ex::DType t) { return t == ex::DType::kDouble ? 8 : t == ex::DType::kFloat ? 4 : 2; }

// Rank inputs: rows, route_of_slot, send_counts, weights (fp32) by the quota rule.
struct RankIn {
  Buffer rows, ros, counts, w;
  int64_t slots = 0;
};

RankIn make_rank(const Case& c, Rng& rng, int64_t s) {
  RankIn r;
  const int64_t n = c.T * c.K, C = c.R * c.Lc;
  r.rows = Buffer(std::max<int64_t>(c.T * c.row_bytes, 1));
  for (int64_t i = 0; i < c.T * c.row_bytes; ++i) r.rows.data()[i] = static_cast<unsigned char>(rng.uniform(0, 255));
  r.w = Buffer(std::max<int64_t>(n, 1) * 4);
  for (int64_t q = 0; q < n; ++q) r.w.put<float>(q, static_cast<float>(rng.normal()));
  std::vector<int64_t> col(n, -1);
  for (int64_t q = 0; q < n; ++q) {
    if (rng.bern(c.invalid)) continue;
    int64_t x = rng.uniform(0, C - 1);
    if (c.mode == 1) x = x / 2 * 2;
    if (c.mode == 2) x = (s + 1) % c.R * c.Lc;  // everything to local expert 0 of one rank
    col[q] = x;
  }
  const int64_t quota = c.quota > 0 ? std::max<int64_t>(1, int64_t(c.quota * n)) : n;
  std::vector<int64_t> kept(c.R, 0), counts(C, 0);
  std::vector<std::vector<int64_t>> chunk(C);
  for (int64_t q = 0; q < n; ++q) {
    if (col[q] < 0) continue;
    const int64_t d = col[q] / c.Lc;
    if (kept[d] >= quota) continue;
    ++kept[d];
    chunk[col[q]].push_back(q);
  }
  r.slots = n;
  r.ros = Buffer(std::max<int64_t>(n, 1) * 8);
  int64_t i = 0;
  for (int64_t x = 0; x < C; ++x) {
    counts[x] = static_cast<int64_t>(chunk[x].size());
    for (int64_t q : chunk[x]) r.ros.put<int64_t>(i++, q);
  }
  for (; i < n; ++i) r.ros.put<int64_t>(i, n);
  r.counts = Buffer(C * 8);
  for (int64_t x = 0; x < C; ++x) r.counts.put<int64_t>(x, counts[x]);
  return r;
}

// The symmetric state of R devices, kept between sessions.
struct Devices {
  int64_t R = 0;
  std::vector<Buffer> ctrl, recv, epoch, out, flag;
  std::vector<Buffer> recv_ptrs, ctrl_ptrs, out_ptrs;  // the pointer arrays, one copy per device
  Devices(const Case& c) : R(c.R) {
    const int64_t words = ex::Control::words(c.R, c.Lc);
    for (int64_t d = 0; d < R; ++d) {
      ctrl.emplace_back(words * 8, 0);
      recv.emplace_back(ex::receive_bytes(c.rows(), c.row_bytes), 0xa5);
      epoch.emplace_back(ex::kEpochWords * 8, 0);
      out.emplace_back(std::max<int64_t>(c.rows() * std::max<int64_t>(c.hidden * dsize(c.dtype), c.row_bytes), 16),
                       0xa5);
      flag.emplace_back(4, 0);
    }
    for (int64_t d = 0; d < R; ++d) {
      recv_ptrs.emplace_back(R * 8);
      ctrl_ptrs.emplace_back(R * 8);
      out_ptrs.emplace_back(R * 8);
      for (int64_t r = 0; r < R; ++r) {
        recv_ptrs[d].put<int64_t>(r, reinterpret_cast<int64_t>(recv[r].data()));
        ctrl_ptrs[d].put<int64_t>(r, reinterpret_cast<int64_t>(ctrl[r].data()));
        out_ptrs[d].put<int64_t>(r, reinterpret_cast<int64_t>(out[r].data()));
      }
    }
  }
};

std::vector<Output> run_dispatch(const Case& c, const std::vector<RankIn>& in, bool gpu, Devices* dev) {
  const int64_t R = c.R, n = c.T * c.K, P = c.rows();
  std::vector<Buffer> expert_in, rw, ms, cnt, rr, flag;
  std::vector<ex::RankDispatch> ranks(R);
  for (int64_t d = 0; d < R; ++d) {
    expert_in.emplace_back(P * c.row_bytes, 0xa5);
    rw.emplace_back(P * 4, 0xa5);
    ms.emplace_back(c.Lc * 8, 0xa5);
    cnt.emplace_back(c.Lc * 8, 0xa5);
    rr.emplace_back(std::max<int64_t>(n, 1) * 8, 0xa5);
    flag.emplace_back(4, 0);
  }
  if (!gpu) {
    for (int64_t d = 0; d < R; ++d) {
      ex::RankDispatch& r = ranks[d];
      r.rows = in[d].rows.data();
      r.tokens = c.T;
      r.route_of_slot = reinterpret_cast<const int64_t*>(in[d].ros.data());
      r.slots = in[d].slots;
      r.send_counts = reinterpret_cast<const int64_t*>(in[d].counts.data());
      r.weights = c.weights ? reinterpret_cast<const float*>(in[d].w.data()) : nullptr;
      r.expert_in = expert_in[d].data();
      r.m_splits = reinterpret_cast<int64_t*>(ms[d].data());
      r.counts = reinterpret_cast<int64_t*>(cnt[d].data());
      r.row_weights = reinterpret_cast<float*>(rw[d].data());
      r.route_row = reinterpret_cast<int64_t*>(rr[d].data());
      r.error_flag = reinterpret_cast<int32_t*>(flag[d].data());
    }
    ex::dispatch_host(ranks.data(), R, c.Lc, c.K, c.capacity, c.row_bytes, c.align);
  } else {
    moe_emu::multi_begin(static_cast<int>(R));
    for (int64_t d = 0; d < R; ++d) {
      moe_emu::set_device(static_cast<int>(d));
      ex::DispatchArgs a;
      a.R = R, a.rank = d, a.Lc = c.Lc, a.topk = c.K, a.tokens = c.T, a.slots = in[d].slots;
      a.capacity = c.capacity, a.row_bytes = c.row_bytes, a.align = c.align;
      a.rows = in[d].rows.data();
      a.route_of_slot = reinterpret_cast<const int64_t*>(in[d].ros.data());
      a.send_counts = reinterpret_cast<const int64_t*>(in[d].counts.data());
      a.weights = c.weights ? reinterpret_cast<const float*>(in[d].w.data()) : nullptr;
      a.recv_ptrs = reinterpret_cast<const int64_t*>(dev->recv_ptrs[d].data());
      a.ctrl_ptrs = reinterpret_cast<const int64_t*>(dev->ctrl_ptrs[d].data());
      a.recv_local = dev->recv[d].data();
      a.ctrl_local = reinterpret_cast<uint64_t*>(dev->ctrl[d].data());
      a.m_splits = reinterpret_cast<int64_t*>(ms[d].data());
      a.counts = reinterpret_cast<int64_t*>(cnt[d].data());
      a.route_row = reinterpret_cast<int64_t*>(rr[d].data());
      a.epoch = reinterpret_cast<uint64_t*>(dev->epoch[d].data());
      a.error_flag = reinterpret_cast<int32_t*>(flag[d].data());
      ex::dispatch_cuda(a, c.ctas, nullptr);
    }
    moe_emu::multi_run();
    const int64_t woff = ex::receive_weights_offset(P, c.row_bytes);
    for (int64_t d = 0; d < R; ++d) {
      std::memcpy(expert_in[d].data(), dev->recv[d].data(), P * c.row_bytes);
      std::memcpy(rw[d].data(), dev->recv[d].data() + woff, P * 4);
    }
  }
  std::vector<Output> o;
  for (int64_t d = 0; d < R; ++d) {
    o.push_back(expert_in[d].out("expert_in", 1));
    o.push_back(rw[d].out("row_weights", 4));
    o.push_back(ms[d].out("m_splits", 8));
    o.push_back(cnt[d].out("counts", 8));
    o.push_back(rr[d].out("route_row", 8));
    o.push_back(flag[d].out("error_flag", 4));
  }
  return o;
}

// Expert outputs of two rounds, per rank: [P, hidden] of dtype (finite values) / [P, row_bytes].
Buffer make_out(const Case& c, Rng& rng, bool gather) {
  const int64_t bytes = gather ? c.rows() * c.row_bytes : c.rows() * c.hidden * int64_t(dsize(c.dtype));
  Buffer b(std::max<int64_t>(bytes, 1));
  if (gather) {
    for (int64_t i = 0; i < bytes; ++i) b.data()[i] = static_cast<unsigned char>(rng.uniform(0, 255));
    return b;
  }
  for (int64_t i = 0; i < c.rows() * c.hidden; ++i) {
    const double v = rng.normal();
    const float f = static_cast<float>(v);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    switch (c.dtype) {
      case ex::DType::kDouble: b.put<double>(i, v); break;
      case ex::DType::kFloat: b.put<float>(i, f); break;
      default: b.put<uint16_t>(i, static_cast<uint16_t>(u >> 16)); break;  // bf16 bits (fp16: below)
    }
  }
  if (c.dtype == ex::DType::kHalf)
    for (int64_t i = 0; i < c.rows() * c.hidden; ++i)
      b.put<uint16_t>(i, static_cast<uint16_t>(rng.uniform(0, 0x7bff)));  // finite halves
  return b;
}

std::vector<Output> run_combine(const Case& c, const std::vector<Buffer>& route_row, const std::vector<Buffer>& w,
                                const std::vector<std::vector<Buffer>>& outs, bool gpu, Devices* dev) {
  const int64_t R = c.R, n = c.T * c.K, hb = c.hidden * int64_t(dsize(c.dtype));
  // rounds: [combine 1, gather 1, combine 2, gather 2]
  std::vector<std::vector<Buffer>> res(4);
  std::vector<Buffer> flag;
  for (int64_t d = 0; d < R; ++d) {
    for (int i = 0; i < 4; ++i)
      res[i].emplace_back(std::max<int64_t>(i % 2 == 0 ? c.T * hb : n * c.row_bytes, 1), 0xa5);
    flag.emplace_back(4, 0);
  }
  if (!gpu) {
    for (int round = 0; round < 2; ++round) {
      std::vector<ex::RankCombine> rc(R), rg(R);
      for (int64_t d = 0; d < R; ++d) {
        rc[d].expert_out = outs[2 * round][d].data();
        rc[d].route_row = reinterpret_cast<const int64_t*>(route_row[d].data());
        rc[d].weights = c.weights ? w[d].data() : nullptr;
        rc[d].tokens = c.T;
        rc[d].out = res[2 * round][d].data();
        rc[d].error_flag = reinterpret_cast<int32_t*>(flag[d].data());
        rg[d] = rc[d];
        rg[d].expert_out = outs[2 * round + 1][d].data();
        rg[d].weights = nullptr;
        rg[d].out = res[2 * round + 1][d].data();
      }
      ex::combine_host(rc.data(), R, c.K, c.rows(), c.hidden, c.dtype);
      ex::gather_host(rg.data(), R, c.K, c.rows(), c.row_bytes);
    }
  } else {
    moe_emu::multi_begin(static_cast<int>(R));
    for (int64_t d = 0; d < R; ++d) {
      moe_emu::set_device(static_cast<int>(d));
      for (int round = 0; round < 2; ++round) {
        for (int g = 0; g < 2; ++g) {
          const Buffer& src = outs[2 * round + g][d];
          moe_graph::launch(produce_kernel, dim3(1), dim3(64), 0, nullptr, src.data(),
                            static_cast<int64_t>(src.size()), dev->out[d].data());
          ex::CombineArgs a;
          a.R = R, a.rank = d, a.topk = c.K, a.tokens = c.T, a.capacity = c.rows();
          a.hidden = c.hidden, a.row_bytes = c.row_bytes, a.dtype = c.dtype;
          a.src_ptrs = reinterpret_cast<const int64_t*>(dev->out_ptrs[d].data());
          a.ctrl_ptrs = reinterpret_cast<const int64_t*>(dev->ctrl_ptrs[d].data());
          a.src_local = dev->out[d].data();
          a.ctrl_local = reinterpret_cast<uint64_t*>(dev->ctrl[d].data());
          a.route_row = reinterpret_cast<const int64_t*>(route_row[d].data());
          a.weights = g == 0 && c.weights ? w[d].data() : nullptr;
          a.out = res[2 * round + g][d].data();
          a.epoch = reinterpret_cast<uint64_t*>(dev->epoch[d].data());
          a.error_flag = reinterpret_cast<int32_t*>(flag[d].data());
          if (g == 0) ex::combine_cuda(a, c.ctas, nullptr);
          else ex::gather_cuda(a, c.ctas, nullptr);
        }
      }
    }
    moe_emu::multi_run();
  }
  std::vector<Output> o;
  const char* names[] = {"combine", "gather_routes", "combine (round 2)", "gather_routes (round 2)"};
  for (int64_t d = 0; d < R; ++d) {
    for (int i = 0; i < 4; ++i) o.push_back(res[i][d].out(names[i], i % 2 == 0 ? dsize(c.dtype) : 1));
    o.push_back(flag[d].out("error_flag", 4));
  }
  return o;
}

int run_exchange_case(const Case& c) {
  Rng rng(1000 + c.R * 7 + c.mode);
  std::vector<RankIn> in1, in2;
  for (int64_t s = 0; s < c.R; ++s) in1.push_back(make_rank(c, rng, s));
  for (int64_t s = 0; s < c.R; ++s) in2.push_back(make_rank(c, rng, s));
  // route_row and weights for the combine: the reference dispatch of the second inputs
  std::vector<Buffer> route_row, w;
  {
    std::vector<Output> ref = run_dispatch(c, in2, false, nullptr);
    for (int64_t d = 0; d < c.R; ++d) {
      const Output& o = ref[d * 6 + 4];
      route_row.emplace_back(o.bytes.size());
      std::memcpy(route_row.back().data(), o.bytes.data(), o.bytes.size());
      const bool dbl = c.dtype == ex::DType::kDouble;
      w.emplace_back(std::max<int64_t>(c.T * c.K, 1) * (dbl ? 8 : 4));
      for (int64_t q = 0; q < c.T * c.K; ++q) {
        float f;
        std::memcpy(&f, in2[d].w.data() + q * 4, 4);
        if (dbl) w.back().put<double>(q, f);
        else w.back().put<float>(q, f);
      }
    }
  }
  std::vector<std::vector<Buffer>> outs(4);
  for (int i = 0; i < 4; ++i)
    for (int64_t d = 0; d < c.R; ++d) outs[i].push_back(make_out(c, rng, i % 2 == 1));
  int runs = 0;
  std::unique_ptr<Devices> dev;
  // the devices' state lives across the sessions of one schedule: a fresh set for each schedule
  auto fresh = [&] { dev = std::make_unique<Devices>(c); };
  runs += run_case(c.name + " dispatch",
                   [&] {
                     auto a = run_dispatch(c, in1, false, nullptr);
                     auto b = run_dispatch(c, in2, false, nullptr);
                     auto x = run_combine(c, route_row, w, outs, false, nullptr);
                     a.insert(a.end(), b.begin(), b.end());
                     a.insert(a.end(), x.begin(), x.end());
                     return a;
                   },
                   [&] {
                     fresh();
                     auto a = run_dispatch(c, in1, true, dev.get());
                     auto b = run_dispatch(c, in2, true, dev.get());
                     auto x = run_combine(c, route_row, w, outs, true, dev.get());
                     a.insert(a.end(), b.begin(), b.end());
                     a.insert(a.end(), x.begin(), x.end());
                     return a;
                   });
  return runs;
}

}  // namespace

int family_exchange() {
  int runs = 0;
  const ex::DType bf = ex::DType::kBFloat16, f32 = ex::DType::kFloat, f64 = ex::DType::kDouble,
                  f16 = ex::DType::kHalf;
  std::vector<Case> cases;
  for (int64_t R : {int64_t(2), int64_t(4), int64_t(8)}) {
    const std::string r = "R=" + std::to_string(R);
    // name, R, Lc, T, K, row_bytes, capacity, mode, quota, invalid, weights, dtype, hidden, ctas
    cases.push_back(
        {r + " bf16 rows, quotas overflow (capacity cut)", R, 3, 6, 2, 48, 5, 0, 0.4, 0.1, true, bf, 24, 2});
    cases.push_back(
        {r + " fp32 rows of 20 bytes, zero-token experts", R, 4, 5, 2, 20, 6 * R, 1, 0, 0.0, true, f32, 5, 2});
    cases.push_back({r + " FP8 rows of 37 bytes, one expert takes everything", R, 2, 4, 3, 37, 4 * 3 * R, 2, 0, 0.2,
                     false, f32, 3, 1});
    cases.push_back({r + " echo-like Lc=5, fp64 combine, capacity below the arrivals", R, 5, 5, 2, 16, 3 * R - 1, 0,
                     0, 0.0, true, f64, 2, 3});
    if (R == 2) cases.push_back({r + " fp16 combine, one block", R, 2, 3, 2, 32, 16, 0, 0, 0.0, true, f16, 16, 1});
    // align 16 (the FP8 experts' group starts): gaps after each group and past the last one zeroed, route_row
    // indexing the padded rows, combine / gather over P-row buffers
    cases.push_back({r + " align 16, bf16 rows, quotas overflow (capacity cut)", R, 3, 6, 2, 48, 5, 0, 0.4, 0.1,
                     true, bf, 24, 2, 16});
    cases.push_back({r + " align 16, fp32 rows of 20 bytes, zero-token experts", R, 4, 5, 2, 20, 6 * R, 1, 0, 0.0,
                     true, f32, 5, 2, 16});
    cases.push_back({r + " align 16, FP8 rows of 37 bytes, one expert takes everything", R, 2, 4, 3, 37, 4 * 3 * R,
                     2, 0, 0.2, false, f32, 3, 1, 16});
    if (R == 2)
      cases.push_back({r + " align 16, 40 tokens over Lc=3, capacity 33 cut", R, 3, 40, 2, 32, 33, 0, 0, 0.0, true,
                       bf, 16, 3, 16});
  }
  for (const Case& c : cases) runs += run_exchange_case(c);
  return runs;
}

}  // namespace emu_test
