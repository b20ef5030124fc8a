"""Distributed optimizer: shard ranges, Adam(W) step vs torch.optim, multi-process runs, checkpoints, memory."""


import pytest
import torch

from conftest import full_only
from helpers import optimizer_checks
from moe_graph.distributed.buffers import ParamAndGradBuffer
from moe_graph.distributed.ddp import DistributedDataParallel
from moe_graph.distributed.optimizer import (
    ConstantLossScaler,
    DistributedOptimizer,
    DynamicLossScaler,
    build_shard_ranges,
)


def _params(*numels, dtype=torch.float32):
    return [torch.nn.Parameter(torch.randn(n).to(dtype)) for n in numels]


def _as_tuples(ranges):
    return {k: tuple(v[k2] for k2 in ("gbuf_world", "gbuf_world_in_bucket", "gbuf_local", "param"))
            for k, v in ranges.items()}


# --------------------------------------------------------------------------------------------
# shard ranges (hand-computed)
# --------------------------------------------------------------------------------------------
def test_shard_ranges_single_bucket():
    # layout (see test_buffers): c [0,1000), b [1024,1124), a [1152,1162); bucket [0,1280); dp=2 -> shards of 640
    a, b, c = _params(10, 100, 1000)
    buf = ParamAndGradBuffer([a, b, c], 2, use_distributed_optimizer=True)
    r0 = _as_tuples(build_shard_ranges(buf, 0, 0))
    assert r0 == {c: ((0, 640), (0, 640), (0, 640), (0, 640))}
    r1 = build_shard_ranges(buf, 0, 1)
    assert list(r1) == [c, b, a]  # buffer walk order, as Megatron iterates param_index_map
    assert _as_tuples(r1) == {
        c: ((640, 1000), (640, 1000), (0, 360), (640, 1000)),
        b: ((1024, 1124), (1024, 1124), (384, 484), (0, 100)),
        a: ((1152, 1162), (1152, 1162), (512, 522), (0, 10)),
    }


def test_shard_ranges_multi_bucket_dp4():
    # layout: d [0,200), c [256,856), b [896,1396) in bucket 0 = [0,1408); a [1408,1708) in bucket 1 = [1408,1792)
    a, b, c, d = _params(300, 500, 600, 200)
    buf = ParamAndGradBuffer([a, b, c, d], 4, bucket_size=1000, use_distributed_optimizer=True)
    # bucket 0: 1408/4 = 352 per rank
    assert _as_tuples(build_shard_ranges(buf, 0, 0)) == {
        d: ((0, 200), (0, 200), (0, 200), (0, 200)), c: ((256, 352), (256, 352), (256, 352), (0, 96))}
    assert _as_tuples(build_shard_ranges(buf, 0, 1)) == {c: ((352, 704), (352, 704), (0, 352), (96, 448))}
    assert _as_tuples(build_shard_ranges(buf, 0, 2)) == {
        c: ((704, 856), (704, 856), (0, 152), (448, 600)), b: ((896, 1056), (896, 1056), (192, 352), (0, 160))}
    assert _as_tuples(build_shard_ranges(buf, 0, 3)) == {b: ((1056, 1396), (1056, 1396), (0, 340), (160, 500))}
    # bucket 1: offset 1408, 384/4 = 96 per rank
    assert _as_tuples(build_shard_ranges(buf, 1, 0)) == {a: ((1408, 1504), (0, 96), (0, 96), (0, 96))}
    assert _as_tuples(build_shard_ranges(buf, 1, 2)) == {a: ((1600, 1696), (192, 288), (0, 96), (192, 288))}
    assert _as_tuples(build_shard_ranges(buf, 1, 3)) == {a: ((1696, 1708), (288, 300), (0, 12), (288, 300))}


@pytest.mark.parametrize("dp", [1, 2, 3, 8])
@pytest.mark.parametrize("bucket_size", [None, 150, 700])
def test_shard_ranges_partition_every_param(dp, bucket_size):
    ps = _params(10, 300, 77, 1000, 64, 5)
    buf = ParamAndGradBuffer(ps, dp, bucket_size=bucket_size, use_distributed_optimizer=True)
    covered = {p: [] for p in ps}
    for bi, bucket in enumerate(buf.buckets):
        n = bucket.grad_data.numel() // dp
        for r in range(dp):
            for p, rg in build_shard_ranges(buf, bi, r).items():
                ws, we = rg["gbuf_world"]
                ls, le = rg["gbuf_local"]
                assert ws == bucket.offset + r * n + ls and we - ws == le - ls
                assert rg["gbuf_world_in_bucket"] == (ws - bucket.offset, we - bucket.offset)
                start = buf.param_index_map[p][0]
                assert rg["param"] == (ws - start, we - start)
                covered[p].append(rg["param"])
    for p, segs in covered.items():
        segs.sort()
        assert segs[0][0] == 0 and segs[-1][1] == p.numel()
        assert all(x[1] == y[0] for x, y in zip(segs, segs[1:]))


def test_shard_ranges_errors():
    buf = ParamAndGradBuffer(_params(10), 2, use_distributed_optimizer=True)
    with pytest.raises(ValueError, match="bucket_index"):
        build_shard_ranges(buf, 1, 0)
    with pytest.raises(ValueError, match="dp_rank"):
        build_shard_ranges(buf, 0, 2)


