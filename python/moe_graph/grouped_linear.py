"""``GroupedLinear``: a drop-in for ``transformer_engine.pytorch.GroupedLinear`` on the sync-free grouped GEMM.

Differences that matter for CUDA graphs: ``m_splits`` may be a device tensor (no ``.tolist()``, no sync) and the
whole forward/backward is capturable. With ``fuse_wgrad_accumulation=True`` the weight gradients are added into
``weight.main_grad`` inside the GEMM epilogue and ``weight.grad_added_to_main_grad`` is set, as Megatron's DDP
expects (``is_first_microbatch=True`` overwrites ``main_grad`` instead, as in TE).

``delay_wgrad_compute=True`` (TE's, used by Megatron to overlap the weight-gradient GEMMs with expert-parallel
communication): backward computes the input and bias gradients only and queues the weight-gradient GEMM;
``backward_dw()`` runs the oldest queued one (into ``main_grad`` or ``weight.grad``) and then calls the hooks
registered with ``register_wgrad_accumulation_and_reduce_hooks`` (Megatron's and moe_graph's DDP register their
grad-ready hooks there for weights marked ``skip_backward_post_hook``).
"""

from __future__ import annotations

import collections
from typing import Callable, List, Optional, Union

import torch
from torch import nn

from .ops.grouped_gemm import _as_splits, _grouped_gemm_autograd, _weight_grads

__all__ = ["GroupedLinear"]


def _default_init(std: float = 0.023) -> Callable[[torch.Tensor], None]:
    # TransformerEngine's default init_method: normal(0, 0.023).
    def init_(t: torch.Tensor) -> None:
        nn.init.normal_(t, mean=0.0, std=std)

    return init_


