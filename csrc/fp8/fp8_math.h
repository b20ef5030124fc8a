// Per-element FP8 arithmetic shared by the CPU implementation and the CUDA kernels (host and device, torch-free).
//
//   encode_fp8<F>(x)      fp32 -> FP8 byte, round to nearest even, saturating to the largest finite value (inf
//                         included), every NaN -> 0x7F (the GPU's canonical NaN of cvt.rn.satfinite; the sign of a
//                         NaN is not kept: x86 and the GPU disagree on it, e.g. inf * 0 is -NaN on x86). On non-NaN
//                         input equals torch's `x.clamp(-max, max).to(float8_*)` and CUDA's
//                         __nv_cvt_float_to_fp8(x, __NV_SATFINITE, ...). fp32 denormals are kept (no flush).
//   decode_fp8<F>(byte)   the exact fp32 value of an FP8 byte.
//   scale_from_amax(...)  TransformerEngine's fp32 scale rule (Float8BlockScaling and Float8CurrentScaling; its
//                         reference `scale_from_amax_tensor`): amax' = max(amax, eps); scale = fp8_max / amax';
//                         an infinite scale becomes `inf_scale` (the largest finite value of the input dtype for
//                         blockwise tiles, of fp32 for per-tensor scaling); with pow2 the scale is rounded down to a
//                         power of two (0 when amax' is inf); amax' == 0 gives scale 1. scale_inv = 1 / scale.
//                         Non-finite amax: inf gives scale 0, scale_inv +inf (TE's rule); NaN gives scale and
//                         scale_inv the canonical +NaN (0x7FC00000).
//   e8m0_from_amax(...)   the MXFP8 block exponent (TransformerEngine's MXFP8 quantizer, OCP MX E8M0 encoding):
//                         float_to_e8m0(amax * (1 / fp8_max)), the exponent rounded up (cvt.rp.satfinite.ue8m0),
//                         values <= 2^-127 give 0, inf gives 0xFE, NaN 0xFF.
//   e8m0_quant_mult(e)    the factor the MX quantizer multiplies by: TransformerEngine's ptx::exp2f_rcp<float>
//                         (transformer_engine/common/util/ptx.cuh, since TE PR #2647 "Fix exp2f_rcp to properly
//                         handle nan and 0xFE cases"): 2^(127 - e) for e in [0, 253] (e == 0: 2^127, no special
//                         case), 2^-127 (the fp32 denormal 0x00400000) for e == 254, NaN for e == 255.
//   e8m0_value(e)         the dequantization factor 2^(e - 127) (e == 0: 2^-127; 0xFF: NaN).
#pragma once
#include <cstdint>
#include <cstring>

#include "common/host_device.h"

