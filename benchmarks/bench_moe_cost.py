"""The cost of one MoE layer outside its GEMMs, measured on the CPU: moe_graph's MoELayer, Megatron-core 0.19.2's
MoELayer and a PyTorch-native MoE side by side, with the same weights, routing and inputs (fp32, EP 1).

On a GPU the part of the layer outside the GEMMs is memory-bound (bytes / ~3 TB/s) and each op is a kernel launch
or a CUDA-graph node, so these device-independent counts predict it. For one forward + backward:

* ``launches fwd/bwd``: ops reaching the dispatcher (a ``TorchDispatchMode``), views and allocations left out
  (they launch nothing); each counted op is a kernel launch or a graph node.
* ``non-GEMM bytes/token``: for every op that is not a GEMM, the bytes of its tensor arguments (read) and results
  (written), each tensor counted whole (broadcast dimensions once), over the tokens of the batch. An upper bound
  for gathers, which read only the rows they index; the same rule for every system. The target of an in-place
  indexed write (``index_add_``, ``index_copy_``, ``index_fill_``) counts as the rows it indexes, read and written;
  a factory that takes a tensor for its metadata only (``new_zeros``, ``zeros_like``, ...) counts its result only
  (results before this rule, up to cc62e1c, also counted that tensor as read: FP8's ``new_zeros(h)`` of fc1's output).
* ``saved bytes/token``: unique storages autograd saves for backward in the forward
  (``torch.autograd.graph.saved_tensors_hooks``) and still holds when the forward returns, parameters left out.
* ``host syncs``: places where the host waits for device values: ``aten._local_scalar_dense`` (``.item()``,
  ``bool(t)``), data-dependent-shape ops (``nonzero``, ``masked_select``, ``unique``, ...), ``.tolist()`` /
  ``.numpy()`` / ``.cpu()`` of tensors the device computed, and stream/event/device synchronizes (Megatron's
  device-to-host copy of its split sizes, through ``megatron_env.cpu_shims``).
* ``cpu_ms``: the host time of a forward + backward on this CPU (information only: GEMMs included).

Systems: moe_graph's MoELayer (echo off; echo off with weight gradients fused into ``main_grad``; one echo slot with
fused ``main_grad``; in bf16 without FP8, with FP8 blockwise experts (``moe_graph.fp8.autocast``), and with FP8
dispatch as well: the column ``of which FP8 quantize`` is the bytes of the quantize ops, ``dispatch bytes/token``
the bytes of the K rows one token sends at EP > 1, from the row width the layer moves: 16-bit or FP8 + scales; the
bf16 rows' ``max abs diff`` is against the bf16 layer), Megatron-core's MoELayer (all-to-all dispatcher; ``SequentialMLP`` experts, and
``TEGroupedMLP`` on moe_graph's GroupedLinear through ``moe_graph.integrations.megatron``; and moe_graph's token
dispatcher inside it, ``moe_graph.integrations.megatron_moe``) and a PyTorch-native MoE
(``torch._grouped_mm`` experts, index-based permutation). Configurations (scaled down): Qwen3-30B-A3B-like
(softmax top-8 of 128, renormalized), Mixtral-like (top-2 of 8), DeepSeek-V3-like (sigmoid top-8 of 64 in 8 groups,
4 groups per token, expert bias, scaling 2.5, one shared expert). Dropless, router losses off. Every system's output
is checked against moe_graph's (``max_abs_diff``): the same routing and weights.

Megatron-core is fetched into ``build/`` (``megatron_env.provide_megatron``); without it its rows are skipped with
the reason.

**Production-like rows** (``production`` in the JSON; issue 41's measure): moe_graph's layer in bf16, with FP8
blockwise experts, and with FP8 experts + FP8 dispatch, at 2048 and 16,384 tokens per rank (``--production-tokens``),
EP 1 and EP 8 (``--ep``), as in training:

* the layer's input and output gradient in bf16 (the parameters' dtype), as a bf16 model passes them: no dtype
  conversion around the layer is counted (the results up to commit ab1234a counted an fp32 input's and gradient's
  conversions, 24 x H bytes per token, in every row);

* fused ``main_grad``, and the FP8 expert weights quantized once per optimizer step as
  ``DistributedOptimizer(fp8_param_gather=...)`` does (the forward reads ``param.fp8_gathered`` and quantizes no
  weight). That step's quantization, ``moe_graph.fp8.quantize_weight`` of fc1 and fc2 (both copies), is counted on
  its own and divided over ``--microbatches`` (default 8) microbatches of the rank's tokens: ``weight quantize
  (amortized)`` = its bytes / (tokens x microbatches), included in ``non-GEMM bytes/token`` and in ``of which FP8
  quantize``; its launches are per step and not in the forward's count (``weight_quantize_launches_per_step``).
* EP 8 is rank 0 of 8 EP ranks in this one process (:func:`simulated_ep`: torch's ``fake`` process group, its
  collectives replaced by a symmetric world where rank ``s`` routes as rank 0 with the experts shifted by ``s``
  ranks): ``E / 8`` local experts, the per-pair all-to-all (``exchange="nccl"``) with capacity factor 1, i.e. the
  ``T * K / 8`` routes per (source, destination) pair of a balanced routing, so the rank's experts get ``T * K`` rows
  as at EP 1 (routes over a pair's capacity are dropped; the shapes, hence the counts, are the same). Each
  collective counts as one launch that reads its input and writes its output (``of which exchange``; ``c10d.*`` in
  the breakdown). Everything else is the layer's own EP 8 path (count all-gather, receive layout, regrouping).
* The GEMMs do not run (:class:`GemmStub`: a grouped GEMM returns zeros of its output's shape): launches and bytes
  depend on shapes only (no data-dependent shape on this path); the test checks the counts equal a run with the
  real GEMMs. No CPU time and no output check in these rows.
* Printed with, for every FP8 row, the ops whose bytes per token differ most from the bf16 row's (FP8 / bf16 /
  excess), so an excess over bf16 is attributable to ops.

    PYTHONPATH=python python3 benchmarks/bench_moe_cost.py                       # all configurations
    PYTHONPATH=python python3 benchmarks/bench_moe_cost.py --configs mixtral --tokens 128
    PYTHONPATH=python python3 benchmarks/bench_moe_cost.py --production-only    # only the production-like rows
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import weakref
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from common import environment, results_path, time_cpu, write_json  # noqa: E402
from megatron_env import cpu_shims, provide_megatron  # noqa: E402
from moe_graph.distributed.fp8_params import Fp8GatheredWeight  # noqa: E402
from moe_graph.moe import echo_planner  # noqa: E402
from moe_graph.moe.layer import MoELayer  # noqa: E402
from moe_graph.ops import fp8 as moe_graph_fp8  # noqa: E402
from moe_graph.ops.errors import check_errors  # noqa: E402
from moe_graph.ops import reroute as reroute_ops  # noqa: E402

CONFIGS = {  # hidden, ffn (per expert), experts, topk, tokens, router options
    "qwen3": dict(H=256, F=96, E=128, K=8, T=2048, score="softmax"),
    "mixtral": dict(H=256, F=896, E=8, K=2, T=2048, score="softmax"),
    "deepseek": dict(H=256, F=64, E=64, K=8, T=2048, score="sigmoid", groups=8, group_topk=4, scaling=2.5,
                     shared=64),
}
LABELS = {"qwen3": "Qwen3-30B-A3B-like", "mixtral": "Mixtral-like", "deepseek": "DeepSeek-V3-like"}

GEMM_OPS = {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "addmv", "mv", "grouped_gemm", "grouped_gemm_out",
            "grouped_gemm_wgrad", "grouped_gemm_wgrad_out", "fp8_scaled_grouped_gemm", "fp8_scaled_grouped_wgrad_out"}
# no kernel: allocation, metadata and aliasing ops
FREE_OPS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_unsafe_view", "lift_fresh",
            "detach", "alias", "is_same_size", "_has_compatible_shallow_copy_type", "sym_size", "sym_stride",
            "sym_numel", "sym_storage_offset", "is_nonzero", "set_", "resize_", "record_stream"}
# the host reads device values (a device-to-host copy the host waits for)
SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
            "unique_consecutive", "bincount", "equal", "allclose", "masked_scatter_", "_assert_async"}


# the FP8 quantize ops: the column "of which FP8 quantize" is their bytes
QUANTIZE_OPS = ("moe_graph.fp8_quantize", "moe_graph.fp8_quantize_pair", "moe_graph.expand_quantize_pair")


def _nbytes(t: torch.Tensor) -> int:
    """Bytes a kernel touches for ``t``: its elements, broadcast (stride 0) dimensions once."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size() if t.numel() else 0


