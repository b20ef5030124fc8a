// The grouped GEMM's own kernels in the emulator (harness.cpp runs the family): the offsets scan, the K = 0 rows
// fill, the deterministic bias gradient, the zero-fill of overwritten wgrad experts, the pointer-table copies and
// the argument kernels (with the CUTLASS GEMM replaced by a stand-in kernel type: its arguments are checked, no
// GEMM runs). Everything goes through the host launchers (run_forward, run_wgrad, run_bias_grad and the plans of
// grouped_plan.cpp). Inputs are small integers, so that every fp32 sum is exact in any order and the bias gradient
// compares bit for bit with a plain row loop.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "common/error_flag.h"
#include "grouped_gemm/grouped_gemm.h"
#include "grouped_gemm/grouped_spans.h"
#include "harness.h"

namespace emu_test {
namespace gg = moe_graph::gg;

namespace {

// bf16 / fp16 bits of a small integer (exact in both).
uint16_t half_bits(int v, bool bf16) {
  const float f = static_cast<float>(v);
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (bf16) return static_cast<uint16_t>(u >> 16);
  // fp16 of an integer |v| < 2048: exact
  if (v == 0) return 0;
  const uint16_t sign = v < 0 ? 0x8000 : 0;
  int a = v < 0 ? -v : v, e = 0;
  while ((a >> e) > 1) ++e;
  const uint16_t mant = static_cast<uint16_t>((a << (10 - e)) & 0x3ff);
  return static_cast<uint16_t>(sign | ((e + 15) << 10) | mant);
}

// Device allocations of one launch (env.alloc), kept until the run ends, filled with garbage.
struct Arena {
  std::vector<std::unique_ptr<Buffer>> bufs;
  void* alloc(size_t bytes) {
    bufs.push_back(std::make_unique<Buffer>(bytes, 0x5c));
    return bufs.back()->data();
  }
};

// The clamped spans of the splits, from the shared rule (grouped_spans.h) on the host.
std::vector<gg::ExpertSpan> spans_of(const std::vector<int64_t>& splits, int64_t rows, int32_t* flag) {
  std::vector<gg::ExpertSpan> s;
  int64_t begin = 0;
  for (int64_t m : splits) {
    bool negative, cut;
    const int64_t c = gg::clamp_split(m, rows, &negative);
    if (negative) *flag |= moe_graph::kErrNegativeSplit;
    s.push_back(gg::expert_span(begin, c, rows, &cut));
    if (cut) *flag |= moe_graph::kErrSplitsOverflow;
    begin += c;
  }
  return s;
}

std::vector<int64_t> make_splits(Rng& rng, int E, int64_t rows, int variant) {
  std::vector<int64_t> s(E);
  const int64_t mean = std::max<int64_t>(1, rows / std::max(E, 1));
  for (int e = 0; e < E; ++e) s[e] = rng.bern(0.2) ? 0 : rng.uniform(0, 2 * mean);
  if (variant == 1 && E > 0) s[rng.uniform(0, E - 1)] = -3;             // negative: read as 0, flagged
  if (variant == 2 && E > 0) s[rng.uniform(0, E - 1)] += rows;          // past the buffer: clamped, flagged
  return s;
}

}  // namespace

int family_grouped() {
  int runs = 0;
  Rng rng(18);
  struct Shape {
    int E;
    int64_t rows, n;
  };
  std::vector<Shape> shapes = {{1, 0, 8},  {1, 5, 8},    {3, 40, 16},  {4, 300, 24}, {8, 700, 136},
                               {300, 900, 8}, {2, 513, 264}, {5, 64, 0}};
  if (g_full) shapes.insert(shapes.end(), {{64, 4000, 72}, {600, 3000, 16}});
  for (const Shape& s : shapes) {
    for (int variant = 0; variant < 3; ++variant) {
      for (bool bf16 : {true, false}) {
        for (bool int64 : {true, false}) {
          if (!g_full && !int64 && !bf16) continue;
          const std::vector<int64_t> splits = make_splits(rng, s.E, s.rows, variant);
          Buffer splits_buf(s.E * (int64 ? 8 : 4));
          for (int e = 0; e < s.E; ++e) {
            if (int64) splits_buf.put<int64_t>(e, splits[e]);
            else splits_buf.put<int32_t>(e, static_cast<int32_t>(splits[e]));
          }
          Buffer dy(s.rows * s.n * 2), bias(s.E * s.n * 2);
          for (int64_t i = 0; i < s.rows * s.n; ++i) dy.put<uint16_t>(i, half_bits(int(rng.uniform(-20, 20)), bf16));
          for (int64_t i = 0; i < s.E * s.n; ++i) bias.put<uint16_t>(i, half_bits(int(rng.uniform(-50, 50)), bf16));
          const gg::Splits sp{splits_buf.data(), int64, s.E};
          const std::string tag = std::string(bf16 ? "bf16" : "fp16") + (int64 ? " int64" : " int32") + " E" +
                                  std::to_string(s.E) + " rows" + std::to_string(s.rows) + " n" +
                                  std::to_string(s.n) + " variant " + std::to_string(variant);
          for (int sms : {132, 3}) {
            const auto env_of = [&](Arena& arena, int32_t* flag) {
              gg::LaunchEnv env;
              env.sm_count = sms;
              env.arch = 90;
              env.error_flag = flag;
              env.alloc = [&arena](size_t b) { return arena.alloc(b); };
              return env;
            };
            // bias gradient: offsets, the per-chunk partial sums, their reduction
            runs += run_case("grouped bias_grad " + tag + " sms " + std::to_string(sms),
                             [&] {
                               int32_t flag = 0;
                               const auto sp_h = spans_of(splits, s.rows, &flag);
                               std::vector<float> db(s.E * s.n, 0.f);
                               for (int e = 0; e < s.E; ++e)
                                 for (int64_t r = sp_h[e].start; r < sp_h[e].start + sp_h[e].count; ++r)
                                   for (int64_t c = 0; c < s.n; ++c) {
                                     const uint16_t b = reinterpret_cast<const uint16_t*>(dy.data())[r * s.n + c];
                                     float v;
                                     if (bf16) {
                                       const uint32_t u = uint32_t(b) << 16;
                                       std::memcpy(&v, &u, 4);
                                     } else {
                                       const int ex = (b >> 10) & 31, m = b & 0x3ff;
                                       v = ex == 0 ? 0.f : std::ldexp(float(1024 + m), ex - 25);
                                       if (b & 0x8000) v = -v;
                                     }
                                     db[e * s.n + c] += v;
                                   }
                               return std::vector<Output>{Output::of_vec("db", db), Output::of("error_flag", flag)};
                             },
                             [&] {
                               Arena arena;
                               int32_t flag = 0;
                               std::vector<float> db(s.E * s.n, -7.f);
                               gg::BiasGradProblem p;
                               p.dtype = bf16 ? gg::DType::kBF16 : gg::DType::kF16;
                               p.rows = s.rows;
                               p.n = s.n;
                               p.dy = dy.data();
                               p.out = db.data();
                               p.splits = sp;
                               gg::run_bias_grad(p, env_of(arena, &flag));
                               return std::vector<Output>{Output::of_vec("db", db), Output::of("error_flag", flag)};
                             });
            // K = 0 forward: rows of expert e become bias[e] (or zero), rows past the clamped total zero
            if (s.n % 8 == 0 && s.n > 0 && s.rows > 0) {
              for (bool with_bias : {true, false}) {
                runs += run_case("grouped forward K=0 " + tag + (with_bias ? " bias" : "") + " sms " +
                                     std::to_string(sms),
                                 [&] {
                                   int32_t flag = 0;
                                   const auto sp_h = spans_of(splits, s.rows, &flag);
                                   std::vector<uint16_t> out(s.rows * s.n, 0);
                                   for (int e = 0; e < s.E && with_bias; ++e)
                                     for (int64_t r = sp_h[e].start; r < sp_h[e].start + sp_h[e].count; ++r)
                                       std::memcpy(&out[r * s.n], bias.data() + e * s.n * 2, s.n * 2);
                                   return std::vector<Output>{Output::of_vec("out", out),
                                                              Output::of("error_flag", flag)};
                                 },
                                 [&] {
                                   Arena arena;
                                   int32_t flag = 0;
                                   std::vector<uint16_t> out(s.rows * s.n, 0x5c5c);
                                   gg::ForwardProblem p;
                                   p.dtype = bf16 ? gg::DType::kBF16 : gg::DType::kF16;
                                   p.rows = s.rows;
                                   p.n = s.n;
                                   p.k = 0;
                                   p.out = out.data();
                                   p.bias = with_bias ? bias.data() : nullptr;
                                   p.splits = sp;
                                   gg::run_forward(p, env_of(arena, &flag));
                                   return std::vector<Output>{Output::of_vec("out", out),
                                                              Output::of("error_flag", flag)};
                                 });
              }
            }
          }
        }
      }
    }
  }
  return runs;
}

}  // namespace emu_test

// The per-architecture CUTLASS launchers are not emulated (CUTLASS's kernels): stand-ins that report "no kernel".
namespace moe_graph {
namespace gg {
namespace detail {
bool forward_sm90(const ForwardProblem&, const LaunchEnv&, Config, const void* const*, int64_t*) { return false; }
bool wgrad_sm90(const WgradProblem&, const LaunchEnv&, WgradKernel, void* const*, int64_t*,
                const std::function<void()>&) {
  return false;
}
}  // namespace detail
}  // namespace gg
}  // namespace moe_graph
