// expand_quantize's kernel in the emulator (family `permute_quantize`, run by harness.cpp): both FP8 copies of the
// expanded rows (permute/expand_quantize.h; half the cases with row weights: the combine's backward, a quarter read
// +0 + x: its EP > 1 form) from one launch (expand_quantize_cuda_launch) against the CPU's tiles
// and tail (expand_quantize_tiles_host, fp8::quantize_tail_cpu), bit for bit: the bytes, the scales, the error
// flag (m_splits bits, out-of-range routes) and the non-finite flag.
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "activation/activation.h"
#include "common/error_flag.h"
#include "fp8/quantize.h"
#include "harness.h"
#include "permute/expand_quantize.h"

namespace emu_test {

namespace {
namespace f8 = moe_graph::fp8;
namespace pm = moe_graph::permute;
namespace act = moe_graph::activation;
}  // namespace

// Random tokens [count] of dtype `in` (0 fp32, 1 bf16, 2 fp16): normal values, a few large, rare NaN / inf.
void fill_tokens(Buffer& src, int64_t count, int in, Rng& rng) {
  for (int64_t i = 0; i < count; ++i) {
    float v = static_cast<float>(rng.normal() * (rng.bern(0.02) ? 1e3 : 2.0));
    if (rng.bern(0.002)) v = rng.bern(0.5) ? std::nanf("") : INFINITY;
    if (rng.bern(0.03)) v = -0.0f;  // -0: a byte 0x80, or 0x00 read with plus_zero
    if (in == 0) src.put<float>(i, v);
    else if (in == 1) src.put<act::bf16_t>(i, act::Narrow<act::bf16_t>::to(v));
    else src.put<act::f16_t>(i, act::Narrow<act::f16_t>::to(v));
  }
}

// r0 and, when not null, r1 (their outputs set) through the kernel's launch (emulate) or the CPU's tiles and tail,
// the flags written to *flag / *nonfinite.
void expand_quantize_either(f8::QuantizeProblem& r0, f8::QuantizeProblem* r1, const pm::ExpandRoutes& e,
                            int32_t* flag, int32_t* nonfinite, bool emulate) {
  for (f8::QuantizeProblem* r : {&r0, r1}) {
    if (r == nullptr) continue;
    r->error_flag = flag;
    r->nonfinite_flag = nonfinite;
  }
  if (emulate) {
    pm::expand_quantize_cuda_launch(r0, r1, e, flag, nullptr);
    return;
  }
  bool bad = false;
  for (const f8::QuantizeProblem* r : {static_cast<const f8::QuantizeProblem*>(&r0),
                                       static_cast<const f8::QuantizeProblem*>(r1)}) {
    if (r == nullptr) continue;
    bad |= pm::expand_quantize_tiles_host(*r, e, 0, r->row_tiles * r->col_tiles);
    f8::quantize_tail_cpu(*r);
  }
  if (bad) *flag |= moe_graph::kErrIndexOutOfRange;
}

// FP8 dispatch's packed rows (pm::PackedRows): the pair from packed source rows (the rowwise copy their bytes and
// scales, the columnwise copy requantized from their dequantized values) and the packed output (the expanded rows
// quantized and packed, through route_of_row or, without it, the rows themselves), each against the CPU's tiles.
int packed_cases(Rng& rng) {
  int runs = 0;
  struct Shape {
    int64_t n, K, m, H, E;
  };
  std::vector<Shape> shapes = {{5, 2, 12, 40, 3}, {9, 1, 9, 130, 1}, {20, 3, 70, 200, 5}, {1, 1, 4, 1, 2}};
  if (g_full) shapes.insert(shapes.end(), {{300, 2, 700, 256, 8}, {64, 8, 600, 96, 16}});
  for (const Shape& s : shapes) {
    for (int mx = 0; mx < 2; ++mx) {
      const int64_t XC = mx ? 32 : 128, st = (s.H + XC - 1) / XC, sb = mx ? 1 : 4, B = s.H + st * sb;
      const bool e5m2 = !mx && rng.bern(0.3);
      const f8::Format fmt = e5m2 ? f8::Format::kE5M2 : f8::Format::kE4M3;
      const int variant = static_cast<int>(rng.uniform(0, 2));  // 0 plain, 1 bad index, 2 rows past the groups
      std::vector<int64_t> splits(s.E);
      for (int64_t g = 0; g < s.E; ++g) splits[g] = rng.bern(0.25) ? 0 : rng.uniform(0, s.m / s.E + 1);
      if (variant != 2) splits[rng.uniform(0, s.E - 1)] += 1;
      Buffer sp(s.E * 8);
      for (int64_t g = 0; g < s.E; ++g) sp.put<int64_t>(g, splits[g]);
      for (int src_kind = 0; src_kind < 2; ++src_kind) {  // 0: packed source (pair), 1: packed output
        const bool pack_out = src_kind == 1;
        // no routes: the rows themselves (the packed output: the tokens; the pair: a receive buffer read in place)
        const bool no_routes = rng.bern(0.3);
        const int64_t n = no_routes && !pack_out ? s.m : s.n;  // source rows
        const int64_t K = no_routes ? 1 : s.K, m = no_routes && pack_out ? s.n : s.m, sentinel = n * K;
        Buffer routes(m * 8);
        for (int64_t i = 0; i < m; ++i) routes.put<int64_t>(i, rng.bern(0.15) ? sentinel : rng.uniform(0, sentinel - 1));
        if (variant == 1 && !no_routes) routes.put<int64_t>(rng.uniform(0, m - 1), rng.bern(0.5) ? -1 : sentinel + 2);
        const int in = static_cast<int>(rng.uniform(0, 2));  // the packed output's token dtype
        const size_t es = in == 0 ? 4 : 2;
        Buffer src(pack_out ? n * s.H * es : n * B);
        if (pack_out) {
          fill_tokens(src, n * s.H, in, rng);
        } else {  // random FP8 bytes (NaN codes included), then the scales of each row at its byte offset
          for (int64_t r = 0; r < n; ++r) {
            for (int64_t c = 0; c < s.H; ++c) src.put<uint8_t>(r * B + c, static_cast<uint8_t>(rng.uniform(0, 255)));
            for (int64_t t = 0; t < st; ++t) {
              uint8_t* b = src.data() + r * B + s.H + t * sb;
              if (mx) {
                b[0] = static_cast<uint8_t>(rng.bern(0.01) ? 0xFF : rng.uniform(100, 150));
              } else {
                const float v = rng.bern(0.01) ? INFINITY : std::ldexp(1.0f + static_cast<float>(rng.uniform(0, 99)) / 100,
                                                                     static_cast<int>(rng.uniform(-20, 20)));
                std::memcpy(b, &v, 4);
              }
            }
          }
        }
        auto problem = [&](int64_t tr, int64_t tc, bool transpose) {
          f8::QuantizeProblem p;
          p.rows = m;
          p.cols = s.H;
          p.in_type = pack_out ? static_cast<f8::InType>(in) : (e5m2 ? f8::InType::kE5M2 : f8::InType::kE4M3);
          p.format = fmt;
          p.x = src.data();
          if (!pack_out) {
            p.m_splits = sp.data();
            p.splits_i64 = true;
            p.groups = s.E;
          }
          p.tile_rows = tr;
          p.tile_cols = tc;
          p.row_tiles = f8::row_tile_capacity(m, pack_out ? 0 : s.E, tr);
          p.col_tiles = (s.H + tc - 1) / tc;
          p.mx = mx;
          p.pow2 = rng.bern(0.5);
          p.transpose = transpose;
          return p;
        };
        const f8::QuantizeProblem p0 = problem(1, XC, false), p1 = problem(XC, 1, true);
        pm::ExpandRoutes e;
        e.route_of_row = no_routes ? nullptr : reinterpret_cast<const int64_t*>(routes.data());
        e.tokens = n;
        e.topk = K;
        e.packed.cols = s.H;
        e.packed.stride = B;
        e.packed.format = fmt;
        e.packed.e8m0 = mx;
        const std::string what = std::string(pack_out ? "expand_quantize_pack" : "expand_quantize_packed") + " n" +
                                 std::to_string(n) + " K" + std::to_string(K) + " m" + std::to_string(m) + " H" +
                                 std::to_string(s.H) + (mx ? " mx" : "") + (no_routes ? " no routes" : "") +
                                 " variant " + std::to_string(variant);
        auto run = [&](bool emulate) {
          Buffer q0(m * s.H, 0x5c), q1(m * s.H, 0x5c), out(m * B, 0x5c);
          Buffer s0(p0.row_tiles * p0.col_tiles * sb, 0x5c), s1(p1.row_tiles * p1.col_tiles * sb, 0x5c);
          int32_t flag = 0, nonfinite = 0;
          f8::QuantizeProblem r0 = p0, r1 = p1;
          pm::ExpandRoutes x = e;
          if (pack_out) {
            x.packed.out = out.data();
          } else {
            x.packed.src = src.data();
            r0.q = q0.data();
            r0.scale = s0.data();
            r1.q = q1.data();
            r1.scale = s1.data();
          }
          expand_quantize_either(r0, pack_out ? nullptr : &r1, x, &flag, &nonfinite, emulate);
          if (pack_out)
            return std::vector<Output>{out.out("packed", 1), Output::of("error_flag", flag),
                                       Output::of("nonfinite_flag", nonfinite)};
          return std::vector<Output>{q0.out("q", 1), s0.out("scale", sb), q1.out("q_t", 1), s1.out("scale_t", sb),
                                     Output::of("error_flag", flag), Output::of("nonfinite_flag", nonfinite)};
        };
        runs += run_case(what, [&] { return run(false); }, [&] { return run(true); });
      }
    }
  }
  return runs;
}

int family_permute_quantize() {
  int runs = 0;
  Rng rng(23);
  struct Shape {
    int64_t n, K, m, H, E;
  };
  std::vector<Shape> shapes = {{5, 2, 12, 40, 3}, {9, 1, 9, 130, 1}, {20, 3, 70, 33, 5}, {1, 1, 4, 1, 2},
                               {33, 4, 150, 160, 6}};
  if (g_full) shapes.insert(shapes.end(), {{300, 2, 700, 256, 8}, {64, 8, 600, 96, 16}});
  struct PairTiles {
    int64_t tr, tc, ctr, ctc;
    bool mx;
  };
  const PairTiles pairs[] = {{1, 128, 128, 1, false}, {1, 32, 32, 1, true}, {0, 0, 0, 0, false}};
  for (const Shape& s : shapes) {
    for (const PairTiles& t : pairs) {
      for (int in = 0; in < 3; ++in) {  // fp32, bf16, fp16 tokens
        const int variant = static_cast<int>(rng.uniform(0, 3));  // 0 plain, 1 bad index, 2 bad split, 3 past m
        std::vector<int64_t> splits(s.E);
        for (int64_t g = 0; g < s.E; ++g) splits[g] = rng.bern(0.25) ? 0 : rng.uniform(0, s.m / s.E + 2);
        if (variant == 2) splits[rng.uniform(0, s.E - 1)] = -3;
        if (variant == 3) splits[rng.uniform(0, s.E - 1)] += s.m;
        const bool i64 = rng.bern(0.5);
        Buffer sp(s.E * (i64 ? 8 : 4));
        for (int64_t g = 0; g < s.E; ++g) {
          if (i64) sp.put<int64_t>(g, splits[g]);
          else sp.put<int32_t>(g, static_cast<int32_t>(splits[g]));
        }
        // route of each row: a real route (repeats allowed: a row reads its token), the sentinel, or (variant 1)
        // an index outside [0, n*K]
        const int64_t sentinel = s.n * s.K;
        Buffer routes(s.m * 8);
        for (int64_t i = 0; i < s.m; ++i) routes.put<int64_t>(i, rng.bern(0.15) ? sentinel : rng.uniform(0, sentinel - 1));
        if (variant == 1) routes.put<int64_t>(rng.uniform(0, s.m - 1), rng.bern(0.5) ? -1 : sentinel + 2);
        // no routes (a fused receive buffer read in place): row i is source row i, K 1, m source rows
        const bool no_routes = variant != 1 && rng.bern(0.25);
        const int64_t n = no_routes ? s.m : s.n, K = no_routes ? 1 : s.K;
        const size_t es = in == 0 ? 4 : 2;
        Buffer src(n * s.H * es);
        fill_tokens(src, n * s.H, in, rng);
        const bool e5m2 = !t.mx && rng.bern(0.3);
        auto problem = [&](int64_t tr, int64_t tc, bool transpose) {
          f8::QuantizeProblem p;
          p.rows = s.m;
          p.cols = s.H;
          p.in_type = static_cast<f8::InType>(in);
          p.format = e5m2 ? f8::Format::kE5M2 : f8::Format::kE4M3;
          p.x = src.data();
          p.m_splits = sp.data();
          p.splits_i64 = i64;
          p.groups = s.E;
          p.tile_rows = tr;
          p.tile_cols = tc;
          p.row_tiles = f8::row_tile_capacity(s.m, s.E, tr);
          p.col_tiles = tc == 0 ? 1 : (s.H + tc - 1) / tc;
          p.mx = t.mx;
          p.pow2 = true;
          p.transpose = transpose;
          return p;
        };
        const f8::QuantizeProblem p0 = problem(t.tr, t.tc, false), p1 = problem(t.ctr, t.ctc, true);
        pm::ExpandRoutes e;
        e.route_of_row = no_routes ? nullptr : reinterpret_cast<const int64_t*>(routes.data());
        e.tokens = n;
        e.topk = K;
        // the combine's backward (fc2's dy): each route's row weight, w * x rounded to the tokens' dtype
        const bool weighted = rng.bern(0.5);
        Buffer weights(n * K * 4);
        for (int64_t r = 0; r < n * K; ++r)
          weights.put<float>(r, rng.bern(0.1) ? 0.0f : static_cast<float>(rng.normal() * 1.5));
        if (weighted) e.weights = reinterpret_cast<const float*>(weights.data());
        // the combine's backward at EP > 1 (reduce_rows' one-route read, +0 + x) on half the unweighted cases
        e.plus_zero = !weighted && rng.bern(0.5);
        const size_t ses = t.mx ? 1 : 4;
        const std::string what = "expand_quantize n" + std::to_string(n) + " K" + std::to_string(K) + " m" +
                                 std::to_string(s.m) + " H" + std::to_string(s.H) + " E" + std::to_string(s.E) +
                                 " tiles " + std::to_string(t.tr) + "x" + std::to_string(t.tc) + (t.mx ? " mx" : "") +
                                 " in " + std::to_string(in) + " variant " + std::to_string(variant) +
                                 (weighted ? " weighted" : "") + (e.plus_zero ? " plus_zero" : "") +
                                 (no_routes ? " no routes" : "");
        auto run = [&](bool emulate) {
          Buffer q0(s.m * s.H, 0x5c), q1(s.m * s.H, 0x5c);
          Buffer s0(p0.row_tiles * p0.col_tiles * ses, 0x5c), s1(p1.row_tiles * p1.col_tiles * ses, 0x5c);
          int32_t flag = 0, nonfinite = 0;
          f8::QuantizeProblem r0 = p0, r1 = p1;
          r0.q = q0.data();
          r0.scale = s0.data();
          r1.q = q1.data();
          r1.scale = s1.data();
          expand_quantize_either(r0, &r1, e, &flag, &nonfinite, emulate);
          return std::vector<Output>{q0.out("q", 1), s0.out("scale", ses), q1.out("q_t", 1),
                                     s1.out("scale_t", ses), Output::of("error_flag", flag),
                                     Output::of("nonfinite_flag", nonfinite)};
        };
        runs += run_case(what, [&] { return run(false); }, [&] { return run(true); });
      }
    }
  }
  return runs + packed_cases(rng);
}

}  // namespace emu_test
