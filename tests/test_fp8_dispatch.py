"""FP8 dispatch (``MoELayer(fp8_dispatch=True)`` under ``moe_graph.fp8.autocast``): tokens quantized rowwise once at
their source travel as FP8 + scale bytes. Checked against the same layer with a 16-bit dispatch (the experts
quantizing their input): forward output, input gradient and every gradient but fc1's bit for bit (the rowwise
tiles lie within a row, so the bytes are the same); fc1's weight gradient against the layer fed the tokens after a
rowwise quantize-dequantize by the TE-reference quantizer (its columnwise copy comes from the dequantized rows).
EP 1 and EP 2 on gloo, both exchange rules, a capacity that drops routes, echo."""

import pytest
import torch

import moe_graph
from helpers.fp8_dispatch_workers import fp8_dispatch_worker
from moe_graph.distributed.launch import run_distributed
from moe_graph.moe.layer import MoELayer
from moe_graph.moe.token_dispatcher import TokenDispatcher, expert_columns
from moe_graph.ops import fp8

pytestmark = pytest.mark.skipif(not fp8.native_available("cpu"), reason="moe_graph._C without the FP8 ops")


def _check(r):
    assert r["out_equal"] and r["dx_equal"], r
    assert r["equal_grads"] == [n for n in r["grads"] if n != "experts.fc1.weight"], r
    assert r["out_vs_qdq"] == 0.0, r
    assert r["fc1_vs_qdq"] <= 1e-6 * max(1.0, r["fc1_scale"]), r


@pytest.mark.parametrize("kind,hidden,recompute", [("blockwise", 160, False), ("mxfp8", 80, False),  # partial tiles
                                                    ("blockwise", 128, True)])  # the layer recomputed in backward
def test_fp8_dispatch_one_rank(kind, hidden, recompute):
    _check(fp8_dispatch_worker(0, 1, kind, "auto", None, 0, hidden, recompute))


@pytest.mark.parametrize("kind,exchange,cf,spare", [
    ("blockwise", "nccl", 0.6, 0),      # per (source, destination) pair, routes dropped
    ("mxfp8", "symm_mem", 0.8, 0),      # per destination (host-sized on gloo), routes dropped
    ("blockwise", "symm_mem", None, 1),  # dropless, one echo slot per rank
    ("mxfp8", "nvlink", 0.8, 1),        # the fused exchange's semantics (gloo), routes dropped, echo
])
def test_fp8_dispatch_two_ranks(kind, exchange, cf, spare):
    res = run_distributed(fp8_dispatch_worker, 2, kind, exchange, cf, spare, 128, timeout=240.0)
    for r in res:
        _check(r)
    if cf is not None:
        assert sum(r["dropped"] for r in res) > 0  # the capacity was binding


