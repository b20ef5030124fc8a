"""Multi-process worker for the FP8-dispatch tests (gloo, ``run_distributed``): on each EP rank, one MoE layer with
``fp8_dispatch=True`` against the same layer without it (16-bit dispatch, the experts quantizing their input) and
against that layer fed the tokens after a rowwise quantize-dequantize by the TE-reference quantizer."""

from __future__ import annotations

from typing import Dict, Optional

import torch

import moe_graph
import moe_graph.moe.experts as experts
from helpers import fp8_reference as ref
from moe_graph.moe.layer import MoELayer


def rowwise_qdq(x: torch.Tensor, kind: str) -> torch.Tensor:
    """fp32 ``x [T, H]`` quantized rowwise as the recipe's forward tiles by the TE-reference quantizers
    (``Float8BlockScaling``: 1x128 tiles, power-of-two fp32 scales; MXFP8: 1x32, E8M0), dequantized."""
    T, H = x.shape
    if kind == "mxfp8":
        q, e = ref.quantize_mxfp8(x.contiguous(), torch.float8_e4m3fn)
        s = torch.exp2(e.view(torch.uint8).float() - 127).repeat_interleave(32, 1)[:, :H]
    else:
        q, s = ref.quantize_tiles(x, torch.float8_e4m3fn, 1, 128, pow2_scales=True)
        s = s.float().repeat_interleave(128, 1)[:, :H]
    return q.float() * s


def _run(layer: MoELayer, x: torch.Tensor, target: torch.Tensor, kind: str):
    xx = x.clone().requires_grad_()
    with moe_graph.fp8.autocast(recipe=kind):
        y = layer(xx)
    (y * target).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    layer.zero_grad(set_to_none=True)
    return y.detach(), xx.grad, grads


def fp8_dispatch_worker(rank: int, world: int, kind: str, exchange: str, capacity_factor: Optional[float],
                        spare: int, hidden: int, recompute: bool = False) -> Dict:
    torch.manual_seed(7)  # the same router and expert init on every rank; experts differ by rank below
    E, K, T = 4 * world, 2, 29
    kw = dict(ep_size=world, capacity_factor=capacity_factor, exchange=exchange, num_spare_experts_per_ep_rank=spare,
              device="cpu", recompute=recompute)
    base = MoELayer(hidden, 64, E, K, **kw)
    with torch.no_grad():
        base.router.weight[0] += 0.3  # expert 0 is busy: drops under a capacity, work for echo
        for p in base.experts.parameters():
            p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(100 + rank))
    fd = MoELayer(hidden, 64, E, K, fp8_dispatch=True, **kw)
    fd.load_state_dict(base.state_dict())
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(T, hidden, generator=g) * torch.logspace(-2, 2, hidden)  # row scales vary along the tiles
    target = torch.randn(T, hidden, generator=g)
    y0, dx0, g0 = _run(base, x, target, kind)
    y1, dx1, g1 = _run(fd, x, target, kind)
    # the experts read the tokens' rowwise FP8 copy: the 16-bit layer whose experts get their rows after a
    # rowwise quantize-dequantize (straight through), which their own quantization reproduces bit for bit, gives
    # the weight gradient of fc1 (its columnwise copy from the dequantized rows)
    hook = base.experts.register_forward_pre_hook(
        lambda mod, args: (args[0] + (rowwise_qdq(args[0].detach(), kind) - args[0]).detach(),) + args[1:])
    fused, experts.FUSED_FP8_EXPERT_INPUT = experts.FUSED_FP8_EXPERT_INPUT, False  # the hook takes 16-bit rows
    y2, _, g2 = _run(base, x, target, kind)
    experts.FUSED_FP8_EXPERT_INPUT = fused
    hook.remove()
    return {
        "out_equal": torch.equal(y0, y1), "dx_equal": torch.equal(dx0, dx1),
        "equal_grads": sorted(n for n in g0 if torch.equal(g0[n], g1[n])),
        "grads": sorted(g0),
        "out_vs_qdq": float((y1 - y2).abs().max()),
        "fc1_vs_qdq": float((g1["experts.fc1.weight"] - g2["experts.fc1.weight"]).abs().max()),
        "fc1_scale": float(g2["experts.fc1.weight"].abs().max()),
        "fc1_vs_16bit_dispatch": float((g1["experts.fc1.weight"] - g0["experts.fc1.weight"]).abs().max()),
        "dropped": base.dispatcher.check_drops(), "rows": int(fd.last_m_splits.sum()),
    }
