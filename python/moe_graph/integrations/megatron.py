"""moe_graph's grouped GEMM inside Megatron-core's ``TEGroupedMLP``, with or without TransformerEngine installed.

Megatron's MoE specs build the expert linears as
``linear_fc1(num_gemms, input_size, output_size, *, config, init_method, bias, skip_bias_add, is_expert,
tp_comm_buffer_name, pg_collection, name)``. :class:`ColumnParallelGroupedLinear` and
:class:`RowParallelGroupedLinear` take exactly that constructor and behave as Megatron's
``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear`` (which subclass TE's ``GroupedLinear`` and
exist only when TE is installed), on :class:`moe_graph.GroupedLinear` instead of TE's:

* the config is read the same way: ``gradient_accumulation_fusion`` (fused ``main_grad``),
  ``delay_wgrad_compute`` / ``overlap_dispatch_backward_with_experts_wgrad`` (``backward_dw``),
  ``moe_single_grouped_weight`` / ``moe_single_grouped_bias``, ``params_dtype``, ``use_cpu_initialization`` /
  ``init_model_with_meta_device``, ``perform_initialization``, ``disable_parameter_transpose_cache``
  (``is_first_microbatch``), the expert-parallel RNG tracker, expert process groups (``allreduce=False``);
* explicit expert communication as Megatron does it (expert TP > 1 or EP > 1: the layer is built for its local
  shard with ``parallel_mode=None``; the partition attributes Megatron's checkpointing reads are set afterwards);
* ``forward(x, m_splits)`` returns ``(out, bias-or-None)``;
* ``sharded_state_dict`` gives the same sharded keys as Megatron's TE classes and ``SequentialMLP`` (one tensor
  per global expert), so distributed checkpoints move between ``SequentialMLP``, TE and moe_graph experts;
* loads accept the per-expert ``_extra_state{i}`` entries of TE distributed checkpoints (no fp8 metadata here);
* ``reset_parameters()`` re-initializes in place and sets the parameter attributes again (Megatron-FSDP's
  meta-device init).

FP8: ``config.fp8`` ("e4m3" | "hybrid") with ``config.fp8_recipe`` ("blockwise" | "mxfp8" | "tensorwise" |
"delayed") runs the expert GEMMs in FP8 through :func:`fp8_recipe_from_config` (``moe_graph.fp8``'s recipes; an
active ``moe_graph.fp8.autocast`` or TE ``fp8_autocast`` takes precedence). fc1 also takes FP8-dispatched rows
(``moe_graph.ops.fp8.QuantizedRows`` from moe_graph's dispatcher with ``fp8_dispatch=True``): its GEMM reads their
FP8 bytes and scales as they arrived.

Echo spare slots (moe_graph's dispatcher with ``num_spare_experts_per_ep_rank``): both linears run ``L + k``
experts, the spare slots holding copies of other experts' weights. Their weight gradients go home with every
weight-gradient mode: plain autograd (``.grad``), fused ``main_grad`` (``gradient_accumulation_fusion``), delayed
(``delay_wgrad_compute``: ``backward_dw`` computes them and sends the spare part home, a collective over the EP
group) and FP8. fp4 (``config.fp4``, ``quant_recipe``),
generalized tensor-parallel rematerialization and TE's op-fuser (``use_transformer_engine_op_fuser``) are TE
features and are rejected with an error here.

:func:`experts_spec` gives the ``TEGroupedMLP`` builder with these linears (``GroupedMLPSubmodules``), and
:func:`get_gpt_layer_with_moe_graph_spec` a GPT layer spec (TE's when TE is installed and asked for, else
Megatron's local spec) whose MoE experts are moe_graph's.
"""

from __future__ import annotations

import copy
import dataclasses
from functools import partial
from typing import Callable, Optional

import torch

try:
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    try:  # megatron-core >= 0.16 (tested: 0.19.2)
        from megatron.core.transformer.moe.experts import GroupedMLPSubmodules
    except ImportError:  # older releases build TEGroupedMLP from MLPSubmodules
        from megatron.core.transformer.mlp import MLPSubmodules as GroupedMLPSubmodules
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
    from megatron.core.utils import get_pg_rank, get_pg_size
except ImportError as exc:  # pragma: no cover - exercised only without megatron-core
    raise ImportError(
        "moe_graph.integrations.megatron needs megatron-core (tested with 0.19.2): pip install megatron-core"
    ) from exc

