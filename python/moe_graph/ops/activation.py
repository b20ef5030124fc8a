"""Fused activation of the expert MLPs: ``expert_activation`` over the native op
``torch.ops.moe_graph.expert_activation`` (C++ on CPU, CUDA kernels on GPU), its fake (meta) implementation and
autograd, and the plain-torch fallback used where the loaded extension has no kernel for the device.

Semantics (also in ``csrc/activation/activation_math.h``). Gated (:data:`GATED_ACTIVATIONS`): ``h [..., 2F]`` is
fc1's output, the gate half ``a`` then the up half ``b``; ``y = act(a, b) * row_scale[..., None]`` with

* ``"swiglu"``: ``act = silu(a) * b``;
* ``"clamped_swiglu"`` (GPT-OSS): ``act = a' * sigmoid(alpha * a') * (b' + 1)``, ``a' = min(a, limit)``,
  ``b' = clamp(b, -limit, limit)``; the clamps pass the gradient inside the closed interval and block it outside;
* ``"limited_swiglu"`` (DeepSeek-V4, GLM5-Next, HY-V4): ``act = silu(a') * b'`` (the same clamps, no alpha, no
  ``+1``).
* ``"post_clamped_swiglu"`` (Step-3.7): ``act = min(silu(a), limit) * b'``: the gate clamped after the activation
  (its gradient passes where ``silu(a) <= limit``), ``b'`` as above;
* ``"softcapped_swiglu"`` (Inkling-2): ``act = cg * tanh(a / cg) * sigmoid(a) * cu * tanh(b / cu)`` with the gate's
  cap ``cg = alpha`` and the up half's ``cu = limit`` (the sigmoid sees the raw gate);
* ``"geglu_tanh"`` (Gemma 4): ``act = gelu_tanh(a) * b``, torch's ``gelu(a, approximate="tanh")``.

Plain (:data:`PLAIN_ACTIVATIONS`): ``h [..., F]``, ``y = act(h) * row_scale[..., None]`` with ``"squared_relu"``
(``relu(h)^2``: Nemotron-H's ``relu2``, Megatron's ``squared_relu``), ``"relu"``, ``"silu"`` or ``"gelu"`` (the
exact, erf GELU).

The math runs in fp32 for bf16/fp16 inputs (fp64 for fp64), each output rounded once to ``h``'s dtype.
``row_scale`` (fp32 or ``h``'s dtype, optional) is the per-row factor the MoE layer uses for the routing
probabilities on the narrow side of the expert MLP; its gradient is ``sum_f grad_y * act`` per row. One launch
forward and one backward; autograd saves ``h`` and ``row_scale`` only. No host sync, capturable.
"""

from __future__ import annotations

from typing import Optional

import torch

from moe_graph.ops._lib import has_kernel, ops

__all__ = ["ACTIVATIONS", "GATED_ACTIVATIONS", "PLAIN_ACTIVATIONS", "expert_activation", "gated_kind",
           "native_available"]

# fc1 holds the gate rows, then the up rows: [2F, H]
GATED_ACTIVATIONS = ("swiglu", "clamped_swiglu", "limited_swiglu", "post_clamped_swiglu", "softcapped_swiglu",
                     "geglu_tanh")
# fc1 holds F rows: [F, H]
PLAIN_ACTIVATIONS = ("gelu", "relu", "silu", "squared_relu")
ACTIVATIONS = GATED_ACTIVATIONS + PLAIN_ACTIVATIONS

_OP = "moe_graph::expert_activation"
_BWD = "moe_graph::expert_activation_backward"


@torch.compiler.assume_constant_result  # fixed per process: traced once by torch.compile
def native_available(device_type: str = "cpu") -> bool:
    """True when the loaded extension has the fused expert activation (forward and backward) for ``device_type``."""
    return has_kernel(_OP, device_type) and has_kernel(_BWD, device_type)


def _torch_activation(h: torch.Tensor, row_scale: Optional[torch.Tensor], activation: str, alpha: float,
                 limit: float) -> torch.Tensor:
    """The same function in plain torch ops (autograd through them): the fallback without a native kernel."""
    x = h if h.dtype == torch.float64 else h.float()
    if activation in PLAIN_ACTIVATIONS:
        fn = {"gelu": torch.nn.functional.gelu, "relu": torch.relu, "silu": torch.nn.functional.silu,
              "squared_relu": lambda v: torch.relu(v).square()}[activation]
        y = fn(x)
        return (y if row_scale is None else y * row_scale[..., None]).to(h.dtype)
    a, b = x.chunk(2, dim=-1)
    if activation == "swiglu":
        y = torch.nn.functional.silu(a) * b
    elif activation == "geglu_tanh":
        y = torch.nn.functional.gelu(a, approximate="tanh") * b
    elif activation == "softcapped_swiglu":
        y = torch.tanh(a / alpha) * alpha * torch.sigmoid(a) * (torch.tanh(b / limit) * limit)
    elif activation == "post_clamped_swiglu":
        y = torch.nn.functional.silu(a).clamp(max=limit) * b.clamp(min=-limit, max=limit)
    else:
        a = a.clamp(max=limit)
        b = b.clamp(min=-limit, max=limit)
        y = (torch.nn.functional.silu(a) * b if activation == "limited_swiglu"
             else a * torch.sigmoid(a * alpha) * (b + 1))
    if row_scale is not None:
        y = y * row_scale[..., None]
    return y.to(h.dtype)


