// CPU implementation of the fused expert activation (semantics in activation.h). Torch-free: one pass over each
// row, the row's scale gradient summed in the math type in column order.
#include "activation/activation.h"

namespace moe_graph {
namespace activation {
namespace {

template <ActKind K, typename T, typename S>
void forward_rows(const ActivationProblem& p, int64_t r0, int64_t r1) {
  using A = acc_t<T>;
  const int64_t F = p.cols;
  const A alpha = static_cast<A>(p.alpha), limit = static_cast<A>(p.limit);
  const T* h = static_cast<const T*>(p.h);
  const S* scale = static_cast<const S*>(p.scale);
  T* y = static_cast<T*>(p.y);
  constexpr int64_t kWidth = is_gated(K) ? 2 : 1;  // h's columns per output column
  for (int64_t r = r0; r < r1; ++r) {
    const T* a = h + r * kWidth * F;
    T* out = y + r * F;
    const A s = scale ? static_cast<A>(widen(scale[r])) : A(1);
    if constexpr (is_gated(K)) {
      const T* b = a + F;
      for (int64_t f = 0; f < F; ++f)
        out[f] = Narrow<T>::to(gated_value<K, A>(widen(a[f]), widen(b[f]), alpha, limit) * s);
    } else {
      for (int64_t f = 0; f < F; ++f) out[f] = Narrow<T>::to(plain_value<K, A>(widen(a[f])) * s);
    }
  }
}

template <ActKind K, typename T, typename S>
void backward_rows(const ActivationProblem& p, int64_t r0, int64_t r1) {
  using A = acc_t<T>;
  const int64_t F = p.cols;
  const A alpha = static_cast<A>(p.alpha), limit = static_cast<A>(p.limit);
  const T* h = static_cast<const T*>(p.h);
  const T* dy = static_cast<const T*>(p.grad_y);
  const S* scale = static_cast<const S*>(p.scale);
  T* dh = static_cast<T*>(p.grad_h);
  S* ds = static_cast<S*>(p.grad_scale);
  constexpr int64_t kWidth = is_gated(K) ? 2 : 1;
  for (int64_t r = r0; r < r1; ++r) {
    const T* a = h + r * kWidth * F;
    const T* g = dy + r * F;
    T* da = dh ? dh + r * kWidth * F : nullptr;  // nullptr: the scale gradient only
    const A s = scale ? static_cast<A>(widen(scale[r])) : A(1);
    A dot = A(0);
    for (int64_t f = 0; f < F; ++f) {
      const A gv = static_cast<A>(widen(g[f]));
      const A gs = gv * s;
      if constexpr (is_gated(K)) {
        const GatedGrad<A> d = gated_grad<K, A>(widen(a[f]), widen(a[F + f]), alpha, limit);
        if (da) {
          da[f] = Narrow<T>::to(gs * d.d_a);
          da[F + f] = Narrow<T>::to(gs * d.d_b);
        }
        dot += gv * d.act;
      } else {
        const PlainGrad<A> d = plain_grad<K, A>(widen(a[f]));
        if (da) da[f] = Narrow<T>::to(gs * d.d_a);
        dot += gv * d.act;
      }
    }
    if (ds) ds[r] = Narrow<S>::to(dot);
  }
}

}  // namespace

void activation_forward_rows(const ActivationProblem& p, int64_t r0, int64_t r1) {
  dispatch_activation(p, [&](auto kind, auto t, auto s) {
    forward_rows<decltype(kind)::value, typename decltype(t)::type, typename decltype(s)::type>(p, r0, r1);
  });
}

void activation_backward_rows(const ActivationProblem& p, int64_t r0, int64_t r1) {
  dispatch_activation(p, [&](auto kind, auto t, auto s) {
    backward_rows<decltype(kind)::value, typename decltype(t)::type, typename decltype(s)::type>(p, r0, r1);
  });
}

}  // namespace activation
}  // namespace moe_graph