namespace moe_graph {
namespace fp8 {

enum class Format : int { kE4M3 = 0, kE5M2 = 1 };

template <Format F>
struct Traits;

template <>
struct Traits<Format::kE4M3> {
  static constexpr int kMantissa = 3;
  static constexpr int kBias = 7;
  static constexpr uint32_t kMaxCode = 0x7E;  // 448
  static constexpr float kMax = 448.0f;
};

template <>
struct Traits<Format::kE5M2> {
  static constexpr int kMantissa = 2;
  static constexpr int kBias = 15;
  static constexpr uint32_t kMaxCode = 0x7B;  // 57344
  static constexpr float kMax = 57344.0f;
};

MOE_GRAPH_HD uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}

MOE_GRAPH_HD float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

// x >> s rounded to nearest, ties to even (1 <= s <= 31).
MOE_GRAPH_HD uint32_t shift_rne(uint32_t x, int s) {
  const uint32_t r = x >> s;
  const uint32_t rem = x & ((1u << s) - 1u);
  const uint32_t half = 1u << (s - 1);
  return (rem > half || (rem == half && (r & 1u))) ? r + 1u : r;
}

template <Format F>
MOE_GRAPH_HD uint8_t encode_fp8(float x) {
  using T = Traits<F>;
  const uint32_t u = float_bits(x);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint8_t>(0x7Fu);  // NaN, canonical (no sign)
  if (a >= float_bits(T::kMax)) return static_cast<uint8_t>(sign | T::kMaxCode);  // saturate (inf included)
  const int e = static_cast<int>(a >> 23) - 127;  // unbiased exponent (fp32 denormals: -127, they round to 0)
  uint32_t code;
  if (e >= 1 - T::kBias) {  // normal in the target: rebias, drop 23 - M mantissa bits (a carry moves the exponent)
    const uint32_t rebiased = (static_cast<uint32_t>(e + T::kBias) << 23) | (a & 0x7FFFFFu);
    code = shift_rne(rebiased, 23 - T::kMantissa);
  } else {  // denormal in the target: the significand in units of 2^(1 - bias - M)
    const int s = 23 - T::kMantissa + (1 - T::kBias - e);
    code = s > 25 ? 0u : shift_rne(a == 0 ? 0u : ((a & 0x7FFFFFu) | 0x800000u), s);
  }
  if (code > T::kMaxCode) code = T::kMaxCode;  // only reachable by rounding just below kMax (never: kMax is exact)
  return static_cast<uint8_t>(sign | code);
}

template <Format F>
MOE_GRAPH_HD float decode_fp8(uint8_t b) {
  using T = Traits<F>;
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t mag = b & 0x7Fu;
  const uint32_t e = mag >> T::kMantissa;
  const uint32_t m = mag & ((1u << T::kMantissa) - 1u);
  if (F == Format::kE4M3 && mag == 0x7Fu) return bits_float(sign | 0x7FC00000u);
  if (F == Format::kE5M2 && e == 0x1Fu) return bits_float(sign | (m ? 0x7FC00000u : 0x7F800000u));
  float v;
  if (e == 0) {
    v = static_cast<float>(m) * bits_float(static_cast<uint32_t>(127 + 1 - T::kBias - T::kMantissa) << 23);
  } else {
    v = bits_float(((e + 127u - T::kBias) << 23) | (m << (23 - T::kMantissa)));
  }
  return sign ? -v : v;
}

// TransformerEngine's fp32 scale rule (see the file comment). Returns the quantization scale; *scale_inv gets its
// reciprocal (the dequantization factor the GEMMs use).
MOE_GRAPH_HD float scale_from_amax(float amax, float fp8_max, float eps, bool pow2, float inf_scale,
                                   float* scale_inv) {
  const float a = amax < eps ? eps : amax;  // NaN stays NaN
  float scale = fp8_max / a;
  if (scale == bits_float(0x7F800000u)) scale = inf_scale;
  if (pow2 && scale == scale) {
    scale = bits_float(float_bits(scale) & 0x7F800000u);  // 2^floor(log2(scale)): scale is normal or 0 here
    if (a == bits_float(0x7F800000u)) scale = 0.0f;
  }
  if (a == 0.0f) scale = 1.0f;
  if (a != a) scale = bits_float(0x7FC00000u);  // canonical NaN (x86 would keep the sign of the input NaN)
  *scale_inv = a != a ? scale : 1.0f / scale;
  return scale;
}

// fp32 -> E8M0 with the exponent rounded up and saturated at 0xFE (cvt.rp.satfinite.ue8m0x2.f32) for val >= 0.
MOE_GRAPH_HD uint8_t float_to_e8m0(float val) {
  if (val != val) return 0xFF;
  const uint32_t u = float_bits(val);
  if ((u & 0x7FFFFFFFu) == 0x7F800000u) return 0xFE;
  if (val == 0.0f) return 0;
  uint32_t exponent = (u >> 23) & 0xFFu;
  const uint32_t mantissa = u & 0x7FFFFFu;
  if ((mantissa > 0 && exponent != 0xFE) && !(exponent == 0 && mantissa <= 0x400000u)) ++exponent;
  return static_cast<uint8_t>(exponent);
}

template <Format F>
MOE_GRAPH_HD uint8_t e8m0_from_amax(float amax) {
  constexpr float kRcp = static_cast<float>(1.0 / static_cast<double>(Traits<F>::kMax));
  return float_to_e8m0(amax * kRcp);
}

MOE_GRAPH_HD float e8m0_quant_mult(uint8_t e) {
  if (e == 0xFF) return bits_float(0x7FFFFFFFu);  // NaN
  if (e == 0xFE) return bits_float(0x00400000u);  // 2^-127: a denormal, not a shifted exponent
  return bits_float(static_cast<uint32_t>(254 - static_cast<int>(e)) << 23);
}

// True for inf and NaN.
MOE_GRAPH_HD bool nonfinite(float v) { return (float_bits(v) & 0x7F800000u) == 0x7F800000u; }

MOE_GRAPH_HD float e8m0_value(uint8_t e) {
  if (e == 0xFF) return bits_float(0x7FC00000u);
  return e == 0 ? bits_float(0x00400000u) : bits_float(static_cast<uint32_t>(e) << 23);
}

}  // namespace fp8
}  // namespace moe_graph
