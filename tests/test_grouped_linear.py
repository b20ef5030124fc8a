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
    # As TE: biases are delivered by backward_dw too (marked skip_backward_post_hook); the weights hold a zero
    # placeholder (so that hooks requiring a gradient see one), fused ones with grad_added_to_main_grad set.
    assert all(getattr(b, "skip_backward_post_hook", False) for b in dly._biases())
    assert all(b.grad is None for b in dly._biases())
    for wg, w in zip(_wgrads(dly, fuse), dly._weights()):
        assert w.grad is not None and torch.count_nonzero(w.grad) == 0
        if fuse:
            assert torch.count_nonzero(wg) == 0 and w.grad_added_to_main_grad is True
    assert len(dly._wgrad_queue) == 2 and calls == []
    dly.backward_dw()
    dly.backward_dw()
    assert calls == [1, 0] and len(dly._wgrad_queue) == 0
    dly.backward_dw()  # nothing queued: no-op, no hook
    assert calls == [1, 0]
    for a, b in zip(_wgrads(dly, fuse), _wgrads(ref, fuse)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for br, bd in zip(ref._biases(), dly._biases()):  # both microbatches' bias gradients, summed
        torch.testing.assert_close(bd.grad, br.grad, rtol=1e-5, atol=1e-5)
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
    # Weights and biases with delayed wgrad: DDP's grad-ready hook runs at the end of backward_dw, not in backward.
    # dp=1, so no process group is needed; bucket readiness shows when the hooks ran.
    from moe_graph.distributed.ddp import DistributedDataParallel

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
        # As TE: weights and biases are both delivered by backward_dw, which then runs DDP's grad-ready hooks.
        assert not any(g.grad_reduce_dispatched for g in weight_groups + bias_groups)
        dly.backward_dw()
        assert all(g.grad_reduce_dispatched for g in weight_groups + bias_groups)
        ddp.finish_grad_sync()
        for p, q in zip(dly.parameters(), ref.parameters()):
            assert p.grad is None
            torch.testing.assert_close(p.main_grad, q.grad, rtol=1e-5, atol=1e-5)


def test_ddp_rejects_delayed_param_without_hook_owner():
    from moe_graph.distributed.ddp import DistributedDataParallel

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


# --------------------------------------------------- issue 11: TE behaviours a real Megatron run relies on --
def test_delayed_wgrad_gives_placeholder_grads_for_overlap_grad_reduce_hooks(gen):
    # Megatron's DDP with overlap_grad_reduce asserts param.grad is not None in the hook that backward_dw
    # triggers; TE returns a placeholder in backward even though the weight GEMM is deferred.
    for fuse in (False, True):
        for single in (False, True):
            ref, dly = _pair(gen, fuse=fuse, single=single, bias=True)
            seen = []

            def megatron_like_hook(params=list(dly.parameters())):
                for p in params:
                    assert p.grad is not None, "param.grad being None is not safe when overlap_grad_reduce is True"
                    if fuse and p.dim() == 3 - (not single):  # weights: real gradient is in main_grad
                        assert p.grad_added_to_main_grad
                    seen.append(p)

            dly.register_wgrad_accumulation_and_reduce_hooks(megatron_like_hook)
            x, g = torch.randn(18, 24, generator=gen), torch.randn(18, 16, generator=gen)
            ref(x, [5, 0, 7, 6]).backward(g)
            dly(x, [5, 0, 7, 6]).backward(g)
            dly.backward_dw()
            assert len(seen) == len(list(dly.parameters()))
            for a, b in zip(_wgrads(dly, fuse), _wgrads(ref, fuse)):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_fused_dummy_grad_is_adopted_not_cloned(gen):
    # The zero placeholder returned after fused main_grad accumulation becomes p.grad without a copy: every
    # weight's p.grad shares one cached buffer, across microbatches (no new [N, K] tensor per weight per step).
    from moe_graph.ops.grouped_gemm import zero_wgrad_placeholder

    for delayed in (False, True):
        layer = GroupedLinear(3, 16, 8, bias=False, device="cpu", fuse_wgrad_accumulation=True,
                              delay_wgrad_compute=delayed)
        ws = layer._weights()
        for w in ws:
            w.main_grad = torch.zeros(w.shape)
        ptrs = set()
        for _ in range(2):
            layer(torch.randn(10, 16, generator=gen), [3, 0, 7]).sum().backward()
            layer.backward_dw()
            ptrs |= {w.grad.untyped_storage().data_ptr() for w in ws}
            for w in ws:  # as Megatron's DDP hook does
                w.grad = None
        cached = zero_wgrad_placeholder(ws[0])  # an alias of the cached [8, 16] fp32 zero buffer
        assert ptrs == {cached.untyped_storage().data_ptr()}
        assert torch.count_nonzero(cached) == 0


def test_dummy_grad_written_by_someone_is_not_handed_out_again(gen):
    from moe_graph.ops.grouped_gemm import zero_wgrad_placeholder

    w = torch.nn.Parameter(torch.randn(5, 4))
    d = zero_wgrad_placeholder(w)
    d.add_(1.0)  # a user writes into p.grad that aliases the placeholder
    d2 = zero_wgrad_placeholder(w)
    assert torch.count_nonzero(d2) == 0 and d2.data_ptr() != d.data_ptr() and torch.all(d == 1)


def test_save_original_input_is_stored_for_megatron():
    # megatron.core.extensions.transformer_engine.set_save_original_input sets the attribute on the module
    # (fine-grained activation offloading of expert_fc1); TE stores the constructor argument.
    assert GroupedLinear(2, 8, 8, device="cpu", save_original_input=True).save_original_input is True
    layer = GroupedLinear(2, 8, 8, device="cpu")
    assert layer.save_original_input is False


def test_reset_parameters_materializes_meta_init(gen):
    # Megatron-FSDP's meta-device init: build on "meta", to_empty(device), reset_parameters().
    def init(t):
        torch.nn.init.normal_(t, 0.0, 0.5)

    for single in (False, True):
        torch.manual_seed(3)
        real = GroupedLinear(3, 8, 4, device="cpu", init_method=init, single_grouped_weight=single)
        meta = GroupedLinear(3, 8, 4, device="meta", init_method=init, single_grouped_weight=single)
        assert all(p.is_meta for p in meta.parameters())
        meta.to_empty(device="cpu", recurse=False)
        with torch.no_grad():
            for b in meta._biases():
                b.fill_(7.0)  # to_empty leaves garbage: reset must zero the biases
        torch.manual_seed(3)
        meta.reset_parameters()
        for p, q in zip(meta.parameters(), real.parameters()):
            torch.testing.assert_close(p, q)
        assert all(torch.count_nonzero(b) == 0 for b in meta._biases())
        assert all(w.tensor_model_parallel for w in meta._weights())  # set again on to_empty's new parameters
        assert 0.3 < float(torch.cat([w.detach().flatten() for w in meta._weights()]).std()) < 0.7


def test_overwrite_main_grad_writes_instead_of_adding(gen):
    # Megatron-FSDP sets param.overwrite_main_grad = True: TE then writes main_grad instead of adding.
    for delayed in (False, True):
        layer = GroupedLinear(3, 8, 6, bias=False, device="cpu", fuse_wgrad_accumulation=True, delay_wgrad_compute=delayed)
        for w in layer._weights():
            w.main_grad = torch.full(w.shape, 5.0)
            w.overwrite_main_grad = True
        x, g = torch.randn(9, 8, generator=gen), torch.randn(9, 6, generator=gen)
        layer(x, [4, 0, 5]).backward(g)
        layer.backward_dw()
        torch.testing.assert_close(layer.weight0.main_grad, g[:4].t() @ x[:4], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer.weight1.main_grad, torch.zeros(6, 8))
        torch.testing.assert_close(layer.weight2.main_grad, g[4:].t() @ x[4:], rtol=1e-5, atol=1e-5)


def test_lazy_main_grad_from_get_main_grad(gen):
    # Megatron-FSDP parameters (__fsdp_param__) get main_grad lazily: None at forward, get_main_grad() before
    # backward. TE resolves it in backward.
    for delayed in (False, True):
        layer = GroupedLinear(2, 8, 4, bias=False, device="cpu", fuse_wgrad_accumulation=True, delay_wgrad_compute=delayed)
        bufs = {}
        for e, w in enumerate(layer._weights()):
            w.__fsdp_param__ = True
            w.main_grad = None
            bufs[e] = torch.zeros(w.shape)
            w.get_main_grad = lambda e=e: bufs[e]
        x, g = torch.randn(6, 8, generator=gen), torch.randn(6, 4, generator=gen)
        layer(x, [2, 4]).backward(g)
        layer.backward_dw()
        torch.testing.assert_close(bufs[0], g[:2].t() @ x[:2], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(bufs[1], g[2:].t() @ x[2:], rtol=1e-5, atol=1e-5)
        assert layer.weight0.main_grad is bufs[0]


def test_single_grouped_bias_and_te_keywords(gen):
    for sw in (False, True):
        for sb in (False, True):
            layer = GroupedLinear(3, 8, 4, device="cpu", single_grouped_weight=sw, single_grouped_bias=sb,
                                  name="fc1", use_grouped_tensor=True)
            names = [n for n, _ in layer.named_parameters()]
            assert ("weight" in names) == sw and ("weight0" in names) == (not sw)
            assert ("bias" in names) == sb and ("bias0" in names) == (not sb)
            if sb:
                assert layer.bias.shape == (3, 4)
            with torch.no_grad():
                for b in layer._biases():
                    b.normal_(generator=gen)
            x = torch.randn(7, 8, generator=gen)
            ref = _ref_forward_any(layer, x, [2, 0, 5])
            torch.testing.assert_close(layer(x, [2, 0, 5]), ref.float(), rtol=1e-5, atol=1e-5)
            _, rb = GroupedLinear(3, 8, 4, device="cpu", single_grouped_bias=sb, return_bias=True)(x, [2, 0, 5])
            assert (isinstance(rb, torch.nn.Parameter) and rb.shape == (3, 4)) if sb else len(rb) == 3
    with pytest.raises(TypeError, match="not_a_te_keyword"):
        GroupedLinear(2, 8, 8, device="cpu", not_a_te_keyword=True)
    with pytest.raises(TypeError, match="use_grouped_tensor"):
        GroupedLinear(2, 8, 8, device="cpu", use_grouped_tensor="yes")


def _ref_forward_any(layer, x, splits):
    W = torch.stack([w for ws in layer._weights() for w in (ws.unbind(0) if ws.dim() == 3 else [ws])])
    bs = layer._biases()
    B = None if bs is None else torch.stack([b for bb in bs for b in (bb.unbind(0) if bb.dim() == 2 else [bb])])
    out, s = torch.zeros(x.shape[0], W.shape[1], dtype=torch.float64), 0
    for e, c in enumerate(splits):
        out[s : s + c] = x[s : s + c].double() @ W[e].double().t() + (0 if B is None else B[e].double())
        s += c
    return out


def test_trigger_wgrad_accumulation_and_reduce_hooks():
    # Megatron's TEGroupedMLP.backward_dw calls it on the linear layers after fused TE ops ran their backward_dw.
    layer = GroupedLinear(2, 8, 8, device="cpu", delay_wgrad_compute=True)
    calls = []
    layer.register_wgrad_accumulation_and_reduce_hooks(lambda: calls.append(1))
    layer._trigger_wgrad_accumulation_and_reduce_hooks()
    assert calls == [1]


# ------------------------------------------------------------------- issue 12: loads validated before writing --
def _snapshot(m):
    return {k: v.clone() for k, v in m.state_dict().items()}


@pytest.mark.parametrize("src_e,dst_single,src_single", [(6, False, True), (6, True, True), (2, False, True),
                                                          (2, True, False), (6, True, False), (6, False, False)])
def test_load_state_dict_expert_count_mismatch_raises_and_writes_nothing(gen, src_e, dst_single, src_single):
    src = GroupedLinear(src_e, 8, 4, device="cpu", single_grouped_weight=src_single)
    dst = GroupedLinear(4, 8, 4, device="cpu", single_grouped_weight=dst_single)
    with torch.no_grad():
        for p in src.parameters():
            p.normal_(generator=gen)
    before = _snapshot(dst)
    for strict in (True, False):
        with pytest.raises(RuntimeError, match=r"num_gemms=4"):
            dst.load_state_dict(src.state_dict(), strict=strict)
        for k, v in _snapshot(dst).items():
            assert torch.equal(v, before[k]), k


def test_load_real_biases_into_bias_free_layer_raises(gen):
    src = GroupedLinear(3, 8, 4, device="cpu")
    with torch.no_grad():
        for b in src._biases():
            b.normal_(generator=gen)
    for single in (False, True):
        dst = GroupedLinear(3, 8, 4, device="cpu", bias=False, single_grouped_weight=single)
        before = _snapshot(dst)
        with pytest.raises(RuntimeError, match="bias=False"):
            dst.load_state_dict(src.state_dict())
        for k, v in _snapshot(dst).items():
            assert torch.equal(v, before[k])
        res = dst.load_state_dict(src.state_dict(), strict=False)  # not strict: loaded, biases listed as unexpected
        assert sorted(res.unexpected_keys) == ["bias0", "bias1", "bias2"]
        torch.testing.assert_close(dst._weights()[0].reshape(-1), torch.cat([w.reshape(-1) for w in src._weights()])[: dst._weights()[0].numel()])


def test_load_state_dict_shape_mismatch_writes_nothing(gen):
    src = GroupedLinear(3, 8, 4, device="cpu")
    dst = GroupedLinear(3, 8, 4, device="cpu")
    sd = src.state_dict()
    sd["weight2"] = torch.randn(4, 9)  # the last expert is wrong: the first two must not be written either
    before = _snapshot(dst)
    with pytest.raises(RuntimeError, match=r"weight2: checkpoint shape \(4, 9\)"):
        dst.load_state_dict(sd)
    for k, v in _snapshot(dst).items():
        assert torch.equal(v, before[k])


@pytest.mark.parametrize("kw,arg", [(dict(tp_size=0), "tp_size"), (dict(in_features=0), "in_features"),
                                    (dict(out_features=-1), "out_features"), (dict(num_gemms=0), "num_gemms"),
                                    (dict(tp_size=0, parallel_mode="column"), "tp_size")])
def test_constructor_rejects_bad_sizes_naming_the_argument(kw, arg):
    args = dict(num_gemms=2, in_features=8, out_features=8, device="cpu")
    args.update(kw)
    with pytest.raises(ValueError, match=arg):
        GroupedLinear(**args)


def test_strict_load_with_unexpected_key_writes_nothing_and_parent_loads_validate(gen):
    src = GroupedLinear(3, 8, 4, device="cpu")
    with torch.no_grad():
        for p in src.parameters():
            p.normal_(generator=gen)
    dst = GroupedLinear(3, 8, 4, device="cpu")
    before = _snapshot(dst)
    sd = dict(src.state_dict(), stray=torch.zeros(1))
    with pytest.raises(RuntimeError, match="Unexpected key.*stray"):
        dst.load_state_dict(sd)
    assert all(torch.equal(v, before[k]) for k, v in _snapshot(dst).items())
    dst.load_state_dict(sd, strict=False)
    torch.testing.assert_close(dst.weight2, src.weight2)
    # through a parent module: the expert-count check still raises before this layer is written
    parent = torch.nn.Sequential(GroupedLinear(4, 8, 4, device="cpu"))
    before = _snapshot(parent)
    with pytest.raises(RuntimeError, match="num_gemms=4"):
        parent.load_state_dict({f"0.{k}": v for k, v in src.state_dict().items()}, strict=False)
    assert all(torch.equal(v, before[k]) for k, v in _snapshot(parent).items())