from moe_graph.grouped_linear import (GroupedLinear, _add_grad, fp8_dgrad, fp8_forward, fp8_wgrad, gathered_fp8_weight,
                                      split_quantized)
from moe_graph.moe.echo import dispatch_spare_weights, wgrad_accumulate_mask
from moe_graph.ops.grouped_gemm import (as_splits, grouped_bias_grad, grouped_gemm, grouped_gemm_autograd,
                                        grouped_gemm_wgrad, has_main_grad_source, resolve_main_grad,
                                        deferred_wgrad_placeholders, zero_wgrad_placeholder)
from moe_graph.integrations.megatron_moe import MoeGraphMoELayer, fp8_recipe_from_config
from moe_graph.ops import fp8 as _fp8

__all__ = [
    "fp8_recipe_from_config",
    "MoeGraphGroupedLinear",
    "ColumnParallelGroupedLinear",
    "RowParallelGroupedLinear",
    "MoeGraphGroupedMLP",
    "experts_spec",
    "get_gpt_layer_with_moe_graph_spec",
]


def _param_device(config):
    if config.use_cpu_initialization:
        return "cpu"
    if getattr(config, "init_model_with_meta_device", False):
        return "meta"
    return torch.cuda.current_device()


def _set_expert_parameter_attributes(module: torch.nn.Module, parallel_mode: Optional[str], use_expert_pgs: bool) -> None:
    # As Megatron's helper of the same name for its TE expert linears: ``allreduce=False`` puts the parameters in
    # the expert-data-parallel buckets; weights (and column-parallel biases) are tensor-parallel partitions along
    # dim 0 (column) or 1 (row) of each expert's matrix, whatever layout the layer uses.
    for name, p in module.named_parameters(recurse=False):
        p.allreduce = not use_expert_pgs
        kind = name.rstrip("0123456789")
        if kind not in ("weight", "bias"):
            continue
        partitioned = parallel_mode in ("column", "row") and (kind == "weight" or parallel_mode == "column")
        p.tensor_model_parallel = partitioned
        if partitioned:
            p.partition_dim = 1 if parallel_mode == "row" else 0
            p.partition_stride = 1


class _QueuedWgrad:
    """A weight-gradient job :class:`_ExplicitGroupedLinear` queued for ``backward_dw`` (``delay_wgrad_compute``)."""

    __slots__ = ("run",)

    def __init__(self, run: Callable[[], None]):
        self.run = run


def _explicit_wgrad(layer, params, echo, recipe, a, dy, splits, fuse: bool, accumulate: bool, delayed: bool):
    """The weight gradients of :class:`_ExplicitGroupedLinear` for ``L`` home experts (``params``: the layer's
    weight parameters, one ``[L, N, K]`` or ``L`` of ``[N, K]``) and ``k`` spare slots (``echo``: ``(dispatcher,
    plan)``, else ``k = 0``). The home experts' gradients go where :class:`moe_graph.GroupedLinear` puts them:
    ``main_grad`` (``fuse``: added, or written when not ``accumulate``; fp32 accumulation inside the GEMM), else
    autograd's gradient (returned) or ``.grad`` (``delayed``). The spare slots' gradients (in ``main_grad``'s dtype
    when fused, fp32 under FP8) are sent to their home ranks and added into the same place as the home experts'
    (:meth:`moe_graph.moe.echo.EchoExpertDispatcher.aggregate_grads`, a collective over the EP group). Returns the
    gradients autograd gets for ``params`` (placeholders when fused or delayed)."""
    single = layer.single_grouped_weight
    L = layer.num_gemms
    with torch.no_grad():
        if fuse:
            mains = [resolve_main_grad(w) for w in params]
            mg = mains[0] if single else None
            main2d = list(mg.unbind(0)) if single else mains
        if recipe is not None:  # fp32 [L + k, N, K]
            dw = fp8_wgrad(dy, splits, recipe, a)
            home_dw, spare_dw = dw[:L], dw[L:]
            if fuse:
                for m, g in zip(main2d, home_dw.unbind(0)):
                    m.add_(g.to(m.dtype)) if accumulate else m.copy_(g)
        elif fuse:  # home experts into main_grad inside the GEMM, the spare slots into a buffer of their own
            spare_dw = None
            outs = list(main2d)
            if echo is not None:
                k = echo[0].num_spare_experts_per_ep_rank
                spare_dw = main2d[0].new_empty((k,) + tuple(main2d[0].shape))
                outs += list(spare_dw.unbind(0))
            mask = accumulate
            if echo is not None and accumulate:
                mask = layer._echo_accumulate_mask(k, main2d[0].device)
            grouped_gemm_wgrad(a, dy, splits, out=outs, accumulate=mask)
        else:
            dw = grouped_gemm_wgrad(a, dy, splits)  # [L + k, N, K] in a's dtype
            home_dw, spare_dw = dw[:L], dw[L:]
        if echo is not None:  # the spare slots' gradients home, added where the home experts' went
            dispatcher, plan = echo
            if not fuse:
                target = home_dw
            elif single:
                target = mg
            else:  # per-expert main_grads: summed in one [L, N, K] buffer first (no host index)
                target = main2d[0].new_zeros((L,) + tuple(main2d[0].shape))
            dispatcher.aggregate_grads(plan, [spare_dw], out=[target])
            if fuse and not single:
                for m, g in zip(main2d, target.unbind(0)):
                    m.add_(g)
    if fuse:
        for w in params:
            w.grad_added_to_main_grad = True
        return [zero_wgrad_placeholder(w) for w in params]
    grads = [home_dw] if single else list(home_dw.unbind(0))
    if delayed:
        for w, g in zip(params, grads):
            _add_grad(w, g)
        return None
    return [g.to(w.dtype) for w, g in zip(params, grads)]


