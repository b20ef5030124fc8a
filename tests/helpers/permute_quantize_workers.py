"""Workers of tests/test_fp8_permute_quantize.py's EP 2 case (an ``MoELayer`` on the fixed-split exchange with the
fused FP8 expert input, the receive side's regrouping writes the FP8 copies, on and off) and of
tests/test_fp8_combine_backward.py's EP 2 / 4 cases (the regrouping of the combine's returned gradient writes fc2's
FP8 dy, on and off)."""

from __future__ import annotations

import contextlib
from typing import Dict, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import moe_graph
import moe_graph.moe.experts as experts
from helpers.aligned_dispatch_workers import busy_expert_layer
from moe_graph.moe.layer import MoELayer


class OpNames(TorchDispatchMode):
    """The names of the ops that reach the dispatcher (``aten.mm``, ``moe_graph.expand_rows``, ...)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def run_switched(layer: MoELayer, x: torch.Tensor, target: torch.Tensor, kind: str, fused: bool,
                 switch: str = "FUSED_FP8_EXPERT_INPUT", record: str = "forward", extra_loss=None):
    """``(output, input gradient, {name: gradient}, op names)`` of one forward and backward under the FP8 ``kind``
    recipe with ``experts.<switch> = fused`` (restored after); the op names of the ``record`` pass ("forward" or
    "backward"); ``extra_loss()``: a term added to the loss (evaluated after the forward)."""
    before = getattr(experts, switch)
    setattr(experts, switch, fused)
    mode = OpNames()
    try:
        xx = x.clone().requires_grad_()
        with moe_graph.fp8.autocast(recipe=kind):
            with mode if record == "forward" else contextlib.nullcontext():
                y = layer(xx)
        with mode if record == "backward" else contextlib.nullcontext():
            ((y.float() * target).sum() + (0 if extra_loss is None else extra_loss())).backward()
    finally:
        setattr(experts, switch, before)
    grads = {n: (p.main_grad if hasattr(p, "main_grad") else p.grad).clone() for n, p in layer.named_parameters()
             if p.grad is not None or hasattr(p, "main_grad")}
    layer.zero_grad(set_to_none=True)
    for p in layer.parameters():
        if hasattr(p, "main_grad"):
            p.main_grad.zero_()
    return y.detach(), xx.grad, grads, mode.seen


def layer_case(hidden: int, ffn: int, dtype: torch.dtype, case: str, main_grad: bool):
    """``(layer, x, target)`` of the switched-layer tests: ``case`` "few_tokens" (16 experts, 5 tokens: most get
    none), "one_expert" (the router sends every token to experts 3 and 1), else 6 experts and 37 tokens;
    ``main_grad``: fp32 ``main_grad`` on the expert weights (the fused wgrad)."""
    E, T = (16, 5) if case == "few_tokens" else (6, 37)
    layer = MoELayer(hidden, ffn, E, 2, params_dtype=dtype)
    if case == "one_expert":
        with torch.no_grad():
            layer.router.weight.zero_()
            layer.router.weight[3] = 1.0
            layer.router.weight[1] = 0.5
    if main_grad:
        for w in layer.experts.weights():
            w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
    x = torch.randn(T, hidden, dtype=dtype)
    if case == "one_expert":
        x = x.abs() + 0.1
    return layer, x, torch.randn(T, hidden)


def fused_input_worker(rank: int, world: int, kind: str, capacity_factor: Optional[float]) -> Dict:
    layer, x, target = busy_expert_layer(rank, world, capacity_factor, exchange="nccl")
    y0, dx0, g0, ops0 = run_switched(layer, x, target, kind, False)
    y1, dx1, g1, ops1 = run_switched(layer, x, target, kind, True)
    return {"out_equal": torch.equal(y0, y1), "dx_equal": torch.equal(dx0, dx1),
            "unequal_grads": sorted(n for n in g0 if not torch.equal(g0[n], g1[n])), "grads": sorted(g0),
            "fused_ops": ops1.count("moe_graph.expand_quantize_pair"),
            "unfused_ops": ops0.count("moe_graph.expand_quantize_pair"),
            "expand_rows_saved": ops0.count("moe_graph.expand_rows") - ops1.count("moe_graph.expand_rows"),
            "quantize_saved": ops0.count("moe_graph.fp8_quantize_pair") - ops1.count("moe_graph.fp8_quantize_pair"),
            "exchanges_added": sum(o.startswith("c10d.") for o in ops1) - sum(o.startswith("c10d.") for o in ops0),
            "dx_nonzero": bool(dx1.abs().sum() > 0), "dropped": layer.dispatcher.check_drops()}


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes (bit-for-bit comparison that holds with NaN; -0 and +0 differ)."""
    return t.detach().contiguous().view(torch.uint8)


