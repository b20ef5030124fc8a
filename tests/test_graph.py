"""FullIterationGraph: eager fallback on CPU (with a note), argument checks that name the changed input, separate
training/validation state, reset; the graph-safe recompute (moe_graph.cuda_graph.checkpoint: forward and recomputation
draw the same random numbers, against a float64 autograd oracle); on CUDA: replayed steps equal eager steps on
changing data (a MoE model with the optimizer step inside the graph, one warm-up step, recomputation), no host
syncs, dropout differs per replay (also inside recomputed regions), statistics follow the training replays after a
validation capture, clear capture errors."""

import copy
import os
import subprocess
import sys
import warnings

import pytest
import torch

from conftest import requires_cuda
from helpers.steps import moe_block_step as _make_step
from moe_graph.cuda_graph import FullIterationGraph, GraphCaptureError, GraphShapeError, checkpoint, recompute_rng

_PY_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python")


def _eager_graph(fn, **kw):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        g = FullIterationGraph(fn, enabled=False, **kw)
    return g, w


def test_cpu_runs_eagerly_with_a_note():
    calls = []

    def step(mbs):
        calls.append(len(mbs))
        return sum(mb["x"].sum() for mb in mbs)

    g, w = _eager_graph(step)
    assert not g.enabled and "running eagerly" in g.note
    assert any("CUDA graphs need CUDA" in str(x.message) for x in w)
    for i in range(4):
        mbs = [{"x": torch.full((2, 3), float(i + j))} for j in range(2)]
        assert float(g(mbs)) == 6 * (2 * i + 1)
    assert calls == [2] * 4 and g.iteration() == 4 and not g.captured()


def test_shape_dtype_structure_changes_are_named():
    g, _ = _eager_graph(lambda mbs, scale=1.0: mbs[0]["tokens"].sum() * scale)
    g([{"tokens": torch.zeros(2, 8)}, {"tokens": torch.zeros(2, 8)}], scale=1.0)
    with pytest.raises(GraphShapeError, match=r"\[1\]\['tokens'\].*\(2, 8\).*\(2, 9\).*reset\(\)"):
        g([{"tokens": torch.zeros(2, 8)}, {"tokens": torch.zeros(2, 9)}], scale=1.0)
    with pytest.raises(GraphShapeError, match="float64"):
        g([{"tokens": torch.zeros(2, 8)}, {"tokens": torch.zeros(2, 8, dtype=torch.float64)}], scale=1.0)
    with pytest.raises(GraphShapeError, match="structure"):
        g([{"tokens": torch.zeros(2, 8)}], scale=1.0)
    with pytest.raises(GraphShapeError, match="non-tensor"):
        g([{"tokens": torch.zeros(2, 8)}, {"tokens": torch.zeros(2, 8)}], scale=2.0)
    g.reset()
    assert float(g([{"tokens": torch.ones(3, 3)}])) == 9.0  # new shapes after reset


def test_training_and_validation_are_separate():
    g, _ = _eager_graph(lambda x: x * 2, eval_fn=lambda x: x + 1)
    assert g(torch.ones(2)).tolist() == [2, 2]
    assert g.eval_step(torch.ones(5)).tolist() == [2] * 5  # its own shapes
    assert g.iteration("training") == 1 and g.iteration("validation") == 1
    g.reset("validation")
    assert g.iteration("validation") == 0 and g.iteration("training") == 1
    g2, _ = _eager_graph(lambda x: x)
    with pytest.raises(RuntimeError, match="eval_fn"):
        g2.eval_step(torch.ones(1))


def test_data_read_and_argument_errors():
    it = iter(range(10))
    assert FullIterationGraph.data_read(it, 3) == [0, 1, 2]
    assert FullIterationGraph.data_read([iter("ab"), None], 2) == [["a", "b"], None]
    with pytest.raises(ValueError, match="num_microbatches"):
        FullIterationGraph.data_read(it, 0)
    with pytest.raises(ValueError, match="warmup_steps"):
        FullIterationGraph(lambda: None, warmup_steps=0, enabled=False)
    with pytest.raises(TypeError, match="train_fn"):
        FullIterationGraph(3, enabled=False)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs CUDA"):
            FullIterationGraph(lambda: None, enabled=True)