class _ExplicitGroupedLinear(torch.autograd.Function):
    """:class:`MoeGraphGroupedLinear`'s grouped GEMM over its ``L`` home experts followed by ``k`` echo spare slots
    (weight copies ``spare [k, N, K]``, plain tensors) and / or on FP8-dispatched rows (``xq``), with the layer's
    weight-gradient mode: fused ``main_grad``, delayed (``defer``: backward computes the input and bias gradients,
    the weight gradients are queued for :meth:`MoeGraphGroupedLinear.backward_dw`), FP8 (``recipe``: the ``L + k``
    weights quantized together per expert at every forward, the input's columnwise copy saved). The weight
    gradients: :func:`_explicit_wgrad`. ``bias [L + k, N]`` (home then spare copies, autograd carries its gradient
    home) is added in the epilogue."""

    @staticmethod
    def forward(ctx, x, bias, layer, splits, spare, echo, recipe, xq, fuse, accumulate, defer, *params):
        homes = list(params[0].unbind(0)) if layer.single_grouped_weight else list(params)
        spares = [] if spare is None else list(spare.to(homes[0].dtype).unbind(0))
        ctx.layer, ctx.params, ctx.echo, ctx.recipe = layer, params, echo, recipe
        ctx.fuse, ctx.accumulate, ctx.defer = fuse, accumulate, defer
        ctx.x_dtype = x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        if recipe is None:
            y = grouped_gemm(x, homes + spares, splits, bias=bias)
            ctx.save_for_backward(x, splits, *homes, *spares)
        else:
            wq = gathered_fp8_weight(params, recipe) if not spares else None  # (fp8_param_gather's copies)
            if wq is None:  # quantized at every forward, per expert
                with torch.no_grad():
                    wq = _fp8.quantize_weight(torch.stack([w.detach() for w in homes + spares]), recipe)
            y, xt = fp8_forward(x, splits, recipe, wq, bias, True, xq)
            ctx.save_for_backward(splits, wq[2], wq[3], *xt)
        return y

    @staticmethod
    def backward(ctx, dy):
        dy = dy.contiguous()
        if ctx.recipe is None:
            x, splits, *weights = ctx.saved_tensors
            dx = grouped_gemm(dy, weights, splits, trans_b=False) if ctx.needs_input_grad[0] else None
            a = x
        else:
            splits, qwt, swt, *xt = ctx.saved_tensors
            dx = fp8_dgrad(dy, splits, ctx.recipe, qwt, swt, ctx.x_dtype) if ctx.needs_input_grad[0] else None
            a = tuple(xt)
        db = None
        if ctx.bias_dtype is not None and ctx.needs_input_grad[1]:
            db = grouped_bias_grad(dy, splits).to(ctx.bias_dtype)
        params, layer = ctx.params, ctx.layer
        if ctx.defer:
            job = partial(_explicit_wgrad, layer, params, ctx.echo, ctx.recipe, a, dy, splits, ctx.fuse,
                          ctx.accumulate, True)
            layer._wgrad_queue.append(_QueuedWgrad(job))
            dws = deferred_wgrad_placeholders(params, ctx.fuse)
        else:
            dws = _explicit_wgrad(layer, params, ctx.echo, ctx.recipe, a, dy, splits, ctx.fuse, ctx.accumulate,
                                  False)
        ctx.layer = ctx.params = ctx.echo = None
        return (dx, db, None, None, None, None, None, None, None, None, None, *dws)


