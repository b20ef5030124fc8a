// Per-element math of the fused expert activations, shared by the CPU and CUDA implementations (torch-free).
//
// Gated kinds: h = [a | b] (gate half, then up half of fc1's output row), s = the row's scale (1 without one):
//   swiglu          act = silu(a) * b = a * sigmoid(a) * b
//   clamped_swiglu  act = a' * sigmoid(alpha * a') * (b' + 1),  a' = min(a, limit),  b' = clamp(b, -limit, limit)
//   limited_swiglu  act = silu(a') * b'  (the same clamps, no alpha, no +1: DeepSeek-V4, GLM5-Next, HY-V4)
//   post_clamped_swiglu  act = min(silu(a), limit) * b'  (the gate clamped after the activation: Step-3.7)
//   softcapped_swiglu    act = cg * tanh(a / cg) * sigmoid(a) * cu * tanh(b / cu),  cg = alpha, cu = limit
//                        (the sigmoid sees the raw gate; the caps bound the linear gate factor and b: Inkling-2)
//   geglu_tanh      act = gelu_tanh(a) * b,  gelu_tanh(a) = a / 2 * (1 + tanh(sqrt(2 / pi) * (a + 0.044715 a^3)))
//                   (Gemma 4's gated GELU, torch's gelu(approximate="tanh"); computed as a * sigmoid(2 * ...))
// Plain (not gated) kinds: h = a (fc1's output row as it is):
//   squared_relu    act = relu(a)^2  (Nemotron-H's relu2, Megatron's squared_relu)
//   relu            act = max(a, 0)
//   silu            act = a * sigmoid(a)
//   gelu            act = a / 2 * (1 + erf(a / sqrt(2)))  (torch's exact gelu)
//   y = act * s
// Backward for dy: da = dy * s * dact/da (and db = dy * s * dact/db for the gated kinds), ds = sum over the row of
// dy * act. The clamps pass the gradient where the input lies inside the closed interval (a <= limit,
// -limit <= b <= limit) and block it outside, as torch.clamp does; post_clamped_swiglu's gate passes it where
// silu(a) <= limit; relu and squared_relu block it where a <= 0, as torch's relu does. A NaN input propagates
// through the clamps and relu (NaN compares false).
// Math in double for double data, in float otherwise (bf16 / fp16 are widened on load, rounded once on store).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/host_device.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace moe_graph {
namespace activation {

enum class ActKind : int {
  kSwiglu = 0,
  kClampedSwiglu = 1,
  kLimitedSwiglu = 2,
  kPostClampedSwiglu = 3,
  kSoftcappedSwiglu = 4,
  kGegluTanh = 5,
  kSquaredRelu = 6,  // the plain kinds from here on: h is [N, F]
  kRelu = 7,
  kSilu = 8,
  kGelu = 9
};

// True for the kinds whose input row is [a | b] (2F values), false for the plain ones (F values).
MOE_GRAPH_HD constexpr bool is_gated(ActKind k) {
  return static_cast<int>(k) < static_cast<int>(ActKind::kSquaredRelu);
}

// 16-bit storage types (bit patterns; converted with round-to-nearest-even).
struct bf16_t {
  uint16_t bits;
};
struct f16_t {
  uint16_t bits;
};

MOE_GRAPH_HD float float_of_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

MOE_GRAPH_HD uint32_t bits_of_float(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

// The math type of a storage type: double for double, float for everything else.
template <typename T>
struct Acc {
  using type = float;
};
template <>
struct Acc<double> {
  using type = double;
};
template <typename T>
using acc_t = typename Acc<T>::type;

MOE_GRAPH_HD float widen(float v) { return v; }
MOE_GRAPH_HD double widen(double v) { return v; }
MOE_GRAPH_HD float widen(bf16_t v) { return float_of_bits(static_cast<uint32_t>(v.bits) << 16); }
MOE_GRAPH_HD float widen(f16_t v) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(v.bits));
#else
  const uint32_t sign = static_cast<uint32_t>(v.bits & 0x8000u) << 16;
  const uint32_t exp = (v.bits >> 10) & 0x1fu, mant = v.bits & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24
    const float mag = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return sign ? -mag : mag;
  }
  if (exp == 0x1f) return float_of_bits(sign | 0x7f800000u | (mant << 13));  // inf / NaN
  return float_of_bits(sign | ((exp + 112u) << 23) | (mant << 13));
#endif
}