# ---------------------------------------------------------------------------------- graph-safe recompute --
def _dropout_region(w, p=0.5):
    return lambda x: torch.nn.functional.dropout(x @ w, p, training=True)


def _oracle_grads(x, w, y, r, p=0.5):
    """float64 autograd of sum(r * dropout(x @ w)) with the mask the forward drew (read off its output)."""
    mask = (y.detach() != 0).to(torch.float64) / (1 - p)
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ((xr @ wr) * mask * r).sum().backward()
    return xr.grad, wr.grad


def test_checkpoint_recomputes_with_the_forward_random_numbers(gen):
    # Two recomputed dropout regions per step, backward in reverse order: the recomputation draws the forward's
    # masks (gradients equal the oracle's), masks change every step, the default generator is left alone, and the
    # pairs of generator states are reused (no growth over steps).
    rng = recompute_rng("cpu")
    H = 16
    w = torch.randn(H, H, dtype=torch.float64, generator=gen, requires_grad=True)
    fn = _dropout_region(w)
    first_masks, pairs = [], []
    for step in range(3):
        xs = [torch.randn(8, H, dtype=torch.float64, generator=gen, requires_grad=True) for _ in range(2)]
        rs = [torch.randn(8, H, dtype=torch.float64, generator=gen) for _ in range(2)]
        before, in_flight = torch.get_rng_state(), rng.in_flight
        ys = [checkpoint(fn, x) for x in xs]
        assert torch.equal(torch.get_rng_state(), before)
        assert rng.in_flight == in_flight + 2
        w.grad = None
        for y, r in reversed(list(zip(ys, rs))):
            (y * r).sum().backward()
        assert rng.in_flight == in_flight
        gw = 0
        for x, y, r in zip(xs, ys, rs):
            gx, gw_i = _oracle_grads(x, w, y, r)
            torch.testing.assert_close(x.grad, gx, rtol=1e-12, atol=1e-12)
            gw = gw + gw_i
        torch.testing.assert_close(w.grad, gw, rtol=1e-12, atol=1e-12)
        assert 0.3 < float((ys[0] != 0).double().mean()) < 0.7  # dropout really drew random numbers
        first_masks.append(ys[0] != 0)
        pairs.append(rng.num_pairs)
    assert not torch.equal(first_masks[0], first_masks[1]) and not torch.equal(first_masks[1], first_masks[2])
    assert pairs[0] == pairs[1] == pairs[2]
    # the oracle can tell: torch.utils.checkpoint without RNG handling recomputes with other masks
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    x = torch.randn(8, H, dtype=torch.float64, generator=gen, requires_grad=True)
    r = torch.randn(8, H, dtype=torch.float64, generator=gen)
    y = torch_checkpoint(fn, x, use_reentrant=False, preserve_rng_state=False)
    (y * r).sum().backward()
    assert not torch.allclose(x.grad, _oracle_grads(x, w, y, r)[0])


def test_checkpoint_abandoned_forward_and_double_backward(gen):
    import gc

    rng = recompute_rng("cpu")
    H = 8
    w = torch.randn(H, H, dtype=torch.float64, generator=gen, requires_grad=True)
    fn = _dropout_region(w)
    x = torch.randn(4, H, dtype=torch.float64, generator=gen, requires_grad=True)
    checkpoint(fn, x)  # a forward whose backward never runs: its pair is brought back in step and freed
    gc.collect()
    n, in_flight = rng.num_pairs, rng.in_flight
    r = torch.randn(4, H, dtype=torch.float64, generator=gen)
    y = checkpoint(fn, x)
    (y * r).sum().backward(retain_graph=True)
    torch.testing.assert_close(x.grad, _oracle_grads(x, w, y, r)[0], rtol=1e-12, atol=1e-12)
    assert rng.num_pairs == n and rng.in_flight == in_flight
    with pytest.raises(RuntimeError, match="already recomputed once"):
        (y * r).sum().backward()
    with torch.no_grad():  # no grad: a plain call
        assert checkpoint(lambda a: a + 1, torch.zeros(2)).tolist() == [1.0, 1.0]


