"""Fused ``main_grad`` weight gradients under ``torch.autograd.graph.saved_tensors_hooks``: activation offloading
(``save_on_cpu``) unpacks every saved tensor as a new tensor, without the attributes of the parameter it was saved
from (``main_grad``, ``grad_added_to_main_grad``). GroupedLinear and MoELayer (echo off and on) under moe_graph's
DistributedDataParallel must give the gradients of a float64 plain-PyTorch reference with and without offloading.
"""

import pytest
import torch

from moe_graph.distributed.ddp import DistributedDataParallel
from moe_graph.grouped_linear import GroupedLinear
from moe_graph.moe.layer import MoELayer
from moe_graph.testing.moe_reference import dense_moe_reference, reference_route


class _Unwrapping(torch.autograd.graph.saved_tensors_hooks):
    """Like save_on_cpu on a CPU-only machine (where it keeps tensors in place): every unpack returns a new tensor
    object (a detached alias of the saved data), as an offloaded copy would be."""

    def __init__(self):
        self.unpacked = 0

        def unpack(t):
            self.unpacked += 1
            return t.detach()

        super().__init__(lambda t: t, unpack)


def _hooks(kind):
    return torch.autograd.graph.save_on_cpu(pin_memory=False) if kind == "save_on_cpu" else _Unwrapping()


def _grouped_linear_reference(x, splits, weights, bias, g):
    """Per-expert ``x_e @ W_e^T + b_e`` in float64: (input grad, weight grads, bias grads)."""
    x = x.double().requires_grad_()
    ws = [w.detach().double().requires_grad_() for w in weights]
    bs = [b.detach().double().requires_grad_() for b in bias]
    outs, start = [], 0
    for e, m in enumerate(splits):
        outs.append(x[start:start + m] @ ws[e].t() + bs[e])
        start += m
    torch.cat(outs).backward(g.double())
    return x.grad, [w.grad for w in ws], [b.grad for b in bs]


@pytest.mark.parametrize("hooks", ["save_on_cpu", "unwrapping"])
@pytest.mark.parametrize("single", [False, True])
@pytest.mark.parametrize("delay", [False, True])
def test_grouped_linear_fused_main_grad_under_saved_tensor_hooks(gen, hooks, single, delay):
    E, fin, fout, splits = 4, 24, 16, [5, 0, 7, 3]
    lin = GroupedLinear(E, fin, fout, bias=True, device="cpu", single_grouped_weight=single,
                        fuse_wgrad_accumulation=True, delay_wgrad_compute=delay)
    with torch.no_grad():
        for p in lin.parameters():
            p.normal_(generator=gen)
    ddp = DistributedDataParallel(lin)
    weights = [w[e] for w in lin._weights() for e in range(E)] if single else lin._weights()
    biases = [b[e] for b in lin._biases() for e in range(E)] if single else lin._biases()
    ref_x, ref_w, ref_b = None, None, None
    ddp.zero_grad_buffer()
    for step in range(2):  # two microbatches: main_grad accumulates
        x = torch.randn(sum(splits), fin, generator=gen, requires_grad=True)
        g = torch.randn(sum(splits), fout, generator=gen)
        ctx = _hooks(hooks)
        with ctx:
            y = ddp(x, torch.tensor(splits))
        y.backward(g)
        if delay:
            lin.backward_dw()
        if hooks == "unwrapping":
            assert ctx.unpacked > 0  # the hooks were in the way of every saved tensor
        rx, rw, rb = _grouped_linear_reference(x.detach(), splits, [w.detach() for w in weights],
                                               [b.detach() for b in biases], g)
        ref_x = rx
        ref_w = rw if ref_w is None else [a + b for a, b in zip(ref_w, rw)]
        ref_b = rb if ref_b is None else [a + b for a, b in zip(ref_b, rb)]
        torch.testing.assert_close(x.grad.double(), ref_x, rtol=1e-5, atol=1e-5)
    ddp.finish_grad_sync()
    mains = [lin.weight.main_grad[e] for e in range(E)] if single else [w.main_grad for w in lin._weights()]
    for e in range(E):
        torch.testing.assert_close(mains[e].double(), ref_w[e], rtol=1e-5, atol=1e-5)
    bias_mains = [lin.bias.main_grad[e] for e in range(E)] if single else [b.main_grad for b in lin._biases()]
    for e in range(E):
        torch.testing.assert_close(bias_mains[e].double(), ref_b[e], rtol=1e-5, atol=1e-5)
    assert all(w.grad_added_to_main_grad for w in lin._weights())


@pytest.mark.parametrize("hooks", ["save_on_cpu", "unwrapping"])
@pytest.mark.parametrize("spare", [0, 1])
def test_moe_layer_fused_main_grad_under_saved_tensor_hooks(gen, hooks, spare):
    H, Fh, E, K, T = 16, 12, 4, 2, 10
    torch.manual_seed(0)
    layer = MoELayer(H, Fh, E, K, num_spare_experts_per_ep_rank=spare, device="cpu", params_dtype=torch.float32)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(generator=gen)
            p.mul_(0.3)
    ddp = DistributedDataParallel(layer)
    ddp.zero_grad_buffer()
    x = torch.randn(T, H, generator=gen)
    g = torch.randn(T, H, generator=gen)
    xm = x.clone().requires_grad_()
    ctx = _hooks(hooks)
    with ctx:
        out = ddp(xm)
    out.backward(g)
    ddp.finish_grad_sync()
    assert layer.experts.uses_fused_wgrad()  # the fused path ran: DDP attached main_grad to both expert weights
    if hooks == "unwrapping":
        assert ctx.unpacked > 0

    # float64 reference: the router and every token through its experts one at a time
    w1 = layer.experts.fc1.weight.detach().double().requires_grad_()
    w2 = layer.experts.fc2.weight.detach().double().requires_grad_()
    gate = layer.router.weight.detach().double().requires_grad_()
    xr = x.double().requires_grad_()
    idx, probs, _ = reference_route(xr, gate, K)
    dense_moe_reference(xr, idx, probs, w1, w2, "swiglu").backward(g.double())
    torch.testing.assert_close(out.detach().double(), dense_moe_reference(x.double(), idx, probs.detach(),
                                                                          w1.detach(), w2.detach()),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xm.grad.double(), xr.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.experts.fc1.weight.main_grad.double(), w1.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.experts.fc2.weight.main_grad.double(), w2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.router.weight.main_grad.double(), gate.grad, rtol=1e-5, atol=1e-5)
    assert layer.experts.fc1.weight.grad_added_to_main_grad and layer.experts.fc2.weight.grad_added_to_main_grad