def test_packed_rows_are_about_half_of_bf16():
    H = 7168  # DeepSeek-V3
    for kind in ("blockwise", "mxfp8"):
        b = fp8.packed_row_bytes(H, fp8.as_recipe(kind))
        assert b == H + (4 * H // 128 if kind == "blockwise" else H // 32)
        assert 0.5 < b / (2 * H) < 0.52


def test_moved_bytes_equal_quantizing_the_expert_input():
    """The dispatcher's FP8 rows equal the quantizer run on its 16-bit expert input, padding rows zero."""
    torch.manual_seed(0)
    cr, cl = expert_columns(4, 1)
    d = TokenDispatcher(4, 1, 0, cr, cl, capacity=5)
    x = torch.randn(9, 96, dtype=torch.bfloat16)
    idx = torch.tensor([[0, 1]] * 7 + [[2, 2], [3, 1]])
    probs = torch.rand(9, 2)
    rec = fp8.as_recipe("blockwise")
    ref, m, _ = d.dispatch(x, idx, probs)
    q, m2, _ = d.dispatch(x, idx, probs, fp8_recipe=rec)
    assert torch.equal(m, m2) and isinstance(q, fp8.QuantizedRows) and q.shape == ref.shape
    qr, sr = fp8.quantize_rows(ref, None, rec, rec.fwd_dtype)
    live = int(m.sum())
    assert torch.equal(q.data[:live].view(torch.uint8), qr[:live].view(torch.uint8))
    assert torch.equal(q.scale[:live], sr[:live])
    assert not q.data[live:].view(torch.uint8).any() and not q.scale[live:].any()


def test_fp8_dispatch_bad_options():
    with pytest.raises(ValueError, match="probs_on_input"):
        MoELayer(32, 16, 4, 2, fp8_dispatch=True, probs_on_input=True)
    with pytest.raises(TypeError, match="fp8_dispatch"):
        MoELayer(32, 16, 4, 2, fp8_dispatch=1)
    layer = MoELayer(32, 16, 4, 2, fp8_dispatch=True)
    with pytest.raises(ValueError, match="rowwise|within a row"):
        with moe_graph.fp8.autocast(recipe="tensorwise"):
            layer(torch.randn(5, 32))
    y = layer(torch.randn(5, 32))  # no recipe: a 16-bit dispatch
    assert y.shape == (5, 32)


def _equal_under_mxfp8(a, b, x):
    """Output, input gradient and every parameter gradient of ``a`` and ``b`` on ``x`` under an MXFP8 autocast,
    bit for bit; returns ``a``'s output."""
    res = []
    for m in (a, b):
        xx = x.clone().requires_grad_()
        with moe_graph.fp8.autocast(recipe="mxfp8"):
            y = m(xx)
        (y * y).sum().backward()
        res.append([y.detach(), xx.grad] + [p.grad for p in m.parameters()])
    assert all(torch.equal(u, v) for u, v in zip(*res))
    return res[0][0]


@pytest.mark.parametrize("fp8_dispatch", [False, True])
def test_fp8_recompute_equals_stored_activations(fp8_dispatch):
    """recompute=True under an FP8 autocast: the backward's recomputation runs under the forward's recipe (it is
    outside the caller's autocast by then), so the gradients equal those of the layer that kept its activations."""
    torch.manual_seed(3)
    a = MoELayer(128, 64, 4, 2, fp8_dispatch=fp8_dispatch)
    b = MoELayer(128, 64, 4, 2, fp8_dispatch=fp8_dispatch, recompute=True)
    b.load_state_dict(a.state_dict())
    _equal_under_mxfp8(a, b, torch.randn(21, 128))


@pytest.mark.parametrize("tiles,K", [("1x128", 256), ("1x32", 96), ("1x128", 160)])
def test_dequantize_of_row_tiles_is_the_elementwise_product(tiles, K):
    """FP8 dispatch dequantizes the moved rows for the columnwise copy: the broadcast form of whole row tiles (and
    the general path for a partial one) equal q times each element's tile scale."""
    torch.manual_seed(1)
    x = torch.randn(37, K) * torch.logspace(-3, 3, K)
    q, s = fp8.quantize(x, tiles=tiles)
    tc = fp8.TILES[tiles][1]
    per_element = s.float().repeat_interleave(tc, 1)[:, :K]
    assert torch.equal(fp8.dequantize(q, s, tiles=tiles), q.float() * per_element)


def test_aligned_groups_start_at_multiples_of_16_and_round_trip():
    from moe_graph.moe.experts import AlignedGroups

    m = torch.tensor([0, 5, 16, 17, 0, 1])  # zero-token experts, exact and partial multiples; 3 capacity rows
    rows = int(m.sum()) + 3
    g = AlignedGroups(m, rows, 16)
    assert g.padded_rows % 16 == 0 and g.m_splits.tolist() == [0, 16, 16, 32, 0, 16]
    x = torch.randn(rows, 4, requires_grad=True)
    xp = g.pad(x)
    starts = (g.m_splits.cumsum(0) - g.m_splits).tolist()
    src = 0
    for s0, n in zip(starts, m.tolist()):
        assert s0 % 16 == 0 and torch.equal(xp[s0:s0 + n], x[src:src + n]) and not xp[s0 + n:s0 + -(-n // 16) * 16].any()
        src += n
    back = g.unpad(xp)
    assert torch.equal(back[:src], x[:src]) and not back[src:].any()  # capacity rows past the groups: zero
    back.sum().backward()
    assert torch.equal(x.grad, (torch.arange(rows) < src).float()[:, None].expand(rows, 4))


def _same_under_switch(monkeypatch, kind, fp8_dispatch, spare, attr, values, seed):
    """A MoELayer's output and every gradient under ``moe.experts.<attr>`` set to each of ``values``: equal bit for
    bit."""
    import moe_graph.moe.experts as experts

    torch.manual_seed(seed)
    layer = MoELayer(128, 64, 4, 2, fp8_dispatch=fp8_dispatch, num_spare_experts_per_ep_rank=spare)
    x = torch.randn(27, 128)
    res = []
    for v in values:
        monkeypatch.setattr(experts, attr, v)
        xx = x.clone().requires_grad_()
        with moe_graph.fp8.autocast(recipe=kind):
            y = layer(xx)
        (y * y).sum().backward()
        res.append([y.detach(), xx.grad] + [p.grad.clone() for p in layer.parameters()])
        layer.zero_grad(set_to_none=True)
    assert all(torch.equal(u, v) for u, v in zip(*res))


@pytest.mark.parametrize("kind,fp8_dispatch,spare", [("blockwise", False, 0), ("mxfp8", True, 0),
                                                     ("blockwise", True, 1)])
def test_fp8_experts_regrouped_to_16_rows_change_nothing(kind, fp8_dispatch, spare, monkeypatch):
    """The FP8 experts regroup their rows to 16-row boundaries (the GPU wgrad's alignment): outputs and every
    gradient equal those without the regrouping bit for bit (zero rows add nothing; partial tiles were zero-padded)."""
    _same_under_switch(monkeypatch, kind, fp8_dispatch, spare, "FP8_ROW_ALIGNMENT", (16, 1), 5)


def test_fp8_with_expert_norms_and_latent():
    """Muse-Spark's block options (latent width, the centered RMSNorm of the experts' input, the scaled RMSNorm of
    each expert output row, the logit multiplier) under an MXFP8 recipe with FP8 dispatch: recompute gives the
    stored activations' gradients bit for bit, and the output stays within FP8 error of the unquantized layer's."""
    torch.manual_seed(4)
    kw = dict(latent_size=96, score_func="sigmoid", router_logit_multiplier=0.5, fp8_dispatch=True,
              expert_input_norm="centered_rmsnorm", expert_output_norm="scaled_rmsnorm")
    a = MoELayer(128, 64, 4, 2, **kw)
    b = MoELayer(128, 64, 4, 2, recompute=True, **kw)
    with torch.no_grad():
        a.expert_input_norm.weight.normal_(0, 0.3)
        a.expert_output_norm.weight.normal_(0, 0.3)
    b.load_state_dict(a.state_dict())
    x = torch.randn(21, 128)
    y = _equal_under_mxfp8(a, b, x)
    assert a.expert_output_norm.weight.grad.abs().max() > 0
    plain = a(x).detach()
    assert (y - plain).norm() < 0.1 * plain.norm()


@pytest.mark.parametrize("kind,fp8_dispatch,spare", [("blockwise", False, 0), ("mxfp8", True, 0),
                                                     ("tensor", False, 1)])
def test_fused_fp8_activation_changes_nothing(kind, fp8_dispatch, spare, monkeypatch):
    """The activation writing fc2's FP8 input directly (both copies, one op) gives the outputs and every gradient
    of the 16-bit activation whose output fc2 quantizes, bit for bit (the routing probabilities scale the rows on
    the narrow side here: ffn 64 < hidden 128)."""
    _same_under_switch(monkeypatch, kind, fp8_dispatch, spare, "FUSED_FP8_ACTIVATION", (True, False), 6)


@pytest.mark.parametrize("kind,fp8_dispatch,spare", [("blockwise", False, 0), ("mxfp8", True, 0),
                                                     ("blockwise", False, 1)])
def test_fused_fp8_activation_backward_changes_nothing(kind, fp8_dispatch, spare, monkeypatch):
    """fc1 and the activation as one node (fc1's FP8 output gradient quantized straight from the activation's
    output gradient, tests/test_fp8_activation_backward.py) against two: output and every gradient bit-equal."""
    _same_under_switch(monkeypatch, kind, fp8_dispatch, spare, "FUSED_FP8_ACTIVATION_BACKWARD", (True, False), 9)
