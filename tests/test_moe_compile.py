"""``torch.compile(MoELayer, fullgraph=True)`` with the router losses on (aux loss of each type and z-loss): one
graph without breaks (``fullgraph=True`` raises on any), and the compiled layer's outputs, gradients of the input and
of every parameter, statistics and expert-bias counts equal the eager layer's over several training steps. CPU,
``backend="aot_eager"`` (AOTAutograd's forward/backward graphs run by eager kernels; inductor's C++ compile is too
slow for this machine's test budget). Echo is covered on the autograd ``.grad`` path; the fused ``main_grad`` path
sets ``grad_added_to_main_grad`` on the parameter in backward, which dynamo cannot trace (as TransformerEngine's)."""

import pytest
import torch

from moe_graph.moe.layer import MoELayer

DT = torch.float64
TOL = dict(rtol=1e-12, atol=1e-12)

_QWEN3 = dict(score_func="softmax", norm_topk_prob=True)  # probabilities: softmax of the top-k logits
_DEEPSEEK = dict(score_func="sigmoid", num_groups=4, group_topk=2, topk_scaling_factor=2.5, enable_expert_bias=True,
                 shared_expert_ffn_size=6, shared_expert_gate=True)
CASES = {
    "qwen3_local": (_QWEN3, "local", False),
    "qwen3_global_padding": (_QWEN3, "global", True),
    "deepseek_sequence_padding": (_DEEPSEEK, "sequence", True),
    "mixtral_local_capacity": (dict(score_func="softmax", norm_topk_prob=True, capacity_factor=1.0), "local", False),
    "softmax_unnormalized_local": (dict(score_func="softmax"), "local", True),
    # echo: plan, index reroute, spare weights and their gradients sent home (autograd .grad path)
    "qwen3_echo1_local": (dict(_QWEN3, num_spare_experts_per_ep_rank=1), "local", False),
}


def _layer(options, aux_type):
    torch.manual_seed(0)
    layer = MoELayer(8, 6, 8, 2, device="cpu", params_dtype=DT, init_std=0.4, aux_loss_coeff=0.05,
                     aux_loss_type=aux_type, z_loss_coeff=0.01, **options)
    with torch.no_grad():
        layer.router.weight.normal_(0, 1.0)
    return layer


@pytest.mark.parametrize("case", list(CASES))
def test_fullgraph_compile_with_router_losses_matches_eager(gen, case):
    options, aux_type, padded = CASES[case]
    eager, comp = _layer(options, aux_type), _layer(options, aux_type)
    compiled = torch.compile(comp, backend="aot_eager", fullgraph=True)
    B, S = 3, 7
    pad = None
    if padded:
        pad = torch.zeros(B, S, dtype=torch.bool)
        pad[0, 5:] = True
        pad[2, 1:] = True
    for step in range(3):
        x = torch.randn(B, S, 8, generator=gen, dtype=DT)
        target = torch.randn(B, S, 8, generator=gen, dtype=DT)
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        ye, yc = eager(xe, padding_mask=pad), compiled(xc, padding_mask=pad)
        torch.testing.assert_close(yc, ye, **TOL)
        (ye * target).sum().backward()
        (yc * target).sum().backward()
        torch.testing.assert_close(xc.grad, xe.grad, **TOL)
        for (name, p), q in zip(eager.named_parameters(), comp.parameters()):
            torch.testing.assert_close(q.grad, p.grad, **TOL, msg=lambda m: f"step {step} {name}: {m}")
        for key, value in eager.statistics().items():
            torch.testing.assert_close(comp.statistics()[key], value, **TOL, msg=lambda m: f"{key}: {m}")
        assert float(eager.last_aux_loss) > 0 and float(eager.last_z_loss) > 0
    if eager.router.enable_expert_bias:
        assert torch.equal(comp.router.local_tokens_per_expert, eager.router.local_tokens_per_expert)
        assert float(eager.router.local_tokens_per_expert.sum()) == 3 * 2 * int((~pad).sum())
