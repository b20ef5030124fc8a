"""Megatron-core's ``MoELayer`` without a host sync: moe_graph's static-capacity token dispatcher inside it.

Megatron-core 0.19's all-to-all dispatcher copies the token counts to the host to size its exchange and the expert
inputs (one host sync per MoE layer per forward), and its ``TEGroupedMLP`` turns ``tokens_per_expert`` into a Python
list. :class:`MoeGraphMoELayer` is Megatron's ``MoELayer`` (its router with every option, its shared experts, its
aux losses and logging) whose token dispatcher is :class:`MoeGraphTokenDispatcher`: Megatron's dispatcher interface
(``dispatch_preprocess`` / ``token_dispatch`` / ``dispatch_postprocess`` / ``combine_preprocess`` /
``token_combine`` / ``combine_postprocess``) on :class:`moe_graph.moe.token_dispatcher.TokenDispatcher`, with the
experts of :func:`moe_graph.integrations.megatron.experts_spec` (``TEGroupedMLP`` on moe_graph's ``GroupedLinear``)
taking the per-expert row counts on the device. Nothing in the layer's forward or backward reads a device value on
the host, so Megatron's full-iteration CUDA graph (``--cuda-graph-impl full_iteration``) can capture MoE models.

* Routing: Megatron's router output (``probs [T, E]`` and ``routing_map [T, E]``) becomes moe_graph's ``[T, K]``
  routes (:func:`moe_graph.moe.token_dispatcher.topk_from_routing_map`; a token with fewer than ``K`` routes, e.g.
  padding or the router's own capacity drop, gets invalid entries). Every router option (score function,
  group-limited top-k, expert bias, aux/seq/global losses, ``moe_router_topk_scaling_factor``, z-loss) is Megatron's
  own code, unchanged.
* Rows: the expert input holds the routes grouped by local expert, then source rank, then token: Megatron's order,
  then padding rows (zeros, probability 0) up to the static size ``R * capacity`` (per pair) or ``capacity`` (per
  destination rank). ``tokens_per_expert`` is a :class:`DeviceSplits` (``.tolist()`` gives the device tensor
  back), which ``TEGroupedMLP`` on moe_graph's grouped linears passes straight to the grouped GEMM.
* Capacity: ``capacity_factor=None`` is dropless (``T * K`` rows per pair). With a factor, routes over the capacity
  are dropped (``overflow="drop"``, counted) or make the step rerun (``overflow="rerun"``:
  :class:`MegatronOverflowRerun` around Megatron's ``train_step``).
* Echo: ``num_spare_experts_per_ep_rank`` spare slots per EP rank take copies of the busiest experts
  (:class:`moe_graph.moe.echo_balancer.EchoBalancer`; the counts all-gathered on the device, the spare weights
  dispatched to :class:`~moe_graph.integrations.megatron.MoeGraphGroupedMLP` through :class:`DeviceSplits`, their
  gradients sent home in backward); ``echo_donors`` limits the donors. With ``gradient_accumulation_fusion`` and /
  or ``delay_wgrad_compute`` the spare slots' weight gradients go home into the home experts' ``main_grad`` (or
  ``.grad``), from the GEMM's backward or from ``backward_dw``
  (:class:`~moe_graph.integrations.megatron.MoeGraphGroupedLinear`).
* FP8: with ``config.fp8`` the experts run moe_graph's FP8 recipes (``fp8_recipe_from_config``) and the rows are
  placed so that each expert's group starts at a multiple of 16 rows (the FP8 wgrad's alignment; zero rows between
  groups). ``fp8_dispatch=True`` (``config.fp8_recipe`` "blockwise" or "mxfp8") quantizes the tokens rowwise before
  the exchange, once each, and sends their FP8 and scale bytes; the experts' first GEMM reads them as they arrive
  (through Megatron's layer the rows travel as their autograd carrier, :meth:`MoeGraphTokenDispatcher.token_dispatch`).
* Statistics: Megatron's MoE metrics tracker (:meth:`MoeGraphTokenDispatcher._log_statistics`).

Not supported (each raises naming the option): expert tensor parallelism ``expert_tensor_parallel_size > 1``,
Megatron's drop-and-pad (``moe_pad_expert_input_to_capacity``: use ``capacity_factor`` here),
``moe_router_padding_for_quantization`` (fp8), the inference-optimized dispatchers, experts other than
:func:`~moe_graph.integrations.megatron.experts_spec`'s, ``fp8_dispatch`` without FP8 experts of a row-local
recipe (blockwise / mxfp8) or with ``moe_apply_probs_on_input``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from functools import partial
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

try:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from megatron.core.transformer.moe import moe_layer as _mcore_moe_layer
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher
except ImportError as exc:  # pragma: no cover - exercised only without megatron-core
    raise ImportError(
        "moe_graph.integrations.megatron_moe needs megatron-core (tested with 0.19.2): pip install megatron-core"
    ) from exc

from moe_graph.grouped_linear import GroupedLinear
from moe_graph.moe.echo import dispatch_spare_weights
from moe_graph.moe.echo_balancer import EchoBalancer
from moe_graph.moe.layer import _all_gather_counts, reset_step_counters, step_max_load_ratio, step_overflow
from moe_graph.moe.experts import aligned_rows_for
from moe_graph.moe.token_dispatcher import (DROP_POLICIES, OVERFLOW_MODES, TokenDispatcher, counting_enabled,
                                            expert_columns, topk_from_routing_map)
from moe_graph.ops import fp8 as _fp8
from moe_graph.ops.fp8 import QuantizedRows
from moe_graph.train.step import OverflowRerun

__all__ = ["DeviceSplits", "fp8_recipe_from_config", "MoeGraphTokenDispatcher", "MoeGraphMoELayer", "moe_graph_layers",
           "MegatronOverflowRerun", "ReplayIterator"]


class DeviceSplits:
    """Rows per local expert as a device tensor, in the place where Megatron's experts expect a host tensor they
    turn into a list (``TEGroupedMLP.forward``: ``tokens_per_expert.tolist()``): ``tolist()`` returns the device
    tensor itself, which moe_graph's grouped linears take as ``m_splits`` without a sync."""

    __slots__ = ("tensor", "echo")

    def __init__(self, tensor: torch.Tensor, echo=None):
        self.tensor = tensor
        self.echo = echo  # with echo: (EchoExpertDispatcher, the forward's plan) for the spare slots' weights

    def tolist(self) -> torch.Tensor:
        return self.tensor

    def __repr__(self) -> str:
        return f"DeviceSplits({self.tensor!r})"