class MoeGraphGroupedLinear(GroupedLinear):
    """:class:`moe_graph.GroupedLinear` with the constructor and behaviour of Megatron's ``TEGroupedLinear``."""

    def __init__(
        self,
        num_gemms: int,
        input_size: int,
        output_size: int,
        *,
        parallel_mode: Optional[str],
        config,
        init_method: Callable,
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool = False,
        tp_comm_buffer_name: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        name: Optional[str] = None,
    ) -> None:
        if not is_expert:
            raise ValueError("moe_graph grouped linears are expert layers (is_expert=True), as Megatron's TEGroupedLinear")
        self._config_fp8_recipe = fp8_recipe_from_config(config)
        for flag in ("fp4", "quant_recipe"):
            if getattr(config, flag, None):
                raise NotImplementedError(f"moe_graph.integrations.megatron: config.{flag} needs TransformerEngine")
        if getattr(config, "use_transformer_engine_op_fuser", False):
            raise NotImplementedError(
                "moe_graph.integrations.megatron: use_transformer_engine_op_fuser builds TE's te.pytorch.ops fused "
                "MLP (TE kernels); leave it off with moe_graph experts")
        self.config = config
        self.te_return_bias = bool(skip_bias_add and bias)
        self.is_first_microbatch = True
        self.disable_parameter_transpose_cache = config.disable_parameter_transpose_cache
        delay = bool(config.delay_wgrad_compute or getattr(config, "overlap_dispatch_backward_with_experts_wgrad", False))
        self.expert_parallel = config.expert_model_parallel_size > 1
        use_expert_pgs = self.expert_parallel or config.expert_tensor_parallel_size != config.tensor_model_parallel_size
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        self._pg_collection = pg_collection
        self._tp_group = pg_collection.expt_tp
        tp_size = get_pg_size(self._tp_group)
        original_parallel_mode = parallel_mode
        # The MoE token dispatcher does the expert TP/EP communication: the layer holds its local shard only.
        self.explicit_expert_comm = tp_size > 1 or self.expert_parallel
        if self.explicit_expert_comm:
            if parallel_mode == "column":
                if output_size % tp_size:
                    raise ValueError(f"output_size {output_size} not divisible by the expert TP size {tp_size}")
                output_size //= tp_size
            elif parallel_mode == "row":
                if input_size % tp_size:
                    raise ValueError(f"input_size {input_size} not divisible by the expert TP size {tp_size}")
                input_size //= tp_size
            parallel_mode, tp_size = None, 1
        tracker = get_cuda_rng_tracker
        super().__init__(
            num_gemms=num_gemms,
            in_features=input_size,
            out_features=output_size,
            sequence_parallel=config.sequence_parallel,
            fuse_wgrad_accumulation=config.gradient_accumulation_fusion,
            tp_size=tp_size,
            get_rng_state_tracker=tracker if tracker().is_initialized() else None,
            rng_tracker_name=get_expert_parallel_rng_tracker_name(),
            init_method=init_method if config.perform_initialization else (lambda w: None),
            bias=bias,
            return_bias=self.te_return_bias,
            params_dtype=config.params_dtype,
            parallel_mode=parallel_mode,
            device=_param_device(config),
            ub_name=tp_comm_buffer_name,
            delay_wgrad_compute=delay,
            single_grouped_weight=bool(getattr(config, "moe_single_grouped_weight", False)),
            single_grouped_bias=bool(getattr(config, "moe_single_grouped_bias", False)),
            name=name,
        )
        self._expert_attributes = (original_parallel_mode, use_expert_pgs)
        self.echo_spare = None
        _set_expert_parameter_attributes(self, *self._expert_attributes)

    def reset_parameters(self, defer_init: bool = False) -> None:
        """As :meth:`GroupedLinear.reset_parameters`, then Megatron's expert attributes again (Megatron-FSDP's
        meta-device init replaces the parameter objects before calling this)."""
        super().reset_parameters(defer_init=defer_init)
        if not defer_init and hasattr(self, "_expert_attributes"):
            _set_expert_parameter_attributes(self, *self._expert_attributes)

    def home_weights(self) -> torch.Tensor:
        """``[L, out, in]``: the local experts' weights stacked (the parameter itself with a single grouped
        weight), the home weights echo copies into spare slots."""
        ws = self._weights()
        return ws[0] if self.single_grouped_weight else torch.stack(ws)

    def home_biases(self) -> Optional[torch.Tensor]:
        bs = self._biases()
        return None if bs is None else (bs[0] if self.single_grouped_bias else torch.stack(bs))

    def _recipe(self):
        """The FP8 recipe of this forward: an active ``moe_graph.fp8.autocast`` (or TE's), else the config's."""
        return _fp8.current_recipe() or self._config_fp8_recipe

    def explicit_wgrad(self) -> bool:
        """Whether a forward with echo spare slots runs :class:`_ExplicitGroupedLinear` (fused ``main_grad``,
        delayed wgrad or FP8): the spare copies are plain tensors and their weight gradients go home from that
        function's backward (or :meth:`backward_dw`). Otherwise they are autograd copies
        (:func:`moe_graph.moe.echo.dispatch_spare_weights`)."""
        return bool(self.fuse_wgrad_accumulation or self.delay_wgrad_compute or self._recipe() is not None)

    def _echo_accumulate_mask(self, k: int, device) -> torch.Tensor:
        """``[L + k]`` bool (home experts accumulate into ``main_grad``, spare slots overwrite their buffer), built
        once per device (before any capture: the first backward) and reused."""
        mask = getattr(self, "_echo_mask", None)
        if mask is None or mask.shape[0] != self.num_gemms + k or mask.device != torch.device(device):
            mask = self._echo_mask = wgrad_accumulate_mask(self.num_gemms, k, device=device)
        return mask

    def forward(self, x, m_splits):
        """``(out, bias)``: bias is the (unapplied) bias with ``skip_bias_add``, else None (as TEGroupedLinear).
        With :attr:`echo_spare` set (:class:`MoeGraphGroupedMLP` sets it for one forward): echo's
        ``(dispatcher, plan, weights [k, out, in], biases [k, out] or None)``: copies of other experts run as
        local experts ``L .. L+k-1`` (``m_splits`` has ``L + k`` entries). ``x`` may be FP8-dispatched rows
        (``moe_graph.ops.fp8.QuantizedRows``, :class:`~moe_graph.integrations.megatron_moe.MoeGraphTokenDispatcher`
        with ``fp8_dispatch=True``): the first GEMM reads their FP8 bytes and scales as they arrived."""
        if self.echo_spare is not None or isinstance(x, _fp8.QuantizedRows):
            return self._forward_explicit(x, m_splits, self.echo_spare)
        first = None if self.disable_parameter_transpose_cache else self.is_first_microbatch
        if self._config_fp8_recipe is not None and _fp8.current_recipe() is None:
            with _fp8.autocast(recipe=self._config_fp8_recipe):
                out = super().forward(x, m_splits, is_first_microbatch=first)
        else:
            out = super().forward(x, m_splits, is_first_microbatch=first)
        self.is_first_microbatch = False
        if self.te_return_bias:
            return out
        return out, None

    def _forward_explicit(self, x, m_splits, echo_spare):
        """Echo spare slots and / or FP8-dispatched rows (see :meth:`forward`)."""
        dispatcher, plan, spare_weights, spare_biases = echo_spare or (None, None, None, None)
        recipe = self._recipe()
        if isinstance(x, _fp8.QuantizedRows) and recipe is None:
            raise ValueError("MoeGraphGroupedLinear: FP8-dispatched rows (QuantizedRows) need FP8 experts "
                             "(config.fp8, or an active moe_graph.fp8.autocast)")
        bias = self.home_biases()
        if bias is not None and spare_biases is not None:
            bias = torch.cat([bias, spare_biases.to(bias.dtype)])
        gemm_bias = None if self.te_return_bias else bias
        xq = None
        if isinstance(x, _fp8.QuantizedRows):
            lead, (x, xq) = x.shape[:-1], split_quantized(x, recipe)
        else:
            lead, x = x.shape[:-1], x.reshape(-1, self.in_features)
        splits = as_splits(m_splits, x.device)
        if not self.explicit_wgrad():  # 16-bit echo: the spare copies are autograd copies (their grads go home)
            home = self.home_weights()
            weights = list(home.unbind(0)) + list(spare_weights.to(home.dtype).unbind(0))
            out = grouped_gemm_autograd(x, weights, splits, bias=gemm_bias)
        else:
            weights = self._weights()
            first = None if self.disable_parameter_transpose_cache else self.is_first_microbatch
            accumulate = True if first is None else not first
            if getattr(weights[0], "overwrite_main_grad", False):
                accumulate = False
            grad = torch.is_grad_enabled() and any(w.requires_grad for w in weights)
            fuse = self.fuse_wgrad_accumulation and grad
            if fuse and not all(has_main_grad_source(w) for w in weights):
                raise RuntimeError("MoeGraphGroupedLinear(gradient_accumulation_fusion=True): every weight needs a "
                                   ".main_grad tensor (Megatron's DDP allocates them) or a get_main_grad()")
            defer = self.delay_wgrad_compute and grad
            echo = None if dispatcher is None else (dispatcher, plan)
            spare = None if spare_weights is None else spare_weights.detach()
            self.fp8 = recipe is not None
            out = _ExplicitGroupedLinear.apply(x, gemm_bias, self, splits, spare, echo, recipe, xq, fuse, accumulate,
                                               defer, *weights)
        out = out.reshape(*lead, self.out_features)
        self.is_first_microbatch = False
        return (out, bias) if self.te_return_bias else (out, None)

    def backward_dw(self) -> None:
        """:meth:`GroupedLinear.backward_dw`; a queued job of :class:`_ExplicitGroupedLinear` (echo / FP8 dispatch)
        runs its weight gradients (the spare slots' sent home: collective over the EP group, as Megatron calls
        ``backward_dw`` on every rank in the same order), then the hooks."""
        if not self.delay_wgrad_compute:
            return
        if self._wgrad_queue and isinstance(self._wgrad_queue[0], _QueuedWgrad):
            self._wgrad_queue.popleft().run()
            self._trigger_wgrad_accumulation_and_reduce_hooks()
            return
        super().backward_dw()

    # --------------------------------------------------------------------------------- distributed checkpoint --
    _tp_axis: dict = {}

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """One sharded tensor per global expert, keyed as ``SequentialMLP``'s (``{prefix}weight`` with the expert
        axis appended to ``sharded_offsets``), as Megatron's ``TEGroupedLinear._sharded_state_dict_grouped``."""
        if metadata is None or "dp_cp_group" not in metadata:
            from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

            metadata = ensure_metadata_has_dp_cp_group(metadata)
        singleton = metadata.get("singleton_local_shards", False)
        E = self.num_gemms
        weights = [w for ws in self._weights() for w in (ws.unbind(0) if self.single_grouped_weight else [ws])]
        biases = None
        if self.use_bias:
            biases = [b for bs in self._biases() for b in (bs.unbind(0) if self.single_grouped_bias else [bs])]
        ep = self._pg_collection.ep
        num_global, offset = get_pg_size(ep) * E, get_pg_rank(ep) * E
        ep_axis = len(sharded_offsets)
        out = {}
        for i in range(E):
            local = {f"{i}.weight": weights[i], f"{i}._extra_state": self.get_extra_state()}
            if biases is not None:
                local[f"{i}.bias"] = biases[i]
            if singleton:
                expert_prefix, offsets = f"{offset + i}.{prefix}", sharded_offsets
            else:
                expert_prefix, offsets = prefix, (*sharded_offsets, (ep_axis, offset + i, num_global))
            axis_map = {f"{i}.{k}": v for k, v in self._tp_axis.items()}
            sub = make_sharded_tensors_for_checkpoint(
                local, "", axis_map, offsets, tp_group=self._tp_group, dp_cp_group=metadata["dp_cp_group"])
            replace_prefix_for_sharding(sub, f"{i}.", expert_prefix)
            out[f"{prefix}weight{i}"] = sub[f"{i}.weight"]
            out[f"{prefix}_extra_state{'' if i == 0 else i}"] = sub[f"{i}._extra_state"]
            if biases is not None:
                out[f"{prefix}bias{i}"] = sub[f"{i}.bias"]
        # Expert-data-parallel replica ids (one writer per expert shard), as Megatron's TE classes.
        pgs = self._pg_collection
        for sh in out.values():
            if isinstance(sh, ShardedObject):
                group = getattr(pgs, "expt_dp_gtp_remat", None) or pgs.expt_dp
            else:
                group = pgs.expt_dp
            sh.replica_id = (*sh.replica_id[:2], get_pg_rank(group))
        return out

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(per expert([in={self.in_features}, out={self.out_features}]) "
                f"X num_gemms={self.num_gemms}, bias={self.use_bias}, TP={self.tp_size}, moe_graph)")