class GroupedLinear(nn.Module):
    """E linear layers applied to consecutive row groups of one input (one grouped GEMM).

    Args follow TransformerEngine's ``GroupedLinear``: ``num_gemms`` experts, each ``y = x W_e^T + b_e`` with
    ``W_e`` of shape ``[out_features, in_features]``. ``tp_size`` with ``parallel_mode="column"`` (``"row"``)
    divides ``out_features`` (``in_features``), as in TE; the layer itself does no tensor-parallel communication
    (neither does TE's: Megatron's MoE dispatcher does it), and ``sequence_parallel`` is recorded as TE does
    (``tp_size > 1 and sequence_parallel``) for the parameter attributes Megatron reads.
    Parameters are ``weight0..weight{E-1}`` and ``bias0..`` (TE layout), or one ``weight`` ``[E, out, in]`` and
    ``bias`` ``[E, out]`` with ``single_grouped_weight=True``; state dicts of either layout load into both.
    """

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        sequence_parallel: bool = False,
        fuse_wgrad_accumulation: bool = False,
        tp_group=None,
        tp_size: int = 1,
        get_rng_state_tracker=None,
        rng_tracker_name: Optional[str] = None,
        init_method: Optional[Callable[[torch.Tensor], None]] = None,
        bias: bool = True,
        return_bias: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        parallel_mode: Optional[str] = None,
        device: Union[torch.device, str] = "cuda",
        ub_overlap_rs: bool = False,
        ub_overlap_ag: bool = False,
        ub_name: Optional[str] = None,
        delay_wgrad_compute: bool = False,
        save_original_input: bool = False,
        single_grouped_weight: bool = False,
        **unused,
    ) -> None:
        super().__init__()
        if num_gemms < 1:
            raise ValueError(f"GroupedLinear: num_gemms must be >= 1, got {num_gemms}")
        if ub_overlap_rs or ub_overlap_ag:
            raise NotImplementedError("GroupedLinear: userbuffers overlap (ub_overlap_*) is not supported")
        if parallel_mode not in (None, "column", "row"):
            raise ValueError(f"GroupedLinear: parallel_mode must be None, 'column' or 'row', got {parallel_mode!r}")
        if tp_group is not None and hasattr(tp_group, "size"):
            tp_size = tp_group.size()
        if parallel_mode == "column":
            if out_features % tp_size:
                raise ValueError(f"GroupedLinear: out_features {out_features} not divisible by tp_size {tp_size}")
            out_features //= tp_size
        elif parallel_mode == "row":
            if in_features % tp_size:
                raise ValueError(f"GroupedLinear: in_features {in_features} not divisible by tp_size {tp_size}")
            in_features //= tp_size

        self.num_gemms = num_gemms
        self.in_features = in_features
        self.out_features = out_features
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.use_bias = bias
        self.return_bias = return_bias
        self.single_grouped_weight = single_grouped_weight
        self.parallel_mode = parallel_mode
        self.tp_size = tp_size
        self.sequence_parallel = tp_size > 1 and bool(sequence_parallel)
        self.delay_wgrad_compute = bool(delay_wgrad_compute)
        self.wgrad_accumulation_and_reduce_hooks: List[Callable[[], None]] = []
        self._wgrad_queue: collections.deque = collections.deque()
        dtype = params_dtype if params_dtype is not None else torch.get_default_dtype()
        base_init = init_method if init_method is not None else _default_init()

        def init(t: torch.Tensor) -> None:
            # As TE: weights are initialized inside the model-parallel RNG tracker's fork (Megatron passes its
            # tracker and, for experts, the expert-parallel stream, so that EP ranks get different experts).
            if get_rng_state_tracker is None:
                base_init(t)
                return
            tracker = get_rng_state_tracker()
            with (tracker.fork(rng_tracker_name) if rng_tracker_name else tracker.fork()):
                base_init(t)

        factory = dict(device=device, dtype=dtype)

        if single_grouped_weight:
            self.weight = nn.Parameter(torch.empty(num_gemms, out_features, in_features, **factory))
            for e in range(num_gemms):
                with torch.no_grad():
                    init(self.weight.data[e])
            if bias:
                self.bias = nn.Parameter(torch.zeros(num_gemms, out_features, **factory))
            else:
                self.register_parameter("bias", None)
        else:
            for e in range(num_gemms):
                w = nn.Parameter(torch.empty(out_features, in_features, **factory))
                with torch.no_grad():
                    init(w.data)
                self.register_parameter(f"weight{e}", w)
                if bias:
                    self.register_parameter(f"bias{e}", nn.Parameter(torch.zeros(out_features, **factory)))

        self._set_parallel_attributes()

    def _set_parallel_attributes(self) -> None:
        # Megatron reads these (TE sets them the same way): weights are always tensor-parallel tensors, split
        # along the output (column / None) or input (row) dimension; a column-parallel bias is split too, a
        # row-parallel one carries ``sequence_parallel``. Delayed weights skip the autograd grad hook.
        lead = 1 if self.single_grouped_weight else 0
        for w in self._weights():
            w.tensor_model_parallel = True
            w.partition_dim = lead + (1 if self.parallel_mode == "row" else 0)
            w.partition_stride = 1
            if self.delay_wgrad_compute:
                w.skip_backward_post_hook = True
        for b in self._biases() or []:
            if self.parallel_mode == "row":
                b.sequence_parallel = self.sequence_parallel
            elif self.parallel_mode == "column":
                b.tensor_model_parallel, b.partition_dim, b.partition_stride = True, lead, 1

    # ---------------------------------------------------------------------------------------------- params --
    def _weights(self) -> List[torch.Tensor]:
        if self.single_grouped_weight:
            return [self.weight]
        return [getattr(self, f"weight{e}") for e in range(self.num_gemms)]

    def _biases(self) -> Optional[List[torch.Tensor]]:
        if not self.use_bias:
            return None
        if self.single_grouped_weight:
            return [self.bias]
        return [getattr(self, f"bias{e}") for e in range(self.num_gemms)]

    def _stacked_bias(self) -> Optional[torch.Tensor]:
        bs = self._biases()
        if bs is None:
            return None
        return bs[0] if self.single_grouped_weight else torch.stack(bs)

    # --------------------------------------------------------------------------------------------- forward --
    def forward(self, inp: torch.Tensor, m_splits, is_first_microbatch: Optional[bool] = None):
        """``inp``: ``[..., in_features]``, rows grouped by expert; ``m_splits``: list or device tensor ``[E]``."""
        # TE: with fuse_wgrad_accumulation, the first microbatch overwrites main_grad (None: accumulate).
        accumulate = True if is_first_microbatch is None else not is_first_microbatch
        if inp.shape[-1] != self.in_features:
            raise ValueError(
                f"GroupedLinear: inp must have last dimension in_features={self.in_features}, got shape {tuple(inp.shape)}"
            )
        lead = inp.shape[:-1]
        x = inp.reshape(-1, self.in_features)
        if not x.is_contiguous():
            x = x.contiguous()
        splits = _as_splits(m_splits, x.device)
        if isinstance(m_splits, torch.Tensor) and m_splits.numel() != self.num_gemms:
            raise ValueError(f"GroupedLinear: m_splits must have {self.num_gemms} entries, got {m_splits.numel()}")
        if not isinstance(m_splits, torch.Tensor) and len(m_splits) != self.num_gemms:
            raise ValueError(f"GroupedLinear: m_splits must have {self.num_gemms} entries, got {len(m_splits)}")
        weights = self._weights()
        fuse = self.fuse_wgrad_accumulation and torch.is_grad_enabled()
        if fuse:
            for w in weights:
                if getattr(w, "main_grad", None) is None:
                    raise RuntimeError(
                        "GroupedLinear(fuse_wgrad_accumulation=True): every weight needs a .main_grad tensor "
                        "(fp32 or the weight dtype), as Megatron's DDP allocates"
                    )
        bias = None if self.return_bias else self._stacked_bias()
        defer = None
        if self.delay_wgrad_compute and torch.is_grad_enabled() and any(w.requires_grad for w in weights):
            queue = self._wgrad_queue

            def defer(a, dy, splits_, fuse=fuse, accumulate=accumulate):
                queue.append((a, dy, splits_, fuse, accumulate))

        out = _grouped_gemm_autograd(x, weights, splits, True, bias, fuse, accumulate, defer)
        out = out.reshape(*lead, self.out_features)
        if self.return_bias:
            return out, self._biases()
        return out

    # ------------------------------------------------------------------------------- delayed weight grads --
    def need_backward_dw(self) -> bool:
        """Whether :meth:`backward_dw` must run to finish the weight gradients (``delay_wgrad_compute``)."""
        return self.delay_wgrad_compute

    def register_wgrad_accumulation_and_reduce_hooks(self, hook: Callable[[], None]) -> None:
        """Register ``hook()`` to run at the end of each :meth:`backward_dw` (TE's API; DDP's grad-ready hooks)."""
        self.wgrad_accumulation_and_reduce_hooks.append(hook)

    def backward_dw(self) -> None:
        """Run the oldest queued weight-gradient GEMM (one per backward since the last call), then the hooks.

        Fused (``fuse_wgrad_accumulation``): into ``weight.main_grad`` (added, or written for the first
        microbatch) with ``grad_added_to_main_grad`` set. Otherwise added to ``weight.grad`` (set when None), as
        autograd would. A call with nothing queued does nothing. Sync-free and capturable like the backward.
        """
        if not self.delay_wgrad_compute or not self._wgrad_queue:
            return
        a, dy, splits, fuse, accumulate = self._wgrad_queue.popleft()
        weights = self._weights()
        with torch.no_grad():
            if fuse:
                _weight_grads(a, dy, splits, True, weights, [w.main_grad for w in weights], accumulate)
                for w in weights:
                    w.grad_added_to_main_grad = True
            else:
                for w, g in zip(weights, _weight_grads(a, dy, splits, True, weights)):
                    if w.grad is None:
                        w.grad = g.to(w.dtype)
                    else:
                        w.grad.add_(g)
        del a, dy, splits
        for hook in self.wgrad_accumulation_and_reduce_hooks:
            hook()

    # ------------------------------------------------------- TE base-module surface (no fp8 in moe_graph) --
    # Megatron's TEGroupedLinear subclasses TE's GroupedLinear and reads these in its checkpoint hooks
    # (merge_extra_states, _split_extra_state); with them it subclasses this class unchanged.
    fp8 = False
    fp8_calibration = False

    @property
    def fp8_meta(self) -> dict:
        return {"fp8_checkpoint": False, "recipe": None}

    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        """TE API: nothing to initialize without fp8."""
        del num_gemms

    def _decode_extra_state(self, state):
        return state

    # --------------------------------------------------------------------------------------- state dict I/O --
    def get_extra_state(self) -> torch.Tensor:
        # TE stores fp8 metadata here; an empty tensor keeps state dicts loadable by TE with strict=True.
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state) -> None:  # TE fp8 metadata is ignored (no fp8 here)
        return None

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        # Convert between TE's per-expert layout (weight0.., bias0..) and the single grouped layout.
        E = self.num_gemms
        per = [f"{prefix}weight{e}" for e in range(E)]
        if self.single_grouped_weight and all(k in state_dict for k in per):
            state_dict[f"{prefix}weight"] = torch.stack([state_dict.pop(k) for k in per])
            bk = [f"{prefix}bias{e}" for e in range(E)]
            if all(k in state_dict for k in bk):
                b = torch.stack([state_dict.pop(k) for k in bk])
                if self.use_bias:
                    state_dict[f"{prefix}bias"] = b
        elif not self.single_grouped_weight and f"{prefix}weight" in state_dict:
            w = state_dict.pop(f"{prefix}weight")
            for e in range(E):
                state_dict[f"{prefix}weight{e}"] = w[e]
            if f"{prefix}bias" in state_dict:
                b = state_dict.pop(f"{prefix}bias")
                if self.use_bias:
                    for e in range(E):
                        state_dict[f"{prefix}bias{e}"] = b[e]
        if not self.use_bias:  # TE writes empty bias tensors when bias=False
            for k in [k for k in state_dict if k.startswith(f"{prefix}bias")]:
                if state_dict[k].numel() == 0:
                    state_dict.pop(k)
        state_dict.setdefault(f"{prefix}_extra_state", torch.empty(0, dtype=torch.uint8))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    def extra_repr(self) -> str:
        return (
            f"num_gemms={self.num_gemms}, in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.use_bias}, single_grouped_weight={self.single_grouped_weight}, "
            f"fuse_wgrad_accumulation={self.fuse_wgrad_accumulation}, delay_wgrad_compute={self.delay_wgrad_compute}"
        )
