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

#include <cutlass/numeric_types.h>

#include "common/error_flag.h"
#include "grouped_gemm/grouped_args.cuh"
#include "grouped_gemm/grouped_configs.h"
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

gg::LaunchEnv env_for(Arena& arena, int32_t* flag, int sm_count, int arch) {
  gg::LaunchEnv env;
  env.sm_count = sm_count;
  env.arch = arch;
  env.error_flag = flag;
  env.alloc = [&arena](size_t bytes) { return arena.alloc(bytes); };
  return env;
}

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

// offsets [E + 1]: the clamped starts and, last, the clamped total
std::vector<int64_t> offsets_of(const std::vector<gg::ExpertSpan>& spans) {
  std::vector<int64_t> offs(spans.size() + 1, 0);
  for (size_t e = 0; e < spans.size(); ++e) {
    offs[e] = spans[e].start;
    offs[spans.size()] = spans[e].start + spans[e].count;
  }
  return offs;
}

std::vector<int64_t> make_splits(Rng& rng, int E, int64_t rows, int variant) {
  std::vector<int64_t> s(E);
  const int64_t mean = std::max<int64_t>(1, rows / std::max(E, 1));
  for (int e = 0; e < E; ++e) s[e] = rng.bern(0.2) ? 0 : rng.uniform(0, 2 * mean);
  if (variant == 1 && E > 0) s[rng.uniform(0, E - 1)] = -3;             // negative: read as 0, flagged
  if (variant == 2 && E > 0) s[rng.uniform(0, E - 1)] += rows;          // past the buffer: clamped, flagged
  return s;
}

// The CUTLASS kernel type the argument kernels are templated on, reduced to the types they read.
template <class Tags, class EAB, class ED>
struct StandInKernel {
  struct ProblemShape {
    using UnderlyingProblemShape = cute::Shape<int, int, int>;
  };
  using ElementA = EAB;
  using ElementB = EAB;
  using ElementD = ED;
  using InternalStrideA = typename gg::detail::TagStrides<Tags>::A;
  using InternalStrideB = typename gg::detail::TagStrides<Tags>::B;
  using InternalStrideC = typename gg::detail::TagStrides<Tags>::D;
  using InternalStrideD = typename gg::detail::TagStrides<Tags>::D;
};

// What the stand-in launchers captured of the last launch: the argument arrays and the offsets, as outputs.
std::vector<Output> g_captured;

template <class T>
Output array_out(const char* name, const T* p, int e) {
  Output o{name, sizeof(T), std::vector<unsigned char>(sizeof(T) * e)};
  if (e > 0) std::memcpy(o.bytes.data(), p, sizeof(T) * e);
  return o;
}

// Serializes per-expert arguments the way the arrays hold them (argument kernel or host loop).
template <class Arr, class ExpertT>
std::vector<Output> args_out(const std::vector<ExpertT>& x, bool with_bias) {
  const int e = static_cast<int>(x.size());
  std::vector<typename Arr::ProblemShape> shapes(e);
  std::vector<const void*> a(e), b(e), d(e), bias(e);
  std::vector<typename Arr::StrideA> sa(e);
  std::vector<typename Arr::StrideB> sb(e);
  std::vector<typename Arr::StrideD> sd(e);
  for (int i = 0; i < e; ++i) {
    shapes[i] = x[i].shape, a[i] = x[i].a, b[i] = x[i].b, d[i] = x[i].d, bias[i] = x[i].bias;
    sa[i] = x[i].stride_a, sb[i] = x[i].stride_b, sd[i] = x[i].stride_d;
  }
  std::vector<Output> o = {array_out("shapes", shapes.data(), e), array_out("ptr_a", a.data(), e),
                           array_out("ptr_b", b.data(), e),       array_out("ptr_c", d.data(), e),
                           array_out("ptr_d", d.data(), e),       array_out("stride_a", sa.data(), e),
                           array_out("stride_b", sb.data(), e),   array_out("stride_c", sd.data(), e),
                           array_out("stride_d", sd.data(), e)};
  if (with_bias) o.push_back(array_out("ptr_bias", bias.data(), e));
  return o;
}

template <class Arr>
std::vector<Output> arrays_out(const Arr& arr, int e, bool with_bias) {
  std::vector<Output> o = {array_out("shapes", arr.shapes, e),     array_out("ptr_a", arr.ptr_a, e),
                           array_out("ptr_b", arr.ptr_b, e),       array_out("ptr_c", arr.ptr_c, e),
                           array_out("ptr_d", arr.ptr_d, e),       array_out("stride_a", arr.stride_a, e),
                           array_out("stride_b", arr.stride_b, e), array_out("stride_c", arr.stride_c, e),
                           array_out("stride_d", arr.stride_d, e)};
  if (with_bias) o.push_back(array_out("ptr_bias", arr.ptr_bias, e));
  return o;
}

