"""Bad inputs at every public entry point, and the outcome each must give (issue 12).

One table: each row names the entry point, the bad input, how it is called, and the outcome:

* an exception type and a regex its message must match (the message names the argument and what was expected);
* ``FLAG``: a condition only the device can see. The call returns without a sync; the kernel sets a bit in the
  device error flag and the explicit ``moe_graph.check_errors()`` raises ``RuntimeError`` naming it;
* ``EXIT``: a command line: ``SystemExit(2)`` with an argparse message naming the flag (on stderr).

Stateful entry points (``load_state_dict``) are also checked to leave the live state unchanged (test_optimizer.py
and test_grouped_linear.py hold those checks with the state compared bit for bit).
"""

from __future__ import annotations

import importlib
import re
from typing import Any, Callable, NamedTuple

import pytest
import torch

FLAG = "device flag"
EXIT = "exit 2"


class Row(NamedTuple):
    entry: str  # the public entry point
    bad: str  # the bad input, in words
    call: Callable[[], Any]
    outcome: Any  # an exception type, FLAG or EXIT
    match: str  # regex on the message (for EXIT: on stderr)


# ------------------------------------------------------------------------------------------------ helpers --
def _gg(*args, **kw):
    from moe_graph.ops.grouped_gemm import grouped_gemm

    return grouped_gemm(*args, **kw)


def _wgrad(*args, **kw):
    from moe_graph.ops.grouped_gemm import grouped_gemm_wgrad

    return grouped_gemm_wgrad(*args, **kw)


def _bias_grad(*args, **kw):
    from moe_graph.ops.grouped_gemm import grouped_bias_grad

    return grouped_bias_grad(*args, **kw)


def _gl(*args, **kw):
    from moe_graph.grouped_linear import GroupedLinear

    kw.setdefault("device", "cpu")
    return GroupedLinear(*args, **kw)


def _gl_forward(x, m_splits):
    layer = _gl(2, 4, 3, params_dtype=torch.float32)
    return layer(x, m_splits)


def _a(m=6, k=4):
    return torch.randn(m, k)


def _w(e=2, n=3, k=4):
    return torch.randn(e, n, k)


def _ddp(module=None, **kw):
    from moe_graph.distributed.ddp import DistributedDataParallel

    return DistributedDataParallel(module if module is not None else torch.nn.Linear(4, 3), **kw)


def _opt(**kw):
    from moe_graph.distributed.optimizer import DistributedOptimizer

    model = kw.pop("model", None)
    if model is None:
        model = _ddp(use_distributed_optimizer=True)
    return DistributedOptimizer(model, **kw)


def _load(state, **kw):
    return _opt(lr=1e-3).load_state_dict(state, **kw)


def _saved():
    return _opt(lr=1e-3).state_dict()


def _buffer(params, dp=1, **kw):
    from moe_graph.distributed.buffers import ParamAndGradBuffer

    return ParamAndGradBuffer(params, dp, **kw)


def _params(*numels):
    return [torch.nn.Parameter(torch.randn(n)) for n in numels]


def _ps():
    from moe_graph import parallel_state

    return parallel_state


def _planner():
    from moe_graph.moe import echo_planner as planner

    return planner


def _pipeline():
    from moe_graph.train import schedules as pipeline

    return pipeline


def _graph(*args, **kw):
    import warnings

    from moe_graph.cuda_graph import FullIterationGraph

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "running eagerly" without CUDA
        return FullIterationGraph(*args, **kw)


def _graph_wrapper(*args, **kw):
    from moe_graph.cuda_graph import FullCudaGraphWrapper

    return FullCudaGraphWrapper(*args, **kw)


def _check_errors(device):
    from moe_graph.ops.errors import check_errors

    return check_errors(device)


def _group_params(params):
    from moe_graph.distributed.buffers import group_params_for_buffers

    return group_params_for_buffers(params)


def _inference_zeros(*shape):
    with torch.inference_mode():
        return torch.zeros(*shape)


def _echo(num_experts=4, num_ep_ranks=1, ep_rank=0):
    from moe_graph.moe.echo import EchoExpertDispatcher, LocalBackend

    return EchoExpertDispatcher(num_experts, num_ep_ranks, ep_rank, 1, backend=LocalBackend())


def _reroute(tokens_to_spare, routing_map=None):
    """reroute_tokens on the docstring's example (T=4, E=2, one slot hosting expert 0; 3 tokens routed to it)."""
    from moe_graph.ops.reroute import reroute_tokens

    if routing_map is None:
        routing_map = torch.tensor([[1, 0], [1, 1], [0, 1], [1, 0]], dtype=torch.bool)
    return reroute_tokens(routing_map, torch.rand(4, 2), tokens_to_spare, torch.tensor([[True], [False]]))