# in place into the rows an index names (``self.index_add_(dim, index, source)``, ...): the kernel reads and writes
# those rows of ``self`` only, not all of it
INDEXED_INPLACE_OPS = {"index_add_", "index_copy_", "index_fill_"}


# factories that take a tensor argument for its dtype / device / shape only: they read none of its bytes
METADATA_ARG_OPS = {"new_zeros", "new_ones", "new_full", "zeros_like", "ones_like", "full_like"}


def _op_bytes(name: str, args, ins, outs) -> int:
    """Bytes an op reads and writes: every tensor argument and result whole (:func:`_nbytes`), except the target of
    an in-place indexed write (:data:`INDEXED_INPLACE_OPS`), counted as the rows it indexes, read and written, and
    the tensor argument of a factory (:data:`METADATA_ARG_OPS`), which is not read."""
    if name in METADATA_ARG_OPS:
        return sum(_nbytes(t) for t in outs)
    total = sum(_nbytes(t) for t in ins) + sum(_nbytes(t) for t in outs)
    if name in INDEXED_INPLACE_OPS and len(args) >= 3 and torch.is_tensor(args[0]) and torch.is_tensor(args[2]):
        target, dim, index = args[0], args[1], args[2]
        whole = _nbytes(target)
        rows = min(index.numel(), target.shape[dim]) if target.dim() else 1
        touched = whole * rows // max(target.shape[dim], 1) if target.dim() else whole
        same = lambda t: t.data_ptr() == target.data_ptr() and t.shape == target.shape  # noqa: E731
        n_target = sum(map(same, ins)) + sum(map(same, outs))
        total -= n_target * whole
        total += 2 * touched  # read and written once
    return total


def _storage_key(t: torch.Tensor):
    return (t.device, t.untyped_storage().data_ptr())