template <bool kBKMajor, class E>
bool forward_stand_in(const gg::ForwardProblem& p, const gg::LaunchEnv& env, const void* const* b_table,
                      int64_t* offsets) {
  using K = StandInKernel<gg::detail::ForwardTags<kBKMajor>, E, E>;
  using Arr = gg::detail::GroupedArrays<K, gg::detail::ForwardTags<kBKMajor>>;
  const int e = p.splits.num_experts;
  auto arr = gg::detail::alloc_arguments<Arr>(env, e, p.bias != nullptr);
  gg::detail::enqueue_forward_args<K, kBKMajor>(arr, p, env, b_table, offsets);
  g_captured = arrays_out(arr, e, p.bias != nullptr);
  g_captured.push_back(array_out("offsets", offsets, e + 1));
  return true;
}

template <class EO>
bool wgrad_stand_in(const gg::WgradProblem& p, const gg::LaunchEnv& env, void* const* out_table, int64_t* offsets,
                    const std::function<void()>& after_args) {
  using K = StandInKernel<gg::detail::WgradTags, cutlass::bfloat16_t, EO>;
  using Arr = gg::detail::GroupedArrays<K, gg::detail::WgradTags>;
  const int e = p.splits.num_experts;
  auto arr = gg::detail::alloc_arguments<Arr>(env, e, false);
  gg::detail::enqueue_wgrad_args<K>(arr, p, env, out_table, offsets);
  after_args();
  g_captured = arrays_out(arr, e, false);
  g_captured.push_back(array_out("offsets", offsets, e + 1));
  return true;
}

// One forward GEMM launch (K > 0) through run_forward: offsets, pointer tables, the argument kernel and its tail
// zeroing; compared with the host loop over the shared per-expert argument function.
int forward_args_case(Rng& rng, const std::string& tag, int E, int64_t rows, int64_t n, int64_t k,
                      const std::vector<int64_t>& splits, const gg::Splits& sp, bool b_k_major, bool list,
                      bool with_bias, int arch) {
  if (!gg::plan_forward(arch, rows, E, n, k, with_bias, list, gg::Config::kAuto).run_gemm) return 0;  // no GEMM
  Buffer a(rows * k * 2 + 2), b(E * n * k * 2 + 2), bias(E * n * 2 + 2);
  std::vector<const void*> b_list(E);
  for (int e = 0; e < E; ++e) b_list[e] = b.data() + ((e * 7919) % std::max(E, 1)) * n * k * 2;  // shuffled
  (void)rng;
  std::vector<uint16_t> out(rows * n);  // one allocation: its address is part of the arguments compared
  auto run = [&](bool emulate) {
    std::fill(out.begin(), out.end(), 0x5c5c);
    int32_t flag = 0;
    gg::ForwardProblem p;
    p.dtype = gg::DType::kBF16;
    p.b_k_major = b_k_major;
    p.rows = rows;
    p.n = n;
    p.k = k;
    p.a = a.data();
    p.b.base = list ? nullptr : b.data();
    p.b.expert_stride = n * k;
    p.b.list = list ? b_list.data() : nullptr;
    p.out = out.data();
    p.bias = with_bias ? bias.data() : nullptr;
    p.splits = sp;
    std::vector<Output> o;
    if (emulate) {
      Arena arena;
      g_captured.clear();
      gg::run_forward(p, env_for(arena, &flag, 132, arch));
      o = g_captured;
    } else {
      const auto spans = spans_of(splits, rows, &flag);
      using EA = cutlass::bfloat16_t;
      auto host_args = [&](auto kmajor) {
        constexpr bool kM = decltype(kmajor)::value;
        using X = decltype(gg::detail::forward_expert_args<kM>(0, 0, 0, 0, 0, (const EA*)nullptr, (const EA*)nullptr,
                                                               0, nullptr, (EA*)nullptr, (const EA*)nullptr));
        std::vector<X> x;
        for (int e = 0; e < E; ++e)
          x.push_back(gg::detail::forward_expert_args<kM>(
              e, spans[e].start, spans[e].count, static_cast<int>(n), static_cast<int>(k),
              reinterpret_cast<const EA*>(a.data()), list ? nullptr : reinterpret_cast<const EA*>(b.data()), n * k,
              list ? b_list.data() : nullptr, reinterpret_cast<EA*>(out.data()),
              with_bias ? reinterpret_cast<const EA*>(bias.data()) : nullptr));
        using Arr = gg::detail::GroupedArrays<StandInKernel<gg::detail::ForwardTags<kM>, EA, EA>,
                                              gg::detail::ForwardTags<kM>>;
        return args_out<Arr>(x, with_bias);
      };
      o = b_k_major ? host_args(std::true_type{}) : host_args(std::false_type{});
      const std::vector<int64_t> offs = offsets_of(spans);
      o.push_back(Output::of_vec("offsets", offs));
      std::fill(out.begin() + offs[E] * n, out.end(), 0);  // the tail the argument kernel zeroes
    }
    o.push_back(Output::of_vec("out", out));
    o.push_back(Output::of("error_flag", flag));
    return o;
  };
  return run_case("grouped forward args " + tag + " k" + std::to_string(k) + (b_k_major ? " k-major" : " n-major") +
                      (list ? " list" : "") + (with_bias ? " bias" : "") + " sm" + std::to_string(arch),
                  [&] { return run(false); }, [&] { return run(true); });
}