// Narrowing from the math type A (float or double) to the storage type T, round to nearest even.
template <typename T>
struct Narrow;
template <>
struct Narrow<float> {
  template <typename A>
  static MOE_GRAPH_HD float to(A v) { return static_cast<float>(v); }
};
template <>
struct Narrow<double> {
  template <typename A>
  static MOE_GRAPH_HD double to(A v) { return static_cast<double>(v); }
};
template <>
struct Narrow<bf16_t> {
  static MOE_GRAPH_HD bf16_t to(float f) {
#if defined(__CUDA_ARCH__)
    return bf16_t{__bfloat16_as_ushort(__float2bfloat16_rn(f))};
#else
    uint32_t u = bits_of_float(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_t{0x7fc0};  // NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return bf16_t{static_cast<uint16_t>(u >> 16)};
#endif
  }
};
template <>
struct Narrow<f16_t> {
  static MOE_GRAPH_HD f16_t to(float f) {
#if defined(__CUDA_ARCH__)
    return f16_t{__half_as_ushort(__float2half_rn(f))};
#else
    // Scale the magnitude so that the float addition below rounds the mantissa to 10 bits (nearest even),
    // including into the subnormal range; overflow becomes inf, NaN stays NaN.
    const float to_inf = 5.192296858534828e+33f;   // 2^112
    const float to_zero = 7.703719777548943e-34f;  // 2^-110
    float base = (std::fabs(f) * to_inf) * to_zero;
    const uint32_t w = bits_of_float(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xff000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = float_of_bits((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = bits_of_float(base);
    const uint32_t nonsign = ((bits >> 13) & 0x00007c00u) + (bits & 0x00000fffu);
    return f16_t{static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xff000000u ? 0x7e00u : nonsign))};
#endif
  }
};

MOE_GRAPH_HD float exp_of(float x) { return expf(x); }
MOE_GRAPH_HD double exp_of(double x) { return exp(x); }

MOE_GRAPH_HD float tanh_of(float x) { return tanhf(x); }
MOE_GRAPH_HD double tanh_of(double x) { return tanh(x); }

MOE_GRAPH_HD float erf_of(float x) { return erff(x); }
MOE_GRAPH_HD double erf_of(double x) { return erf(x); }

template <typename A>
MOE_GRAPH_HD A sigmoid_of(A x) {
  return A(1) / (A(1) + exp_of(-x));
}

// sqrt(2 / pi) and the cubic coefficient of the tanh approximation of GELU (torch's kBeta, kKappa). Since
// (1 + tanh(y)) / 2 = sigmoid(2y), gelu_tanh(a) = a * sigmoid(gelu_tanh_arg(a)) with
// gelu_tanh_arg(a) = 2 * kBeta * (a + kKappa * a^3): SwiGLU's form with another argument (no tanh, and no
// cancellation in 1 + tanh for negative a).
template <typename A>
struct GeluTanh {
  static constexpr A kBeta = A(0.7978845608028654);
  static constexpr A kKappa = A(0.044715);
};
template <typename A>
MOE_GRAPH_HD A gelu_tanh_arg(A a) {
  return A(2) * GeluTanh<A>::kBeta * (a + GeluTanh<A>::kKappa * a * a * a);
}

// act(a, b) and its partial derivatives.
template <typename A>
struct GatedGrad {
  A act, d_a, d_b;
};

template <ActKind K, typename A>
MOE_GRAPH_HD A gated_value(A a, A b, A alpha, A limit) {
  if constexpr (K == ActKind::kSwiglu) {
    return a * sigmoid_of(a) * b;
  } else if constexpr (K == ActKind::kLimitedSwiglu) {
    const A ac = a > limit ? limit : a;
    const A bc = b < -limit ? -limit : (b > limit ? limit : b);
    return ac * sigmoid_of(ac) * bc;
  } else if constexpr (K == ActKind::kPostClampedSwiglu) {
    const A silu = a * sigmoid_of(a);
    const A bc = b < -limit ? -limit : (b > limit ? limit : b);
    return (silu > limit ? limit : silu) * bc;
  } else if constexpr (K == ActKind::kSoftcappedSwiglu) {
    return alpha * tanh_of(a / alpha) * sigmoid_of(a) * (limit * tanh_of(b / limit));
  } else if constexpr (K == ActKind::kGegluTanh) {
    return a * sigmoid_of(gelu_tanh_arg(a)) * b;
  } else {
    const A ac = a > limit ? limit : a;
    const A bc = b < -limit ? -limit : (b > limit ? limit : b);
    return ac * sigmoid_of(alpha * ac) * (bc + A(1));
  }
}

template <ActKind K, typename A>
MOE_GRAPH_HD GatedGrad<A> gated_grad(A a, A b, A alpha, A limit) {
  if constexpr (K == ActKind::kSwiglu) {
    const A s = sigmoid_of(a);
    const A silu = a * s;
    return {silu * b, b * s * (A(1) + a * (A(1) - s)), silu};
  } else if constexpr (K == ActKind::kLimitedSwiglu) {
    const A ac = a > limit ? limit : a;
    const A bc = b < -limit ? -limit : (b > limit ? limit : b);
    const A s = sigmoid_of(ac);
    const A silu = ac * s;
    const A d_a = a <= limit ? bc * s * (A(1) + ac * (A(1) - s)) : A(0);
    const A d_b = (b >= -limit && b <= limit) ? silu : A(0);
    return {silu * bc, d_a, d_b};
  } else if constexpr (K == ActKind::kPostClampedSwiglu) {
    const A s = sigmoid_of(a);
    const A silu = a * s;
    const A g = silu > limit ? limit : silu;  // a NaN propagates
    const A bc = b < -limit ? -limit : (b > limit ? limit : b);
    const A d_a = silu <= limit ? bc * s * (A(1) + a * (A(1) - s)) : A(0);
    const A d_b = (b >= -limit && b <= limit) ? g : A(0);
    return {g * bc, d_a, d_b};
  } else if constexpr (K == ActKind::kSoftcappedSwiglu) {
    const A tg = tanh_of(a / alpha), tu = tanh_of(b / limit);
    const A s = sigmoid_of(a);
    const A gate = alpha * tg * s, up = limit * tu;
    return {gate * up, up * s * ((A(1) - tg * tg) + alpha * tg * (A(1) - s)), gate * (A(1) - tu * tu)};
  } else if constexpr (K == ActKind::kGegluTanh) {
    const A s = sigmoid_of(gelu_tanh_arg(a));
    const A gelu = a * s;
    const A dz = A(2) * GeluTanh<A>::kBeta * (A(1) + A(3) * GeluTanh<A>::kKappa * a * a);  // d gelu_tanh_arg / da
    return {gelu * b, b * s * (A(1) + a * (A(1) - s) * dz), gelu};
  } else {
    const A ac = a > limit ? limit : a;
    const A bc = b < -limit ? -limit : (b > limit ? limit : b);
    const A s = sigmoid_of(alpha * ac);
    const A glu = ac * s;
    const A d_a = a <= limit ? (bc + A(1)) * s * (A(1) + alpha * ac * (A(1) - s)) : A(0);
    const A d_b = (b >= -limit && b <= limit) ? glu : A(0);
    return {glu * (bc + A(1)), d_a, d_b};
  }
}

// Plain kinds: act(a) and its derivative.
template <typename A>
struct PlainGrad {
  A act, d_a;
};

// 1 / sqrt(2) and 1 / sqrt(2 pi), for the exact GELU.
template <typename A>
struct GeluErf {
  static constexpr A kInvSqrt2 = A(0.7071067811865476);
  static constexpr A kInvSqrt2Pi = A(0.3989422804014327);
};

template <ActKind K, typename A>
MOE_GRAPH_HD A plain_value(A a) {
  if constexpr (K == ActKind::kSquaredRelu) {
    const A r = a < A(0) ? A(0) : a;
    return r * r;
  } else if constexpr (K == ActKind::kRelu) {
    return a < A(0) ? A(0) : a;
  } else if constexpr (K == ActKind::kSilu) {
    return a * sigmoid_of(a);
  } else {
    static_assert(K == ActKind::kGelu, "plain_value: a plain kind");
    return a * A(0.5) * (A(1) + erf_of(a * GeluErf<A>::kInvSqrt2));
  }
}

template <ActKind K, typename A>
MOE_GRAPH_HD PlainGrad<A> plain_grad(A a) {
  if constexpr (K == ActKind::kSquaredRelu) {
    const A r = a < A(0) ? A(0) : a;
    return {r * r, a <= A(0) ? A(0) : A(2) * a};  // NaN: NaN, as torch
  } else if constexpr (K == ActKind::kRelu) {
    return {a < A(0) ? A(0) : a, a <= A(0) ? A(0) : A(1)};  // NaN passes, as torch
  } else if constexpr (K == ActKind::kSilu) {
    const A s = sigmoid_of(a);
    return {a * s, s * (A(1) + a * (A(1) - s))};
  } else {
    static_assert(K == ActKind::kGelu, "plain_grad: a plain kind");
    const A cdf = A(0.5) * (A(1) + erf_of(a * GeluErf<A>::kInvSqrt2));
    return {a * cdf, cdf + a * GeluErf<A>::kInvSqrt2Pi * exp_of(A(-0.5) * a * a)};
  }
}

}  // namespace activation
}  // namespace moe_graph