def fp8_recipe_from_config(config):
    """``moe_graph.fp8.Recipe`` for Megatron's ``config.fp8`` / ``config.fp8_recipe`` (None without ``fp8``)."""
    fmt = getattr(config, "fp8", None)
    if not fmt:
        return None
    fmt = str(fmt).lower()
    if fmt not in ("e4m3", "hybrid"):
        raise NotImplementedError(f"moe_graph.integrations.megatron: config.fp8={fmt!r} (moe_graph runs 'e4m3' and "
                                  "'hybrid')")
    name = str(getattr(config, "fp8_recipe", None) or "delayed").lower()
    if name not in ("blockwise", "mxfp8", "tensorwise", "delayed"):
        raise NotImplementedError(f"moe_graph.integrations.megatron: config.fp8_recipe={name!r} (moe_graph runs "
                                  "'blockwise', 'mxfp8', 'tensorwise' and 'delayed' as current scaling)")
    base = _fp8.as_recipe(name)
    return dataclasses.replace(base, fp8_format="HYBRID" if fmt == "hybrid" else "E4M3")


def _check_fp8_dispatch(config, recipe) -> None:
    """``fp8_dispatch=True`` needs FP8 experts with row-local activation tiles and the rows as they arrive."""
    if recipe is None or recipe.kind not in ("blockwise", "mxfp8"):
        raise ValueError(
            "moe_graph's Megatron dispatcher: fp8_dispatch=True needs FP8 experts whose activation tiles are "
            "row-local: config.fp8 with config.fp8_recipe 'blockwise' or 'mxfp8' (got fp8="
            f"{getattr(config, 'fp8', None)!r}, fp8_recipe={getattr(config, 'fp8_recipe', None)!r})")
    if config.moe_apply_probs_on_input:
        raise NotImplementedError(
            "moe_graph's Megatron dispatcher: fp8_dispatch=True with moe_apply_probs_on_input (the experts scale "
            "their input rows, which arrive in FP8) is not supported")


def _table_device(config) -> torch.device:
    """Where the dispatcher's constant tables start: the parameters' device (Megatron's rule); ``.to()`` / ``.cuda()``
    of the layer moves them (the dispatcher is a submodule of :class:`MoeGraphMoELayer`)."""
    if config.use_cpu_initialization or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