// One wgrad launch through run_wgrad: offsets, the output pointer table, the argument kernel, the zero-fill of
// overwritten experts; compared with the host loop and the plan's zero-fill rule.
int wgrad_args_case(const std::string& tag, int E, int64_t rows, int64_t n, int64_t k,
                    const std::vector<int64_t>& splits, const gg::Splits& sp, bool fp32_out, bool list, int acc_mode,
                    const std::vector<uint8_t>& mask, int arch) {
  Buffer a(rows * k * 2 + 2), dy(rows * n * 2 + 2);
  const size_t eb = fp32_out ? 4 : 2;
  Buffer out(E * n * k * eb);  // one allocation: its address is part of the arguments compared
  std::vector<void*> out_list(E);
  for (int e = 0; e < E; ++e) out_list[e] = out.data() + ((e * 7919) % std::max(E, 1)) * n * k * eb;
  auto run = [&](bool emulate) {
    if (out.size()) std::memset(out.data(), 0x5c, out.size());
    int32_t flag = 0;
    gg::WgradProblem p;
    p.dtype = gg::DType::kBF16;
    p.out_dtype = fp32_out ? gg::DType::kF32 : gg::DType::kBF16;
    p.rows = rows;
    p.n = n;
    p.k = k;
    p.a = a.data();
    p.dy = dy.data();
    p.out.base = list ? nullptr : out.data();
    p.out.expert_stride = n * k;
    p.out.list = list ? reinterpret_cast<const void* const*>(out_list.data()) : nullptr;
    p.accumulate_all = acc_mode == 1;
    p.accumulate_mask = acc_mode == 2 ? reinterpret_cast<const bool*>(mask.data()) : nullptr;
    p.splits = sp;
    std::vector<Output> o;
    if (emulate) {
      Arena arena;
      g_captured.clear();
      gg::run_wgrad(p, env_for(arena, &flag, 132, arch));
      o = g_captured;
    } else {
      const auto spans = spans_of(splits, rows, &flag);
      const gg::WgradPlan plan = gg::plan_wgrad(arch, rows, E, n, k, p.out_dtype, p.accumulate_all,
                                                p.accumulate_mask != nullptr, list, gg::Config::kAuto);
      const std::vector<int64_t> offs = offsets_of(spans);
      if (plan.kernel != gg::WgradKernel::kNone) {
        using EA = cutlass::bfloat16_t;
        auto host_args = [&](auto eo) {
          using EO = typename decltype(eo)::type;
          using X = decltype(gg::detail::wgrad_expert_args(0, 0, 0, 0, 0, (const EA*)nullptr, (const EA*)nullptr,
                                                           (EO*)nullptr, 0, nullptr));
          std::vector<X> x;
          for (int e = 0; e < E; ++e)
            x.push_back(gg::detail::wgrad_expert_args(
                e, spans[e].start, spans[e].count, static_cast<int>(n), static_cast<int>(k),
                reinterpret_cast<const EA*>(dy.data()), reinterpret_cast<const EA*>(a.data()),
                list ? nullptr : reinterpret_cast<EO*>(out.data()), n * k, list ? out_list.data() : nullptr));
          using Arr = gg::detail::GroupedArrays<StandInKernel<gg::detail::WgradTags, EA, EO>, gg::detail::WgradTags>;
          return args_out<Arr>(x, false);
        };
        o = fp32_out ? host_args(std::type_identity<float>{}) : host_args(std::type_identity<EA>{});
        o.push_back(Output::of_vec("offsets", offs));
      }
      if (plan.zero_fill) {  // wgrad_zero_kernel's rule: overwritten experts, all of them or the empty ones
        for (int e = 0; e < E; ++e) {
          const bool acc = acc_mode == 2 ? mask[e] != 0 : acc_mode == 1;
          if (!acc && (plan.zero_fill_all_overwritten || spans[e].count == 0))
            std::memset(list ? out_list[e] : out.data() + e * n * k * eb, 0, n * k * eb);
        }
      }
    }
    o.push_back(out.out("out", eb));
    o.push_back(Output::of("error_flag", flag));
    return o;
  };
  return run_case("grouped wgrad args " + tag + " k" + std::to_string(k) + (fp32_out ? " fp32 out" : " bf16 out") +
                      (list ? " list" : "") + " acc " + std::to_string(acc_mode) + " sm" + std::to_string(arch),
                  [&] { return run(false); }, [&] { return run(true); });
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
          for (int sms : {132, gg::effective_sm_count(132, 129)}) {  // and a carve-out leaving 3 SMs
            const auto env_of = [&](Arena& arena, int32_t* flag) { return env_for(arena, flag, sms, 90); };
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
          // the argument kernels (GEMM launches with K > 0), their pointer tables and the wgrad zero-fill
          if (bf16 && s.n % 8 == 0 && s.n > 0) {
            for (int arch : {90, 100}) {
              const int64_t k = arch == 90 ? 16 : 24;
              runs += forward_args_case(rng, tag, s.E, s.rows, s.n, k, splits, sp, variant != 1, variant == 2,
                                        variant == 0, arch);
              std::vector<uint8_t> mask(s.E);
              for (int e = 0; e < s.E; ++e) mask[e] = rng.bern(0.5);
              runs += wgrad_args_case(tag, s.E, s.rows, s.n, k, splits, sp, variant != 2, variant == 1, variant, mask,
                                      arch);
            }
          }
        }
      }
    }
  }
  return runs;
}

}  // namespace emu_test