def _moe(**kw):
    from moe_graph.moe.layer import MoELayer

    return MoELayer(**{"hidden_size": 8, "ffn_hidden_size": 16, "num_experts": 4, "topk": 2, **kw})


def _dispatcher(num_local_columns, num_ep_ranks, ep_rank, **kw):
    from moe_graph.moe.token_dispatcher import TokenDispatcher

    cols = torch.zeros(2, dtype=torch.long)
    return TokenDispatcher(num_local_columns, num_ep_ranks, ep_rank, cols, cols.clone(), **kw)


def _launch():
    from moe_graph.distributed import launch as launch

    return launch


def _demo(argv):
    from moe_graph.demo import cli

    return cli.main(argv)


def _counts(r=2, e=4):
    return torch.tensor([[3, 1, 0, 2], [0, 5, 1, 1]])[:r, :e]


# --------------------------------------------------------------------------------------------------- table --
ROWS = [
    # ---- grouped GEMM ops (moe_graph.ops.grouped_gemm) ----
    Row("grouped_gemm", "m_splits neither tensor nor list", lambda: _gg(_a(), _w(), "2,4"), TypeError,
        r"m_splits must be a tensor or a list of ints, got str"),
    Row("grouped_gemm", "b neither tensor nor list of tensors", lambda: _gg(_a(), [1, 2], [2, 4]), TypeError,
        r"b must be a tensor or a list of tensors"),
    Row("grouped_gemm", "out= with autograd", lambda: _gg(_a().requires_grad_(), _w(), [2, 4], out=torch.empty(6, 3)),
        RuntimeError, r"out= does not support autograd"),
    Row("grouped_gemm", "sum(m_splits) past the rows of a (device tensor)",
        lambda: _gg(_a(), _w(), torch.tensor([4, 4])), FLAG, r"sum\(m_splits\) exceeded the rows"),
    Row("grouped_gemm", "negative m_splits entry (device tensor)", lambda: _gg(_a(), _w(), torch.tensor([-1, 4])),
        FLAG, r"m_splits contained a negative count"),
    Row("grouped_gemm", "m_splits list holding a float", lambda: _gg(_a(), _w(), [2.5, 3.5]), TypeError,
        r"m_splits\[0\] must be an int \(a token count\), got float 2.5"),
    Row("grouped_gemm", "m_splits list holding None", lambda: _gg(_a(), _w(), [2, None]), TypeError,
        r"m_splits\[1\] must be an int \(a token count\), got NoneType"),
    Row("grouped_gemm", "out partially overlapping a",
        lambda: (lambda buf: _gg(buf[:6], torch.randn(2, 4, 4), [2, 4], out=buf[1:7]))(torch.randn(20, 4)),
        RuntimeError, r"out overlaps a in memory"),
    Row("grouped_gemm", "out the same tensor as a",
        lambda: (lambda buf: _gg(buf, torch.randn(2, 4, 4), [2, 4], out=buf))(torch.randn(6, 4)),
        RuntimeError, r"out overlaps a in memory"),
    Row("grouped_gemm", "m_splits near 2^62 (device tensor)", lambda: _gg(_a(), _w(), torch.tensor([2**62, 2**62])),
        FLAG, r"sum\(m_splits\) exceeded the rows"),
    Row("grouped_gemm_wgrad", "the same out tensor twice",
        lambda: (lambda t: _wgrad(_a(), torch.randn(6, 3), [2, 4], out=[t, t]))(torch.zeros(3, 4)), RuntimeError,
        r"out\[0\] overlaps out\[1\] in memory"),
    Row("grouped_gemm_wgrad", "an inference tensor in out",
        lambda: _wgrad(_a(), torch.randn(6, 3), [2, 4], out=[torch.zeros(3, 4), _inference_zeros(3, 4)]),
        RuntimeError, r"out\[1\] is an inference tensor"),
    Row("grouped_gemm_wgrad", "accumulate without out=", lambda: _wgrad(_a(), torch.randn(6, 3), [2, 4], accumulate=True),
        ValueError, r"accumulate needs out="),
    Row("grouped_gemm_wgrad", "out= with autograd",
        lambda: _wgrad(_a().requires_grad_(), torch.randn(6, 3), [2, 4], out=torch.empty(2, 3, 4)), RuntimeError,
        r"out= does not support autograd"),
    Row("grouped_bias_grad", "m_splits neither tensor nor list", lambda: _bias_grad(torch.randn(6, 3), None),
        TypeError, r"m_splits must be a tensor or a list of ints, got NoneType"),
    # ---- GroupedLinear ----
    Row("GroupedLinear", "num_gemms=0", lambda: _gl(0, 4, 3), ValueError, r"num_gemms must be an int >= 1, got 0"),
    Row("GroupedLinear", "in_features=0", lambda: _gl(2, 0, 3), ValueError, r"in_features must be an int >= 1, got 0"),
    Row("GroupedLinear", "tp_size=0", lambda: _gl(2, 4, 3, tp_size=0), ValueError, r"tp_size must be an int >= 1, got 0"),
    Row("GroupedLinear.forward", "input of the wrong width", lambda: _gl_forward(torch.randn(5, 5), [2, 3]), ValueError,
        r"inp must have last dimension in_features=4, got shape \(5, 5\)"),
    Row("GroupedLinear.forward", "m_splits of the wrong length", lambda: _gl_forward(torch.randn(5, 4), [2, 3, 0]),
        ValueError, r"m_splits must have 2 entries, got 3"),
    Row("GroupedLinear.load_state_dict", "6 experts into a 4-expert layer",
        lambda: _gl(4, 4, 3, single_grouped_weight=True).load_state_dict(_gl(6, 4, 3, single_grouped_weight=True).state_dict()),
        RuntimeError, r"weight has shape \(6, 3, 4\): expected 4 experts \(num_gemms=4\)"),
    Row("GroupedLinear.load_state_dict", "2 experts into a 4-expert layer",
        lambda: _gl(4, 4, 3, single_grouped_weight=True).load_state_dict(_gl(2, 4, 3, single_grouped_weight=True).state_dict()),
        RuntimeError, r"weight has shape \(2, 3, 4\): expected 4 experts"),
    Row("GroupedLinear.load_state_dict", "biases into a bias=False layer",
        lambda: _gl(2, 4, 3, bias=False).load_state_dict(_gl(2, 4, 3).state_dict()), RuntimeError,
        r"the checkpoint has biases \['bias0', 'bias1'\] but the layer was built with bias=False"),
    Row("GroupedLinear.load_state_dict", "missing keys", lambda: _gl(2, 4, 3).load_state_dict({}), RuntimeError,
        r"Missing key\(s\) in state_dict: \"weight0\""),
    Row("GroupedLinear", "parallel_mode not column/row", lambda: _gl(2, 4, 3, parallel_mode="diagonal"),
        ValueError, r"parallel_mode"),
    Row("GroupedLinear", "userbuffers overlap", lambda: _gl(2, 4, 3, ub_overlap_rs=True), NotImplementedError,
        r"ub_overlap"),
    # ---- echo planner (moe_graph.moe.echo_planner) ----
    Row("planner.gen_offloading_plan", "counts not a tensor",
        lambda: _planner().gen_offloading_plan(torch.zeros(3, 4, dtype=torch.bool), torch.ones(3, 4), [[1, 2]], 0, 2),
        TypeError, r"counts must be a torch.Tensor \[R, E\]"),
    Row("planner.gen_plan", "counts 1-D", lambda: _planner().gen_plan(torch.tensor([1, 2, 3, 4])), ValueError,
        r"counts must be a 2-D tensor \[R, E\]"),
    Row("planner.gen_plan", "float counts", lambda: _planner().gen_plan(_counts().float()), TypeError,
        r"counts must have an integer dtype, got torch.float32"),
    Row("planner.gen_plan", "no spare slot", lambda: _planner().gen_plan(_counts(), num_spare_experts_per_ep_rank=0),
        ValueError, r"num_spare_experts_per_ep_rank must be >= 1, got 0"),
    Row("planner.gen_plan", "experts not divisible by ranks", lambda: _planner().gen_plan(_counts(2, 3)), ValueError,
        r"the number of experts E=3 must be divisible by the number of EP ranks R=2"),
    Row("planner.gen_plan", "unknown assignment", lambda: _planner().gen_plan(_counts(), assignment="optimal"),
        ValueError, r"assignment must be one of"),
    Row("planner.gen_plan", "counts past the planner's limit",
        lambda: _planner().gen_plan(torch.tensor([[2**41, 1, 1, 1], [1, 1, 1, 1]])), ValueError,
        r"exceeds the planner's limit MAX_TOTAL_TOKENS"),
    Row("reroute_tokens", "a plan moving more tokens than are routed", lambda: _reroute(torch.tensor([5])), FLAG,
        r"reroute_tokens: the plan asked to move more tokens than are routed locally"),
    Row("reroute_tokens", "a negative request", lambda: _reroute(torch.tensor([-1])), FLAG,
        r"offloading plan input was inconsistent"),
    Row("reroute_tokens", "routing_map not bool", lambda: _reroute(torch.tensor([1]), routing_map=torch.ones(4, 2)),
        RuntimeError, r"reroute_tokens: routing_map must have dtype Bool, got Float"),
    Row("EchoExpertDispatcher", "num_ep_ranks=0", lambda: _echo(4, 0, 0), ValueError, r"num_ep_ranks must be >= 1, got 0"),
    Row("EchoExpertDispatcher.aggregate_grads", "neither home_params nor out",
        lambda: _echo().aggregate_grads(torch.zeros(4, 1, dtype=torch.long), [torch.zeros(1, 3)]), ValueError,
        r"aggregate_grads needs home_params or out"),
    Row("EchoExpertDispatcher.aggregate_grads", "an out tensor of the wrong shape",
        lambda: _echo().aggregate_grads(torch.zeros(4, 1, dtype=torch.long), [torch.zeros(1, 3)], out=[torch.zeros(4, 5)]),
        ValueError, r"gradient tensor 0 must have shape \[L=4, 3\]"),
    # ---- MoELayer ----
    *[Row("MoELayer", bad, lambda kw=kw: _moe(**kw), exc, msg) for bad, kw, exc, msg in [
        ("unknown activation", dict(activation="tanh"), ValueError, r"activation must be one of \(.*got 'tanh'"),
        ("topk above num_experts", dict(topk=5), ValueError, r"topk must be in \[1, num_experts=4\], got 5"),
        ("unknown aux_loss_type", dict(aux_loss_type="x"), ValueError, r"aux_loss_type must be 'local', 'global' or 'sequence'"),
        ("sequence_dim=2", dict(sequence_dim=2), ValueError, r"sequence_dim must be 0 \(\[S, B, H\] input\) or 1"),
        ("negative spare slots", dict(num_spare_experts_per_ep_rank=-1), ValueError,
         r"num_spare_experts_per_ep_rank must be >= 0, got -1"),
        ("negative capacity_factor", dict(capacity_factor=-1.0), ValueError,
         r"capacity_factor must be a finite number > 0 or None \(dropless\), got -1.0"),
        ("unknown token_drop_policy", dict(token_drop_policy="x"), ValueError, r"drop_policy must be 'position' or 'probs'"),
        ("groups not dividing the experts", dict(num_groups=3, group_topk=1), ValueError,
         r"num_groups=3 must divide num_experts=4"),
        ("ep_size=2 without torch.distributed", dict(ep_size=2), RuntimeError,
         r"ep_size=2 needs an initialized torch.distributed"),
    ]],
    Row("MoELayer.forward", "input of the wrong width", lambda: _moe()(torch.randn(2, 3, 7)), ValueError,
        r"x must have last dimension hidden_size=8, got shape \(2, 3, 7\)"),
    Row("MoELayer.forward", "padding_mask of the wrong shape",
        lambda: _moe()(torch.randn(2, 3, 8), padding_mask=torch.zeros(2, 4, dtype=torch.bool)), ValueError,
        r"padding_mask must have shape \(2, 3\) \(x without its last dimension\), got \(2, 4\)"),
    # ---- token dispatcher ----
    Row("TokenDispatcher", "num_local_columns=0", lambda: _dispatcher(0, 1, 0), ValueError,
        r"num_local_columns must be >= 1, got 0"),
    Row("TokenDispatcher", "ep_rank past num_ep_ranks", lambda: _dispatcher(1, 2, 2), ValueError,
        r"need num_ep_ranks >= 1 and 0 <= ep_rank < num_ep_ranks, got num_ep_ranks=2, ep_rank=2"),
    Row("TokenDispatcher", "capacity=0", lambda: _dispatcher(1, 1, 0, capacity=0), ValueError,
        r"capacity must be >= 1 or None \(dropless\), got 0"),
    Row("dispatcher.expert_columns", "experts not divisible by ranks",
        lambda: importlib.import_module("moe_graph.moe.token_dispatcher").expert_columns(5, 2), ValueError,
        r"num_experts=5 must be divisible by num_ep_ranks=2"),
    Row("dispatcher.capacity_for", "capacity_factor=0",
        lambda: importlib.import_module("moe_graph.moe.token_dispatcher").capacity_for(10, 2, 2, 0.0), ValueError,
        r"capacity_factor must be > 0 or None \(dropless\), got 0.0"),
    # ---- parallel_state ----
    Row("parallel_state.initialize_model_parallel", "tensor_model_parallel_size=0",
        lambda: _ps().initialize_model_parallel(0), ValueError, r"tensor_model_parallel_size must be a positive int, got 0"),
    Row("parallel_state.initialize_model_parallel", "negative timeout",
        lambda: _ps().initialize_model_parallel(distributed_timeout_minutes=-1), ValueError,
        r"distributed_timeout_minutes must be None or a finite number > 0"),
    Row("parallel_state.initialize_model_parallel", "virtual pipeline without pp",
        lambda: _ps().initialize_model_parallel(1, 1, virtual_pipeline_model_parallel_size=2), ValueError,
        r"needs pipeline_model_parallel_size > 1"),
    Row("parallel_state.initialize_model_parallel", "before init_process_group",
        lambda: _ps().initialize_model_parallel(), RuntimeError, r"needs torch.distributed.init_process_group\(\) first"),
    Row("parallel_state.get_tensor_model_parallel_rank", "before initialize_model_parallel",
        lambda: _ps().get_tensor_model_parallel_rank(), RuntimeError, r"not initialized; call initialize_model_parallel"),
    Row("parallel_state.get_rank_groups", "unknown kind", lambda: _ps().get_rank_groups("zz"), ValueError,
        r"kind must be one of \['dp_cp'"),
    Row("parallel_state.build_rank_groups", "world size not divisible", lambda: _ps().build_rank_groups(8, 3),
        ValueError, r"world_size 8 is not divisible by tp\*pp\*cp = 3\*1\*1 = 3"),
    Row("parallel_state.build_rank_groups", "embedding ranks outside the pipeline group",
        lambda: _ps().build_rank_groups(8, 1, 2, get_embedding_ranks=lambda r: [99]), ValueError,
        r"get_embedding_ranks\(\[0, 4\]\) must return a non-empty list of distinct ranks of that pipeline group"),
    Row("parallel_state.build_rank_groups", "get_embedding_ranks not callable",
        lambda: _ps().build_rank_groups(8, 1, 2, get_embedding_ranks=5), ValueError,
        r"get_embedding_ranks must be None or a function"),
    Row("parallel_state.make_rank_generators", "float size", lambda: _ps().make_rank_generators(8, 2.0), ValueError,
        r"tensor_model_parallel_size must be a positive int, got 2.0"),
    Row("parallel_state.RankGenerator", "repeated axis in order",
        lambda: _ps().RankGenerator(1, 1, 1, 1, 1, order="tp-tp"), ValueError, r"axis \['tp'\] repeated in order"),
    Row("parallel_state.RankGenerator.coordinates", "rank not an int",
        lambda: _ps().RankGenerator(1, 1, 1, 1, 1).coordinates("a"), ValueError, r"rank must be an int, got 'a'"),
    Row("parallel_state.generate_masked_orthogonal_rank_groups", "negative sizes",
        lambda: _ps().generate_masked_orthogonal_rank_groups(4, [-2, -2], [True, False]), ValueError,
        r"parallel_size must hold positive ints"),
    Row("parallel_state.set_virtual_pipeline_model_parallel_rank", "negative rank",
        lambda: _ps().set_virtual_pipeline_model_parallel_rank(-1), ValueError,
        r"virtual pipeline rank must be None or an int >= 0, got -1"),
    Row("parallel_state.set_virtual_pipeline_model_parallel_world_size", "size 0",
        lambda: _ps().set_virtual_pipeline_model_parallel_world_size(0), ValueError,
        r"virtual pipeline world size must be None or a positive int, got 0"),
    Row("python -m moe_graph.parallel_state", "--world-size 0", lambda: _ps().main(["--world-size", "0"]), EXIT,
        r"world_size must be a positive int, got 0"),
    Row("python -m moe_graph.parallel_state", "--tp not an int", lambda: _ps().main(["--world-size", "8", "--tp", "x"]),
        EXIT, r"argument --tp: invalid int value: 'x'"),
    # ---- buffers ----
    Row("ParamAndGradBuffer", "params=None", lambda: _buffer(None), TypeError,
        r"params must be a list of parameters, got NoneType"),
    Row("ParamAndGradBuffer", "empty params", lambda: _buffer([]), ValueError, r"params is empty"),
    Row("ParamAndGradBuffer", "an int in params", lambda: _buffer([1]), TypeError,
        r"params\[0\] must be a floating-point parameter, got int"),
    Row("ParamAndGradBuffer", "an integer tensor in params",
        lambda: _buffer([torch.nn.Parameter(torch.ones(3, dtype=torch.int64), requires_grad=False)]), TypeError,
        r"params\[0\] must be a floating-point parameter, got a torch.int64 tensor"),
    Row("ParamAndGradBuffer", "duplicate params", lambda: _buffer(_params(3) * 2), ValueError, r"duplicates"),
    Row("ParamAndGradBuffer", "data_parallel_world_size=0", lambda: _buffer(_params(3), 0), ValueError,
        r"data_parallel_world_size must be an int >= 1, got 0"),
    Row("ParamAndGradBuffer", "fractional bucket_size", lambda: _buffer(_params(3, 4), bucket_size=1.5), ValueError,
        r"bucket_size must be a positive int or None, got 1.5"),
    Row("ParamAndGradBuffer", "unknown device", lambda: _buffer(_params(3), device="bogus"), ValueError,
        r"device must be a torch.device or a device string, got 'bogus'"),
    Row("ParamAndGradBuffer", "gradient_scaling_factor not a number",
        lambda: _buffer(_params(3), gradient_scaling_factor="x"), ValueError,
        r"gradient_scaling_factor must be a finite number or None"),
    Row("ParamAndGradBuffer", "mixed dtypes",
        lambda: _buffer([torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))]),
        ValueError, r"params must share one \(param_dtype, grad_dtype\)"),
    # ---- DistributedDataParallel ----
    Row("DistributedDataParallel", "module a tensor", lambda: _ddp(torch.randn(3)), TypeError,
        r"module must be a torch.nn.Module, got Tensor"),
    Row("DistributedDataParallel", "data_parallel_group not a group", lambda: _ddp(data_parallel_group="dp"), TypeError,
        r"data_parallel_group must be None or a torch.distributed ProcessGroup, got str"),
    Row("DistributedDataParallel", "bucket_size not an int",
        lambda: _ddp(overlap_grad_reduce=True, bucket_size="big"), ValueError,
        r"bucket_size must be a positive int or None, got 'big'"),
    Row("DistributedDataParallel", "no trainable parameter",
        lambda: _ddp(torch.nn.Linear(2, 2).requires_grad_(False)), ValueError,
        r"module has no parameter with requires_grad=True"),
    # ---- DistributedOptimizer and loss scalers ----
    Row("DistributedOptimizer", "model without use_distributed_optimizer", lambda: _opt(model=_ddp()), ValueError,
        r"use_distributed_optimizer=True"),
    Row("DistributedOptimizer", "model list with a non-DDP entry", lambda: _opt(model=[_ddp(use_distributed_optimizer=True), None]),
        ValueError, r"model\[1\] must be a DistributedDataParallel"),
    Row("DistributedOptimizer", "fp64 params",
        lambda: _opt(model=_ddp(torch.nn.Linear(2, 2).double(), use_distributed_optimizer=True)), NotImplementedError,
        r"parameters of dtype torch.float64 are not supported .*supported parameter dtypes: torch.float32"),
    Row("DistributedOptimizer", "negative lr", lambda: _opt(lr=-1.0), ValueError, r"lr must be a finite number >= 0"),
    Row("DistributedOptimizer", "nan lr", lambda: _opt(lr=float("nan")), ValueError, r"lr must be a finite number"),
    Row("DistributedOptimizer", "betas not a pair", lambda: _opt(betas=0.9), ValueError,
        r"betas must be a pair \(beta1, beta2\) of numbers in \[0, 1\)"),
    Row("DistributedOptimizer", "beta1 = 1", lambda: _opt(betas=(1.0, 0.9)), ValueError, r"betas must be a pair"),
    Row("DistributedOptimizer", "negative eps", lambda: _opt(eps=-1e-8), ValueError, r"eps must be a finite number >= 0"),
    Row("DistributedOptimizer", "nan weight_decay", lambda: _opt(weight_decay=float("nan")), ValueError,
        r"weight_decay must be a finite number >= 0"),
    Row("DistributedOptimizer", "negative clip_grad", lambda: _opt(clip_grad=-1.0), ValueError,
        r"clip_grad must be a finite number >= 0 \(0: no clipping\)"),
    Row("DistributedOptimizer", "adamw not a bool", lambda: _opt(adamw="no"), ValueError, r"adamw must be a bool"),
    Row("DistributedOptimizer", "unknown impl", lambda: _opt(impl="apex"), ValueError, r"impl must be 'auto'"),
    Row("DistributedOptimizer", "loss_scaler a number", lambda: _opt(loss_scaler=1024.0), ValueError,
        r"loss_scaler must be None, a ConstantLossScaler or a DynamicLossScaler"),
    Row("DistributedOptimizer", "no_weight_decay_params not of the model",
        lambda: _opt(no_weight_decay_params=_params(3)), ValueError,
        r"no_weight_decay_params\[0\] is not a trainable parameter of the model"),
    Row("DistributedOptimizer", "negative tensor_model_parallel_rank", lambda: _opt(tensor_model_parallel_rank=-1),
        ValueError, r"tensor_model_parallel_rank must be None or an int >= 0"),
    Row("DistributedOptimizer", "model_parallel_group not a group", lambda: _opt(model_parallel_group="mp"), ValueError,
        r"model_parallel_group must be 'auto', None or a torch.distributed ProcessGroup"),
    Row("DistributedOptimizer.set_lr", "nan", lambda: _opt().set_lr(float("nan")), ValueError,
        r"set_lr: lr must be a finite number >= 0"),
    Row("DistributedOptimizer.beta2", "set to 1", lambda: setattr(_opt(), "beta2", 1.0), ValueError,
        r"betas must be a pair"),
    Row("DistributedOptimizer.load_state_dict", "None", lambda: _load(None), ValueError,
        r"state must be the dict returned by state_dict\(\) or a list of them .*got NoneType"),
    Row("DistributedOptimizer.load_state_dict", "a file name", lambda: _load("ckpt.pt"), ValueError,
        r"state must be .*got str"),
    Row("DistributedOptimizer.load_state_dict", "an empty list", lambda: _load([]), ValueError, r"no shard given"),
    Row("DistributedOptimizer.load_state_dict", "another format", lambda: _load({"format": "torch.optim"}), ValueError,
        r"unknown checkpoint format 'torch.optim'"),
    Row("DistributedOptimizer.load_state_dict", "a fractional step",
        lambda: _load({**_saved(), "step": 2.5}, verify_checksum=False), ValueError, r"'step' must be a whole number"),
    Row("DistributedOptimizer.load_state_dict", "a piece of the wrong size",
        lambda: _load((lambda sd: {**sd, "shard": {**sd["shard"], "bias": {**sd["shard"]["bias"], "exp_avg": torch.zeros(2)}}})(_saved()),
                      verify_checksum=False), ValueError, r"'exp_avg' must be a 1-D torch.float32 tensor of 3 elements"),
    Row("DistributedOptimizer.load_state_dict", "a piece with range None",
        lambda: _load((lambda sd: {**sd, "shard": {**sd["shard"], "bias": {**sd["shard"]["bias"], "range": None}}})(_saved()),
                      verify_checksum=False), ValueError, r"'range' must be \(start, end\)"),
    Row("DistributedOptimizer.load_state_dict", "hyper-parameters without eps",
        lambda: _load((lambda sd: {**sd, "hyper": {k: v for k, v in sd["hyper"].items() if k != "eps"}})(_saved()),
                      verify_checksum=False), ValueError, r"'hyper' must be a dict with keys"),
    Row("DistributedOptimizer.load_state_dict", "an edited (checksum-failing) state",
        lambda: _load({**_saved(), "lr": torch.tensor(0.5)}), ValueError, r"fails its checksum"),
    Row("ConstantLossScaler", "scale 0", lambda: importlib.import_module("moe_graph.distributed.optimizer").ConstantLossScaler(0.0),
        ValueError, r"scale must be a finite number > 0"),
    Row("DynamicLossScaler", "min_scale above initial_scale",
        lambda: importlib.import_module("moe_graph.distributed.optimizer").DynamicLossScaler(initial_scale=1.0, min_scale=4.0),
        ValueError, r"min_scale \(4.0\) must not exceed initial_scale \(1.0\)"),
    Row("DynamicLossScaler", "fractional growth_interval",
        lambda: importlib.import_module("moe_graph.distributed.optimizer").DynamicLossScaler(growth_interval=1.5), ValueError,
        r"growth_interval must be an int >= 1, got 1.5"),
    # ---- pipeline schedules ----
    Row("pipeline.get_schedule_table", "microbatch group size 0", lambda: _pipeline().get_schedule_table(4, 2, 0),
        ValueError, r"microbatch_group_size_per_vp_stage must be an int >= 1, got 0"),
    Row("pipeline.get_schedule_table", "num_model_chunks=0", lambda: _pipeline().get_schedule_table(4, 0, 2),
        ValueError, r"num_model_chunks must be an int >= 1, got 0"),
    Row("pipeline.num_warmup_microbatches", "num_microbatches=0", lambda: _pipeline().num_warmup_microbatches(0, 2, 0),
        ValueError, r"num_microbatches must be an int >= 1, got 0"),
    Row("pipeline.num_warmup_microbatches", "pp_rank past pp_size",
        lambda: _pipeline().num_warmup_microbatches(4, 2, 5), ValueError, r"pp_rank 5 out of range for pp_size 2"),
    Row("pipeline.schedule_order", "interleaving without pipeline stages",
        lambda: _pipeline().schedule_order(4, 1, 0, vpp_size=2), ValueError, r"vpp_size=2 \(interleaved schedule\) needs pp_size > 1"),
    Row("python -m moe_graph.train.schedules", "--pp 0", lambda: _pipeline().main(["--pp", "0", "-m", "4"]), EXIT,
        r"argument --pp: expected an integer >= 1, got 0"),
    Row("pipeline.chunk_layer_ids", "layers not divisible by stages", lambda: _pipeline().chunk_layer_ids(5, 2, 0),
        ValueError, r"num_layers=5 is not divisible by pp_size\*vpp_size = 2\*1 = 2"),
    # ---- FullIterationGraph ----
    Row("FullIterationGraph", "train_fn not callable", lambda: _graph(5), TypeError, r"train_fn must be callable, got int"),
    Row("FullIterationGraph", "warmup_steps=0", lambda: _graph(lambda: None, warmup_steps=0), ValueError,
        r"warmup_steps must be >= 1"),
    Row("FullIterationGraph", "unknown capture_error_mode", lambda: _graph(lambda: None, capture_error_mode="loose"),
        ValueError, r"capture_error_mode must be 'global', 'thread_local' or 'relaxed'"),
    Row("FullCudaGraphWrapper", "forward_backward_func not callable", lambda: _graph_wrapper(3), TypeError,
        r"forward_backward_func must be callable"),
    Row("check_errors", "device not a device name", lambda: _check_errors("bogus"), ValueError,
        r"check_errors: device must name a device"),
    Row("check_errors", "device of the wrong type", lambda: _check_errors(3.5), TypeError,
        r"check_errors: device must be a str, a torch.device or None, got float"),
    Row("group_params_for_buffers", "params=None", lambda: _group_params(None), TypeError,
        r"params must be an iterable of parameters"),
    Row("group_params_for_buffers", "an int in params", lambda: _group_params([1]), TypeError,
        r"every entry of params must be a parameter, got int"),
    # ---- training entry point: launch layout and checkpoints ----
    Row("launch.resolve_layout", "--pp not dividing the world", lambda: _launch().resolve_layout(3, pp=2), ValueError,
        r"--pp 2 does not divide the world size 3"),
    Row("launch.resolve_layout", "--pp 0", lambda: _launch().resolve_layout(4, pp=0), ValueError,
        r"--pp must be an integer >= 1, got 0"),
    Row("launch.resolve_layout", "--ep not dividing the data-parallel size", lambda: _launch().resolve_layout(4, ep=3),
        ValueError, r"--ep 3 does not divide the data-parallel size 4"),
    Row("checkpoint.resolve_checkpoint", "a missing folder",
        lambda: importlib.import_module("moe_graph.train.checkpoint").resolve_checkpoint("/nonexistent/moe_graph_ckpt"),
        FileNotFoundError, r"--load /nonexistent/moe_graph_ckpt: no such folder"),
    # ---- demo command line (choices checked by argparse) ----
    *[Row("python -m moe_graph.demo", " ".join(args), lambda args=args: _demo(args), EXIT, msg) for args, msg in [
        (["--ep", "0"], r"argument --ep: expected an integer >= 1, got 0"),
        (["--steps", "-5"], r"argument --steps: expected an integer >= 1, got -5"),
        (["--steps", "0"], r"argument --steps: expected an integer >= 1, got 0"),
        (["--batch", "0"], r"argument --batch: expected an integer >= 1, got 0"),
        (["--log-every", "0"], r"argument --log-every: expected an integer >= 1, got 0"),
        (["--heads", "3"], r"--heads 3 must divide --hidden 64"),
        (["--lr", "nan"], r"argument --lr: expected a finite number > 0.0, got nan"),
    ]],
    Row("python -m moe_graph.demo", "--router unknown", lambda: _demo(["--router", "x"]),
        EXIT, r"argument --router: invalid choice: 'x'"),
    Row("python -m moe_graph.demo", "--steps not an int", lambda: _demo(["--steps", "1e3"]),
        EXIT, r"argument --steps: invalid int value: '1e3'"),
]