def test_moe_layer_recompute_is_graph_safe_checkpoint(gen):
    # MoELayer(recompute=True): the activations inside the layer are not kept (an outer saved-tensor hook sees far
    # fewer tensors), gradients and counters equal the plain layer's, the layer draws no random numbers.
    from moe_graph.moe.layer import MoELayer

    def make(recompute):
        torch.manual_seed(0)
        return MoELayer(8, 12, 6, 2, capacity_factor=0.7, num_spare_experts_per_ep_rank=1, aux_loss_coeff=0.01,
                        score_func="sigmoid", enable_expert_bias=True, device="cpu", params_dtype=torch.float64,
                        recompute=recompute)

    plain, rec = make(False), make(True)
    x = torch.randn(2, 10, 8, dtype=torch.float64, generator=gen)
    saved = {}
    for name, layer in (("plain", plain), ("rec", rec)):
        xl = x.clone().requires_grad_()
        count = [0]

        def pack(t, count=count):
            count[0] += 1
            return t

        before = torch.get_rng_state()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = layer(xl)
        assert torch.equal(torch.get_rng_state(), before)
        (y * torch.arange(8, dtype=torch.float64)).sum().backward()
        saved[name] = (count[0], xl.grad)
    assert saved["rec"][0] < saved["plain"][0] // 3, saved
    torch.testing.assert_close(saved["rec"][1], saved["plain"][1], rtol=0, atol=0)
    for (n, p), q in zip(plain.named_parameters(), rec.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=lambda m: f"{n}: {m}")
    assert rec.dispatcher.check_drops() == plain.dispatcher.check_drops() > 0
    assert torch.equal(rec.router.local_tokens_per_expert, plain.router.local_tokens_per_expert)
    with torch.no_grad():  # inference: no recomputation
        torch.testing.assert_close(rec(x), plain(x), rtol=0, atol=0)