class CostMeter(TorchDispatchMode):
    """Counts ops, non-GEMM bytes and host syncs per phase (``self.phase``) while entered; see the module
    docstring. Device values: the storages of ``device_tensors`` (parameters, buffers, the input) and of every result
    of an op with a device value among its arguments or with no tensor argument (a factory: on a GPU it is given the
    device); host copies (``host_copy``, ``Tensor.cpu``) and values computed from host values only are host values,
    which the host reads without a sync (e.g. Megatron's host-side sort indices)."""

    def __init__(self, device_tensors=()):
        super().__init__()
        self.phase = "fwd"
        self.active = False
        self.launches: Dict[str, int] = {"fwd": 0, "bwd": 0}
        self.bytes: Dict[str, int] = {"fwd": 0, "bwd": 0}
        self.syncs: List[str] = []
        self.ops: Dict[str, Dict[str, int]] = {"fwd": {}, "bwd": {}}
        self.op_bytes: Dict[str, int] = {}  # non-GEMM bytes per op (both phases)
        self.device_storages = {_storage_key(t) for t in device_tensors}

    def __enter__(self):
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.active = False
        return super().__exit__(*exc)

    def add(self, key: str, nbytes: int) -> None:
        """One launch of ``key`` moving ``nbytes`` (an op the meter cannot see: the simulated collectives)."""
        if self.active:
            self.launches[self.phase] += 1
            self.ops[self.phase][key] = self.ops[self.phase].get(key, 0) + 1
            self.bytes[self.phase] += nbytes
            self.op_bytes[key] = self.op_bytes.get(key, 0) + nbytes

    def sync(self, what: str) -> None:
        if self.active:
            self.syncs.append(f"{self.phase}:{what}")

    def host_copy(self, value) -> None:
        if torch.is_tensor(value):
            self.device_storages.discard(_storage_key(value))

    def read_on_host(self, t: torch.Tensor, what: str) -> None:
        if torch.is_tensor(t) and _storage_key(t) in self.device_storages:
            self.sync(what)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        on_device = not ins or any(_storage_key(t) in self.device_storages for t in ins)
        # every new storage is some op's result: its status is set here (a freed address may be reused)
        if on_device and name != "lift_fresh":  # lift_fresh: torch.tensor(host values)
            self.device_storages.update(_storage_key(t) for t in outs)
        else:
            self.device_storages.difference_update(_storage_key(t) for t in outs)
        if func.is_view or name in FREE_OPS:
            return out
        if name in SYNC_OPS and on_device:
            self.sync(name)
        self.launches[self.phase] += 1
        key = f"{func.namespace}.{name}"
        self.ops[self.phase][key] = self.ops[self.phase].get(key, 0) + 1
        if name not in GEMM_OPS:
            b = _op_bytes(name, args, ins, outs)
            self.bytes[self.phase] += b
            self.op_bytes[key] = self.op_bytes.get(key, 0) + b
        return out


@contextlib.contextmanager
def host_reads(meter: CostMeter):
    """``Tensor.tolist/numpy/cpu`` report to ``meter`` (they bypass the dispatcher on a host tensor)."""
    saved = {n: getattr(torch.Tensor, n) for n in ("tolist", "numpy", "cpu")}

    def wrap(n):
        f = saved[n]

        def reading(self, *a, **k):
            meter.read_on_host(self, f"Tensor.{n}")
            out = f(self, *a, **k)
            if n == "cpu" and out is not self:
                meter.host_copy(out)
            return out
        return reading

    for n in saved:
        setattr(torch.Tensor, n, wrap(n))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


class GemmStub(TorchDispatchMode):
    """moe_graph's grouped GEMMs (16-bit and FP8) without their arithmetic, for counting at sizes where the CPU's
    GEMMs (the FP8 one is scalar) would take minutes: a GEMM returns zeros of the shape and dtype its registered fake
    kernel gives, and an ``_out`` GEMM leaves its output as it is. The meter counts a GEMM's launch and no bytes
    either way, and every other op sees tensors of the same shapes, so launches, non-GEMM bytes and saved bytes do
    not change (the layer has no data-dependent shape; ``tests/test_benchmarks.py`` checks the counts equal the
    real run's). The values do change: outputs are not compared."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace != "moe_graph" or func.overloadpacket.__name__ not in GEMM_OPS:
            return func(*args, **kwargs)
        if not func._schema.returns:  # written into ``out``: left as it is
            return None
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode(allow_non_fake_inputs=True):
            fake = func(*args, **kwargs)
        dev = next(t.device for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor))
        return tree_map(lambda t: torch.zeros(t.shape, dtype=t.dtype, device=dev)
                        if isinstance(t, torch.Tensor) else t, fake)


def measure(step_fwd: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, g: torch.Tensor,
            module: torch.nn.Module, meter: CostMeter, reps: int, arithmetic: bool = True) -> Dict[str, object]:
    """One forward + backward of ``step_fwd`` under ``meter`` (after one warm-up step), then the CPU time.
    ``arithmetic=False``: both steps with :class:`GemmStub` (the same counts, no GEMM arithmetic, no CPU time)."""
    if not arithmetic:
        with GemmStub():
            res = measure(step_fwd, x, g, module, meter, 0)
        res["cpu_ms"] = None
        return res
    params = list(module.parameters())
    meter.device_storages.update(_storage_key(t) for t in params + list(module.buffers()) + [x, g])
    def step():
        xi = x.detach().requires_grad_()
        step_fwd(xi).backward(g)
        return xi

    step()  # warm-up: lazily built state (plans, buffers) is not part of the per-step cost
    for p in params:
        p.grad = None
    param_keys = {_storage_key(p) for p in params}
    saved: Dict[object, List] = {}  # storage -> [(weak reference to the packed tensor, storage bytes)]

    def pack(t):
        k = _storage_key(t)
        if k not in param_keys and t.untyped_storage().nbytes():
            saved.setdefault(k, []).append((weakref.ref(t), t.untyped_storage().nbytes()))
        return t

    xi = x.detach().requires_grad_()
    with meter, host_reads(meter):
        meter.phase = "fwd"
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = step_fwd(xi)
        # what backward holds: storages of packed tensors still alive (a graph branch that does not reach the
        # output is freed during the forward, and its storages may be reused at the same address)
        saved_bytes = sum(max(n for ref, n in refs if ref() is not None) for refs in saved.values()
                          if any(ref() is not None for ref, _ in refs))
        meter.phase = "bwd"
        out.backward(g)
    result = out.detach().clone()
    del out
    T = x.numel() // x.shape[-1]
    cpu_ms = time_cpu(step, warmup=0, reps=reps) if reps else None
    return {"launches_fwd": meter.launches["fwd"], "launches_bwd": meter.launches["bwd"],
            "non_gemm_bytes_per_token": (meter.bytes["fwd"] + meter.bytes["bwd"]) / T,
            "non_gemm_bytes_per_token_fwd": meter.bytes["fwd"] / T,
            "saved_bytes_per_token": saved_bytes / T, "host_syncs": len(meter.syncs),
            "quantize_bytes_per_token": sum(meter.op_bytes.get(k, 0) for k in QUANTIZE_OPS) / T,
            "op_bytes_per_token": {k: b / T for k, b in sorted(meter.op_bytes.items(), key=lambda kv: -kv[1])},
            "sync_points": meter.syncs, "cpu_ms": cpu_ms, "ops": meter.ops, "out": result}


# ---------------------------------------------------------------------------------------------- weights --
def make_weights(cfg, seed: int = 0) -> Dict[str, torch.Tensor]:
    """The one set of weights every system copies: router ``[E, H]``, fc1 ``[E, 2F, H]`` (gate rows then up rows,
    SwiGLU), fc2 ``[E, H, F]``, and the shared expert's fc1/fc2."""
    gen = torch.Generator().manual_seed(seed)
    H, Fh, E = cfg["H"], cfg["F"], cfg["E"]
    w = {"router": torch.randn(E, H, generator=gen) * 0.1,
         "fc1": torch.randn(E, 2 * Fh, H, generator=gen) * H ** -0.5,
         "fc2": torch.randn(E, H, Fh, generator=gen) * Fh ** -0.5}
    if cfg.get("shared"):
        S = cfg["shared"]
        w["shared_fc1"] = torch.randn(2 * S, H, generator=gen) * H ** -0.5
        w["shared_fc2"] = torch.randn(H, S, generator=gen) * S ** -0.5
    return w