class ColumnParallelGroupedLinear(MoeGraphGroupedLinear):
    """Megatron's ``TEColumnParallelGroupedLinear`` on moe_graph (expert ``linear_fc1``)."""

    _tp_axis = {"weight": 0, "bias": 0}

    def __init__(self, num_gemms, input_size, output_size, *, config, init_method, bias, skip_bias_add, is_expert,
                 tp_comm_buffer_name=None, pg_collection=None, name=None):
        super().__init__(num_gemms, input_size, output_size, parallel_mode="column", config=config,
                         init_method=init_method, bias=bias, skip_bias_add=skip_bias_add, is_expert=is_expert,
                         tp_comm_buffer_name=tp_comm_buffer_name, pg_collection=pg_collection, name=name)


class RowParallelGroupedLinear(MoeGraphGroupedLinear):
    """Megatron's ``TERowParallelGroupedLinear`` on moe_graph (expert ``linear_fc2``)."""

    _tp_axis = {"weight": 1}

    def __init__(self, num_gemms, input_size, output_size, *, config, init_method, bias, skip_bias_add, is_expert,
                 tp_comm_buffer_name=None, pg_collection=None, name=None):
        super().__init__(num_gemms, input_size, output_size, parallel_mode="row", config=config,
                         init_method=init_method, bias=bias, skip_bias_add=skip_bias_add, is_expert=is_expert,
                         tp_comm_buffer_name=tp_comm_buffer_name, pg_collection=pg_collection, name=name)