// The per-architecture CUTLASS launchers: the GEMM is CUTLASS's (not emulated); these stand-ins run the project's
// part of a launch, the argument kernel through the same enqueue functions as grouped_launch.cuh, with a stand-in
// kernel type of the same element and stride types, and record what it wrote.
namespace moe_graph {
namespace gg {
namespace detail {
namespace {
bool forward_any(const ForwardProblem& p, const LaunchEnv& env, const void* const* b_table, int64_t* offsets) {
  if (p.dtype != DType::kBF16) return false;
  return p.b_k_major ? emu_test::forward_stand_in<true, cutlass::bfloat16_t>(p, env, b_table, offsets)
                     : emu_test::forward_stand_in<false, cutlass::bfloat16_t>(p, env, b_table, offsets);
}
bool wgrad_any(const WgradProblem& p, const LaunchEnv& env, void* const* out_table, int64_t* offsets,
               const Hook& after_args) {
  if (p.dtype != DType::kBF16) return false;
  return p.out_dtype == DType::kF32
             ? emu_test::wgrad_stand_in<float>(p, env, out_table, offsets, after_args)
             : emu_test::wgrad_stand_in<cutlass::bfloat16_t>(p, env, out_table, offsets, after_args);
}
}  // namespace
bool forward_sm90(const ForwardProblem& p, const LaunchEnv& env, Config, const void* const* b_table,
                  int64_t* offsets) {
  return forward_any(p, env, b_table, offsets);
}
bool forward_sm100(const ForwardProblem& p, const LaunchEnv& env, Config, const void* const* b_table,
                   int64_t* offsets) {
  return forward_any(p, env, b_table, offsets);
}
bool wgrad_sm90(const WgradProblem& p, const LaunchEnv& env, WgradKernel, void* const* out_table, int64_t* offsets,
                const Hook& after_args) {
  return wgrad_any(p, env, out_table, offsets, after_args);
}
bool wgrad_sm100(const WgradProblem& p, const LaunchEnv& env, WgradKernel, void* const* out_table, int64_t* offsets,
                 const Hook& after_args) {
  return wgrad_any(p, env, out_table, offsets, after_args);
}
}  // namespace detail
}  // namespace gg
}  // namespace moe_graph