# -------------------------------------------------------------------------------------------- moe_graph --
def moe_graph_system(cfg, w, spare: int, fused: bool, dtype: torch.dtype = torch.float32, fp8: Optional[str] = None,
                     fp8_dispatch: bool = False, ep: int = 1, fp8_gathered: bool = False):
    """moe_graph's layer with ``w``; ``fp8``: a recipe name, the forward and backward under
    ``moe_graph.fp8.autocast`` (``fp8_dispatch``: the tokens travel quantized). ``ep > 1`` (inside
    :func:`simulated_ep`): rank 0 of ``ep`` EP ranks, its ``E / ep`` experts (the first of ``w``), the per-pair
    exchange with capacity factor 1 (the balanced routing's ``T * K / ep`` routes per pair). ``fp8_gathered``: the
    FP8 expert weights as ``DistributedOptimizer(fp8_param_gather=...)`` leaves them (``param.fp8_gathered``,
    quantized once per optimizer step, outside the forward)."""
    dispatch = dict(ep_size=ep, capacity_factor=1.0, exchange="nccl") if ep > 1 else {}
    layer = MoELayer(cfg["H"], cfg["F"], cfg["E"], cfg["K"], score_func=cfg["score"], fp8_dispatch=fp8_dispatch,
                     norm_topk_prob=True if cfg["score"] == "softmax" else None, activation="swiglu",
                     num_groups=cfg.get("groups"), group_topk=cfg.get("group_topk"),
                     topk_scaling_factor=cfg.get("scaling"), enable_expert_bias=cfg["score"] == "sigmoid",
                     num_spare_experts_per_ep_rank=spare, shared_expert_ffn_size=cfg.get("shared"),
                     device="cpu", params_dtype=dtype, **dispatch)
    L = layer.num_local_experts
    with torch.no_grad():
        layer.router.weight.copy_(w["router"])
        layer.experts.fc1.weight.copy_(w["fc1"][:L])
        layer.experts.fc2.weight.copy_(w["fc2"][:L])
        if cfg.get("shared"):
            layer.shared_expert.fc1.weight.copy_(w["shared_fc1"])
            layer.shared_expert.fc2.weight.copy_(w["shared_fc2"])
    if fused:  # as moe_graph's DistributedDataParallel attaches: fp32 views of a grad buffer
        for p in layer.experts.weights():
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
    if fp8 is not None and fp8_gathered:  # as DistributedOptimizer(fp8_param_gather=recipe) marks them
        for p in layer.experts.weights():
            p.fp8_gathered = Fp8GatheredWeight(p, moe_graph_fp8.as_recipe(fp8))
    if fp8 is None:
        return (lambda x: layer(x.to(dtype)).to(x.dtype)), layer

    def fwd(x):
        with moe_graph_fp8.autocast(recipe=fp8):  # the backward quantizes with the recipe saved by the forward
            return layer(x.to(dtype)).to(x.dtype)
    return fwd, layer


def dispatch_row_bytes(layer: MoELayer, dtype: torch.dtype, fp8_dispatch: Optional[str]) -> int:
    """Bytes of one routed token row on the wire at EP > 1 (the expert input's row: 16-bit or FP8 + scales)."""
    if fp8_dispatch:
        return moe_graph_fp8.packed_row_bytes(layer.hidden_size, moe_graph_fp8.as_recipe(fp8_dispatch))
    return layer.hidden_size * torch.empty((), dtype=dtype).element_size()


@contextlib.contextmanager
def device_branch():
    """moe_graph checks eager CPU counts on the host (``real_host_values``: raise at once instead of flagging the
    device error); a GPU never takes that branch. Measure the branch a GPU runs."""
    saved = [(m, m.real_host_values) for m in (echo_planner, reroute_ops)]
    for m, _ in saved:
        m.real_host_values = lambda t: False
    try:
        yield
    finally:
        for m, f in saved:
            m.real_host_values = f


