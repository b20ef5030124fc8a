// The FP8 scaled grouped GEMM's own kernels in the emulator (family `fp8_scaled`, run by harness.cpp): the offsets
// scan, the argument kernel (problem sizes, operand and scale pointers, strides, scale layouts), the forward tail
// zeroing, the scale relayouts and the wgrad zero fill, through the host launchers run_scaled_forward /
// run_scaled_wgrad and their plans (scaled_plan.cpp), with the CUTLASS GEMM replaced by a stand-in that runs the
// same enqueue functions (scaled_args.cuh) and records what they wrote. The expected arrays are computed here on the
// host from the problem alone: the spans rule (grouped_spans.h), pointer arithmetic on the operands' bases, the
// relayouts as plain index loops, and CUTLASS's own scale-layout function of each group's problem shape.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include <cutlass/detail/blockwise_scale_layout.hpp>
#include <cutlass/detail/sm100_blockscaled_layout.hpp>
#include <cutlass/numeric_types.h>

#include "common/error_flag.h"
#include "fp8/quantize.h"
#include "fp8/scaled_args.cuh"
#include "fp8/scaled_gemm_cuda.h"
#include "fp8/scaled_plan.h"
#include "grouped_gemm/grouped_spans.h"
#include "harness.h"

namespace emu_test {
namespace f8 = moe_graph::fp8;
namespace gg = moe_graph::gg;

using Fp8 = cutlass::float_e4m3_t;
using ForwardX = f8::detail::ScaledExpert<cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128>, Fp8, Fp8,
                                          cutlass::bfloat16_t, float>;
using WgradX = f8::detail::ScaledExpert<cutlass::detail::Sm90BlockwiseScaleConfig<1, 1, 128>, Fp8, Fp8, float, float>;
using Ue8m0 = cutlass::float_ue8m0_t;
using MxConfig = cutlass::detail::Sm1xxBlockScaledConfig<32>;
using ForwardMxX = f8::detail::ScaledExpert<MxConfig, Fp8, Fp8, cutlass::bfloat16_t, Ue8m0>;
using WgradMxX = f8::detail::ScaledExpert<MxConfig, Fp8, Fp8, float, Ue8m0>;

namespace {

struct Arena {
  std::vector<std::unique_ptr<Buffer>> bufs;
  void* alloc(size_t bytes) {
    bufs.push_back(std::make_unique<Buffer>(bytes, 0x5c));
    return bufs.back()->data();
  }
};

// What the stand-in launch recorded: the argument arrays (pointers as element offsets from their operand's base),
// the offsets and the relayouted scale buffers.
std::vector<Output> g_scaled;
const void* g_base[6];  // a, b, d, bias, sfa buffer, sfb buffer of the launch being recorded

template <class T>
Output vec_out(const char* name, const T* p, size_t n) {
  Output o{name, sizeof(T), std::vector<unsigned char>(sizeof(T) * n)};
  if (n > 0) std::memcpy(o.bytes.data(), p, sizeof(T) * n);
  return o;
}

int64_t rel(const void* p, const void* base, size_t elem) {
  if (p == nullptr) return -1;
  return (static_cast<const char*>(p) - static_cast<const char*>(base)) / static_cast<int64_t>(elem);
}

// Serializes one launch's per-expert arguments (from the device arrays or from the host's expectation).
template <class X>
std::vector<Output> args_out(const std::vector<X>& x, const void* const* base) {
  const size_t e = x.size();
  std::vector<int32_t> shapes;
  std::vector<int64_t> ptrs, strides;
  std::vector<unsigned char> layouts;
  for (const X& v : x) {
    shapes.insert(shapes.end(), {cute::get<0>(v.shape), cute::get<1>(v.shape), cute::get<2>(v.shape)});
    ptrs.insert(ptrs.end(), {rel(v.a, base[0], 1), rel(v.b, base[1], 1), rel(v.d, base[2], sizeof(*v.d)),
                             rel(v.bias, base[3], 4), rel(v.sfa, base[4], sizeof(*v.sfa)),
                             rel(v.sfb, base[5], sizeof(*v.sfb))});
    strides.insert(strides.end(), {cute::get<0>(v.stride_a), cute::get<0>(v.stride_b), cute::get<0>(v.stride_d)});
    const auto* la = reinterpret_cast<const unsigned char*>(&v.layout_sfa);
    const auto* lb = reinterpret_cast<const unsigned char*>(&v.layout_sfb);
    layouts.insert(layouts.end(), la, la + sizeof(v.layout_sfa));
    layouts.insert(layouts.end(), lb, lb + sizeof(v.layout_sfb));
  }
  (void)e;
  return {Output::of_vec("shapes", shapes), Output::of_vec("pointers (a b d bias sfa sfb)", ptrs),
          Output::of_vec("strides (a b d)", strides), Output::of_vec("scale layouts", layouts)};
}

// The arrays as the argument kernel left them, read back into per-expert records.
template <class X>
std::vector<X> read_arrays(const f8::detail::ScaledArrays<X>& arr, int e, bool check_c) {
  std::vector<X> x(e);
  for (int i = 0; i < e; ++i) {
    x[i].shape = arr.shapes[i];
    x[i].a = arr.ptr_a[i];
    x[i].b = arr.ptr_b[i];
    x[i].d = arr.ptr_d[i];
    x[i].bias = arr.ptr_bias ? arr.ptr_bias[i] : nullptr;
    x[i].sfa = arr.ptr_sfa[i];
    x[i].sfb = arr.ptr_sfb[i];
    x[i].stride_a = arr.stride_a[i];
    x[i].stride_b = arr.stride_b[i];
    x[i].stride_d = arr.stride_d[i];
    x[i].layout_sfa = arr.layout_sfa[i];
    x[i].layout_sfb = arr.layout_sfb[i];
    // C aliases D, with D's stride (the accumulating wgrad reads it)
    if (check_c && (arr.ptr_c[i] != arr.ptr_d[i] || cute::get<0>(arr.stride_c[i]) != cute::get<0>(arr.stride_d[i])))
      x[i].d = nullptr;
  }
  return x;
}

struct Spans {
  std::vector<gg::ExpertSpan> s;
  int32_t flag = 0;
};

Spans spans_of(const std::vector<int64_t>& splits, int64_t rows) {
  Spans r;
  int64_t begin = 0;
  for (int64_t m : splits) {
    bool negative, cut;
    const int64_t c = gg::clamp_split(m, rows, &negative);
    if (negative) r.flag |= moe_graph::kErrNegativeSplit;
    r.s.push_back(gg::expert_span(begin, c, rows, &cut));
    if (cut) r.flag |= moe_graph::kErrSplitsOverflow;
    begin += c;
  }
  return r;
}

gg::LaunchEnv env_for(Arena& arena, int32_t* flag, int arch) {
  gg::LaunchEnv env;
  env.sm_count = 132;
  env.arch = arch;
  env.error_flag = flag;
  env.alloc = [&arena](size_t bytes) { return arena.alloc(bytes); };
  return env;
}

std::vector<int64_t> make_splits(Rng& rng, int E, int64_t rows, int variant, int64_t align) {
  std::vector<int64_t> s(E);
  const int64_t mean = std::max<int64_t>(1, rows / std::max(E, 1));
  for (int e = 0; e < E; ++e) s[e] = rng.bern(0.25) ? 0 : rng.uniform(0, 2 * mean) / align * align;
  if (variant == 1) s[rng.uniform(0, E - 1)] = -3;         // negative: read as 0, flagged
  if (variant == 2) s[rng.uniform(0, E - 1)] += rows;      // past the buffer: clamped, flagged
  if (variant == 3) {                                      // one expert takes every row
    std::fill(s.begin(), s.end(), 0);
    s[rng.uniform(0, E - 1)] = rows;
  }
  if (variant == 4) s[rng.uniform(0, E - 1)] += 5;         // wgrad: an unaligned start for the later experts
  return s;
}

float scale_value(int64_t i) { return static_cast<float>(i % 1000) + 0.5f; }

// The region of group rows x kblocks scales in CUTLASS's block-scaled layout, from CUTLASS's own layout function
// (an oracle independent of scaled_args.cuh's offset formula): value(i, c) for the real scales, 127 (2^0) in the
// padding up to 128 rows and 4 K blocks.
template <class Value>
void mx_region(uint8_t* region, int64_t rows, int64_t kblocks, int64_t k_elems, Value value) {
  if (rows == 0 || kblocks == 0) return;
  const auto layout = MxConfig::tile_atom_to_shape_SFA(cute::make_shape((int)rows, 1, (int)k_elems, 1));
  const int64_t prow = (rows + 127) / 128 * 128, pcol = (kblocks + 3) / 4 * 4;
  for (int64_t i = 0; i < prow; ++i)
    for (int64_t c = 0; c < pcol; ++c)
      region[layout(i, c * 32, 0)] = (i < rows && c < kblocks) ? value(i, c) : uint8_t(127);
}

template <class X>
int forward_case(Rng& rng, int E, int64_t rows, int64_t n, int64_t k, int variant, bool with_bias, bool i64) {
  constexpr bool mx = std::is_same_v<typename X::ElementSF, Ue8m0>;
  const int64_t bk = mx ? 32 : 128, bn = mx ? 1 : 128;
  const int arch = mx ? 100 : 90;
  const std::vector<int64_t> splits = make_splits(rng, E, rows, variant, 1);
  const int64_t kb = k / bk, nb = (n + bn - 1) / bn, es = mx ? 1 : 4;
  Buffer a(rows * k + 1), b(E * n * k + 1), bias(E * n * 4 + 4), sa(rows * kb * es + 4), sb(E * nb * kb * es + 4);
  for (int64_t i = 0; i < rows * kb; ++i) {
    if (mx)
      sa.put<uint8_t>(i, static_cast<uint8_t>(i % 200 + 1));
    else
      sa.put<float>(i, scale_value(i));
  }
  for (int64_t i = 0; i < E * nb * kb; ++i) {
    if (mx)
      sb.put<uint8_t>(i, static_cast<uint8_t>((3 * i + 1) % 200 + 1));
    else
      sb.put<float>(i, scale_value(3 * i + 1));
  }
  Buffer splits_buf(E * 8);
  for (int e = 0; e < E; ++e) {
    if (i64)
      splits_buf.put<int64_t>(e, splits[e]);
    else
      splits_buf.put<int32_t>(e, static_cast<int32_t>(splits[e]));
  }
  std::vector<uint16_t> out(rows * n);
  const f8::ScaledForwardPlan plan = f8::plan_scaled_forward(arch, rows, E, n, k, bk, bn, mx, with_bias);
  auto run = [&](bool emulate) {
    std::fill(out.begin(), out.end(), 0x5c5c);
    int32_t flag = 0;
    std::vector<Output> o;
    if (emulate) {
      f8::ScaledForwardCuda p;
      p.rows = rows, p.n = n, p.k = k, p.block_k = bk, p.block_n = bn, p.e8m0 = mx;
      p.a = a.data(), p.a_scale = sa.data(), p.b = b.data(), p.b_scale = sb.data();
      p.bias = with_bias ? reinterpret_cast<const float*>(bias.data()) : nullptr;
      p.out = out.data();
      p.splits = gg::Splits{splits_buf.data(), i64, E};
      Arena arena;
      g_scaled.clear();
      f8::run_scaled_forward(p, env_for(arena, &flag, arch));
      o = g_scaled;
    } else if (!plan.run_gemm) {  // the offsets scan only (empty output): the flags
      flag = spans_of(splits, rows).flag;
    } else {
      const Spans sp = spans_of(splits, rows);
      flag = sp.flag;
      std::vector<uint8_t> sfa(plan.sfa_bytes, 0x5c), sfb(plan.sfb_bytes, 0x5c);
      using ESF = typename X::ElementSF;
      ESF* sfa_t = reinterpret_cast<ESF*>(sfa.data());
      ESF* sfb_t = reinterpret_cast<ESF*>(sfb.data());
      std::vector<X> x(E);
      const void* base[6] = {a.data(), b.data(), out.data(), bias.data(), sfa.data(), sfb.data()};
      int64_t total = 0, q = 0;
      const int64_t kb4 = (kb + 3) / 4 * 4;
      const float* saf = reinterpret_cast<const float*>(sa.data());
      const uint8_t* sab = sa.data();
      for (int e = 0; e < E; ++e) {
        const int64_t s = sp.s[e].start, c = sp.s[e].count;
        total = s + c;
        X& v = x[e];
        v.shape = cute::make_shape(static_cast<int>(c), static_cast<int>(n), static_cast<int>(k));
        v.a = reinterpret_cast<const Fp8*>(a.data()) + s * k;
        v.b = reinterpret_cast<const Fp8*>(b.data()) + e * n * k;
        v.d = reinterpret_cast<cutlass::bfloat16_t*>(out.data()) + s * n;
        v.bias = with_bias ? reinterpret_cast<const float*>(bias.data()) + e * n : nullptr;
        // blockwise: the group's MN-major [kb, count] grid at start * kb; mx: 128-row padded regions in order
        v.sfa = sfa_t + (mx ? q * 128 * kb4 : s * kb);
        v.sfb = sfb_t + (mx ? e * ((n + 127) / 128) * 128 * kb4 : e * kb * nb);
        v.stride_a = f8::detail::KMajorStride{k, cute::_1{}, cute::_0{}};
        v.stride_b = f8::detail::KMajorStride{k, cute::_1{}, cute::_0{}};
        v.stride_d = f8::detail::KMajorStride{n, cute::_1{}, cute::_0{}};
        v.layout_sfa = X::Config::tile_atom_to_shape_SFA(cute::make_shape((int)c, (int)n, (int)k, 1));
        v.layout_sfb = X::Config::tile_atom_to_shape_SFB(cute::make_shape((int)c, (int)n, (int)k, 1));
        if (mx) {
          mx_region(sfa.data() + q * 128 * kb4, c, kb, k, [&](int64_t i, int64_t j) { return sab[(s + i) * kb + j]; });
        } else {
          for (int64_t i = 0; i < c; ++i)
            for (int64_t j = 0; j < kb; ++j) reinterpret_cast<float*>(sfa.data())[s * kb + j * c + i] = saf[(s + i) * kb + j];
        }
        q += (c + 127) / 128;
      }
      for (int e = 0; e < E; ++e) {
        if (mx) {
          mx_region(sfb.data() + e * ((n + 127) / 128) * 128 * kb4, n, kb, k,
                    [&](int64_t i, int64_t j) { return sb.data()[(e * n + i) * kb + j]; });
        } else {
          for (int64_t i = 0; i < nb; ++i)
            for (int64_t j = 0; j < kb; ++j)
              reinterpret_cast<float*>(sfb.data())[e * kb * nb + j * nb + i] =
                  reinterpret_cast<const float*>(sb.data())[(e * nb + i) * kb + j];
        }
      }
      o = args_out(x, base);
      o.push_back(Output::of_vec("tile0", std::vector<int64_t>(E, 0)));
      std::vector<int64_t> offs(E + 1);
      for (int e = 0; e < E; ++e) offs[e] = sp.s[e].start;
      offs[E] = total;
      o.push_back(Output::of_vec("offsets", offs));
      o.push_back(Output::of_vec("sfa (relayouted)", sfa));
      o.push_back(Output::of_vec("sfb (relayouted)", sfb));
      std::fill(out.begin() + total * n, out.end(), 0);  // the tail the argument kernel zeroes
    }
    o.push_back(Output::of_vec("out", out));
    o.push_back(Output::of("error_flag", flag));
    return o;
  };
  return run_case(std::string("fp8_scaled forward ") + (mx ? "mxfp8" : "blockwise") + " E" + std::to_string(E) +
                      " rows" + std::to_string(rows) + " n" + std::to_string(n) + " k" + std::to_string(k) +
                      " variant " + std::to_string(variant) + (with_bias ? " bias" : "") + (i64 ? " int64" : " int32"),
                  [&] { return run(false); }, [&] { return run(true); });
}

template <class X>
int wgrad_case(Rng& rng, int E, int64_t rows, int64_t n, int64_t k, int variant, bool accumulate) {
  constexpr bool mx = std::is_same_v<typename X::ElementSF, Ue8m0>;
  const int64_t bm = mx ? 32 : 128, es = mx ? 1 : 4;
  const int arch = mx ? 100 : 90;
  const std::vector<int64_t> splits = make_splits(rng, E, rows, variant, 16);
  const int64_t rt = f8::row_tile_capacity(rows, E, bm);
  Buffer a_t(n * rows + 1), b_t(k * rows + 1), sa(n * rt * es + 4), sb(k * rt * es + 4), out(E * n * k * 4);
  for (int64_t i = 0; i < n * rt; ++i) {
    if (mx)
      sa.put<uint8_t>(i, static_cast<uint8_t>(i % 200 + 1));
    else
      sa.put<float>(i, scale_value(i));
  }
  for (int64_t i = 0; i < k * rt; ++i) {
    if (mx)
      sb.put<uint8_t>(i, static_cast<uint8_t>((7 * i + 2) % 200 + 1));
    else
      sb.put<float>(i, scale_value(7 * i + 2));
  }
  Buffer splits_buf(E * 8);
  for (int e = 0; e < E; ++e) splits_buf.put<int64_t>(e, splits[e]);
  const f8::ScaledWgradPlan plan = f8::plan_scaled_wgrad(arch, rows, E, n, k, bm, mx, accumulate);
  auto run = [&](bool emulate) {
    for (int64_t i = 0; i < E * n * k; ++i) out.put<float>(i, static_cast<float>(i % 17));  // a main_grad
    int32_t flag = 0;
    std::vector<Output> o;
    if (emulate) {
      f8::ScaledWgradCuda p;
      p.rows = rows, p.n = n, p.k = k, p.block_m = bm, p.e8m0 = mx;
      p.a_t = a_t.data(), p.a_scale = sa.data(), p.b_t = b_t.data(), p.b_scale = sb.data();
      p.out = reinterpret_cast<float*>(out.data());
      p.accumulate = accumulate;
      p.splits = gg::Splits{splits_buf.data(), true, E};
      Arena arena;
      g_scaled.clear();
      f8::run_scaled_wgrad(p, env_for(arena, &flag, arch));
      o = g_scaled;
    } else {
      const Spans sp = spans_of(splits, rows);
      flag = sp.flag;
      if (plan.run_gemm) {
        std::vector<uint8_t> sfa(plan.sfa_bytes, 0x5c), sfb(plan.sfb_bytes, 0x5c);
        using ESF = typename X::ElementSF;
        const void* base[6] = {a_t.data(), b_t.data(), out.data(), nullptr, sfa.data(), sfb.data()};
        std::vector<X> x(E);
        std::vector<int64_t> tile0(E);
        int64_t q = 0, t0 = 0, total = 0;
        const int64_t na = (n + 127) / 128 * 128 * 4, nbk = (k + 127) / 128 * 128 * 4;  // bytes per 128 tokens
        for (int e = 0; e < E; ++e) {
          const int64_t s = sp.s[e].start, c = sp.s[e].count;
          total = s + c;
          const bool unaligned = c > 0 && s % 16 != 0;
          if (unaligned) flag |= moe_graph::kErrUnalignedSplit;
          X& v = x[e];
          v.shape = cute::make_shape(c > 0 && !unaligned ? (int)n : 0, (int)k, (int)c);
          v.a = reinterpret_cast<const Fp8*>(a_t.data()) + s;
          v.b = reinterpret_cast<const Fp8*>(b_t.data()) + s;
          v.d = reinterpret_cast<float*>(out.data()) + e * n * k;
          v.bias = nullptr;
          // blockwise: tile q of the transposed [RT, n] / [RT, k] grids; mx: padded regions of ceil(c / 128) x 4
          // K blocks
          v.sfa = reinterpret_cast<ESF*>(sfa.data()) + (mx ? q * na : q * n);
          v.sfb = reinterpret_cast<ESF*>(sfb.data()) + (mx ? q * nbk : q * k);
          v.stride_a = f8::detail::KMajorStride{rows, cute::_1{}, cute::_0{}};
          v.stride_b = f8::detail::KMajorStride{rows, cute::_1{}, cute::_0{}};
          v.stride_d = f8::detail::KMajorStride{k, cute::_1{}, cute::_0{}};
          v.layout_sfa = X::Config::tile_atom_to_shape_SFA(cute::make_shape((int)n, (int)k, (int)c, 1));
          v.layout_sfb = X::Config::tile_atom_to_shape_SFB(cute::make_shape((int)n, (int)k, (int)c, 1));
          tile0[e] = t0;
          if (mx) {
            const int64_t nt = (c + 31) / 32;
            mx_region(sfa.data() + q * na, n, nt, c, [&](int64_t i, int64_t j) { return sa.data()[i * rt + t0 + j]; });
            mx_region(sfb.data() + q * nbk, k, nt, c, [&](int64_t i, int64_t j) { return sb.data()[i * rt + t0 + j]; });
          }
          q += (c + 127) / 128;
          t0 += (c + bm - 1) / bm;
        }
        if (!mx) {
          float* fa = reinterpret_cast<float*>(sfa.data());
          float* fb = reinterpret_cast<float*>(sfb.data());
          for (int64_t i = 0; i < n; ++i)
            for (int64_t t = 0; t < rt; ++t) fa[t * n + i] = reinterpret_cast<const float*>(sa.data())[i * rt + t];
          for (int64_t i = 0; i < k; ++i)
            for (int64_t t = 0; t < rt; ++t) fb[t * k + i] = reinterpret_cast<const float*>(sb.data())[i * rt + t];
        }
        o = args_out(x, base);
        o.push_back(Output::of_vec("tile0", tile0));
        std::vector<int64_t> offs(E + 1);
        for (int e = 0; e < E; ++e) offs[e] = sp.s[e].start;
        offs[E] = total;
        o.push_back(Output::of_vec("offsets", offs));
        o.push_back(Output::of_vec("sfa (relayouted)", sfa));
        o.push_back(Output::of_vec("sfb (relayouted)", sfb));
      }
      if (plan.zero_fill) std::memset(out.data(), 0, out.size());  // overwrite: zero, then D = acc + C
    }
    o.push_back(out.out("out", 4));
    o.push_back(Output::of("error_flag", flag));
    return o;
  };
  return run_case(std::string("fp8_scaled wgrad ") + (mx ? "mxfp8" : "blockwise") + " E" + std::to_string(E) +
                      " rows" + std::to_string(rows) + " n" + std::to_string(n) + " k" + std::to_string(k) +
                      " variant " + std::to_string(variant) + (accumulate ? " accumulate" : " overwrite"),
                  [&] { return run(false); }, [&] { return run(true); });
}

}  // namespace

int family_fp8_scaled() {
  int runs = 0;
  Rng rng(31);
  struct Shape {
    int E;
    int64_t rows, n, k;
  };
  std::vector<Shape> shapes = {{1, 0, 8, 128}, {1, 5, 8, 128},     {3, 40, 136, 256}, {4, 300, 24, 128},
                               {8, 700, 16, 384}, {300, 900, 8, 128}, {5, 64, 0, 128}};
  if (g_full) shapes.push_back({64, 4000, 264, 512});
  for (const Shape& s : shapes) {
    const int64_t wrows = s.rows / 16 * 16, wn = std::max<int64_t>(8, s.n), wk = std::max<int64_t>(8, s.k / 16);
    for (int variant = 0; variant < 4; ++variant) {
      runs += forward_case<ForwardX>(rng, s.E, s.rows, s.n, s.k, variant, variant % 2 == 0, variant != 1);
      runs += forward_case<ForwardMxX>(rng, s.E, s.rows, s.n, s.k - 32 * (variant % 2), variant, variant == 2,
                                       variant != 3);  // K blocks not a multiple of 4 too
      runs += wgrad_case<WgradX>(rng, s.E, wrows, wn, wk, variant, variant % 2 == 1);
      runs += wgrad_case<WgradMxX>(rng, s.E, wrows, wn, wk, variant, variant % 2 == 0);
    }
    runs += wgrad_case<WgradX>(rng, s.E, wrows, wn, 16, 4, false);  // unaligned starts
    runs += wgrad_case<WgradMxX>(rng, s.E, wrows, wn, 16, 4, true);
  }
  return runs;
}

}  // namespace emu_test