def test_recompute_rng_refuses_what_a_capture_cannot_do(monkeypatch, gen):
    # During a capture no generator state can be created or registered, and the get/set_state fallback is refused:
    # both are clear GraphCaptureErrors (simulated here by declaring the CPU stream "capturing").
    import moe_graph.cuda_graph as G

    rng = G.RecomputeRNG("cpu")
    w = torch.randn(4, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    x = torch.randn(2, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    y = torch_checkpoint(_dropout_region(w), x, use_reentrant=False, preserve_rng_state=False, early_stop=False,
                         context_fn=rng.context_fn)  # the documented torch.utils.checkpoint arguments
    y.sum().backward()
    assert rng.num_pairs == 1 and rng.in_flight == 0 and rng.graph_states() == []  # CPU: nothing to register
    monkeypatch.setattr(G, "_capturing", lambda device: True)
    with pytest.raises(GraphCaptureError, match="graph-safe|torch >= 2.5"):
        rng.context_fn()[0].__enter__()  # the free pair is taken, but get/set_state cannot run in a capture
    with pytest.raises(GraphCaptureError, match="more recomputed regions in flight than its warm-up"):
        rng.context_fn()
    with pytest.raises(ValueError, match="cpu or cuda"):
        G.RecomputeRNG("meta")


def test_captured_graphs_hook():
    from moe_graph.cuda_graph import captured_graphs

    g, _ = _eager_graph(lambda x: x + 1)
    g(torch.zeros(2))
    assert g not in captured_graphs()  # eager: nothing captured, nothing baked in


# ------------------------------------------------------------------------------------------------- CUDA --
def _moe_model(seed=0, spare=0, recompute=False):
    from moe_graph.moe.layer import MoELayer

    torch.manual_seed(seed)
    return torch.nn.ModuleDict({
        "inp": torch.nn.Linear(32, 64, device="cuda", dtype=torch.bfloat16),
        "moe": MoELayer(64, 96, 8, 2, capacity_factor=2.0, aux_loss_coeff=0.01, device="cuda",
                        params_dtype=torch.bfloat16, num_spare_experts_per_ep_rank=spare, recompute=recompute),
        "out": torch.nn.Linear(64, 16, device="cuda", dtype=torch.bfloat16),
    })


def _batches(n, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [[{"x": torch.randn(128, 32, device="cuda", generator=g).bfloat16(),
              "y": torch.randint(0, 16, (128,), device="cuda", generator=g)} for _ in range(2)] for _ in range(n)]


@requires_cuda
@pytest.mark.parametrize("spare", [0, 1])
def test_cuda_replay_equals_eager_on_changing_data(spare):
    data = _batches(8, 1)
    m_eager = _moe_model(spare=spare)
    m_graph = copy.deepcopy(m_eager)
    for p in m_eager.parameters():
        p.grad = torch.zeros_like(p)
    for p in m_graph.parameters():
        p.grad = torch.zeros_like(p)
    opt_e = torch.optim.Adam(m_eager.parameters(), lr=1e-3, capturable=True)
    opt_g = torch.optim.Adam(m_graph.parameters(), lr=1e-3, capturable=True)
    step_e, step_g = _make_step(m_eager, opt_e), _make_step(m_graph, opt_g)
    graph = FullIterationGraph(step_g, warmup_steps=2, clone_outputs=True)
    le = [step_e(mbs) for mbs in data]
    lg = [graph(mbs) for mbs in data]
    assert graph.captured() and graph.iteration() == 8
    for a, b in zip(le, lg):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    assert not torch.equal(lg[-1], lg[-2])  # the data really changed
    for (n, pa), pb in zip(m_eager.named_parameters(), m_graph.parameters()):
        torch.testing.assert_close(pa.float(), pb.float(), rtol=2e-2, atol=2e-2, msg=lambda m: f"{n}: {m}")


@requires_cuda
@pytest.mark.parametrize("spare", [0, 1])
def test_cuda_one_warmup_step_with_recomputed_moe_layer(spare):
    # warmup_steps=1: the only warm-up step runs under sync debug mode "error" (the dispatcher's tables exist from
    # construction, nothing is copied lazily); the captured MoE layer is recomputed in backward and the replays
    # equal an eager model without recomputation.
    data = _batches(5, 3)
    m_eager = _moe_model(spare=spare)
    m_graph = _moe_model(spare=spare, recompute=True)  # the same seed: the same parameters
    for m in (m_eager, m_graph):
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
    opt_e = torch.optim.Adam(m_eager.parameters(), lr=1e-3, capturable=True)
    opt_g = torch.optim.Adam(m_graph.parameters(), lr=1e-3, capturable=True)
    graph = FullIterationGraph(_make_step(m_graph, opt_g), warmup_steps=1, clone_outputs=True)
    step_e = _make_step(m_eager, opt_e)
    le = [step_e(mbs) for mbs in data]
    lg = [graph(mbs) for mbs in data]
    assert graph.captured()
    for a, b in zip(le, lg):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    for (n, pa), pb in zip(m_eager.named_parameters(), m_graph.parameters()):
        torch.testing.assert_close(pa.float(), pb.float(), rtol=2e-2, atol=2e-2, msg=lambda m: f"{n}: {m}")


@requires_cuda
def test_cuda_recomputed_dropout_under_capture():
    # A recomputed dropout region inside a captured step: masks change per replay, and the gradients (computed
    # from the recomputation) equal the float32 oracle built from the mask the forward drew.
    torch.manual_seed(0)
    H = 64
    w = torch.randn(H, H, device="cuda", requires_grad=True)
    fn = _dropout_region(w)

    def step(x, r):
        y = checkpoint(fn, x)
        gx, gw = torch.autograd.grad((y * r).sum(), [x, w])
        return y.detach(), gx, gw

    graph = FullIterationGraph(step, warmup_steps=1, clone_outputs=True)
    masks = []
    for i in range(4):
        x = torch.randn(32, H, device="cuda", requires_grad=True)
        r = torch.randn(32, H, device="cuda")
        y, gx, gw = graph(x, r)
        mask = (y != 0).float() * 2
        torch.testing.assert_close(gx, (mask * r) @ w.detach().t(), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(gw, x.detach().t() @ (mask * r), rtol=1e-4, atol=1e-4)
        masks.append(mask)
    assert graph.captured()
    assert not torch.equal(masks[2], masks[3]) and not torch.equal(masks[1], masks[2])


@requires_cuda
def test_cuda_statistics_follow_training_replays_after_validation_capture():
    model = _moe_model()
    stats = model["moe"].statistics()  # references taken once, before any capture

    def train(x):
        h = model["inp"](x)
        model["out"](h + model["moe"](h)).float().sum().backward()

    def evaluate(x):
        with torch.no_grad():
            h = model["inp"](x)
            return model["out"](h + model["moe"](h))

    graph = FullIterationGraph(train, eval_fn=evaluate, warmup_steps=1)
    g = torch.Generator(device="cuda").manual_seed(5)
    xs = [torch.randn(128, 32, device="cuda", generator=g).bfloat16() for _ in range(6)]
    for i in range(2):
        graph(xs[i])
        graph.eval_step(xs[2 + i])  # the validation graph is captured too
    graph(xs[4])  # a training replay after the validation capture
    got = stats["tokens_per_expert"].clone()
    assert model["moe"].statistics()["tokens_per_expert"] is stats["tokens_per_expert"]
    with torch.no_grad():
        evaluate(xs[4])  # eager, same weights: what the training replay must have written
    assert got.tolist() == model["moe"].last_tokens_per_expert.tolist()
    assert int(got.sum()) == 128 * 2


@requires_cuda
def test_cuda_replays_do_not_sync():
    model = _moe_model(spare=1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=True)
    graph = FullIterationGraph(_make_step(model, opt), warmup_steps=2)
    data = _batches(5, 2)
    for mbs in data[:3]:
        graph(mbs)  # warm-up (checked under sync debug mode "error") and capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for mbs in data[3:]:
            graph(mbs)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@requires_cuda
def test_cuda_dropout_differs_per_replay_and_custom_generator():
    gen = torch.Generator(device="cuda").manual_seed(3)

    def fn(x):
        return torch.nn.functional.dropout(x, 0.5), torch.rand(x.shape, device="cuda", generator=gen)

    graph = FullIterationGraph(fn, warmup_steps=1, generators=[gen], clone_outputs=True)
    x = torch.ones(4096, device="cuda")
    outs = [graph(x) for _ in range(4)]
    assert graph.captured()
    assert not torch.equal(outs[2][0], outs[3][0])
    assert not torch.equal(outs[2][1], outs[3][1])


@requires_cuda
def test_cuda_host_sync_is_reported():
    def bad(x):
        return x * x.sum().item()

    graph = FullIterationGraph(bad, warmup_steps=1)
    with pytest.raises(GraphCaptureError, match="synchronizes with the host"):
        graph(torch.ones(4, device="cuda"))


@requires_cuda
def test_cuda_failed_capture_is_reported():
    # A capture that fails inside torch (the sync is not caught by our check) can leave the caching allocator in
    # capture mode on torch < 2.12, breaking later captures: run it in a child process.
    code = (
        "import torch\n"
        "from moe_graph.cuda_graph import FullIterationGraph, GraphCaptureError\n"
        "g = FullIterationGraph(lambda x: x * x.sum().item(), warmup_steps=1, check_syncs=False)\n"
        "g(torch.ones(4, device='cuda'))\n"
        "try:\n"
        "    g(torch.ones(4, device='cuda'))\n"
        "except GraphCaptureError as e:\n"
        "    assert 'capture failed' in str(e), e\n"
        "    print('REPORTED')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([_PY_DIR, os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert "REPORTED" in r.stdout, r.stdout + r.stderr


@requires_cuda
def test_cuda_validation_graph_and_shared_pool_and_reset():
    w = torch.ones(8, device="cuda", requires_grad=True)
    graph = FullIterationGraph(lambda x: (x * w).sum(), eval_fn=lambda x: (x * w).detach() + 1, share_pool=True,
                               warmup_steps=1, clone_outputs=True)
    for i in range(3):
        assert float(graph(torch.full((8,), float(i), device="cuda"))) == 8 * i
        assert graph.eval_step(torch.full((8,), float(i), device="cuda")).tolist() == [i + 1.0] * 8
    assert graph.captured("training") and graph.captured("validation")
    assert graph.pool("training") == graph.pool("validation")
    with pytest.raises(GraphShapeError):
        graph(torch.ones(9, device="cuda"))
    graph.reset()
    assert float(graph(torch.ones(9, device="cuda"))) == 9.0


def _pipeline_setup(device):
    from moe_graph.train.schedules import get_forward_backward_func

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1, device=device)

    def forward_step_func(data_iterator, model):
        mb = next(data_iterator)
        out = model(mb["x"])
        return out, lambda o: ((o.squeeze(-1) - mb["y"]) ** 2).mean()

    return model, forward_step_func, get_forward_backward_func(pp_size=1)


def test_full_cuda_graph_wrapper_eager_matches_direct_schedule():
    from moe_graph.cuda_graph import FullCudaGraphWrapper

    data = [{"x": torch.randn(3, 4), "y": torch.randn(3)} for _ in range(6)]
    m1, fs1, fb = _pipeline_setup("cpu")
    direct = fb(forward_step_func=fs1, data_iterator=iter(data[:3]), model=m1, num_microbatches=3)
    g1 = m1.weight.grad.clone()
    m2, fs2, fb2 = _pipeline_setup("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = FullCudaGraphWrapper(fb2, enabled=False)
    wrapped = w(forward_step_func=fs2, data_iterator=iter(data[:3]), model=m2, num_microbatches=3)
    assert [float(a) for a in direct] == [float(b) for b in wrapped]
    assert torch.equal(g1, m2.weight.grad)
    ev = w(forward_step_func=fs2, data_iterator=iter(data[3:]), model=m2, num_microbatches=3, forward_only=True)
    assert len(ev) == 3 and w.graph.iteration("validation") == 1
    with pytest.raises(GraphShapeError, match="model"):
        w(forward_step_func=fs2, data_iterator=iter(data[:3]), model=m1, num_microbatches=3)


def test_full_cuda_graph_wrapper_list_microbatches_and_per_chunk_iterators():
    """A microbatch that is itself a list ([x, y]) is one item, not a list of per-chunk iterators."""
    from moe_graph.cuda_graph import FullCudaGraphWrapper

    data = [{"x": torch.randn(3, 4), "y": torch.randn(3)} for _ in range(3)]
    m1, fs1, fb = _pipeline_setup("cpu")
    direct = fb(forward_step_func=fs1, data_iterator=iter(data), model=m1, num_microbatches=3)

    def as_list_step(it, model):
        x, y = next(it)
        return fs1(iter([{"x": x, "y": y}]), model)

    m2, fs2, fb2 = _pipeline_setup("cpu")
    m2.load_state_dict(m1.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = FullCudaGraphWrapper(fb2, enabled=False)
    pairs = [[d["x"], d["y"]] for d in data]
    got = w(forward_step_func=as_list_step, data_iterator=iter(pairs), model=m2, num_microbatches=3, forward_only=True)
    assert [float(a) for a in got] == [float(b) for b in direct]
    # one iterator per model chunk (a list of iterators) is still read per chunk (another input structure:
    # the graph must be reset)
    w.reset()
    got = w(forward_step_func=as_list_step, data_iterator=[iter(pairs)], model=m2, num_microbatches=3,
            forward_only=True)
    assert [float(a) for a in got] == [float(b) for b in direct]


@requires_cuda
def test_cuda_full_cuda_graph_wrapper_replays_schedule():
    from moe_graph.cuda_graph import FullCudaGraphWrapper
    from moe_graph.distributed.ddp import DistributedDataParallel

    m_e, fs_e, fb = _pipeline_setup("cuda")
    m_g, fs_g, _ = _pipeline_setup("cuda")
    d_e, d_g = DistributedDataParallel(m_e), DistributedDataParallel(m_g)  # static main_grad buffers
    w = FullCudaGraphWrapper(fb, cuda_graph_warmup_steps=1, clone_outputs=True)
    for it in range(4):
        data = [{"x": torch.randn(3, 4, device="cuda"), "y": torch.randn(3, device="cuda")} for _ in range(2)]
        d_e.zero_grad_buffer()
        d_g.zero_grad_buffer()  # outside the graph: zeroes the static buffers the graph accumulates into
        le = fb(forward_step_func=fs_e, data_iterator=iter(data), model=d_e, num_microbatches=2)
        lg = w(forward_step_func=fs_g, data_iterator=iter(data), model=d_g, num_microbatches=2)
        torch.testing.assert_close(torch.stack(list(le)), torch.stack(list(lg)))
        torch.testing.assert_close(m_e.weight.main_grad, m_g.weight.main_grad)
    assert w.graph.captured()
