// Test-only host entry points (grouped_probe.h). The argument probe needs the CuTe/CUTLASS headers (and the CUDA
// headers they include); builds without them (MOE_GRAPH_HAVE_CUTE undefined) raise a clear error instead.
#include "grouped_gemm/grouped_probe.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>

#include "common/torch_checks.h"
#include "grouped_gemm/grouped_plan.h"
#include "grouped_gemm/grouped_spans.h"

#if defined(MOE_GRAPH_HAVE_CUTE)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#include <cutlass/numeric_types.h>

#include "grouped_gemm/grouped_expert_args.h"
#pragma GCC diagnostic pop
#endif

namespace moe_graph {
namespace {

gg::Config to_config(int64_t c) {
  TORCH_CHECK(c >= 0 && c <= static_cast<int64_t>(gg::Config::kSm100OneSmM64), "config must be a gg::Config, got ", c);
  return static_cast<gg::Config>(c);
}

}  // namespace

std::vector<int64_t> grouped_plan_forward_probe(int64_t arch, int64_t rows, int64_t num_experts, int64_t n, int64_t k,
                                                bool has_bias, bool b_is_list, int64_t config) {
  gg::ForwardPlan p;
  try {
    p = gg::plan_forward(static_cast<int>(arch), rows, static_cast<int>(num_experts), n, k, has_bias, b_is_list,
                         to_config(config));
  } catch (const std::runtime_error& e) {
    TORCH_CHECK(false, e.what());
  }
  return {static_cast<int64_t>(p.config), p.run_offsets, p.run_gemm, p.fill_rows, p.zero_tail,
          static_cast<int64_t>(p.offsets_bytes), static_cast<int64_t>(p.ptr_table_bytes),
          static_cast<int64_t>(p.argument_bytes), p.run_rows_fill, p.arg_tail_blocks};
}

std::vector<int64_t> grouped_plan_wgrad_probe(int64_t arch, int64_t rows, int64_t num_experts, int64_t n, int64_t k,
                                              int64_t out_dtype, bool accumulate_all, bool has_mask, bool out_is_list,
                                              int64_t config) {
  gg::WgradPlan p;
  try {
    p = gg::plan_wgrad(static_cast<int>(arch), rows, static_cast<int>(num_experts), n, k,
                       static_cast<gg::DType>(out_dtype), accumulate_all, has_mask, out_is_list, to_config(config));
  } catch (const std::runtime_error& e) {
    TORCH_CHECK(false, e.what());
  }
  return {static_cast<int64_t>(p.config), p.run_offsets, static_cast<int64_t>(p.kernel), p.zero_fill,
          p.zero_fill_all_overwritten, static_cast<int64_t>(p.offsets_bytes), static_cast<int64_t>(p.ptr_table_bytes),
          static_cast<int64_t>(p.argument_bytes)};
}

std::string grouped_config_name_probe(int64_t config) { return gg::config_name(to_config(config)); }

int64_t grouped_effective_sm_count_probe(int64_t sm_count, int64_t carveout, int64_t config) {
  // what a launch of `config` gives CUTLASS (grouped_gemm_ops.cpp, then hardware_info in grouped_launch.cuh)
  return gg::cluster_sm_count(gg::effective_sm_count(static_cast<int>(sm_count), static_cast<int>(carveout)),
                              gg::cluster_size(to_config(config)));
}

#if defined(MOE_GRAPH_HAVE_CUTE)
namespace {

using Elem = cutlass::bfloat16_t;

// Fake, never dereferenced device addresses of the operands' bases (far apart, 16-byte aligned).
template <class T>
T* fake_base(int i) {
  return reinterpret_cast<T*>(static_cast<uintptr_t>(i) << 40);
}
template <class T>
int64_t elem_offset(const T* p, int i) {
  return (reinterpret_cast<intptr_t>(p) - (static_cast<intptr_t>(i) << 40)) / static_cast<intptr_t>(sizeof(T));
}

// The layout of one operand with the args' stride, evaluated at (x, y) (L = 0).
template <class Stride>
int64_t layout_at(int x_extent, int y_extent, const Stride& stride, int64_t x, int64_t y) {
  auto layout = cute::make_layout(cute::make_shape(x_extent, y_extent, 1), stride);
  return static_cast<int64_t>(layout(static_cast<int>(x), static_cast<int>(y), 0));
}

template <class Args>
void evaluate(const Args& r, int ia, int ib, int id, const int64_t* c, int64_t* o) {
  const int M = cute::get<0>(r.shape), N = cute::get<1>(r.shape), K = cute::get<2>(r.shape);
  o[0] = elem_offset(r.a, ia) + layout_at(M, K, r.stride_a, c[1], c[3]);
  o[1] = elem_offset(r.b, ib) + layout_at(N, K, r.stride_b, c[2], c[3]);
  o[2] = elem_offset(r.d, id) + layout_at(M, N, r.stride_d, c[1], c[2]);
  if (r.bias != nullptr)
    o[3] = elem_offset(r.bias, 4) + layout_at(M, N, gg::detail::BiasStride{}, c[1], c[2]);
  else
    o[3] = -1;
}

}  // namespace
#endif

std::tuple<at::Tensor, at::Tensor> grouped_args_probe(const at::Tensor& m_splits, int64_t rows, int64_t n, int64_t k,
                                                      int64_t kind, bool b_list, bool has_bias,
                                                      const at::Tensor& coords) {
#if defined(MOE_GRAPH_HAVE_CUTE)
  const char* op = "_grouped_args_probe";
  check_dtype(m_splits, {at::kLong}, op, "m_splits");
  check_dtype(coords, {at::kLong}, op, "coords");
  TORCH_CHECK(kind >= 0 && kind <= 2, op, ": kind must be 0, 1 or 2");
  auto sp = m_splits.cpu().contiguous();
  auto cc = coords.cpu().contiguous();
  const int E = static_cast<int>(sp.size(0));
  const int64_t* s = sp.data_ptr<int64_t>();
  auto shapes = at::zeros({E, 3}, at::kLong);
  auto offsets = at::zeros({cc.size(0), 4}, at::kLong);
  int64_t* sh = shapes.data_ptr<int64_t>();
  // per-expert pointer table (b for forward, out for wgrad): expert e at (E - 1 - e) * n * k
  std::vector<const void*> table(E);
  const int tbl_base = kind == 2 ? 3 : 2;
  for (int e = 0; e < E; ++e) table[e] = fake_base<Elem>(tbl_base) + static_cast<int64_t>(E - 1 - e) * n * k;
  const void* const* tp = b_list ? table.data() : nullptr;

  // Spans exactly as the argument kernel's scan computes them (grouped_spans.h), then the shared per-expert
  // function; the results per expert are kept to evaluate the sampled coordinates.
  using Fwd0 = gg::detail::ExpertArgs<gg::detail::ForwardTags<true>, Elem, Elem, Elem>;
  using Fwd1 = gg::detail::ExpertArgs<gg::detail::ForwardTags<false>, Elem, Elem, Elem>;
  using Wg = gg::detail::ExpertArgs<gg::detail::WgradTags, Elem, Elem, Elem>;
  std::vector<Fwd0> f0;
  std::vector<Fwd1> f1;
  std::vector<Wg> wg;
  int64_t begin = 0;
  for (int e = 0; e < E; ++e) {
    bool neg, cut;
    const int64_t m = gg::clamp_split(s[e], rows, &neg);
    const gg::ExpertSpan span = gg::expert_span(begin, m, rows, &cut);
    begin = std::min(begin + m, rows + 1);
    const int ni = static_cast<int>(n), ki = static_cast<int>(k);
    Elem* bias = has_bias ? fake_base<Elem>(4) : nullptr;
    cute::Shape<int, int, int> shape;
    if (kind == 0) {
      f0.push_back(gg::detail::forward_expert_args<true>(e, span.start, span.count, ni, ki, fake_base<Elem>(1),
                                                         fake_base<Elem>(2), n * k, tp, fake_base<Elem>(3), bias));
      shape = f0.back().shape;
    } else if (kind == 1) {
      f1.push_back(gg::detail::forward_expert_args<false>(e, span.start, span.count, ni, ki, fake_base<Elem>(1),
                                                          fake_base<Elem>(2), n * k, tp, fake_base<Elem>(3), bias));
      shape = f1.back().shape;
    } else {
      wg.push_back(gg::detail::wgrad_expert_args(e, span.start, span.count, ni, ki, fake_base<Elem>(1),
                                                 fake_base<Elem>(2), fake_base<Elem>(3), n * k, tp));
      shape = wg.back().shape;
    }
    sh[3 * e + 0] = cute::get<0>(shape);
    sh[3 * e + 1] = cute::get<1>(shape);
    sh[3 * e + 2] = cute::get<2>(shape);
  }
  const int64_t* c = cc.data_ptr<int64_t>();
  int64_t* o = offsets.data_ptr<int64_t>();
  for (int64_t i = 0; i < cc.size(0); ++i) {
    const int64_t e = c[4 * i];
    TORCH_CHECK(e >= 0 && e < E, op, ": coords[", i, "] names expert ", e);
    // operand bases: A = 1, B = 2, D = 3 (table entries keep the base of the tensor they point into)
    if (kind == 0)
      evaluate(f0[e], 1, 2, 3, c + 4 * i, o + 4 * i);
    else if (kind == 1)
      evaluate(f1[e], 1, 2, 3, c + 4 * i, o + 4 * i);
    else
      evaluate(wg[e], 1, 2, 3, c + 4 * i, o + 4 * i);
  }
  return {shapes, offsets};
#else
  (void)m_splits, (void)rows, (void)n, (void)k, (void)kind, (void)b_list, (void)has_bias, (void)coords;
  TORCH_CHECK(false, "_grouped_args_probe: this build has no CuTe headers (install nvidia-cutlass and the CUDA "
                     "headers, then rebuild)");
#endif
}

}  // namespace moe_graph