# --------------------------------------------------------------------------------------------
# single-process optimizer (dp=1, no process group)
# --------------------------------------------------------------------------------------------
def _run_single(impl, dtype=torch.float32, steps=4, clip=0.0, adamw=True, no_wd=False, **opt_kw):
    model = optimizer_checks.make_model(dtype)
    ddp = DistributedDataParallel(model, use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    nwd = [p for n, p in model.named_parameters() if n.endswith("bias")] if no_wd else None
    opt = DistributedOptimizer(ddp, lr=1e-2, weight_decay=0.1, impl=impl, clip_grad=clip, adamw=adamw,
                               no_weight_decay_params=nwd, **opt_kw)
    for it in range(steps):
        x, y = optimizer_checks.batch(it)
        ddp.zero_grad_buffer()
        (optimizer_checks.loss_fn(ddp(x.to(dtype)), y) * opt.loss_scale).backward()
        opt.step()
    return model, opt


def test_a_flag_set_before_the_optimizer_does_not_skip_its_steps():
    """The FP8 non-finite flag is one per device: set by a quantization before this optimizer was built (another
    model's pass, an evaluation), it is cleared at construction, so the steps equal torch's AdamW (none skipped),
    also in a loop that zeroes the grad buffers itself, never calling ``zero_grad``."""
    from moe_graph.ops import fp8
    flag = fp8.nonfinite_flag("cpu")
    if flag is None:
        pytest.skip("no compiled extension")
    flag.fill_(1)
    model, opt = _run_single("tensor")
    assert _maxdiff(model, _torch_ref()) < 2e-6
    assert int(flag[0]) == 0


def _torch_ref(steps=4, clip=0.0, adamw=True, no_wd=False):
    m = optimizer_checks.make_model()
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    if no_wd:
        groups = [{"params": [p for n, p in m.named_parameters() if not n.endswith("bias")]},
                  {"params": [p for n, p in m.named_parameters() if n.endswith("bias")], "weight_decay": 0.0}]
    else:
        groups = m.parameters()
    opt = cls(groups, lr=1e-2, weight_decay=0.1, foreach=False)
    for it in range(steps):
        x, y = optimizer_checks.batch(it)
        opt.zero_grad()
        optimizer_checks.loss_fn(m(x), y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
        opt.step()
    return m


def _maxdiff(a, b):
    return max((x.detach().float() - y.detach().float()).abs().max().item()
               for x, y in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("impl", ["tensor", "fused"])
@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_step_matches_torch_adamw_single_process(impl, clip):
    if impl == "fused" and not hasattr(torch, "_fused_adamw_"):
        pytest.skip("no torch._fused_adamw_")
    model, opt = _run_single(impl, clip=clip)
    assert opt.impl == impl
    ref = _torch_ref(clip=clip)
    assert _maxdiff(model, ref) < 2e-6
    assert _maxdiff(model, optimizer_checks.make_model()) > 1e-2  # it trained
    assert float(opt.step_count) == 4.0


def test_adam_l2_and_no_weight_decay_params():
    model, opt = _run_single("auto", no_wd=True)
    assert opt.impl == "tensor"  # per-element weight decay needs the tensor path
    assert _maxdiff(model, _torch_ref(no_wd=True)) < 2e-6
    assert _maxdiff(model, _torch_ref(no_wd=False)) > 1e-5  # the mask matters
    model, _ = _run_single("tensor", adamw=False)
    assert _maxdiff(model, _torch_ref(adamw=False)) < 2e-6


def test_loss_scaler_constant_is_transparent():
    model, _ = _run_single("tensor", loss_scaler=ConstantLossScaler(1024.0))
    assert _maxdiff(model, _torch_ref()) < 2e-6


def test_dynamic_loss_scaler_updates_without_branches():
    s = DynamicLossScaler(initial_scale=8.0, growth_interval=2, hysteresis=2, min_scale=2.0)
    seq = [False, True, True, True, False, False, False, False]
    got = []
    for inf in seq:
        s.update(torch.tensor(inf))
        got.append(float(s.scale))
    # step1 ok (g=1); inf (hyst 2->1, no backoff); inf (hyst 0 -> 4); inf (hyst -1 -> 2, min 2);
    # ok (g=1); ok (g=2 -> grow to 4, hyst refilled); ok (g=1); ok (g=2 -> 8)
    assert got == [8.0, 8.0, 4.0, 2.0, 2.0, 4.0, 4.0, 8.0]


def test_step_has_no_host_sync(monkeypatch):
    """Forbid every Tensor -> Python conversion while step() runs (the CPU stand-in for
    torch.cuda.set_sync_debug_mode('error'))."""
    model = optimizer_checks.make_model()
    ddp = DistributedDataParallel(model, use_distributed_optimizer=True)
    opts = [DistributedOptimizer(ddp, lr=1e-2, impl="tensor", clip_grad=1.0, loss_scaler=DynamicLossScaler()),
            DistributedOptimizer(ddp, lr=1e-2, impl="fused", clip_grad=1.0, loss_scaler=DynamicLossScaler())]

    def boom(*a, **k):
        raise AssertionError("host sync in step()")

    for opt in opts:
        x, y = optimizer_checks.batch(0)
        ddp.zero_grad_buffer()
        (optimizer_checks.loss_fn(ddp(x), y) * opt.loss_scale).backward()
        with monkeypatch.context() as m:
            for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy"):
                m.setattr(torch.Tensor, name, boom)
            ok, norm = opt.step()
        assert bool(ok) and float(norm) > 0


@pytest.mark.parametrize("impl", ["tensor", "fused"])
@pytest.mark.parametrize("amp_check", [True, False])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_nonfinite_grad_skips_update(impl, amp_check, bad):
    model = optimizer_checks.make_model()
    ddp = DistributedDataParallel(model, use_distributed_optimizer=True)
    opt = DistributedOptimizer(ddp, lr=1e-2, impl=impl, clip_grad=1.0, loss_scaler=ConstantLossScaler(4.0))
    opt._amp_check = amp_check and opt._amp_check  # also exercise the portable fallback
    x, y = optimizer_checks.batch(0)
    ddp.zero_grad_buffer()
    (optimizer_checks.loss_fn(ddp(x), y) * opt.loss_scale).backward()
    opt.step()
    state = [t.clone() for s in opt.shards for t in (s.main_param, s.exp_avg, s.exp_avg_sq)]
    ddp.zero_grad_buffer()
    (optimizer_checks.loss_fn(ddp(x), y) * opt.loss_scale).backward()
    model.fc2.bias.main_grad[1] = bad
    ok, norm = opt.step()
    assert not bool(ok) and not torch.isfinite(norm)
    after = [t for s in opt.shards for t in (s.main_param, s.exp_avg, s.exp_avg_sq)]
    assert all(torch.equal(a, b) for a, b in zip(state, after))
    assert float(opt.step_count) == 1.0
    ddp.zero_grad_buffer()
    (optimizer_checks.loss_fn(ddp(x), y) * opt.loss_scale).backward()
    ok, norm = opt.step()  # the next clean step proceeds
    assert bool(ok) and float(opt.step_count) == 2.0
    assert all(torch.isfinite(s.main_param).all() for s in opt.shards)


def test_optimizer_argument_errors():
    model = optimizer_checks.make_model()
    with pytest.raises(ValueError, match="use_distributed_optimizer=True"):
        DistributedOptimizer(DistributedDataParallel(model), lr=1e-3)
    ddp = DistributedDataParallel(optimizer_checks.make_model(), use_distributed_optimizer=True)
    with pytest.raises(ValueError, match="impl"):
        DistributedOptimizer(ddp, impl="apex")
    with pytest.raises(ValueError, match="betas"):
        DistributedOptimizer(ddp, betas=(1.0, 0.9))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_single_process_roundtrip(dtype):
    model, opt = _run_single("tensor", dtype=dtype, steps=2)
    sd = opt.state_dict()
    assert sd["format"] == "moe_graph.distributed_optimizer.sharded.v1"
    names = {n for n, _ in model.named_parameters()}
    assert set(sd["shard"]) == set(sd["metadata"]["params"]) == names
    assert (sd["metadata"]["dp_size"], sd["metadata"]["dp_rank"]) == (1, 0)
    w = sd["shard"]["fc1.weight"]
    assert w["range"] == (0, model.fc1.weight.numel()) and w["exp_avg_sq"].min() >= 0
    assert sd["metadata"]["params"]["fc1.weight"] == {"shape": (optimizer_checks.HID, optimizer_checks.IN), "dtype": str(dtype), "expert": False}
    # fp32: the model params are the main params (saved with the model); 16-bit: fp32 copies
    assert ("main_param" in w) == (dtype != torch.float32)
    if dtype != torch.float32:
        assert w["main_param"].dtype == torch.float32
        assert torch.equal(w["main_param"].to(dtype), model.fc1.weight.detach().reshape(-1))
    assert float(sd["step"]) == 2.0
    model2, opt2 = _run_single("tensor", dtype=dtype, steps=0)
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(sd)  # one dict = the single shard of a DP=1 run
    assert torch.equal(model2.fc1.weight.detach(), model.fc1.weight.detach())
    sd2 = opt2.state_dict()
    assert all(torch.equal(sd2["shard"][k][f], sd["shard"][k][f]) for k in sd["shard"] for f in w if f != "range")
    with pytest.raises(ValueError, match="format"):
        opt2.load_state_dict({"format": "other"})


def test_load_state_dict_errors_name_the_parameter():
    model, opt = _run_single("tensor", steps=1)
    sd = opt.state_dict()
    _, opt2 = _run_single("tensor", steps=0)
    bad = {**sd, "metadata": {**sd["metadata"], "params": {**sd["metadata"]["params"]}}}
    bad["metadata"]["params"]["fc2.weight"] = {**bad["metadata"]["params"]["fc2.weight"], "shape": (7, optimizer_checks.HID)}
    with pytest.raises(ValueError, match="fails its checksum"):  # an edited state fails its checksum
        opt2.load_state_dict(bad)
    with pytest.raises(ValueError, match=r"'fc2.weight'.*\(7, 40\)"):
        opt2.load_state_dict(bad, verify_checksum=False)
    _, opt16 = _run_single("tensor", dtype=torch.bfloat16, steps=0)
    with pytest.raises(ValueError, match=r"'fc2.bias' is torch.float32"):  # dtype mismatch
        opt16.load_state_dict(sd)
    piece = sd["shard"]["fc1.bias"]
    cut = {**sd, "shard": {**sd["shard"], "fc1.bias": {k: v if k == "range" else v[:30] for k, v in piece.items()}}}
    cut["shard"]["fc1.bias"]["range"] = (0, 30)
    with pytest.raises(ValueError, match=r"elements \[30, 40\) of parameter 'fc1.bias'"):
        opt2.load_state_dict(cut, verify_checksum=False)
    before = [t.clone() for s in opt2.shards for t in (s.exp_avg, s.exp_avg_sq)]
    del cut["shard"]["fc1.bias"]
    with pytest.raises(ValueError, match=r"\[0, 40\) of parameter 'fc1.bias'"):
        opt2.load_state_dict([cut], verify_checksum=False)
    # a failed load leaves the state untouched
    assert all(torch.equal(a, b) for a, b in zip(before, [t for s in opt2.shards for t in (s.exp_avg, s.exp_avg_sq)]))
    with pytest.raises(ValueError, match="different steps"):
        opt2.load_state_dict([sd, {**sd, "step": sd["step"] + 1}], verify_checksum=False)
    with pytest.raises(ValueError, match=r"elements \[0, \d+\) of '\w+\.\w+' are in two shards"):
        opt2.load_state_dict([sd, sd])  # the same file passed twice


# --------------------------------------------------------------------------------------------
# transactional loads (issue 12): every check before the first write
# --------------------------------------------------------------------------------------------
def _trained_bf16_with_scaler(steps):
    return _run_single("tensor", dtype=torch.bfloat16, steps=steps, clip=1.0,
                       loss_scaler=DynamicLossScaler(initial_scale=256.0, growth_interval=2))


@pytest.mark.parametrize("case", sorted(optimizer_checks.CORRUPTIONS))
def test_failed_load_leaves_state_bit_identical(case):
    """bf16 params (fp32 main params in the state) and a dynamic loss scaler: save after 2 steps, take a 3rd,
    then load a corrupted copy of the save. The load raises the expected error and leaves every byte the load
    could write (moments, main params, bf16 params, step, lr, settings, scaler) as it was."""
    corrupt, exc, msg, verify = optimizer_checks.CORRUPTIONS[case]
    model, opt = _trained_bf16_with_scaler(2)
    sd = opt.state_dict()
    x, y = optimizer_checks.batch(9)
    opt.zero_grad()
    (optimizer_checks.loss_fn(opt.model(x.to(torch.bfloat16)), y) * opt.loss_scale).backward()
    opt.step()
    before = optimizer_checks.optimizer_snapshot(opt)
    # the last piece in the copy order, so that a partial load would already have written the others
    name = [opt._name(p) for s in opt.shards for p in s.ranges][-1]
    with pytest.raises(exc, match=msg):
        opt.load_state_dict([corrupt(sd, name)], verify_checksum=verify)
    assert optimizer_checks.snapshots_identical(before, optimizer_checks.optimizer_snapshot(opt))
    opt.load_state_dict(sd)  # the intact state still loads, and restores the save exactly
    assert opt.state_dict()["checksum"] == sd["checksum"]


@pytest.mark.parametrize("state, msg", [
    (None, r"state must be the dict returned by state_dict\(\) or a list of them .* got NoneType"),
    ("ckpt.pt", r"state must be .* got str"),
    (7, r"state must be .* got int"),
    ([], r"no shard given"),
    ([None], r"shard 0 must be a dict saved by DistributedOptimizer.state_dict\(\), got NoneType"),
    ({"format": "other"}, r"unknown checkpoint format 'other'"),
])
def test_load_rejects_what_is_not_a_state(state, msg):
    _, opt = _run_single("tensor", steps=1)
    before = optimizer_checks.optimizer_snapshot(opt)
    with pytest.raises(ValueError, match=msg):
        opt.load_state_dict(state)
    assert optimizer_checks.snapshots_identical(before, optimizer_checks.optimizer_snapshot(opt))


def test_load_takes_number_step_and_lr():
    """A state edited by hand may hold Python numbers for ``step`` and ``lr`` (as torch.optim's states do)."""
    _, opt = _run_single("tensor", steps=2)
    sd = opt.state_dict()
    _, opt2 = _run_single("tensor", steps=0)
    opt2.load_state_dict({**sd, "step": 2.0, "lr": 0.5}, verify_checksum=False)
    assert float(opt2.step_count) == 2.0 and float(opt2.lr) == 0.5


def test_checksum_survives_torch_save_and_detects_damage():
    import io

    _, opt = _run_single("tensor", dtype=torch.bfloat16, steps=2, loss_scaler=DynamicLossScaler())
    sd = opt.state_dict()
    assert sd["checksum"].startswith("sha256:") and len(sd["checksum"]) == 7 + 64
    buf = io.BytesIO()
    torch.save(sd, buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    _, opt2 = _run_single("tensor", dtype=torch.bfloat16, steps=0, loss_scaler=DynamicLossScaler())
    opt2.load_state_dict(loaded)  # a file round trip keeps the checksum valid
    assert opt2.state_dict()["checksum"] == sd["checksum"]
    # one flipped bit anywhere in a tensor, or a changed number, fails the check
    for field in ("exp_avg", "exp_avg_sq", "main_param"):
        with pytest.raises(ValueError, match="fails its checksum"):
            opt2.load_state_dict(optimizer_checks._flip_byte(loaded, "fc1.weight", field))
    with pytest.raises(ValueError, match="fails its checksum"):
        opt2.load_state_dict({**loaded, "step": loaded["step"] + 1})
    with pytest.raises(ValueError, match="fails its checksum"):
        opt2.load_state_dict({**loaded, "hyper": {**loaded["hyper"], "eps": 1e-6}})
    # opting out: saved without, loaded without
    plain = opt.state_dict(checksum=False)
    assert "checksum" not in plain
    with pytest.raises(ValueError, match=r"has no 'checksum'.*verify_checksum=False"):
        opt2.load_state_dict(plain)
    opt2.load_state_dict(plain, verify_checksum=False)
    opt2.load_state_dict(optimizer_checks._flip_byte(loaded, "fc1.weight", "exp_avg"), verify_checksum=False)  # no check: loads


LOAD_FAILURE_CASES = ["short_piece", "range_none", "hyper_no_eps", "no_lr", "scaler_missing_key", "flipped_bit",
                      "step_fraction", "unknown_param", "injected"]


def _check_load_failures(res, cases=LOAD_FAILURE_CASES):
    """Results of :func:`optimizer_checks.load_failure_worker` on every rank (groups with a 30 s timeout): the last rank read a
    corrupted shard and raises its own error; every other rank raises too, after one flag all-reduce per group,
    instead of waiting in the param all-gather; all return within a few seconds with the state unchanged, and a
    clean load afterwards works everywhere. Run by the multi-process suites below (one spawn each)."""
    import re

    for case in cases:
        _, exc, msg, _ = optimizer_checks.CORRUPTIONS[case]
        t, m, _, _ = res[-1][case]
        assert t == exc.__name__ and re.search(msg, m), (case, t, m)
        for r in res[:-1]:  # the other ranks name the failing rank's error too
            assert r[case][0] == "CollectiveFailure" and "another rank could not load" in r[case][1], (case, r[case])
            assert re.search(msg, r[case][1]) and f"rank {len(res) - 1}: " in r[case][1], (case, r[case])
        assert all(r[case][3] for r in res), case  # live state bit-identical on every rank
        assert max(r[case][2] for r in res) < 10.0, case  # far below the 30 s a rank stuck in a collective takes
    assert all(all(r["clean_load_roundtrip"]) for r in res)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU")
@pytest.mark.parametrize("impl", ["tensor", "fused"])
def test_cuda_graph_capture_of_full_step(impl):
    """forward + backward + optimizer step captured once and replayed == eager."""
    dev = torch.device("cuda")

    def build():
        m = optimizer_checks.make_model().to(dev)
        d = DistributedDataParallel(m, use_distributed_optimizer=True)
        return m, d, DistributedOptimizer(d, lr=1e-2, impl=impl, clip_grad=1.0, loss_scaler=DynamicLossScaler())

    m_e, d_e, o_e = build()
    m_g, d_g, o_g = build()
    sx = torch.zeros(optimizer_checks.GLOBAL_BATCH, optimizer_checks.IN, device=dev)
    sy = torch.zeros(optimizer_checks.GLOBAL_BATCH, optimizer_checks.OUT, device=dev)

    def it(d, o, x, y):
        d.zero_grad_buffer()
        (optimizer_checks.loss_fn(d(x), y) * o.loss_scale).backward()
        o.step()

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up (also step 0 of the graphed model)
        x, y = optimizer_checks.batch(0)
        sx.copy_(x)
        sy.copy_(y)
        it(d_g, o_g, sx, sy)
    torch.cuda.current_stream().wait_stream(s)
    it(d_e, o_e, x.to(dev), y.to(dev))
    g = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(g):
            it(d_g, o_g, sx, sy)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for step in range(1, 4):
        x, y = optimizer_checks.batch(step)
        sx.copy_(x)
        sy.copy_(y)
        g.replay()
        it(d_e, o_e, x.to(dev), y.to(dev))
    torch.cuda.synchronize()
    assert _maxdiff(m_e, m_g) < 1e-5
    assert float(o_g.step_count) == float(o_e.step_count) == 4.0


# --------------------------------------------------------------------------------------------
# multi-process (gloo)
# --------------------------------------------------------------------------------------------
STEPS = 3


def _check_train(results, cfgs, ws):
    for cfg, r in zip(cfgs, results):
        dtype = cfg.get("dtype", torch.float32)
        ref = optimizer_checks.reference_adamw(STEPS, dtype, clip=cfg.get("clip", 0.0))
        init = optimizer_checks.make_model(dtype).float().state_dict()
        diff = torch.cat([(r["params"][k] - ref[k]).abs().flatten() for k in ref])
        moved = torch.cat([(init[k] - ref[k]).abs().flatten() for k in ref])
        assert r["consistent"], f"ranks disagree ({cfg}, ws={ws})"
        assert r["step"] == STEPS and r["n_expert_buffers"] == 1
        if dtype == torch.float32:
            assert diff.max() < 2e-6, (cfg, ws, diff.max())
        else:
            # Adam's first steps are ~sign(grad): a 16-bit forward may flip the sign of a tiny grad
            # (a 2*lr jump on that element), so compare in aggregate.
            assert diff.mean() < 0.03 * moved.mean(), (cfg, ws, diff.mean(), moved.mean())
            assert (diff > 1e-2).float().mean() < 0.01, (cfg, ws)
        if cfg.get("overlap"):
            assert r["dispatched_in_backward"] == [True] * STEPS  # hooks launched every bucket's collective
        if cfg.get("bucket_size", 10**9) <= 300:
            assert r["n_buckets"] == 3  # dense: [fc2.bias, fc2.weight] | [fc1.*]; expert: one bucket


TRAIN_CFGS = [
    dict(dtype=torch.float32),
    dict(dtype=torch.float32, overlap=True, bucket_size=300, impl="fused", microbatches=2),
    dict(dtype=torch.float32, clip=0.05),
    dict(dtype=torch.bfloat16),
    dict(dtype=torch.bfloat16, grad_fp32=False, overlap=True, bucket_size=500),
    dict(dtype=torch.float16, grad_fp32=False),
]


def _expected_bytes(d):
    return {"fp32/fp32": 8 + 8 / d, "bf16/fp32": 6 + 12 / d, "bf16/bf16": 4 + 16 / d, "fp16/fp16": 4 + 16 / d}


def test_two_ranks_training_memory_inf_allreduce_failed_load():
    res = optimizer_checks.run(optimizer_checks.suite_worker, 2, {"train": TRAIN_CFGS, "memory": True, "inf": True, "allreduce": True,
                                     "load_failure": (LOAD_FAILURE_CASES, 30.0)})
    _check_train(res[0]["train"], TRAIN_CFGS, 2)
    # DP=2: only rank 1 reads a corrupted shard; both raise at once, state unchanged (issue 12)
    _check_load_failures([r["load_failure"] for r in res])
    for r in res:
        assert r["memory"] == pytest.approx(_expected_bytes(2))
    # inf on the last rank at step 1: every rank skips that step, the scale backs off, then regrows
    for r in res:
        assert r["inf"]["ok"] == [True, False, True, True]
        assert r["inf"]["changed"] == [True, False, True, True]
        assert r["inf"]["scales"] == [1024.0, 512.0, 512.0, 1024.0]
        assert r["inf"]["step"] == 3.0
    # plain DDP (all-reduce): main_grad == grad of the mean loss over the global batch
    m = optimizer_checks.make_model()
    x, y = optimizer_checks.batch(0)
    optimizer_checks.loss_fn(m(x), y).backward()
    for r in res:
        for mode in ("sum", "avg"):
            got = r["allreduce"][mode]
            assert got["grad_is_none"] and got["n_groups"] > 2
            for n, p in m.named_parameters():
                torch.testing.assert_close(got["grads"][n], p.grad, atol=1e-6, rtol=1e-5)


def _check_shard_sizes(save, ws):
    """Each rank's file holds ~1/ws of the state; together the files hold each element once."""
    fields = ("exp_avg", "exp_avg_sq") + (("main_param",) if "main_param" in save[0]["shard_numel"] else ())
    for f in fields:
        sizes = [r["shard_numel"][f] for r in save]
        assert sum(sizes) == save[0]["numel"], (f, sizes)
        for r, n in zip(save, sizes):
            assert n <= r["shard_bound"] <= -(-r["numel"] // ws) + r["padding"], (f, sizes)
    assert [(r["metadata"]["dp_size"], r["metadata"]["dp_rank"]) for r in save] == [(ws, i) for i in range(ws)]


def test_four_ranks_then_resume_at_two_and_one(tmp_path):
    """Train at DP=4, each rank saves its own shard, take one more step. In the same 4 processes,
    two DP=2 replicas (groups {0,1} and {2,3}) and four DP=1 replicas load the 4 files and take that
    step too, for fp32 and bf16 params. Then a load without the last file fails on every rank, and so does a load
    in which one rank reads a corrupted file."""
    cfgs = [dict(dtype=torch.float32), dict(dtype=torch.bfloat16, overlap=True, bucket_size=400)]
    dtypes = [torch.float32, torch.bfloat16]
    prefixes = [str(tmp_path / f"ckpt_{str(d)[6:]}") for d in dtypes]
    save = [(pre, d, 2) for pre, d in zip(prefixes, dtypes)]
    load = [(pre, d, 2, dp) for pre, d in zip(prefixes, dtypes) for dp in (2, 1)]
    res = optimizer_checks.run(optimizer_checks.suite_worker, 4, {"train": cfgs, "memory": True, "save": save, "load": load,
                                     "missing": [(prefixes[1], torch.bfloat16, 2)],
                                     "load_failure": (["short_piece", "flipped_bit"], 30.0, 2)})
    _check_train(res[0]["train"], cfgs, 4)
    # DP groups {0, 1}, {2, 3}; model-parallel groups {0, 2}, {1, 3} (two stages). Rank 3 reads a corrupted shard:
    # ranks 0 and 1, whose DP group is intact, raise too (the flag crosses the model-parallel group), so no stage
    # resumes while another keeps its old state (issue 12)
    _check_load_failures([r["load_failure"] for r in res], ["short_piece", "flipped_bit"])
    for r in res:
        assert r["memory"] == pytest.approx(_expected_bytes(4))
    ref = optimizer_checks.reference_adamw(3, torch.float32)
    for i, dtype in enumerate(dtypes):
        _check_shard_sizes([r["save"][i] for r in res], 4)
        saved = res[0]["save"][i]
        for j, dp in enumerate((2, 1)):
            for r in res:
                resumed = r["load"][2 * i + j]
                # the restored state is exactly the saved one (for bf16: the fp32 main params, not
                # values re-derived from the bf16 model params), and the hyper-parameters came back
                assert resumed["dp_size"] == dp and resumed["roundtrip_exact"]
                assert resumed["lr"] == pytest.approx(1e-2)
                # the next step at DP=2 / DP=1 equals the next step at DP=4: fp32 up to the order of
                # the gradient sums, and the single-process reference
                if dtype == torch.float32:
                    for k in ref:
                        torch.testing.assert_close(resumed["main"][k], saved["main"][k], atol=1e-6, rtol=0)
                        torch.testing.assert_close(resumed["params"][k], saved["params"][k], atol=1e-6, rtol=0)
                        torch.testing.assert_close(resumed["params"][k], ref[k], atol=2e-6, rtol=0)
                    continue
                # bf16: each rank's bf16 grads are sums over its own rows, so the grads differ at bf16
                # precision between DP sizes (~5e-6 mean, ~1e-4 max on the next fp32 main params).
                # Main params re-derived from the bf16 params would be off by ~1.3e-4 mean, ~1e-3 max.
                diff = torch.cat([(resumed["main"][k] - saved["main"][k]).abs().flatten() for k in ref])
                assert diff.mean() < 2e-5 and diff.max() < 4e-4, (dp, diff.mean(), diff.max())
                pdiff = torch.cat([(resumed["params"][k] - saved["params"][k]).abs().flatten() for k in ref])
                assert (pdiff > 0).float().mean() < 0.1 and pdiff.max() <= 2**-8, (dp, pdiff.max())
    # without the last DP=4 file, DP=2 rank 1's range is not covered: it names the parameter, and
    # the other rank of its group raises too instead of waiting in the param all-gather
    msgs = [r["missing"][0] for r in res]
    assert all(m.startswith("CollectiveFailure: load_state_dict: another rank") or "no saved shard covers" in m
               for m in msgs), msgs
    assert "no saved shard covers" in msgs[1] and "of parameter '" in msgs[1], msgs
    assert msgs[0].startswith("CollectiveFailure") and "no saved shard covers" in msgs[0], msgs


def test_expert_dp_differs_from_dense_dp(tmp_path):
    """4 ranks, EP=2: dense DP=4, expert DP=2 (each expert's grads reduced over 2 ranks), grad
    clipping on. Grad norm and params match one process training every expert on the whole batch:
    the global norm counts each dense and each expert parameter once. The sharded checkpoint
    (expert params share names across EP ranks) then resumes at dense DP=2, expert DP=1."""
    steps, clip = 3, 0.05
    res = optimizer_checks.run(optimizer_checks.expert_dp_worker, 4, str(tmp_path / "moe"), 2, steps, clip)
    ref, ref_norms = optimizer_checks.moe_reference(steps, clip)
    assert min(ref_norms) > clip  # clipping is active on every step
    assert [(r["dp"], r["expert_dp"]) for r in res] == [(4, 2)] * 4
    assert [r["expert_names"][0] for r in res] == ["experts.bias[0]", "experts.bias[2]"] * 2
    experts = {k for r in res for k in r["params"] if k.startswith("experts.")}
    assert experts == {k for k in ref if k.startswith("experts.")}
    for r in res:
        assert r["norms"] == pytest.approx(ref_norms, rel=1e-5, abs=0)
        assert r["resumed_norm"] == pytest.approx(r["norms"][-1], rel=1e-5, abs=0)
        for k, v in r["params"].items():
            torch.testing.assert_close(v, ref[k], atol=2e-6, rtol=0)
            torch.testing.assert_close(r["resumed_params"][k], v, atol=1e-6, rtol=0)


@pytest.mark.parametrize("world", full_only(8))
def test_eight_ranks_training_and_memory(world):
    """The 2- and 4-rank tests above check the same training and memory rows; this one at 8 ranks (skipped with
    ``MOE_GRAPH_FULL_TESTS=0``)."""
    cfgs = [dict(dtype=torch.float32, overlap=True, bucket_size=300), dict(dtype=torch.bfloat16)]
    res = optimizer_checks.run(optimizer_checks.suite_worker, world, {"train": cfgs, "memory": True})
    _check_train(res[0]["train"], cfgs, world)
    assert res[0]["memory"] == pytest.approx(_expected_bytes(world))
    assert res[0]["memory"]["bf16/fp32"] == pytest.approx(6 + 12 / 8)  # the seed's 6 + 12/d row


# --------------------------------------------------------------------------------------------
# grad norm over tensor- and pipeline-parallel ranks (Megatron's counting rules)
# --------------------------------------------------------------------------------------------
def test_grad_norm_counts_tp_duplicates_once_single_process():
    # As tensor-parallel rank 1: the duplicate bias and the shared embedding are counted elsewhere.
    for tp_rank, shared in ((0, False), (1, False), (0, True)):
        module = optimizer_checks.tp_pp_module(tp_rank, last_stage=shared)
        ddp = DistributedDataParallel(module, use_distributed_optimizer=True)
        opt = DistributedOptimizer(ddp, lr=1e-2, impl="tensor", tensor_model_parallel_rank=tp_rank)
        gw, gb, ge = torch.randn(3, 4), torch.randn(4), torch.randn(5)
        ddp.zero_grad_buffer()
        for p, g in ((module.w, gw), (module.b, gb), (module.emb, ge)):
            p.main_grad.copy_(g)
        _, norm = opt.step()
        dup = gb.square().sum() + (0 if shared else ge.square().sum())  # b and emb are not tensor_model_parallel
        expect = gw.square().sum() + (dup if tp_rank == 0 else 0)
        torch.testing.assert_close(norm, expect.sqrt())


@pytest.mark.parametrize("clip", [1.0, *full_only(0.0)])  # 1.0 clips and checks the norm too
def test_grad_norm_and_clipping_over_tp2_pp2(clip):
    res = optimizer_checks.run(optimizer_checks.tp_pp_norm_worker, 4, clip, True)
    grads = optimizer_checks.tp_pp_grads()
    total = sum(gw.square().sum() + gb.square().sum() for gw, gb in grads["stages"].values())
    expect = float((total + grads["emb"].square().sum()).sqrt())
    assert all(r["ok"] for r in res)
    for r in res:  # one global norm on every stage and TP rank
        assert r["norm"] == pytest.approx(expect, rel=1e-6)
    coef = min(1.0, clip / (expect + 1e-6)) if clip > 0 else 1.0
    for rank, r in enumerate(res):
        gw = grads["stages"][rank // 2][0][3 * (rank % 2):3 * (rank % 2) + 3]
        torch.testing.assert_close(r["w_grad"], gw * coef)
    if clip > 0:
        # without the model-parallel group each stage would clip with its own partial norm
        local = optimizer_checks.run(optimizer_checks.tp_pp_norm_worker, 4, clip, False)
        assert all(abs(r["norm"] - expect) > 1e-3 for r in local)


def test_one_optimizer_over_model_chunks_single_process():
    # The interleaved schedule's model chunks: one optimizer, one global norm, names prefixed by chunk; the same
    # updates as one optimizer over one module holding both chunks.
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)
    both = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    both.load_state_dict({"0." + k: v for k, v in a.state_dict().items()} | {"1." + k: v for k, v in b.state_dict().items()})
    chunks = [DistributedDataParallel(m, use_distributed_optimizer=True) for m in (a, b)]
    whole = DistributedDataParallel(both, use_distributed_optimizer=True)
    opt_c = DistributedOptimizer(chunks, lr=1e-2, clip_grad=0.1, impl="tensor")
    opt_w = DistributedOptimizer(whole, lr=1e-2, clip_grad=0.1, impl="tensor")
    x = torch.randn(5, 4)
    for _ in range(2):
        opt_c.zero_grad()
        opt_w.zero_grad()
        b(a(x)).square().sum().backward()
        both(x).square().sum().backward()
        (_, n_c), (_, n_w) = opt_c.step(), opt_w.step()
        torch.testing.assert_close(n_c, n_w)
    for p, q in zip(list(a.parameters()) + list(b.parameters()), both.parameters()):
        torch.testing.assert_close(p, q)
    sd = opt_c.state_dict()
    assert sorted(sd["shard"]) == ["chunk0.bias", "chunk0.weight", "chunk1.bias", "chunk1.weight"]
    assert sorted(sd["metadata"]["params"]) == sorted(sd["shard"])
    import copy

    before = copy.deepcopy(sd["shard"])
    opt_c.load_state_dict([sd])
    torch.testing.assert_close(opt_c.state_dict()["shard"], before, rtol=0, atol=0)
    with pytest.raises(ValueError, match="empty list"):
        DistributedOptimizer([], lr=1e-3)


# --------------------------------------------------------------------------------------------
# settings under a captured step (issue 14 item 3)
# --------------------------------------------------------------------------------------------
def _ref_with_settings(settings_per_step, steps=4):
    """torch.optim.AdamW / Adam with clip_grad_norm_, the settings of step i from ``settings_per_step[i]``."""
    m = optimizer_checks.make_model()
    adamw = settings_per_step[0]["adamw"]
    opt = (torch.optim.AdamW if adamw else torch.optim.Adam)(m.parameters(), lr=1e-2, foreach=False)
    for it in range(steps):
        st = settings_per_step[it]
        for g in opt.param_groups:
            g.update(betas=(st["beta1"], st["beta2"]), eps=st["eps"], weight_decay=st["weight_decay"], lr=st["lr"])
        x, y = optimizer_checks.batch(it)
        opt.zero_grad()
        optimizer_checks.loss_fn(m(x), y).backward()
        if st["clip_grad"] > 0:
            torch.nn.utils.clip_grad_norm_(m.parameters(), st["clip_grad"])
        opt.step()
    return m


def test_tensor_path_reads_every_setting_from_device_tensors():
    """What a replay of a captured step sees: the tensor path's numbers come from device tensors only. Write new
    values into those tensors alone (the Python attributes keep the old ones) between steps: the updates follow
    the tensors, and match torch.optim with the same changes."""
    a = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, clip_grad=0.05, lr=1e-2, adamw=True)
    b = dict(beta1=0.5, beta2=0.9, eps=1e-3, weight_decay=0.3, clip_grad=0.2, lr=3e-2, adamw=True)
    model = optimizer_checks.make_model()
    ddp = DistributedDataParallel(model, use_distributed_optimizer=True)
    opt = DistributedOptimizer(ddp, lr=a["lr"], betas=(a["beta1"], a["beta2"]), eps=a["eps"],
                               weight_decay=a["weight_decay"], clip_grad=a["clip_grad"], impl="tensor")
    ptrs = {k: t.data_ptr() for k, t in opt._settings_t.items()}
    for it in range(4):
        if it == 2:
            for k in ("beta1", "beta2", "eps", "weight_decay", "clip_grad"):
                opt._settings_t[k].fill_(b[k])
            opt.lr.fill_(b["lr"])
        x, y = optimizer_checks.batch(it)
        ddp.zero_grad_buffer()
        optimizer_checks.loss_fn(ddp(x), y).backward()
        opt.step()
    assert opt.beta1 == a["beta1"]  # the Python value was not consulted
    ref = _ref_with_settings([a, a, b, b])
    assert _maxdiff(model, ref) < 2e-6
    assert _maxdiff(model, _ref_with_settings([a] * 4)) > 1e-4  # the change mattered
    # the public setters write those same tensors in place (a captured graph keeps their addresses)
    opt.beta1, opt.eps, opt.weight_decay, opt.clip_grad = 0.8, 1e-6, 0.0, 0.0
    assert {k: t.data_ptr() for k, t in opt._settings_t.items()} == ptrs
    assert [float(opt._settings_t[k]) for k in ("beta1", "eps", "weight_decay", "clip_grad")] == \
        pytest.approx([0.8, 1e-6, 0.0, 0.0])


def _captured(monkeypatch, opt, fig):
    """Run one step as if ``fig`` (a FullIterationGraph) were capturing it on a CUDA stream."""
    from moe_graph import cuda_graph
    from moe_graph.distributed import optimizer

    monkeypatch.setattr(optimizer, "_stream_capturing", lambda device: True)
    x, y = optimizer_checks.batch(0)
    opt.zero_grad()
    optimizer_checks.loss_fn(opt.model(x), y).backward()
    with cuda_graph._capture_scope(fig._modes["training"]):
        opt.step()
    monkeypatch.setattr(optimizer, "_stream_capturing", lambda device: False)


@pytest.mark.filterwarnings("ignore:FullIterationGraph")
@pytest.mark.parametrize("impl", ["tensor", "fused"])
def test_settings_baked_into_a_capture_raise_until_reset(monkeypatch, impl):
    from moe_graph.cuda_graph import FullIterationGraph

    ddp = DistributedDataParallel(optimizer_checks.make_model(), use_distributed_optimizer=True)
    opt = DistributedOptimizer(ddp, lr=1e-2, weight_decay=0.1, clip_grad=0.0, impl=impl)
    fig = FullIterationGraph(lambda: None, enabled=False)
    sd = opt.state_dict()
    _captured(monkeypatch, opt, fig)
    frozen = ["adamw", "clip_grad"] + (["beta1", "beta2", "eps"] if impl == "fused" else [])
    new = {"adamw": False, "clip_grad": 1.0, "beta1": 0.8, "beta2": 0.99, "eps": 1e-6}
    for name in frozen:
        with pytest.raises(RuntimeError, match=rf"cannot change {name} while a captured CUDA graph .*"
                                               r"FullIterationGraph\.reset\(\)"):
            setattr(opt, name, new[name])
        assert getattr(opt, name) != new[name]
    for name in set(new) - set(frozen):  # held in device tensors: allowed
        setattr(opt, name, new[name])
        assert float(opt._settings_t[name]) == pytest.approx(new[name])
    opt.lr.fill_(5e-3)
    opt.set_lr(2e-3)
    opt.weight_decay = 0.1  # unchanged value: fine on both paths
    if impl == "tensor":
        opt.weight_decay = 0.0  # captured with decay code: 0 is a value it can take
    else:
        with pytest.raises(RuntimeError, match="cannot change weight_decay"):
            opt.weight_decay = 0.2
    # a checkpoint whose hyper-parameters differ in a frozen setting is refused before anything is written
    before = optimizer_checks.optimizer_snapshot(opt)
    with pytest.raises(RuntimeError, match=r"cannot change adamw.*FullIterationGraph\.reset\(\)"):
        opt.load_state_dict({**sd, "hyper": {**sd["hyper"], "adamw": False}}, verify_checksum=False)
    assert optimizer_checks.snapshots_identical(before, optimizer_checks.optimizer_snapshot(opt))
    fig.reset()  # releases the capture: every setting may change again
    for name in frozen:
        setattr(opt, name, new[name])
        assert getattr(opt, name) == new[name]
    opt.load_state_dict(sd)
    assert opt.adamw is True and opt.clip_grad == 0.0


def test_release_captures_for_graphs_captured_by_hand(monkeypatch):
    ddp = DistributedDataParallel(optimizer_checks.make_model(), use_distributed_optimizer=True)
    opt = DistributedOptimizer(ddp, lr=1e-2, impl="fused")
    from moe_graph.distributed import optimizer

    monkeypatch.setattr(optimizer, "_stream_capturing", lambda device: True)  # a torch.cuda.graph outside FullIterationGraph
    x, y = optimizer_checks.batch(0)
    optimizer_checks.loss_fn(ddp(x), y).backward()
    opt.step()
    with pytest.raises(RuntimeError, match=r"release_captures\(\)"):
        opt.beta2 = 0.95
    opt.release_captures()
    opt.beta2 = 0.95
    assert opt.beta2 == 0.95


@pytest.mark.parametrize("name, value, msg", [
    ("beta1", 1.0, r"betas must be a pair .* in \[0, 1\)"), ("eps", -1.0, "eps must be a finite number >= 0"),
    ("weight_decay", float("nan"), "weight_decay must be"), ("clip_grad", "x", "clip_grad must be"),
    ("adamw", 1, "adamw must be a bool")])
def test_setting_setters_validate(name, value, msg):
    ddp = DistributedDataParallel(optimizer_checks.make_model(), use_distributed_optimizer=True)
    opt = DistributedOptimizer(ddp, lr=1e-2, impl="tensor")
    old = getattr(opt, name)
    with pytest.raises(ValueError, match=msg):
        setattr(opt, name, value)
    assert getattr(opt, name) == old


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU")
def test_settings_changed_under_a_real_capture_match_eager():
    """FullIterationGraph captures forward + backward + step (tensor path); after two replays beta1, beta2, eps,
    weight_decay, clip_grad and lr change: the replays follow, equal to an eager optimizer with the same changes.
    On the fused path beta1 raises until reset(); after reset the recaptured step uses the new value."""
    from moe_graph.cuda_graph import FullIterationGraph

    dev = torch.device("cuda")
    changes = dict(beta1=0.5, beta2=0.9, eps=1e-3, weight_decay=0.3, clip_grad=0.2)

    def build(impl):
        m = optimizer_checks.make_model().to(dev)
        d = DistributedDataParallel(m, use_distributed_optimizer=True)
        return m, d, DistributedOptimizer(d, lr=1e-2, weight_decay=0.1, clip_grad=0.05, impl=impl)

    for impl in ("tensor", "fused"):
        m_e, d_e, o_e = build(impl)
        m_g, d_g, o_g = build(impl)

        def it(d, o, x, y):
            d.zero_grad_buffer()
            optimizer_checks.loss_fn(d(x), y).backward()
            o.step()

        fig = FullIterationGraph(lambda x, y: it(d_g, o_g, x, y), warmup_steps=1)
        for step in range(6):
            if step == 3:
                if impl == "fused":
                    with pytest.raises(RuntimeError, match=r"FullIterationGraph\.reset\(\)"):
                        o_g.beta1 = changes["beta1"]
                    fig.reset()
                for k, v in changes.items():
                    setattr(o_g, k, v)
                    setattr(o_e, k, v)
                o_g.set_lr(3e-2)
                o_e.set_lr(3e-2)
            x, y = (t.to(dev) for t in optimizer_checks.batch(step))
            fig(x, y)
            it(d_e, o_e, x, y)
        torch.cuda.synchronize()
        assert fig.captured()
        assert _maxdiff(m_e, m_g) < 1e-5, impl