def combine_backward_worker(rank: int, world: int, kind: str, capacity_factor: Optional[float], dtype: str,
                            case: str, exchange: str = "nccl") -> Dict:
    """EP ``world`` on ``exchange`` ("nccl": fixed-split; "symm_mem": the host-sized per-destination exchange;
    "symm_fake": ``SymmMemExchange`` on ``helpers.symm_mem_fake``): one forward and backward with
    ``FUSED_FP8_COMBINE_BACKWARD`` off and on. ``dtype`` "bfloat16" / "float32" (parameters and tokens); ``case``: "plain", "one_expert" (the router
    sends every token to experts 3 and 1, both on rank 0: the other ranks' experts get none), "signed_zeros" (-0 in
    the output gradient at every third token, every fifth column), "nonfinite" (also an inf and a NaN), "main_grad"
    (fp32 ``main_grad`` on the expert weights: the fused wgrad), "second_consumer" (fc2's output also feeds another
    loss term: the hand-off falls back to the 16-bit gradient, sent again). Bit-for-bit comparison of the output, the input
    gradient and every parameter gradient (the router's carries the probabilities')."""
    dt = getattr(torch, dtype)
    layer, x, target = busy_expert_layer(rank, world, capacity_factor, params_dtype=dt,
                                         exchange="symm_mem" if exchange == "symm_fake" else exchange)
    if exchange == "symm_fake":
        from helpers import symm_mem_fake
        symm_mem_fake.install(layer)
    x = x.to(dt)
    if case == "one_expert":
        with torch.no_grad():
            layer.router.weight.zero_()
            layer.router.weight[3] = 1.0
            layer.router.weight[1] = 0.5
        x = x.abs() + 0.1
    if case in ("signed_zeros", "nonfinite"):
        target[::3, ::5] = -0.0
    if case == "nonfinite":
        target[4, 7], target[9, 40] = float("inf"), float("nan")
    if case == "main_grad":
        for w in layer.experts.weights():
            w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
    extra_loss = None
    if case == "second_consumer":  # fc2's output (the experts' output, aligned rows) also feeds another loss term
        seen = []
        layer.experts.register_forward_hook(lambda m, a, out: seen.append(out))

        def extra_loss():
            out = seen.pop()
            g = torch.Generator().manual_seed(rank + 5)
            return (out.float() * torch.randn(out.shape, generator=g)).sum()
    y0, dx0, g0, ops0 = run_switched(layer, x, target, kind, False, switch="FUSED_FP8_COMBINE_BACKWARD",
                                     record="backward", extra_loss=extra_loss)
    y1, dx1, g1, ops1 = run_switched(layer, x, target, kind, True, switch="FUSED_FP8_COMBINE_BACKWARD",
                                     record="backward", extra_loss=extra_loss)
    return {"out_equal": torch.equal(bits(y0), bits(y1)), "dx_equal": torch.equal(bits(dx0), bits(dx1)),
            "unequal_grads": sorted(n for n in g0 if not torch.equal(bits(g0[n]), bits(g1[n]))),
            "grads": sorted(g0), "grads_on": sorted(g1),
            "nonzero": [n for n in g1 if bool((g1[n] != 0).any())], "dx_nonzero": bool((dx1 != 0).any()),
            "fused_ops": ops1.count("moe_graph.expand_quantize_pair") - ops0.count("moe_graph.expand_quantize_pair"),
            "reduce_rows_saved": ops0.count("moe_graph.reduce_rows") - ops1.count("moe_graph.reduce_rows"),
            "quantize_saved": ops0.count("moe_graph.fp8_quantize_pair") - ops1.count("moe_graph.fp8_quantize_pair"),
            "exchanges_added": sum(o.startswith("c10d.") for o in ops1) - sum(o.startswith("c10d.") for o in ops0),
            "dropped": layer.dispatcher.check_drops()}
