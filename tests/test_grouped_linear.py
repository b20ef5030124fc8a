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


# ------------------------------------------------------------------------------------------ TE compatibility --
def _pair(gen, *, fuse, single, bias, E=4, fin=24, fout=16, dtype=torch.float32):
    """A reference layer and a delay_wgrad_compute layer with equal parameters (and main_grads when fused)."""
    kw = dict(bias=bias, device="cpu", params_dtype=dtype, single_grouped_weight=single, fuse_wgrad_accumulation=fuse)
    ref = GroupedLinear(E, fin, fout, **kw)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(generator=gen)
    dly = GroupedLinear(E, fin, fout, delay_wgrad_compute=True, **kw)
    dly.load_state_dict(ref.state_dict())
    if fuse:
        for m in (ref, dly):
            for w in m._weights():
                w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
    return ref, dly


def _wgrads(layer, fuse):
    ws = layer._weights()
    return [(w.main_grad if fuse else w.grad) for w in ws]


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("single", [False, True])
def test_delay_wgrad_compute_defers_weight_grads_to_backward_dw(gen, fuse, single):
    ref, dly = _pair(gen, fuse=fuse, single=single, bias=True)
    assert dly.need_backward_dw() and not ref.need_backward_dw()
    assert all(getattr(w, "skip_backward_post_hook", False) for w in dly._weights())
    calls = []
    dly.register_wgrad_accumulation_and_reduce_hooks(lambda: calls.append(len(dly._wgrad_queue)))
    mbs = [([5, 0, 7, 3], 18), ([0, 11, 0, 2], 14)]  # rows past sum(m_splits) are capacity rows
    for splits, rows in mbs:
        x = torch.randn(rows, 24, generator=gen)
        g = torch.randn(rows, 16, generator=gen)
        xr, xd = x.clone().requires_grad_(), x.clone().requires_grad_()
        ref(xr, torch.tensor(splits)).backward(g)
        dly(xd, torch.tensor(splits)).backward(g)
        torch.testing.assert_close(xd.grad, xr.grad)  # dgrad is not delayed
    # biases are not delayed either; the weights have nothing yet
    for br, bd in zip(ref._biases(), dly._biases()):
        torch.testing.assert_close(bd.grad, br.grad)
    for wg, w in zip(_wgrads(dly, fuse), dly._weights()):
        assert (wg is None) if not fuse else (torch.count_nonzero(wg) == 0 and not getattr(w, "grad_added_to_main_grad", False))
    assert len(dly._wgrad_queue) == 2 and calls == []
    dly.backward_dw()
    dly.backward_dw()
    assert calls == [1, 0] and len(dly._wgrad_queue) == 0
    dly.backward_dw()  # nothing queued: no-op, no hook
    assert calls == [1, 0]
    for a, b in zip(_wgrads(dly, fuse), _wgrads(ref, fuse)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    if fuse:
        assert all(w.grad_added_to_main_grad is True for w in dly._weights())


def test_is_first_microbatch_overwrites_main_grad(gen):
    # TE: with fuse_wgrad_accumulation, is_first_microbatch=True writes main_grad, later microbatches add.
    for delayed in (False, True):
        layer = GroupedLinear(3, 8, 6, bias=False, device="cpu", fuse_wgrad_accumulation=True, delay_wgrad_compute=delayed)
        ws = layer._weights()
        for w in ws:
            w.main_grad = torch.randn(w.shape, generator=gen)  # stale values the first microbatch must replace
        x1, g1 = torch.randn(9, 8, generator=gen), torch.randn(9, 6, generator=gen)
        x2, g2 = torch.randn(9, 8, generator=gen), torch.randn(9, 6, generator=gen)
        layer(x1, [4, 0, 5], is_first_microbatch=True).backward(g1)
        layer(x2, [2, 0, 7], is_first_microbatch=False).backward(g2)
        layer.backward_dw()
        layer.backward_dw()
        expect = [g1[:4].t() @ x1[:4] + g2[:2].t() @ x2[:2], torch.zeros(6, 8), g1[4:9].t() @ x1[4:9] + g2[2:9].t() @ x2[2:9]]
        for w, ex in zip(ws, expect):
            torch.testing.assert_close(w.main_grad, ex, rtol=1e-5, atol=1e-5)  # expert 1 (no tokens): zeros


def test_sequence_parallel_and_parallel_attributes_as_te():
    # Megatron passes sequence_parallel=config.sequence_parallel with tp_size=1 for experts: accepted, recorded
    # as False (TE: tp_size > 1 and sequence_parallel); parameter attributes as TE sets them.
    layer = GroupedLinear(2, 8, 8, device="cpu", sequence_parallel=True)
    assert layer.sequence_parallel is False
    assert all(w.tensor_model_parallel and w.partition_dim == 0 and w.partition_stride == 1 for w in layer._weights())
    row = GroupedLinear(2, 8, 8, device="cpu", sequence_parallel=True, parallel_mode="row", tp_size=2)
    assert row.sequence_parallel is True and row.in_features == 4
    assert all(w.partition_dim == 1 for w in row._weights()) and all(b.sequence_parallel for b in row._biases())
    col = GroupedLinear(2, 8, 8, device="cpu", parallel_mode="column", tp_size=2, single_grouped_weight=True)
    assert col.weight.partition_dim == 1 and col.bias.partition_dim == 1 and col.bias.tensor_model_parallel
    assert not hasattr(col.weight, "skip_backward_post_hook")


def test_ddp_grad_ready_hooks_run_from_backward_dw(gen):
    # Weights with delayed wgrad: DDP's grad-ready hook runs at the end of backward_dw, not in backward; biases
    # keep the autograd hook. dp=1, so no process group is needed; bucket readiness shows when the hooks ran.
    from moe_graph.ddp import DistributedDataParallel

    for fuse in (False, True):
        ref, dly = _pair(gen, fuse=False, single=False, bias=True)
        dly.fuse_wgrad_accumulation = fuse
        ddp = DistributedDataParallel(dly, overlap_grad_reduce=True, bucket_size=1)  # one param per bucket
        weight_groups = [ddp.param_to_bucket_group[w] for w in dly._weights()]
        bias_groups = [ddp.param_to_bucket_group[b] for b in dly._biases()]
        ddp.zero_grad_buffer()
        x, g = torch.randn(18, 24, generator=gen), torch.randn(18, 16, generator=gen)
        ref(x, [5, 0, 7, 3]).backward(g)
        ddp(x, torch.tensor([5, 0, 7, 3])).backward(g)
        assert all(bg.grad_reduce_dispatched for bg in bias_groups)
        assert not any(wg.grad_reduce_dispatched for wg in weight_groups)
        dly.backward_dw()
        assert all(wg.grad_reduce_dispatched for wg in weight_groups)
        ddp.finish_grad_sync()
        for p, q in zip(dly.parameters(), ref.parameters()):
            assert p.grad is None
            torch.testing.assert_close(p.main_grad, q.grad, rtol=1e-5, atol=1e-5)


def test_ddp_rejects_delayed_param_without_hook_owner():
    from moe_graph.ddp import DistributedDataParallel

    lin = torch.nn.Linear(4, 4)
    lin.weight.skip_backward_post_hook = True
    with pytest.raises(ValueError, match=r"\['weight'\].*register_wgrad_accumulation_and_reduce_hooks"):
        DistributedDataParallel(lin)


def test_init_runs_inside_the_rng_tracker_fork():
    # Megatron passes get_rng_state_tracker (and rng_tracker_name for experts): every weight is initialized inside
    # tracker.fork(name), so expert-parallel ranks with different tracker seeds get different experts.
    import contextlib

    class Tracker:
        def __init__(self, seed):
            self.gen_state = torch.Generator().manual_seed(seed).get_state()
            self.names = []

        @contextlib.contextmanager
        def fork(self, name="model-parallel-rng"):
            self.names.append(name)
            outer = torch.get_rng_state()
            torch.set_rng_state(self.gen_state)
            try:
                yield
            finally:
                self.gen_state = torch.get_rng_state()
                torch.set_rng_state(outer)

    def build(seed, name, single=False):
        t = Tracker(seed)
        torch.manual_seed(0)  # the default stream is the same on every "rank"
        layer = GroupedLinear(3, 8, 4, device="cpu", get_rng_state_tracker=lambda: t, rng_tracker_name=name,
                              single_grouped_weight=single)
        return layer, t

    a, ta = build(1, "expert-parallel-rng")
    b, _ = build(2, "expert-parallel-rng")
    c, _ = build(1, "expert-parallel-rng")
    assert ta.names == ["expert-parallel-rng"] * 3
    assert not torch.equal(a.weight0, b.weight0)  # different tracker seeds: different experts
    assert all(torch.equal(getattr(a, f"weight{e}"), getattr(c, f"weight{e}")) for e in range(3))
    _, td = build(1, None, single=True)
    assert td.names == ["model-parallel-rng"] * 3  # fork() with the tracker's default name


def test_megatron_style_subclass(gen):
    # Megatron's TEGroupedLinear subclasses TE's GroupedLinear: it passes is_first_microbatch, returns (out, None),
    # reads the fp8 flags in its state-dict hooks and splits _extra_state per expert when saving.
    class MegatronGrouped(GroupedLinear):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.is_first_microbatch = True
            self._register_load_state_dict_pre_hook(self._merge_extra_states)

        def _merge_extra_states(self, state_dict, prefix, *unused):
            self.init_fp8_metadata(num_gemms=self.num_gemms)
            if self.fp8_meta["fp8_checkpoint"] or self.fp8 or self.fp8_calibration:
                raise AssertionError("no fp8 checkpoint here")
            for i in range(1, self.num_gemms):
                state_dict.pop(f"{prefix}_extra_state{i}", None)

        def split_extra_state(self):
            state = self.state_dict()["_extra_state"]
            return [self._decode_extra_state(state)] * self.num_gemms

        def forward(self, x, m_splits):
            out = super().forward(x, m_splits, is_first_microbatch=self.is_first_microbatch)
            self.is_first_microbatch = False
            return out, None

    layer = MegatronGrouped(3, 8, 4, device="cpu", fuse_wgrad_accumulation=True, bias=False)
    for w in layer._weights():
        w.main_grad = torch.full(w.shape, 7.0)  # stale: the first microbatch overwrites it
    x = torch.randn(6, 8, generator=gen)
    out, none = layer(x, [2, 0, 4])
    out.sum().backward()
    assert none is None and layer.is_first_microbatch is False
    torch.testing.assert_close(layer.weight1.main_grad, torch.zeros(4, 8))
    torch.testing.assert_close(layer.weight0.main_grad, torch.ones(4, 2) @ x[:2])
    assert len(layer.split_extra_state()) == 3
    sd = layer.state_dict()
    sd.update({f"_extra_state{i}": torch.empty(0, dtype=torch.uint8) for i in (1, 2)})  # a dist-ckpt layout
    layer.load_state_dict(sd)


@pytest.mark.parametrize("fuse,delay", [(True, False), (False, True), (True, True)])
def test_torch_compile_with_fused_or_delayed_wgrad(gen, fuse, delay):
    # torch.compile (graph breaks around the autograd.Function that touches main_grad / the wgrad queue) gives the
    # eager gradients, accumulated over two iterations.
    layer = GroupedLinear(3, 16, 8, device="cpu", fuse_wgrad_accumulation=fuse, delay_wgrad_compute=delay)
    ref = GroupedLinear(3, 16, 8, device="cpu")
    ref.load_state_dict(layer.state_dict())
    for w in layer._weights():
        w.main_grad = torch.zeros(w.shape)
    x, splits = torch.randn(12, 16, generator=gen), torch.tensor([4, 0, 6])
    compiled = torch.compile(lambda x, s: layer(x, s).square().sum(), backend="aot_eager")
    for _ in range(2):
        compiled(x, splits).backward()
        layer.backward_dw()
        ref(x, splits).square().sum().backward()
    for w, r in zip(layer._weights(), ref._weights()):
        torch.testing.assert_close(w.main_grad if fuse else w.grad, r.grad, rtol=1e-5, atol=1e-5)