class MoeGraphGroupedMLP(TEGroupedMLP):
    """Megatron's ``TEGroupedMLP`` (built on moe_graph's grouped linears by :func:`experts_spec`) that also takes the
    rows per expert on the device: from Megatron's dispatchers ``tokens_per_expert`` is a host tensor and everything
    is ``TEGroupedMLP``'s; from moe_graph's (:class:`moe_graph.integrations.megatron_moe.DeviceSplits`) the grouped
    GEMMs get the device tensor and the fc2 bias (``add_bias_linear``: ``skip_bias_add``, scaled by each row's
    probability) is added without splitting the rows on the host (padding rows have probability 0).

    With ``config.fp8`` the module is built from a copy of the config without ``fp8`` (TEGroupedMLP would pad each
    expert's rows for TE's FP8 GEMMs on the host, and asserts TE): moe_graph's FP8 tiles restart at every expert,
    and its two linears run the mapped recipe (:func:`fp8_recipe_from_config`) themselves."""

    def __init__(self, num_local_experts, config, *args, **kwargs):
        recipe = fp8_recipe_from_config(config)
        if recipe is not None:
            config = copy.copy(config)
            config.fp8 = None
        super().__init__(num_local_experts, config, *args, **kwargs)
        if recipe is not None:
            for lin in (self.linear_fc1, self.linear_fc2):
                lin._config_fp8_recipe = recipe

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs, *args, **kwargs):
        """``TEGroupedMLP.forward``; with echo (``tokens_per_expert.echo``: moe_graph's dispatcher) the spare slots'
        weight copies are dispatched first (their gradients go home in backward, a collective over the EP group)
        and both linears run ``L + k`` experts."""
        echo = getattr(tokens_per_expert, "echo", None)
        if echo is None:
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs, *args, **kwargs)
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        biases = [fc1.home_biases(), fc2.home_biases()]
        with_bias = biases[0] is not None
        if fc1.explicit_wgrad():  # weight copies as plain tensors (their gradients go home from the GEMMs'
            with torch.no_grad():  # backward or backward_dw), bias copies through autograd
                weights = echo[0].dispatch(echo[1], [fc1.home_weights(), fc2.home_weights()])
            spares = weights + (dispatch_spare_weights(*echo, biases) if with_bias else [])
        else:
            spares = dispatch_spare_weights(*echo, [fc1.home_weights(), fc2.home_weights()]
                                            + (biases if with_bias else []))
        spare1 = (*echo, spares[0], spares[2] if with_bias else None)
        spare2 = (*echo, spares[1], spares[3] if with_bias else None)
        fc1.echo_spare, fc2.echo_spare = spare1, spare2
        try:
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs, *args, **kwargs)
        finally:
            fc1.echo_spare = fc2.echo_spare = None

    @staticmethod
    def _apply_bias(intermediate_parallel, bias_parallel, tokens_per_expert, permuted_probs):
        if bias_parallel is None or not torch.is_tensor(tokens_per_expert):
            return TEGroupedMLP._apply_bias(intermediate_parallel, bias_parallel, tokens_per_expert, permuted_probs)
        shape = intermediate_parallel.shape
        y = intermediate_parallel.view(-1, shape[-1])
        bias = bias_parallel if torch.is_tensor(bias_parallel) else torch.stack(list(bias_parallel))
        rows = torch.arange(y.shape[0], device=y.device)
        expert = torch.searchsorted(tokens_per_expert.cumsum(0), rows, right=True).clamp_(max=bias.shape[0] - 1)
        out = y + bias.index_select(0, expert) * permuted_probs.view(-1, 1)
        return out.view(shape).to(intermediate_parallel.dtype)