@contextlib.contextmanager
def simulated_ep(num_ranks: int, meter_of: Callable[[], Optional[CostMeter]]):
    """Rank 0 of ``num_ranks`` EP ranks in this one process: torch's ``fake`` process group (world ``num_ranks``),
    with its collectives replaced by a symmetric world in which rank ``s`` routes as rank 0 does with the experts
    shifted by ``s`` ranks: an all-to-all gives rank 0, from source ``s``, the block rank 0 sends to rank ``-s``
    (rows and counts alike, so every count matches its rows); an all-gather gives every rank's slot rank 0's value;
    an all-reduce MAX / MIN leaves the value, SUM multiplies it by ``num_ranks``. Each collective counts as one
    launch reading its input and writing its output (``c10d.<name>`` in the breakdown; its copies are not
    themselves counted) on the meter ``meter_of()`` returns, when one is active."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("simulated_ep: torch.distributed is already initialized (run it outside other groups)")
    R = num_ranks

    def count(name, ins, outs):
        meter = meter_of()
        if meter is not None:
            meter.add(f"c10d.{name}", sum(_nbytes(t) for t in ins) + sum(_nbytes(t) for t in outs))

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        if output_split_sizes is not None or input_split_sizes is not None:
            raise NotImplementedError("simulated_ep: uneven all_to_all_single (the per-destination rule) is not "
                                      "simulated; use exchange='nccl'")
        with _disable_current_modes(), torch.no_grad():
            src = input.reshape(R, -1)
            output.reshape(R, -1).copy_(src[[(-s) % R for s in range(R)]])
        count("all_to_all_single", [input], [output])

    def all_gather_into_tensor(output, input, group=None, async_op=False):
        with _disable_current_modes(), torch.no_grad():
            output.reshape(R, -1).copy_(input.reshape(1, -1).expand(R, -1))
        count("all_gather_into_tensor", [input], [output])

    def all_gather(tensors, tensor, group=None, async_op=False):
        with _disable_current_modes(), torch.no_grad():
            for t in tensors:
                t.copy_(tensor)
        count("all_gather", [tensor], tensors)

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if op == dist.ReduceOp.SUM:
            with _disable_current_modes(), torch.no_grad():
                tensor.mul_(R)
        elif op not in (dist.ReduceOp.MAX, dist.ReduceOp.MIN):
            raise NotImplementedError(f"simulated_ep: all_reduce {op}")
        count("all_reduce", [tensor], [tensor])

    def all_gather_object(objects, obj, group=None):
        objects[:] = [obj] * R

    patched = dict(all_to_all_single=all_to_all_single, all_gather_into_tensor=all_gather_into_tensor,
                   all_gather=all_gather, all_reduce=all_reduce, all_gather_object=all_gather_object)
    saved = {n: getattr(dist, n) for n in patched}
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=R)
    try:
        for n, f in patched.items():
            setattr(dist, n, f)
        yield
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- native --
class NativeMoE(torch.nn.Module):
    """A PyTorch-native MoE: top-k router, index-based permutation (one stable sort of the routes), the experts as
    two ``torch._grouped_mm`` calls, the probabilities applied to the narrow ``[rows, F]`` activation, and
    ``index_add`` back to the tokens. Sync-free (counts by ``scatter_add``, offsets by ``cumsum``)."""

    def __init__(self, cfg, w):
        super().__init__()
        self.cfg = cfg
        self.router = torch.nn.Parameter(w["router"].clone())
        self.fc1 = torch.nn.Parameter(w["fc1"].clone())
        self.fc2 = torch.nn.Parameter(w["fc2"].clone())
        if cfg.get("shared"):
            self.shared_fc1 = torch.nn.Parameter(w["shared_fc1"].clone())
            self.shared_fc2 = torch.nn.Parameter(w["shared_fc2"].clone())
            self.register_buffer("expert_bias", torch.zeros(cfg["E"]))

    def route(self, x):
        cfg, K, E = self.cfg, self.cfg["K"], self.cfg["E"]
        logits = x @ self.router.t()
        if cfg["score"] == "softmax":
            top, idx = logits.topk(K, dim=-1)
            return top.softmax(-1), idx  # = the renormalized top-k of the softmax
        scores = logits.sigmoid()
        sel = scores.detach() + self.expert_bias
        T, G = x.shape[0], cfg["groups"]
        group_scores = sel.view(T, G, E // G).topk(K // cfg["group_topk"], dim=-1)[0].sum(-1)
        allowed = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(cfg["group_topk"], dim=-1)[1], 1.0)
        sel = sel.masked_fill(allowed.repeat_interleave(E // G, dim=1) == 0, float("-inf"))
        idx = sel.topk(K, dim=-1)[1]
        top = scores.gather(1, idx)
        return top / (top.sum(-1, keepdim=True) + 1e-20) * cfg["scaling"], idx

    def forward(self, x):
        K, E, Fh = self.cfg["K"], self.cfg["E"], self.cfg["F"]
        probs, idx = self.route(x)
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        token = order // K
        counts = torch.zeros(E, dtype=torch.int64).scatter_add_(0, flat, torch.ones_like(flat))
        offs = counts.cumsum(0).to(torch.int32)
        h = torch._grouped_mm(x[token], self.fc1.transpose(-2, -1), offs=offs)
        act = F.silu(h[:, :Fh]) * h[:, Fh:] * probs.reshape(-1)[order].unsqueeze(-1)
        y = torch._grouped_mm(act, self.fc2.transpose(-2, -1), offs=offs)
        out = torch.zeros_like(x).index_add_(0, token, y)
        if self.cfg.get("shared"):
            s = x @ self.shared_fc1.t()
            out = out + (F.silu(s[:, :self.cfg["shared"]]) * s[:, self.cfg["shared"]:]) @ self.shared_fc2.t()
        return out


def native_system(cfg, w):
    m = NativeMoE(cfg, w)
    return m, m


# -------------------------------------------------------------------------------------------- Megatron --
def megatron_config(cfg):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(num_layers=1, hidden_size=cfg["H"], num_attention_heads=2, num_moe_experts=cfg["E"],
              moe_ffn_hidden_size=cfg["F"], ffn_hidden_size=cfg["F"], use_cpu_initialization=True,
              gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, bias_activation_fusion=False,
              bias_dropout_fusion=False, gradient_accumulation_fusion=False, params_dtype=torch.float32,
              moe_router_topk=cfg["K"], moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.0,
              moe_router_load_balancing_type="none", moe_grouped_gemm=True,
              moe_router_score_function=cfg["score"])
    if cfg["score"] == "sigmoid":
        kw.update(moe_router_enable_expert_bias=True, moe_router_num_groups=cfg["groups"],
                  moe_router_group_topk=cfg["group_topk"], moe_router_topk_scaling_factor=cfg["scaling"],
                  moe_router_dtype="fp32")
    if cfg.get("shared"):
        kw.update(moe_shared_expert_intermediate_size=cfg["shared"])
    return TransformerConfig(**kw)


def megatron_system(cfg, w, grouped: bool, pg, dispatcher: str = "megatron"):
    """Megatron's MoELayer at EP 1: ``SequentialMLP`` (its local spec) or ``TEGroupedMLP`` on moe_graph's
    GroupedLinear (``get_gpt_layer_with_moe_graph_spec``; ``dispatcher="moe_graph"``: with moe_graph's token
    dispatcher, ``MoeGraphMoELayer``), with the shared weights copied in."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from moe_graph.integrations.megatron import get_gpt_layer_with_moe_graph_spec

    mcfg = megatron_config(cfg)
    if grouped:
        spec = get_gpt_layer_with_moe_graph_spec(num_experts=cfg["E"], use_transformer_engine=False,
                                                 dispatcher=dispatcher)
    else:
        spec = get_gpt_layer_local_spec(num_experts=cfg["E"], moe_grouped_gemm=True)
    layer = spec.submodules.mlp(config=mcfg, pg_collection=pg)
    with torch.no_grad():
        layer.router.weight.copy_(w["router"])
        if grouped:
            for name, key in (("linear_fc1", "fc1"), ("linear_fc2", "fc2")):
                ws = getattr(layer.experts, name)._weights()
                if len(ws) == 1 and ws[0].dim() == 3:
                    ws[0].copy_(w[key])
                else:
                    for e, p in enumerate(ws):
                        p.copy_(w[key][e])
        else:
            for e, mlp in enumerate(layer.experts.local_experts):
                # Megatron's RowParallelLinear at TP=EP=1 returns through a no-op all-reduce Function; at EP>1 the
                # layer skips it (explicit_expert_comm), as here (see tests/test_megatron_client.py)
                mlp.linear_fc2.explicit_expert_comm = True
                mlp.linear_fc1.weight.copy_(w["fc1"][e])
                mlp.linear_fc2.weight.copy_(w["fc2"][e])
        if cfg.get("shared"):
            layer.shared_experts.linear_fc1.weight.copy_(w["shared_fc1"])
            layer.shared_experts.linear_fc2.weight.copy_(w["shared_fc2"])
    return (lambda x: layer(x.unsqueeze(1))[0].squeeze(1)), layer


