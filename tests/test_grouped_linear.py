"""GroupedLinear (TransformerEngine drop-in) on CPU: math, TE state-dict layout, fused main_grad accumulation."""

import pytest
import torch

from moe_graph import GroupedLinear
from moe_graph.testing.grouped_gemm_ref import rel_err


def _ref_forward(layer, x, splits):
    ws = layer._weights()
    W = ws[0] if layer.single_grouped_weight else torch.stack(ws)
    bs = layer._biases()
    outs, s = [], 0
    for e, c in enumerate(splits):
        y = x[s : s + c].double() @ W[e].double().t()
        if bs is not None:
            b = bs[0][e] if layer.single_grouped_weight else bs[e]
            y = y + b.double()
        outs.append(y)
        s += c
    return torch.cat(outs + [torch.zeros(x.shape[0] - s, W.shape[1], dtype=torch.float64)])


@pytest.mark.parametrize("single", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_forward_backward(gen, single, bias):
    E, fin, fout = 4, 24, 16
    layer = GroupedLinear(E, fin, fout, bias=bias, device="cpu", params_dtype=torch.float32, single_grouped_weight=single)
    if bias:  # non-zero biases so that the test sees them
        with torch.no_grad():
            for b in layer._biases():
                b.normal_(generator=gen)
    splits = [5, 0, 7, 3]
    x = torch.randn(2, 9, fin, generator=gen, requires_grad=True)  # leading dims are flattened (18 rows)
    y = layer(x, torch.tensor(splits))
    assert y.shape == (2, 9, fout)
    ref = _ref_forward(layer, x.detach().reshape(-1, fin), splits)
    assert rel_err(y.reshape(-1, fout), ref) < 1e-5
    y.sum().backward()
    names = [n for n, _ in layer.named_parameters()]
    assert names == (["weight"] + (["bias"] if bias else []) if single else sum(([f"weight{e}"] + ([f"bias{e}"] if bias else []) for e in range(E)), []))
    xs = x.detach().reshape(-1, fin)
    w_grad = layer.weight.grad if single else torch.stack([getattr(layer, f"weight{e}").grad for e in range(E)])
    s = 0
    for e, c in enumerate(splits):
        torch.testing.assert_close(w_grad[e], torch.ones(fout, c) @ xs[s : s + c], rtol=1e-5, atol=1e-5)
        s += c
    assert torch.all(x.grad.reshape(-1, fin)[15:] == 0)


def test_list_and_tensor_splits_agree(gen):
    layer = GroupedLinear(3, 8, 8, device="cpu")
    x = torch.randn(10, 8, generator=gen)
    torch.testing.assert_close(layer(x, [3, 3, 4]), layer(x, torch.tensor([3, 3, 4], dtype=torch.int32)))


def test_fuse_wgrad_accumulation_into_main_grad(gen):
    E, fin, fout = 3, 16, 8
    layer = GroupedLinear(E, fin, fout, bias=False, device="cpu", params_dtype=torch.bfloat16, fuse_wgrad_accumulation=True)
    ws = layer._weights()
    init = [torch.randn(fout, fin, generator=gen) for _ in ws]
    for w, i in zip(ws, init):
        w.main_grad = i.clone()  # fp32, as Megatron's grad buffer
    splits = [4, 0, 6]
    x = torch.randn(12, fin, generator=gen).bfloat16()
    g = torch.randn(12, fout, generator=gen).bfloat16()
    layer(x, splits).backward(g)
    s = 0
    for e, (w, c) in enumerate(zip(ws, splits)):
        expect = init[e].double() + g[s : s + c].double().t() @ x[s : s + c].double()
        assert rel_err(w.main_grad, expect) < 1e-3
        assert w.grad_added_to_main_grad is True
        assert w.grad is not None and torch.count_nonzero(w.grad) == 0  # dummy grad: hooks fire, nothing added
        s += c


def test_fuse_without_main_grad_raises():
    layer = GroupedLinear(2, 8, 8, device="cpu", fuse_wgrad_accumulation=True)
    with pytest.raises(RuntimeError, match="main_grad"):
        layer(torch.randn(4, 8), [2, 2])


def test_state_dict_te_layout_round_trip(gen):
    per = GroupedLinear(3, 8, 8, device="cpu")
    with torch.no_grad():
        for p in per.parameters():
            p.normal_(generator=gen)
    sd = per.state_dict()
    assert set(sd) == {f"weight{e}" for e in range(3)} | {f"bias{e}" for e in range(3)} | {"_extra_state"}
    single = GroupedLinear(3, 8, 8, device="cpu", single_grouped_weight=True)
    single.load_state_dict(sd)
    x = torch.randn(9, 8, generator=gen)
    torch.testing.assert_close(single(x, [2, 3, 4]), per(x, [2, 3, 4]))
    back = GroupedLinear(3, 8, 8, device="cpu")
    back.load_state_dict(single.state_dict())
    torch.testing.assert_close(back(x, [2, 3, 4]), per(x, [2, 3, 4]))
    # TE also writes fp8 metadata in _extra_state; a state dict without it loads too.
    sd.pop("_extra_state")
    back.load_state_dict(sd)


def test_return_bias_and_tp_partition():
    layer = GroupedLinear(2, 8, 16, device="cpu", return_bias=True, parallel_mode="column", tp_size=2)
    assert layer.out_features == 8
    y, biases = layer(torch.randn(4, 8), [1, 3])
    assert y.shape == (4, 8) and len(biases) == 2
    with pytest.raises(ValueError, match="not divisible"):
        GroupedLinear(2, 8, 15, device="cpu", parallel_mode="column", tp_size=2)
    with pytest.raises(ValueError, match="m_splits must have 2 entries"):
        GroupedLinear(2, 8, 8, device="cpu")(torch.randn(4, 8), [4])
    with pytest.raises(ValueError, match="in_features=8"):
        GroupedLinear(2, 8, 8, device="cpu")(torch.randn(4, 7), [2, 2])