def experts_spec(activation_func=None):
    """The experts builder for ``MoESubmodules(experts=...)``: Megatron's ``TEGroupedMLP`` with moe_graph's
    grouped linears (:class:`MoeGraphGroupedMLP`; ``activation_func``: the optional TE activation module builder
    Megatron's spec passes)."""
    return partial(
        MoeGraphGroupedMLP,
        submodules=GroupedMLPSubmodules(
            linear_fc1=ColumnParallelGroupedLinear,
            linear_fc2=RowParallelGroupedLinear,
            activation_func=activation_func,
        ),
    )


DISPATCHERS = ("megatron", "moe_graph")


def get_gpt_layer_with_moe_graph_spec(num_experts: int, use_transformer_engine: Optional[bool] = None, *,
                                      dispatcher: str = "megatron", dispatcher_options: Optional[dict] = None,
                                      **kwargs):
    """A GPT transformer-layer ``ModuleSpec`` whose MoE experts run on moe_graph.

    Starts from Megatron's TE layer spec (``use_transformer_engine``: default, when TE is importable) or its local
    spec, with ``num_experts`` and ``moe_grouped_gemm=True`` (``kwargs`` go to that spec function), and replaces
    the experts builder of its ``MoELayer`` with :func:`experts_spec` (router, shared experts and the rest stay).

    ``dispatcher``: ``"megatron"`` (Megatron's own, as ``config.moe_token_dispatcher_type`` names it) or
    ``"moe_graph"``: the layer is :class:`moe_graph.integrations.megatron_moe.MoeGraphMoELayer` (moe_graph's
    sync-free static-capacity dispatcher), with ``dispatcher_options`` as its keywords (``capacity_factor``,
    ``overflow``, ``token_drop_policy``, ``exchange``, ``num_spare_experts_per_ep_rank``, ``echo_donors``,
    ``echo_assignment``, ``fp8_dispatch``)."""
    from megatron.core.models.gpt import gpt_layer_specs

    if dispatcher not in DISPATCHERS:
        raise ValueError(f"dispatcher must be one of {DISPATCHERS}, got {dispatcher!r}")
    if dispatcher_options and dispatcher != "moe_graph":
        raise ValueError("dispatcher_options are the moe_graph dispatcher's: give dispatcher='moe_graph'")
    if use_transformer_engine is None:
        try:
            import transformer_engine  # noqa: F401

            use_transformer_engine = True
        except ImportError:
            use_transformer_engine = False
    make = (gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec if use_transformer_engine
            else gpt_layer_specs.get_gpt_layer_local_spec)
    spec = make(num_experts=num_experts, moe_grouped_gemm=True, **kwargs)
    mlp = spec.submodules.mlp
    if not (isinstance(mlp, partial) and hasattr(mlp.keywords.get("submodules"), "experts")):
        raise TypeError(f"unexpected MoE spec from megatron-core: {mlp!r} (expected partial(MoELayer, submodules=...))")
    old = mlp.keywords["submodules"]
    act = getattr(getattr(old.experts, "keywords", {}).get("submodules"), "activation_func", None)
    keywords = dict(mlp.keywords, submodules=dataclasses.replace(old, experts=experts_spec(act)))
    layer_cls = mlp.func
    if dispatcher == "moe_graph":
        layer_cls = MoeGraphMoELayer
        keywords.update(dispatcher_options or {})
    new_mlp = partial(layer_cls, *mlp.args, **keywords)
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, mlp=new_mlp))