// The per-architecture CUTLASS launches: the GEMM is CUTLASS's (not emulated); these stand-ins run the project's
// part of a launch through the same enqueue functions, with the kernel's expert types, and record what it wrote.
namespace moe_graph {
namespace fp8 {
namespace detail {

namespace {
template <class X>
void forward_stand_in(const ScaledForwardCuda& p, const ScaledForwardPlan& plan, const gg::LaunchEnv& env,
                      int64_t* offsets) {
  using Arr = ScaledArrays<X>;
  using ESF = typename X::ElementSF;
  const int e = p.splits.num_experts;
  const Arr arr = gg::detail::carve_arguments<Arr>(static_cast<char*>(env.alloc(plan.argument_bytes)), e,
                                              p.bias != nullptr);
  auto* sfa = static_cast<ESF*>(env.alloc(plan.sfa_bytes));
  auto* sfb = static_cast<ESF*>(env.alloc(plan.sfb_bytes));
  enqueue_scaled_forward_args<X>(arr, p, plan, env, offsets, sfa, sfb);
  const void* base[6] = {p.a, p.b, p.out, p.bias, sfa, sfb};
  emu_test::g_scaled = emu_test::args_out(emu_test::read_arrays(arr, e, false), base);
  emu_test::g_scaled.push_back(emu_test::vec_out("tile0", arr.tile0, e));
  emu_test::g_scaled.push_back(emu_test::vec_out("offsets", offsets, e + 1));
  emu_test::g_scaled.push_back(emu_test::vec_out("sfa (relayouted)", reinterpret_cast<uint8_t*>(sfa), plan.sfa_bytes));
  emu_test::g_scaled.push_back(emu_test::vec_out("sfb (relayouted)", reinterpret_cast<uint8_t*>(sfb), plan.sfb_bytes));
}

template <class X>
void wgrad_stand_in(const ScaledWgradCuda& p, const ScaledWgradPlan& plan, const gg::LaunchEnv& env,
                    int64_t* offsets) {
  using Arr = ScaledArrays<X>;
  using ESF = typename X::ElementSF;
  const int e = p.splits.num_experts;
  const Arr arr = gg::detail::carve_arguments<Arr>(static_cast<char*>(env.alloc(plan.argument_bytes)), e, false);
  auto* sfa = static_cast<ESF*>(env.alloc(plan.sfa_bytes));
  auto* sfb = static_cast<ESF*>(env.alloc(plan.sfb_bytes));
  enqueue_scaled_wgrad_args<X>(arr, p, plan, env, offsets, sfa, sfb);
  const void* base[6] = {p.a_t, p.b_t, p.out, nullptr, sfa, sfb};
  emu_test::g_scaled = emu_test::args_out(emu_test::read_arrays(arr, e, true), base);
  emu_test::g_scaled.push_back(emu_test::vec_out("tile0", arr.tile0, e));
  emu_test::g_scaled.push_back(emu_test::vec_out("offsets", offsets, e + 1));
  emu_test::g_scaled.push_back(emu_test::vec_out("sfa (relayouted)", reinterpret_cast<uint8_t*>(sfa), plan.sfa_bytes));
  emu_test::g_scaled.push_back(emu_test::vec_out("sfb (relayouted)", reinterpret_cast<uint8_t*>(sfb), plan.sfb_bytes));
}
}  // namespace

// The stand-ins of both families' CUTLASS launches (scaled_launch.cuh defines them on a GPU build).
template <>
void ScaledArch<ScaledKernel::kSm90Blockwise>::forward(const ScaledForwardCuda& p, const ScaledForwardPlan& plan,
                                                       const gg::LaunchEnv& env, int64_t* offsets) {
  forward_stand_in<emu_test::ForwardX>(p, plan, env, offsets);
}
template <>
void ScaledArch<ScaledKernel::kSm90Blockwise>::wgrad(const ScaledWgradCuda& p, const ScaledWgradPlan& plan,
                                                     const gg::LaunchEnv& env, int64_t* offsets) {
  wgrad_stand_in<emu_test::WgradX>(p, plan, env, offsets);
}
template <>
void ScaledArch<ScaledKernel::kSm100Mxfp8>::forward(const ScaledForwardCuda& p, const ScaledForwardPlan& plan,
                                                    const gg::LaunchEnv& env, int64_t* offsets) {
  forward_stand_in<emu_test::ForwardMxX>(p, plan, env, offsets);
}
template <>
void ScaledArch<ScaledKernel::kSm100Mxfp8>::wgrad(const ScaledWgradCuda& p, const ScaledWgradPlan& plan,
                                                  const gg::LaunchEnv& env, int64_t* offsets) {
  wgrad_stand_in<emu_test::WgradMxX>(p, plan, env, offsets);
}

}  // namespace detail
}  // namespace fp8
}  // namespace moe_graph