def gated_kind(activation: str) -> bool:
    """True for a gated activation (fc1's output ``[..., 2F]``), False for a plain one (``[..., F]``)."""
    return activation in GATED_ACTIVATIONS


def _check(h: torch.Tensor, row_scale: Optional[torch.Tensor], activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    gated = gated_kind(activation)
    if not isinstance(h, torch.Tensor) or h.dim() < 1 or (gated and h.shape[-1] % 2):
        raise ValueError(f"h must be a tensor {'[..., 2F] (gate half, then up half)' if gated else '[..., F]'} for "
                         f"activation {activation!r}, got "
                         f"{tuple(h.shape) if isinstance(h, torch.Tensor) else type(h).__name__}")
    if not h.dtype.is_floating_point:
        raise TypeError(f"h must be a floating-point tensor, got {h.dtype}")
    if row_scale is None:
        return
    if not isinstance(row_scale, torch.Tensor) or row_scale.shape != h.shape[:-1]:
        raise ValueError(f"row_scale must have shape {tuple(h.shape[:-1])} (one factor per row of h), got "
                         f"{tuple(row_scale.shape) if isinstance(row_scale, torch.Tensor) else type(row_scale).__name__}")
    if row_scale.dtype not in (torch.float32, h.dtype):
        raise TypeError(f"row_scale must have dtype torch.float32 or the dtype of h ({h.dtype}), got {row_scale.dtype}")
    if row_scale.device != h.device:
        raise ValueError(f"row_scale must be on {h.device} (the device of h), got {row_scale.device}")


def expert_activation(h: torch.Tensor, activation: str = "swiglu", row_scale: Optional[torch.Tensor] = None, *,
                     swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0) -> torch.Tensor:
    """``act(h) * row_scale[..., None]``: ``h [..., 2F]`` (gated) or ``[..., F]`` (plain) -> ``[..., F]`` in
    ``h``'s dtype (differentiable w.r.t. ``h`` and ``row_scale``).

    Args:
        h: fc1's output; for a gated activation the gate half, then the up half on the last dimension (a
            non-contiguous ``h`` is copied).
        activation: one of :data:`ACTIVATIONS` (:data:`GATED_ACTIVATIONS`, :data:`PLAIN_ACTIVATIONS`).
        row_scale: ``h.shape[:-1]``, fp32 or ``h``'s dtype, or None (factor 1).
        swiglu_alpha, swiglu_limit: ``"clamped_swiglu"``'s ``alpha`` and ``limit`` (``"limited_swiglu"``,
            ``"post_clamped_swiglu"``: the ``limit``; ``"softcapped_swiglu"``: the gate's cap and the up half's).
    """
    _check(h, row_scale, activation)
    alpha, limit = float(swiglu_alpha), float(swiglu_limit)
    if not native_available(h.device.type):
        return _torch_activation(h, row_scale, activation, alpha, limit)
    lead, w = h.shape[:-1], h.shape[-1]
    h2 = (h.unsqueeze(0) if h.dim() == 1 else h.flatten(0, -2)).contiguous()
    s2 = None if row_scale is None else row_scale.reshape(-1).contiguous()
    return ops.expert_activation(h2, s2, activation, alpha, limit).view(*lead, w // 2 if gated_kind(activation)
                                                                        else w)


def _register() -> None:
    if not native_available():  # pragma: no cover - a build without the op
        return

    @torch.library.register_fake(_OP)
    def _(h, row_scale, activation, alpha, limit):
        torch._check(h.dim() == 2, lambda: "expert_activation: h must be a 2-D tensor [N, 2F] or [N, F]")
        return h.new_empty((h.shape[0], h.shape[1] // 2 if gated_kind(activation) else h.shape[1]))

    @torch.library.register_fake(_BWD)
    def _(grad_y, h, row_scale, activation, alpha, limit, write_grad_h=True):
        grad_scale = row_scale.new_empty((h.shape[0],)) if row_scale is not None else h.new_empty(
            (0,), dtype=torch.float32)
        return (torch.empty_like(h) if write_grad_h else h.new_empty((0,))), grad_scale

    def _setup_context(ctx, inputs, output):
        h, row_scale, activation, alpha, limit = inputs
        ctx.options = (activation, alpha, limit)
        ctx.save_for_backward(h, row_scale)

    def _backward(ctx, grad_y):
        h, row_scale = ctx.saved_tensors
        need_h, need_scale = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if grad_y is None or not (need_h or need_scale):
            return None, None, None, None, None
        grad_h, grad_scale = ops.expert_activation_backward(grad_y.contiguous(), h, row_scale, *ctx.options)
        return (grad_h if need_h else None), (grad_scale if need_scale and row_scale is not None else None), \
            None, None, None

    torch.library.register_autograd(_OP, _backward, setup_context=_setup_context)


_register()