def _id(row: Row) -> str:
    return re.sub(r"\W+", "_", f"{row.entry}-{row.bad}").strip("_")


def test_every_entry_point_family_has_rows():
    families = {"grouped_gemm", "GroupedLinear", "planner", "reroute_tokens", "EchoExpertDispatcher", "MoELayer",
                "TokenDispatcher", "launch", "checkpoint", "parallel_state", "ParamAndGradBuffer",
                "DistributedDataParallel", "DistributedOptimizer", "pipeline", "FullIterationGraph", "demo"}
    assert all(any(f in r.entry for r in ROWS) for f in families)
    assert len({_id(r) for r in ROWS}) == len(ROWS)


@pytest.mark.parametrize("row", ROWS, ids=_id)
def test_bad_input(row: Row, capsys):
    if row.outcome is FLAG:
        from moe_graph.ops.errors import check_errors, read_error_flag

        read_error_flag("cpu")  # start clean
        row.call()  # returns: the condition is only known on the device
        with pytest.raises(RuntimeError, match=row.match):
            check_errors("cpu")
        check_errors("cpu")  # reading cleared it
    elif row.outcome is EXIT:
        with pytest.raises(SystemExit) as exc:
            row.call()
        assert exc.value.code == 2
        assert re.search(row.match, capsys.readouterr().err), row
    else:
        with pytest.raises(row.outcome, match=row.match):
            row.call()