class MoeGraphTokenDispatcher(MoETokenDispatcher):
    """Megatron's token-dispatcher interface on :class:`moe_graph.moe.token_dispatcher.TokenDispatcher`.

    Constructed as Megatron's dispatchers are (``num_local_experts, local_expert_indices, config, pg_collection``)
    plus moe_graph's options: ``capacity_factor`` (``None``: dropless), ``overflow`` (``"drop"`` or ``"rerun"``),
    ``token_drop_policy`` (``"probs"``, Megatron's, or ``"position"``), ``exchange`` (``"auto"``, ``"nccl"``,
    ``"symm_mem"``), ``num_spare_experts_per_ep_rank`` (the routing columns include the spare slots; the echo
    plan itself is :class:`MoeGraphMoELayer`'s) and ``fp8_dispatch`` (the rows travel in FP8: needs ``config.fp8``
    with ``fp8_recipe`` "blockwise" or "mxfp8"). The moe_graph dispatcher is :attr:`dispatcher` (an ``nn.Module``
    holding the constant tables and the per-step counters)."""

    def __init__(self, num_local_experts: int, local_expert_indices, config, pg_collection=None, *,
                 capacity_factor: Optional[float] = None, overflow: str = "drop", token_drop_policy: str = "probs",
                 exchange: str = "auto", num_spare_experts_per_ep_rank: int = 0, echo_donors: Optional[int] = None,
                 echo_assignment: str = "auto", fp8_dispatch: bool = False):
        super().__init__(config=config, pg_collection=pg_collection)
        _check_config(config, self.tp_size)
        self.fp8_recipe = fp8_recipe_from_config(config)  # the experts' (None: 16-bit experts)
        if fp8_dispatch:
            _check_fp8_dispatch(config, self.fp8_recipe)
        self.fp8_dispatch = bool(fp8_dispatch)
        if overflow not in OVERFLOW_MODES:
            raise ValueError(f"overflow must be one of {OVERFLOW_MODES}, got {overflow!r}")
        if token_drop_policy not in DROP_POLICIES:
            raise ValueError(f"token_drop_policy must be one of {DROP_POLICIES}, got {token_drop_policy!r}")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0 or None (dropless), got {capacity_factor!r}")
        if overflow == "rerun" and capacity_factor is None:
            raise ValueError("overflow='rerun' needs a capacity_factor (None is dropless: nothing overflows)")
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        self.num_experts = config.num_moe_experts
        self.topk = config.moe_router_topk
        self.capacity_factor, self.overflow = capacity_factor, overflow
        k = num_spare_experts_per_ep_rank
        col_rank, col_local = expert_columns(self.num_experts, self.ep_size, k)
        self.dispatcher = TokenDispatcher(num_local_experts + k, self.ep_size, self.ep_rank, col_rank, col_local,
                                          capacity=None, group=self.ep_group if self.ep_size > 1 else None,
                                          drop_policy=token_drop_policy, device=_table_device(config),
                                          exchange=exchange)
        self.echo = None
        if k > 0:
            self.echo = EchoBalancer(self.num_experts, self.ep_size, self.ep_rank, k, assignment=echo_assignment,
                                     donors=echo_donors, group=self.ep_group if self.ep_size > 1 else None,
                                     device=_table_device(config))
        self._echo_plan = None
        self.cudagraph_attrs = []  # nothing to hand across a partial per-layer capture: every shape is static
        self.shared_experts = None
        self.layer_number = None  # set by MoeGraphMoELayer (Megatron's metrics are per layer)
        self._routes = None
        self._handle = None
        self._fp8_rows = None

    # ---------------------------------------------------------------------------------------- routing --
    def set_routes(self, indices: torch.Tensor, probs: torch.Tensor, valid: Optional[torch.Tensor]) -> None:
        """The ``[T, K]`` routes of the next dispatch when the layer computed them itself (echo rerouting);
        without it :meth:`dispatch_preprocess` takes them from the router's ``routing_map``."""
        self._routes = (indices, probs, valid)

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """``[T, E]`` routing map and probabilities -> ``[T, K]`` routes (kept for :meth:`token_dispatch`)."""
        self.hidden_shape = hidden_states.shape
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        if self._routes is None:
            self._routes = topk_from_routing_map(routing_map, probs, self.topk)
        if self.echo is not None:
            self._balance(routing_map)
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden_states.view(self.hidden_shape))
        return hidden_states, probs

    def _balance(self, routing_map: torch.Tensor) -> None:
        """Echo: the per-rank expert counts all-gathered over the EP group, the plan, this rank's routes moved to the
        spare slots (the probabilities stay), and the load imbalance before / after into Megatron's tracker."""
        indices, route_probs, valid = self._routes
        R = self.ep_size
        counts = _all_gather_counts(routing_map.sum(0).to(torch.int64), self.ep_group, R)  # [R, E]
        indices, self._echo_plan, home_to_spare = self.echo.plan(counts, indices, valid)
        self._routes = (indices, route_probs, valid)
        if self.layer_number is not None and counting_enabled():
            before = counts.sum(0).view(R, -1).sum(1)
            after = self.echo.load_after(before, home_to_spare)
            num_layers = self.config.num_layers + (self.config.mtp_num_layers or 0)
            tracker = get_moe_metrics_tracker()
            for name, load in (("moe_graph_load_imbalance_before_echo", before),
                               ("moe_graph_load_imbalance_after_echo", after)):
                load = load.to(torch.float32)
                tracker.record(name, load.max() / load.mean().clamp_min(1.0), self.layer_number, num_layers)

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """The static-capacity exchange: ``(expert input [rows, H], row probabilities [rows])``. Under FP8 experts
        the groups start at multiples of 16 rows; with ``fp8_dispatch`` the expert input returned is the FP8 rows'
        autograd carrier (a zero-stride tensor: Megatron's layer may wrap it in its own autograd functions) and
        :meth:`dispatch_postprocess` hands the experts the rows (``moe_graph.ops.fp8.QuantizedRows``) with it."""
        indices, route_probs, valid = self._routes
        self._routes = None
        if self.shared_experts is not None:
            self.shared_experts.wait_current_stream()
        T = hidden_states.shape[0]
        d = self.dispatcher
        d.capacity = d.capacity_for(T, self.topk, self.capacity_factor)
        recipe = self._experts_recipe()
        align = aligned_rows_for(recipe)
        expert_input, m_splits, self._handle = d.dispatch(hidden_states, indices, route_probs, valid,
                                                          fp8_recipe=recipe if self.fp8_dispatch else None,
                                                          align_rows=align)
        self._log_statistics(self._handle, self._handle.m_splits, T)
        if isinstance(expert_input, QuantizedRows):  # FP8 dispatch: Megatron's layer passes the carrier on
            self._fp8_rows, expert_input = expert_input, expert_input.carrier
        if self.shared_experts is not None:
            self.shared_experts.linear_fc1_forward_and_act(expert_input)
        self._m_splits = m_splits
        return expert_input, d.row_weights(self._handle)

    def _experts_recipe(self):
        """The FP8 recipe the experts run this forward (an active ``moe_graph.fp8.autocast`` / TE's, else the
        config's, as :class:`moe_graph.integrations.megatron.MoeGraphGroupedLinear`), or None."""
        return _fp8.current_recipe() or self.fp8_recipe

    def _log_statistics(self, handle, m_splits: torch.Tensor, num_tokens: int) -> None:
        """This dispatch's statistics into Megatron's MoE metrics tracker (device ops: no sync, capturable; not
        again while activation recomputation re-runs the forward), reported by ``tracker.report()`` per layer,
        averaged over the microbatches: ``moe_graph_dropped_routes`` (routes over the capacity, summed over the EP
        group), ``moe_graph_load_ratio`` (the most routes this rank sends one rank, over the mean ``T * K / R``: the
        capacity factor at which nothing drops) and ``moe_graph_expert_rows`` (rows this rank's experts received,
        over the mean ``T * K``)."""
        if self.layer_number is None or not counting_enabled():
            return
        tracker = get_moe_metrics_tracker()
        num_layers = self.config.num_layers + (self.config.mtp_num_layers or 0)
        R, TK = self.ep_size, max(num_tokens * self.topk, 1)
        per_rank = torch.zeros(R, dtype=torch.float32, device=m_splits.device).index_add_(
            0, self.dispatcher.column_rank, handle.column_counts.to(torch.float32))
        ep = self.ep_group if R > 1 else None
        tracker.record("moe_graph_dropped_routes", handle.dropped.to(torch.float32), self.layer_number, num_layers,
                       reduce_group=ep)
        tracker.record("moe_graph_load_ratio", per_rank.max() * R / TK, self.layer_number, num_layers)
        tracker.record("moe_graph_expert_rows", m_splits.sum().to(torch.float32) / TK, self.layer_number,
                       num_layers)

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """``(expert input, DeviceSplits(rows per local expert), row probabilities)``: already in expert order."""
        m_splits, self._m_splits = self._m_splits, None
        plan, self._echo_plan = self._echo_plan, None
        echo = (self.echo.dispatcher, plan) if plan is not None else None
        rows, self._fp8_rows = self._fp8_rows, None
        if rows is not None:  # the FP8 rows, with the carrier Megatron handed on (its autograd path)
            hidden_states = dataclasses.replace(rows, carrier=hidden_states)
        return hidden_states, DeviceSplits(m_splits, echo), probs

    def combine_preprocess(self, hidden_states: torch.Tensor):
        return hidden_states

    def token_combine(self, hidden_states: torch.Tensor, async_finish: bool = True,
                      allocate_on_comm_stream: bool = True):
        """The reverse exchange and the plain sum of each token's routes (the experts applied the probabilities)."""
        if self.shared_experts is not None:
            self.shared_experts.wait_current_stream()
        handle, self._handle = self._handle, None
        out = self.dispatcher.combine(hidden_states, handle, weighted=False)
        if self.shared_experts is not None:
            self.shared_experts.linear_fc2_forward(out)
            self.shared_experts.post_forward_comm()
        return out

    def combine_postprocess(self, hidden_states: torch.Tensor):
        out = hidden_states.view(self.hidden_shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts.get_output()
        return out


def _check_config(config, expert_tp_size: int) -> None:
    """Clear errors for the combinations this dispatcher does not serve."""
    if expert_tp_size > 1:
        raise NotImplementedError(
            f"moe_graph's Megatron dispatcher: expert tensor parallelism (expert_tensor_parallel_size="
            f"{expert_tp_size}) is not supported; use expert_tensor_parallel_size=1 (attention TP with sequence "
            "parallelism is fine: each rank dispatches its own sequence shard over the EP group)")
    if config.moe_pad_expert_input_to_capacity:
        raise NotImplementedError(
            "moe_graph's Megatron dispatcher: moe_pad_expert_input_to_capacity (Megatron's drop-and-pad) is not "
            "supported; the moe_graph dispatcher is static-capacity by construction: give capacity_factor to "
            "get_gpt_layer_with_moe_graph_spec(dispatcher_options=...)")
    if config.moe_router_padding_for_quantization:
        raise NotImplementedError(
            "moe_graph's Megatron dispatcher: moe_router_padding_for_quantization (fp8/fp4 expert padding) is not "
            "supported")
    if getattr(config, "transformer_impl", None) == "inference_optimized":
        raise NotImplementedError(
            "moe_graph's Megatron dispatcher: transformer_impl='inference_optimized' builds Megatron's inference "
            "dispatchers; use the default transformer_impl")


_PATCH_LOCK = threading.Lock()


@contextlib.contextmanager
def _megatron_dispatchers(factory):
    """While Megatron's ``MoELayer.__init__`` runs: every dispatcher type it may build is ``factory`` (it builds one
    from ``config.moe_token_dispatcher_type`` and hands it the shared experts with ``moe_shared_expert_overlap``)."""
    names = ("MoEAllGatherTokenDispatcher", "MoEAlltoAllTokenDispatcher", "MoEFlexTokenDispatcher")
    with _PATCH_LOCK:
        saved = {n: getattr(_mcore_moe_layer, n) for n in names}
        for n in names:
            setattr(_mcore_moe_layer, n, factory)
        try:
            yield
        finally:
            for n, f in saved.items():
                setattr(_mcore_moe_layer, n, f)


class MoeGraphMoELayer(MoELayer):
    """Megatron-core's ``MoELayer`` with :class:`MoeGraphTokenDispatcher` (whatever ``moe_token_dispatcher_type``
    the config names; set ``"alltoall"``, whose config checks fit) and moe_graph's options as keywords:
    ``capacity_factor``, ``overflow``, ``token_drop_policy``, ``exchange``, ``num_spare_experts_per_ep_rank``,
    ``echo_donors``, ``echo_assignment``, ``fp8_dispatch``. The experts must be moe_graph's
    (:func:`moe_graph.integrations.megatron.experts_spec`)."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, is_mtp_layer=False,
                 name=None, *, capacity_factor: Optional[float] = None, overflow: str = "drop",
                 token_drop_policy: str = "probs", exchange: str = "auto", num_spare_experts_per_ep_rank: int = 0,
                 echo_donors: Optional[int] = None, echo_assignment: str = "auto", fp8_dispatch: bool = False):
        factory = partial(MoeGraphTokenDispatcher, capacity_factor=capacity_factor, overflow=overflow,
                          token_drop_policy=token_drop_policy, exchange=exchange,
                          num_spare_experts_per_ep_rank=num_spare_experts_per_ep_rank, echo_donors=echo_donors,
                          echo_assignment=echo_assignment, fp8_dispatch=fp8_dispatch)
        with _megatron_dispatchers(factory):
            super().__init__(config, submodules=submodules, layer_number=layer_number, pg_collection=pg_collection,
                             is_mtp_layer=is_mtp_layer, name=name)
        fc1 = getattr(self.experts, "linear_fc1", None)
        if not isinstance(fc1, GroupedLinear):
            raise TypeError(
                f"MoeGraphMoELayer: the experts must be TEGroupedMLP on moe_graph's grouped linears "
                f"(moe_graph.integrations.megatron.experts_spec), got {type(self.experts).__name__}: the dispatcher "
                "hands them padded rows and per-expert counts on the device")
        # a submodule: .to()/.cuda() of the model move its constant tables and counters (non-persistent buffers)
        self.moe_graph_dispatcher = self.token_dispatcher.dispatcher
        if self.token_dispatcher.echo is not None:
            self.moe_graph_echo = self.token_dispatcher.echo
        self.token_dispatcher.layer_number = self.layer_number

    def set_layer_number(self, layer_number: int) -> None:
        super().set_layer_number(layer_number)
        self.token_dispatcher.layer_number = layer_number

    # the names moe_graph's training helpers read (MegatronOverflowRerun)
    @property
    def dispatcher(self) -> TokenDispatcher:
        return self.token_dispatcher.dispatcher

    @property
    def capacity_factor(self) -> Optional[float]:
        return self.token_dispatcher.capacity_factor

    @capacity_factor.setter
    def capacity_factor(self, value: Optional[float]) -> None:
        self.token_dispatcher.capacity_factor = value

    @property
    def overflow(self) -> str:
        return self.token_dispatcher.overflow

    @property
    def num_ep_ranks(self) -> int:
        return self.token_dispatcher.ep_size


def moe_graph_layers(model) -> list:
    """Every :class:`MoeGraphMoELayer` in ``model`` (a module or a list of model chunks), in module order."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [m for c in chunks for m in c.modules() if isinstance(m, MoeGraphMoELayer)]


# --------------------------------------------------------------------------------- the training loop --
# forward_backward_func's index in the arguments after the first four of Megatron's train_step(forward_step_func,
# data_iterator, model, optimizer, opt_param_scheduler, config, forward_backward_func, ...)
_FBF_ARG = 2


class ReplayIterator:
    """Wraps a data iterator and keeps the items read since :meth:`start`; after :meth:`rewind` it hands the same
    items again, then reads on."""

    def __init__(self, iterator):
        self.iterator = iterator
        self.items: List[Any] = []
        self.pos = None

    def start(self) -> None:
        self.items, self.pos = [], None

    def rewind(self) -> None:
        self.pos = 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.pos is not None and self.pos < len(self.items):
            self.pos += 1
            return self.items[self.pos - 1]
        item = next(self.iterator)
        self.items.append(item)
        if self.pos is not None:
            self.pos += 1
        return item


def _rng_state(device: Optional[torch.device]) -> Dict[str, Any]:
    st: Dict[str, Any] = {"cpu": torch.get_rng_state()}
    if device is not None and device.type == "cuda":
        st["cuda"] = torch.cuda.get_rng_state(device)
    tracker = get_cuda_rng_tracker()
    if tracker.is_initialized():  # byte-tensor states, or generators (use_cudagraphable_rng): their states
        st["megatron"] = {k: (v, v.get_state()) if isinstance(v, torch.Generator) else v.clone() if torch.is_tensor(v)
                          else v for k, v in tracker.get_states().items()}
    return st


def _set_rng_state(st: Dict[str, Any], device: Optional[torch.device]) -> None:
    torch.set_rng_state(st["cpu"])
    if "cuda" in st:
        torch.cuda.set_rng_state(st["cuda"], device)
    if "megatron" in st:
        states = {}
        for k, v in st["megatron"].items():
            if isinstance(v, tuple):  # a generator and its saved state
                v[0].set_state(v[1])
                v = v[0]
            states[k] = v.clone() if torch.is_tensor(v) else v
        get_cuda_rng_tracker().set_states(states)


class _GraphReset:
    """``reset()`` of Megatron's ``FullCudaGraphWrapper`` training graph (what :class:`OverflowRerun` calls after
    raising the capacity)."""

    def __init__(self, graph):
        self.graph = graph

    def reset(self) -> None:
        self.graph.reset_cuda_graph("training")


class MegatronOverflowRerun(OverflowRerun):
    """Dropless training with a static capacity (``overflow="rerun"``) around Megatron's ``train_step``: moe_graph's
    :class:`moe_graph.train.step.OverflowRerun` (its rerun loop, adaptive capacity, statistics and state dict) over
    Megatron's training loop.

    A :class:`moe_graph.integrations.megatron_moe.MoeGraphMoELayer` with ``capacity_factor`` and ``overflow="rerun"``
    counts, on the device, the routes of the step that went over its static capacity. :class:`MegatronOverflowRerun`
    makes that a dropless step:

    1. before the step it zeroes the per-step counters (device ops) and keeps what a rerun must restore: the RNG states
       (torch's CPU and CUDA generators and Megatron's ``CudaRNGStatesTracker``), the MoE layers' buffers (the router's
       expert-bias counts, the global aux-loss counts, which Megatron's ``finalize_model_grads`` consumes), Megatron's
       MoE metrics tracker, and every microbatch the step reads from its data iterator;
    2. the optimizer's ``step()`` (Megatron's contract: ``(update_successful, grad_norm, num_zeros_in_grad)``) is
       guarded: the job-wide overflow flag is reduced (one 1-element MAX all-reduce over the default group: every rank
       takes the same decision) and, when set, the update is skipped on every rank (``(False, None, None)``: Megatron's
       ``train_step`` counts a skipped iteration and leaves the learning-rate schedule alone; the loss scaler is not
       touched). Megatron's optimizer step runs outside its full-iteration CUDA graph and reads device values on the
       host itself (its inf/nan flag, the grad norm): this read is one more there, never inside the graph;
    3. after an overflowed step it reruns the same microbatches eagerly (the eager ``forward_backward_func`` when the
       one given is Megatron's ``FullCudaGraphWrapper``), from the saved state, with every MoE layer's capacity raised
       to the job's observed load ratio (again while a later layer still overflows): the update applied is a dropless
       step's;
    4. when more than ``threshold * window`` of the last ``window`` steps reran, the capacity factor rises to
       ``max observed ratio * (1 + margin)`` and Megatron's full-iteration graph is reset (captured again after its
       warm-up steps), as :class:`moe_graph.train.step.OverflowRerun` does for moe_graph's own loop.

    Use it in place of the call to ``train_step`` in ``pretrain``'s loop (``megatron.training.training.train``)::

        rerun = MegatronOverflowRerun(model, optimizer)
        ...
        out = rerun.train_step(train_step, forward_step_func, train_data_iterator, model, optimizer,
                               opt_param_scheduler, config, forward_backward_func, iteration=iteration)

    ``train_step_fn`` is called as ``train_step_fn(forward_step_func, data_iterator, model, optimizer, *args,
    **kwargs)``; ``forward_backward_func`` (a keyword, or the 7th positional argument as in Megatron's ``train_step``) is
    swapped for its eager function in reruns. Megatron's own rerun state machine (``--rerun-mode``) must stay
    ``disabled``, its default (it asserts its own data-iterator wrapper).

    Args:
        model: Megatron's model chunks (a module or a list of them, DDP-wrapped or not).
        optimizer: Megatron's optimizer (or anything with its ``step()`` contract); its ``step`` is guarded.
        window, threshold, margin: the adaptive capacity rule (``threshold=None``: never adapt).
        group: the process group of the overflow decision (default: the whole job).
    """

    def __init__(self, model, optimizer, *, window: int = 100, threshold: Optional[float] = 0.01,
                 margin: float = 0.1, group=None):
        super().__init__(model, optimizer, window=window, threshold=threshold, margin=margin)
        self.layers = [m for m in moe_graph_layers(model) if m.overflow == "rerun"]
        if not self.layers:
            raise ValueError("MegatronOverflowRerun: the model has no MoeGraphMoELayer with overflow='rerun'")
        self.user_capacity_factor = [m.capacity_factor for m in self.layers]
        self.device = self.layers[0].dispatcher.device
        self.group = group
        self.overflowed = False
        self._optimizer_step = optimizer.step
        optimizer.step = self._guarded_step

    # -------------------------------------------------------------------------------------- optimizer --
    def _reduce_max(self, value: torch.Tensor) -> torch.Tensor:
        value = value.reshape(1)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        return value

    def _guarded_step(self, *args, **kwargs):
        """Megatron's ``optimizer.step()``, skipped on every rank when some MoE layer of some rank overflowed."""
        flag = self._reduce_max(step_overflow(self.layers, self.device).to(torch.float32))
        self.overflowed = bool(flag.item() > 0)
        if self.overflowed:
            return False, None, None
        return self._optimizer_step(*args, **kwargs)

    def _job_max_load_ratio(self) -> float:
        return float(self._reduce_max(step_max_load_ratio(self.layers, self.device).to(torch.float64)).item())

    # ------------------------------------------------------------------------------------------- step --
    def step(self, step_fn, microbatches):
        raise TypeError("MegatronOverflowRerun wraps Megatron's train_step: call .train_step(train_step_fn, ...)")

    def train_step(self, train_step_fn: Callable, forward_step_func, data_iterator, model, optimizer, *args,
                   **kwargs):
        """``train_step_fn(forward_step_func, data_iterator, model, optimizer, *args, **kwargs)``, rerun eagerly
        from the same state and microbatches while it overflowed; returns the applied step's result."""
        if optimizer is not self.optimizer:
            raise ValueError("MegatronOverflowRerun.train_step: optimizer is not the one this object guards")
        iters = data_iterator if isinstance(data_iterator, list) else [data_iterator]
        replay = [ReplayIterator(it) if it is not None else None for it in iters]
        wrapped = replay if isinstance(data_iterator, list) else replay[0]
        graph = self._find_graph(args, kwargs)
        saved = self._save(replay)
        reset_step_counters(self.layers)
        self.overflowed = False
        out = train_step_fn(forward_step_func, wrapped, model, optimizer, *args, **kwargs)
        reran = self.overflowed
        self.steps += 1
        if reran:
            args, kwargs = self._eager(graph, args, kwargs)
            out, ratio = self._rerun(lambda: train_step_fn(forward_step_func, wrapped, model, optimizer, *args,
                                                           **kwargs), saved)
            self.reruns += 1
            self.max_load_ratio = max(self.max_load_ratio, ratio)
        self.recent.append(reran)
        self._adapt(_GraphReset(graph) if graph is not None else None)
        return out

    def _pass(self, run, saved):
        """One eager rerun pass (what :meth:`OverflowRerun._rerun` calls): the saved state back, the same
        microbatches, Megatron's step."""
        self._restore(saved)
        reset_step_counters(self.layers)
        self.overflowed = False
        out = run()
        return out, self.overflowed

    def _save(self, replay) -> Dict[str, Any]:
        tracker = get_moe_metrics_tracker()
        return {"rng": _rng_state(self.device), "replay": replay,
                "buffers": [{n: b.detach().clone() for n, b in m.named_buffers()
                             if not n.startswith("moe_graph_")} for m in self.layers],
                "metrics": {k: e.values.detach().clone() for k, e in tracker.metrics.items()}}

    def _restore(self, saved: Dict[str, Any]) -> None:
        _set_rng_state(saved["rng"], self.device)
        for r in saved["replay"]:
            if r is not None:
                r.rewind()
        with torch.no_grad():
            for m, bufs in zip(self.layers, saved["buffers"]):
                own = dict(m.named_buffers())
                for n, b in bufs.items():
                    own[n].copy_(b)
            for k, e in get_moe_metrics_tracker().metrics.items():
                if k in saved["metrics"]:
                    e.values.copy_(saved["metrics"][k])
                else:
                    e.values.zero_()

    @staticmethod
    def _find_graph(args, kwargs):
        """Megatron's ``FullCudaGraphWrapper`` given as ``forward_backward_func``, or None."""
        i = _FBF_ARG
        fbf = kwargs.get("forward_backward_func", args[i] if len(args) > i else None)
        return fbf if callable(getattr(fbf, "reset_cuda_graph", None)) else None

    @staticmethod
    def _eager(graph, args, kwargs):
        """The arguments with Megatron's ``FullCudaGraphWrapper`` replaced by its eager function."""
        if graph is None:
            return args, kwargs
        eager = graph.forward_backward_func
        if "forward_backward_func" in kwargs:
            return args, dict(kwargs, forward_backward_func=eager)
        i = _FBF_ARG
        return args[:i] + (eager,) + args[i + 1:], kwargs