@contextlib.contextmanager
def megatron_parallel_state():
    """One-process gloo group and Megatron's model-parallel state at TP = PP = EP = 1."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            ps.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
            try:
                yield ProcessGroupCollection.use_mpu_process_groups()
            finally:
                ps.destroy_model_parallel()
        finally:
            dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------- run --
SYSTEMS = [  # key, label
    ("megatron_sequential", "Megatron-core 0.19.2 MoELayer (alltoall, SequentialMLP)"),
    ("megatron_grouped", "Megatron-core MoELayer, TEGroupedMLP on moe_graph GroupedLinear"),
    ("megatron_moe_graph", "Megatron-core MoELayer, moe_graph dispatcher + TEGroupedMLP on GroupedLinear"),
    ("native", "PyTorch-native MoE (torch._grouped_mm, index permutation)"),
    ("moe_graph", "moe_graph MoELayer, echo off"),
    ("moe_graph_fused", "moe_graph MoELayer, echo off, fused main_grad"),
    ("moe_graph_echo", "moe_graph MoELayer, 1 echo slot, fused main_grad"),
    ("moe_graph_bf16", "moe_graph MoELayer, bf16, fused main_grad"),
    ("moe_graph_fp8", "moe_graph MoELayer, bf16, FP8 blockwise experts, fused main_grad"),
    ("moe_graph_fp8_dispatch", "moe_graph MoELayer, bf16, FP8 blockwise experts + FP8 dispatch, fused main_grad"),
]
# the 16-bit / FP8 rows: (params dtype, recipe, FP8 dispatch)
PRECISION = {"moe_graph_bf16": (torch.bfloat16, None, False), "moe_graph_fp8": (torch.bfloat16, "blockwise", False),
             "moe_graph_fp8_dispatch": (torch.bfloat16, "blockwise", True)}


def run_config(name: str, cfg, reps: int, megatron_skip: Optional[str], pg) -> List[Dict[str, object]]:
    w = make_weights(cfg)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(cfg["T"], cfg["H"], generator=gen)
    g = torch.randn(cfg["T"], cfg["H"], generator=gen)
    rows, outs = [], {}
    for key, label in SYSTEMS:
        row = {"config": name, "system": key, "label": label}
        if key.startswith("megatron") and megatron_skip is not None:
            rows.append(dict(row, skipped=megatron_skip))
            continue
        meter = CostMeter()
        torch.manual_seed(0)
        if key.startswith("megatron"):
            with cpu_shims(on_sync=meter.sync, on_host_copy=meter.host_copy):
                fwd, module = megatron_system(cfg, w, key != "megatron_sequential", pg,
                                              "moe_graph" if key == "megatron_moe_graph" else "megatron")
                with device_branch() if key == "megatron_moe_graph" else contextlib.nullcontext():
                    res = measure(fwd, x, g, module, meter, reps)
        else:
            dtype, recipe, fp8_dispatch = PRECISION.get(key, (torch.float32, None, False))
            if key == "native":
                fwd, module = native_system(cfg, w)
            else:
                fwd, module = moe_graph_system(cfg, w, spare=1 if key == "moe_graph_echo" else 0,
                                               fused=key != "moe_graph", dtype=dtype, fp8=recipe,
                                               fp8_dispatch=fp8_dispatch)
                row["dispatch_bytes_per_token"] = cfg["K"] * dispatch_row_bytes(module, dtype,
                                                                                 recipe if fp8_dispatch else None)
            with device_branch():
                res = measure(fwd, x, g, module, meter, 1 if recipe else reps)  # the CPU's FP8 GEMM is scalar
        outs[key] = res.pop("out")
        row.update(res)
        rows.append(row)
    for row in rows:  # the same routing and weights: every system's output against moe_graph's
        if "skipped" not in row:
            ref = "moe_graph_bf16" if row["system"] in PRECISION else "moe_graph"  # 16-bit rows: the bf16 layer
            row["max_abs_diff"] = (outs[row["system"]] - outs[ref]).abs().max().item()
    return rows


# ------------------------------------------------------------------------------- production-like rows --
PRODUCTION_SYSTEMS = ("moe_graph_bf16", "moe_graph_fp8", "moe_graph_fp8_dispatch")
PRODUCTION_TOKENS = (2048, 16384)
PRODUCTION_EP = (1, 8)


def weight_quantize_cost(layer: MoELayer, recipe: str) -> Dict[str, int]:
    """Launches and bytes of quantizing the layer's expert weights, both copies the recipe needs
    (``moe_graph.fp8.quantize_weight`` of ``fc1`` and ``fc2``: what the layer does at every forward without
    ``fp8_param_gather``, and the optimizer once per step with it), counted by the meter."""
    meter = CostMeter()
    with meter, torch.no_grad():
        for p in layer.experts.weights():
            moe_graph_fp8.quantize_weight(p.detach().contiguous(), moe_graph_fp8.as_recipe(recipe))
    return {"launches": meter.launches["fwd"], "bytes": meter.bytes["fwd"], "op_bytes": dict(meter.op_bytes)}


def production_rows(name: str, cfg, tokens: int, ep: int, microbatches: int,
                    arithmetic: bool = False) -> List[Dict[str, object]]:
    """The 16-bit and FP8 rows of one configuration at ``tokens`` tokens per rank and EP ``ep``, as in training:
    fused ``main_grad``, the FP8 weights quantized once per optimizer step (``fp8_param_gather``: the forward reads
    ``param.fp8_gathered``) and that cost divided over ``microbatches`` microbatches of ``tokens`` tokens; EP > 1 as
    rank 0 of a :func:`simulated_ep` world. Counted with :class:`GemmStub` (no GEMM arithmetic, no CPU time) unless
    ``arithmetic``."""
    cfg = dict(cfg, T=tokens)
    w = make_weights(cfg)
    gen = torch.Generator().manual_seed(1)
    # the input and its gradient in the layers' parameter dtype, as a bf16 model hands them over (no dtype
    # conversion around the layer is counted)
    dtype0, = {PRECISION[key][0] for key in PRODUCTION_SYSTEMS}
    x = torch.randn(tokens, cfg["H"], generator=gen).to(dtype0)
    g = torch.randn(tokens, cfg["H"], generator=gen).to(dtype0)
    rows = []
    for key in PRODUCTION_SYSTEMS:
        dtype, recipe, fp8_dispatch = PRECISION[key]
        current: Dict[str, CostMeter] = {}
        with simulated_ep(ep, lambda: current.get("meter")) if ep > 1 else contextlib.nullcontext():
            torch.manual_seed(0)
            fwd, layer = moe_graph_system(cfg, w, spare=0, fused=True, dtype=dtype, fp8=recipe,
                                          fp8_dispatch=fp8_dispatch, ep=ep, fp8_gathered=True)
            meter = current["meter"] = CostMeter()
            rows_in = []  # the expert input's rows (what the layer hands its experts)
            hook = layer.experts.register_forward_pre_hook(lambda m, a, kw: rows_in.append(a[0].shape[0]),
                                                           with_kwargs=True)
            with device_branch():
                res = measure(fwd, x, g, layer, meter, 0, arithmetic=arithmetic)
            hook.remove()
            check_errors("cpu")  # the simulated world is consistent: no count or layout error was flagged
            wq = weight_quantize_cost(layer, recipe) if recipe else {"launches": 0, "bytes": 0, "op_bytes": {}}
        res.pop("out")
        amortized = wq["bytes"] / (tokens * microbatches)
        exchange = sum(b for k, b in res["op_bytes_per_token"].items() if k.startswith("c10d."))
        row = {"config": name, "system": key, "label": dict(SYSTEMS)[key], "tokens": tokens, "ep": ep,
               "microbatches": microbatches, "local_experts": layer.num_local_experts,
               "expert_input_rows": rows_in[-1], "dispatch_bytes_per_token": cfg["K"] * dispatch_row_bytes(
                   layer, dtype, recipe if fp8_dispatch else None)}
        row.update(res)
        row.update({
            "microbatch_non_gemm_bytes_per_token": res["non_gemm_bytes_per_token"],
            "microbatch_quantize_bytes_per_token": res["quantize_bytes_per_token"],
            "weight_quantize_launches_per_step": wq["launches"], "weight_quantize_bytes_per_step": wq["bytes"],
            "weight_quantize_op_bytes_per_step": wq["op_bytes"],
            "weight_quantize_bytes_per_token_amortized": amortized,
            "non_gemm_bytes_per_token": res["non_gemm_bytes_per_token"] + amortized,
            "quantize_bytes_per_token": res["quantize_bytes_per_token"] + amortized,
            "exchange_bytes_per_token": exchange})
        rows.append(row)
    bf16 = rows[0]
    for r in rows:
        r["vs_bf16_bytes"] = r["non_gemm_bytes_per_token"] / bf16["non_gemm_bytes_per_token"]
        r["vs_bf16_launches_fwd"] = r["launches_fwd"] - bf16["launches_fwd"]
    return rows


def excess_over_bf16(row, bf16, top: int = 8) -> List[tuple]:
    """``(op, FP8 bytes/token, bf16 bytes/token, excess)`` of the ops whose bytes differ most from the bf16 row's
    (the amortized weight quantization as the op ``weight quantize (per step / microbatches)``), largest first."""
    ops = dict(row["op_bytes_per_token"])
    if row["weight_quantize_bytes_per_token_amortized"]:
        ops["weight quantize (per step / microbatches)"] = row["weight_quantize_bytes_per_token_amortized"]
    base = bf16["op_bytes_per_token"]
    diff = [(k, ops.get(k, 0.0), base.get(k, 0.0), ops.get(k, 0.0) - base.get(k, 0.0)) for k in set(ops) | set(base)]
    return sorted(diff, key=lambda d: -abs(d[3]))[:top]


def print_production(rows) -> None:
    if not rows:
        return
    mb = rows[0]["microbatches"]
    print(f"\nProduction-like rows (moe_graph MoELayer, bf16 parameters, fused main_grad; GEMMs not run: launches and "
          f"bytes only). Per rank and per token of one microbatch; FP8 weights quantized once per optimizer step "
          f"(fp8_param_gather), that cost / ({mb} microbatches x tokens) added to the bytes (its launches are "
          f"per step, not in the forward's). EP 8: rank 0 of 8 (E/8 local experts, per-pair all-to-all with capacity "
          f"factor 1 = the balanced routing's T*K/8 routes per pair, a symmetric world; each collective one launch, "
          f"its input read and output written).")
    print("| config | tokens | EP | system | launches fwd/bwd | non-GEMM bytes/token | of which FP8 quantize | "
          "of which weight quantize (amortized) | of which exchange | saved bytes/token | vs bf16: bytes, fwd launches |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {LABELS[r['config']]} | {r['tokens']:,} | {r['ep']} | {r['system']} | {r['launches_fwd']} / "
              f"{r['launches_bwd']} | {r['non_gemm_bytes_per_token']:,.0f} | {r['quantize_bytes_per_token']:,.0f} | "
              f"{r['weight_quantize_bytes_per_token_amortized']:,.0f} | {r['exchange_bytes_per_token']:,.0f} | "
              f"{r['saved_bytes_per_token']:,.0f} | {r['vs_bf16_bytes']:.3f}x, {r['vs_bf16_launches_fwd']:+d} |")
    print("\nFP8 rows: the ops whose bytes/token differ most from the bf16 row's (FP8 / bf16 / excess)")
    for r in rows:
        if r["system"] == "moe_graph_bf16":
            bf16 = r
            continue
        parts = [f"{k} {a:,.0f} / {b:,.0f} / {d:+,.0f}" for k, a, b, d in excess_over_bf16(r, bf16)]
        print(f"- {LABELS[r['config']]}, {r['tokens']:,} tokens, EP {r['ep']}, {r['system']}: " + "; ".join(parts))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--tokens", type=int, default=None, help="override the tokens of every configuration")
    ap.add_argument("--reps", type=int, default=3, help="CPU-time repetitions")
    ap.add_argument("--no-megatron", action="store_true", help="skip Megatron-core's rows")
    ap.add_argument("--production-tokens", type=int, nargs="*", default=None,
                    help=f"tokens per rank of the production-like rows (default {list(PRODUCTION_TOKENS)}, or "
                         "--tokens when given; none: no such rows)")
    ap.add_argument("--ep", type=int, nargs="+", default=list(PRODUCTION_EP),
                    help="EP sizes of the production-like rows")
    ap.add_argument("--microbatches", type=int, default=8,
                    help="microbatches per optimizer step over which the FP8 weight quantization is amortized")
    ap.add_argument("--production-only", action="store_true", help="only the production-like rows")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.microbatches < 1:
        ap.error(f"--microbatches must be >= 1, got {args.microbatches}")
    for e in args.ep:
        bad = [n for n in args.configs if e < 1 or CONFIGS[n]["E"] % e]
        if bad:
            ap.error(f"--ep {e} must be >= 1 and divide the experts of {bad}")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    prod_tokens = args.production_tokens if args.production_tokens is not None else (
        [args.tokens] if args.tokens else list(PRODUCTION_TOKENS))
    skip = "--no-megatron given" if args.no_megatron or args.production_only else provide_megatron()
    rows = []
    if not args.production_only:
        with (megatron_parallel_state() if skip is None else contextlib.nullcontext()) as pg:
            for name in args.configs:
                cfg = dict(CONFIGS[name])
                if args.tokens:
                    cfg["T"] = args.tokens
                rows += run_config(name, cfg, args.reps, skip, pg)
        print_table(rows)
    prod = []
    for name in args.configs:
        for tokens in prod_tokens:
            for ep in args.ep:
                prod += production_rows(name, CONFIGS[name], tokens, ep, args.microbatches)
    print_production(prod)
    path = args.out or results_path("moe_cost")
    write_json(path, {"env": environment(), "configs": {n: CONFIGS[n] for n in args.configs},
                      "tokens_override": args.tokens, "megatron_skipped": skip, "rows": rows,
                      "production": {"tokens": prod_tokens, "ep": args.ep, "microbatches": args.microbatches,
                                     "rows": prod}})
    return rows, prod


def print_table(rows) -> None:
    for name in dict.fromkeys(r["config"] for r in rows):
        cfg = CONFIGS[name]
        print(f"\n{LABELS[name]}: H {cfg['H']}, F {cfg['F']}, E {cfg['E']}, top-{cfg['K']}, fp32, EP 1")
        print("| system | launches fwd/bwd | non-GEMM bytes/token | of which FP8 quantize | saved bytes/token | "
              "dispatch bytes/token at EP > 1 | host syncs | cpu ms | max abs diff |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            if r["config"] != name:
                continue
            if "skipped" in r:
                print(f"| {r['label']} | skipped: {r['skipped']} |||||||")
                continue
            wire = r.get("dispatch_bytes_per_token")
            print(f"| {r['label']} | {r['launches_fwd']} / {r['launches_bwd']} | "
                  f"{r['non_gemm_bytes_per_token']:,.0f} | {r['quantize_bytes_per_token']:,.0f} | "
                  f"{r['saved_bytes_per_token']:,.0f} | {'' if wire is None else f'{wire:,}'} | {r['host_syncs']} | "
                  f"{r['cpu_ms']:.1f} | {r['max_abs_diff']:.1e} |")


if __name__ == "__main__":
    main()
