// CPU implementation of the fused gated activation (semantics in activation.h). Torch-free: one pass over each
// row, the row's scale gradient summed in the math type in column order.
#include "activation/activation.h"

namespace moe_graph {
namespace activation {
namespace {

template <GatedKind K, typename T, typename S>
void forward_rows(const GatedProblem& p, int64_t r0, int64_t r1) {
  using A = acc_t<T>;
  const int64_t F = p.cols;
  const A alpha = static_cast<A>(p.alpha), limit = static_cast<A>(p.limit);
  const T* h = static_cast<const T*>(p.h);
  const S* scale = static_cast<const S*>(p.scale);
  T* y = static_cast<T*>(p.y);
  for (int64_t r = r0; r < r1; ++r) {
    const T* a = h + r * 2 * F;
    const T* b = a + F;
    T* out = y + r * F;
    const A s = scale ? static_cast<A>(widen(scale[r])) : A(1);
    for (int64_t f = 0; f < F; ++f)
      out[f] = Narrow<T>::to(gated_value<K, A>(widen(a[f]), widen(b[f]), alpha, limit) * s);
  }
}

template <GatedKind K, typename T, typename S>
void backward_rows(const GatedProblem& p, int64_t r0, int64_t r1) {
  using A = acc_t<T>;
  const int64_t F = p.cols;
  const A alpha = static_cast<A>(p.alpha), limit = static_cast<A>(p.limit);
  const T* h = static_cast<const T*>(p.h);
  const T* dy = static_cast<const T*>(p.grad_y);
  const S* scale = static_cast<const S*>(p.scale);
  T* dh = static_cast<T*>(p.grad_h);
  S* ds = static_cast<S*>(p.grad_scale);
  for (int64_t r = r0; r < r1; ++r) {
    const T* a = h + r * 2 * F;
    const T* b = a + F;
    const T* g = dy + r * F;
    T* da = dh + r * 2 * F;
    T* db = da + F;
    const A s = scale ? static_cast<A>(widen(scale[r])) : A(1);
    A dot = A(0);
    for (int64_t f = 0; f < F; ++f) {
      const GatedGrad<A> d = gated_grad<K, A>(widen(a[f]), widen(b[f]), alpha, limit);
      const A gv = static_cast<A>(widen(g[f]));
      const A gs = gv * s;
      da[f] = Narrow<T>::to(gs * d.d_a);
      db[f] = Narrow<T>::to(gs * d.d_b);
      dot += gv * d.act;
    }
    if (ds) ds[r] = Narrow<S>::to(dot);
  }
}

}  // namespace

void gated_forward_rows(const GatedProblem& p, int64_t r0, int64_t r1) {
  dispatch_gated(p, [&](auto kind, auto t, auto s) {
    forward_rows<decltype(kind)::value, typename decltype(t)::type, typename decltype(s)::type>(p, r0, r1);
  });
}

void gated_backward_rows(const GatedProblem& p, int64_t r0, int64_t r1) {
  dispatch_gated(p, [&](auto kind, auto t, auto s) {
    backward_rows<decltype(kind)::value, typename decltype(t)::type, typename decltype(s)::type>(p, r0, r1);
  });
}

}  // namespace activation
}  // namespace moe_graph
