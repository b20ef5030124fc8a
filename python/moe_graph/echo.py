"""Echo experts: copy home expert weights into the spare slots the planner chose, and send the spare slots' weight
gradients back to the home experts.

Layout (as in :mod:`moe_graph.planner`): ``R`` EP ranks, ``E`` home experts (``L = E // R`` local ones per rank,
expert ``e`` on rank ``e // L`` at local index ``e % L``), ``k`` spare slots per rank (``S = R * k``, slot ``j``
on rank ``j // k`` at local index ``j % k``). ``expert_offloading_map [E, S]`` bool (identical on every rank)
says which home expert each slot hosts.

Weights are "any list of per-expert tensors": each tensor holds this rank's ``L`` home experts stacked on dim 0
(e.g. a grouped MLP's fc1 ``[L, 2F, H]`` and fc2 ``[L, H, F]``); the spare copies come back as tensors of shape
``[k, ...]`` (one per input tensor). A list of ``L`` per-expert tensors (TransformerEngine's ``weight0..``) can be
stacked with ``torch.stack`` first.

Everything has static sizes (capturable, no host syncs): the plan is only read on the device, as masks and
gather indices. The exchange goes through a :class:`EchoBackend`:

* :class:`AllToAllBackend` (default): one ``all_to_all_single`` with equal splits; every rank sends ``k`` slots'
  worth of weights to every rank (zeros where that rank hosts nothing of ours). ``R*k*N`` elements per rank,
  works on NCCL and gloo.
* :class:`AllGatherBackend`: the same exchange through ``all_gather`` (for process groups without all-to-all);
  ``R`` times the traffic.
* a sparse peer-to-peer backend (only the ``<= k`` real copies per rank) can implement the same
  ``exchange(send [R, k, N]) -> recv [R, k, N]`` interface later.

Gradients: the spare slots' weight gradients live in their own buffers (the grouped GEMM's per-expert accumulate
mask overwrites those while it accumulates the home experts into ``main_grad``, see :func:`wgrad_accumulate_mask`);
:meth:`EchoExpertDispatcher.aggregate_grads` sends them home and adds them into the home experts' gradients
(``main_grad`` when present). :func:`dispatch_spare_weights` wraps dispatch + aggregation as an autograd function.

Fused path (weights with ``main_grad``, e.g. under :class:`moe_graph.ddp.DistributedDataParallel`):
:func:`echo_grouped_gemm` runs one grouped GEMM over the ``L`` home + ``k`` spare experts; its backward computes
dgrad, then ONE ``grouped_gemm_wgrad`` call with the per-expert mask (home experts accumulate into ``main_grad``,
spare slots overwrite their own buffers), then :meth:`EchoExpertDispatcher.aggregate_grads` adds the spare slots'
gradients into the home experts' ``main_grad``, sets ``grad_added_to_main_grad`` and returns a zero weight
gradient (the DDP hook still fires, adds nothing).
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = [
    "EchoBackend",
    "AllToAllBackend",
    "AllGatherBackend",
    "LocalBackend",
    "default_backend",
    "EchoExpertDispatcher",
    "dispatch_spare_weights",
    "wgrad_accumulate_mask",
    "spare_grad_buffers",
    "echo_grouped_gemm",
]


# --------------------------------------------------------------------------------------------------- backends --
class EchoBackend:
    """Exchanges fixed-size per-destination blocks: ``send[d]`` goes to rank ``d`` of the group and ``recv[s]`` is
    what rank ``s`` sent here. Shapes ``[R, ...]`` are static."""

    def exchange(self, send: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError


class AllToAllBackend(EchoBackend):
    """``torch.distributed.all_to_all_single`` with equal splits (NCCL, gloo)."""

    def __init__(self, group=None):
        self.group = group

    def exchange(self, send: torch.Tensor) -> torch.Tensor:
        send = send.contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        return recv


class AllGatherBackend(EchoBackend):
    """The same exchange through ``all_gather`` of every rank's whole send buffer (``R`` times the traffic), for
    process groups without all-to-all."""

    def __init__(self, group=None):
        self.group = group

    def exchange(self, send: torch.Tensor) -> torch.Tensor:
        send = send.contiguous()
        world = dist.get_world_size(self.group)
        me = dist.get_rank(self.group)
        gathered = [torch.empty_like(send) for _ in range(world)]
        dist.all_gather(gathered, send, group=self.group)
        return torch.stack([g[me] for g in gathered])


class LocalBackend(EchoBackend):
    """Single process holding all ranks (tests, simulations): ``exchange_all(sends[R][R, ...])`` transposes."""

    def exchange(self, send: torch.Tensor) -> torch.Tensor:
        if send.shape[0] != 1:
            raise ValueError("LocalBackend.exchange handles a group of one rank; use exchange_all for several")
        return send.clone()

    @staticmethod
    def exchange_all(sends: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        return [torch.stack([sends[s][d] for s in range(len(sends))]) for d in range(len(sends))]


_A2A_WORKS: dict = {}


def default_backend(group=None) -> EchoBackend:
    """All-to-all where the process group supports it (probed once per backend name with a tiny collective, at
    setup time, never during capture), else all-gather."""
    name = dist.get_backend(group)
    if name not in _A2A_WORKS:
        try:
            dev = torch.device("cuda", torch.cuda.current_device()) if name == "nccl" else torch.device("cpu")
            w = dist.get_world_size(group)
            t = torch.zeros(w, device=dev)
            dist.all_to_all_single(torch.empty_like(t), t, group=group)
            ok = True
        except (RuntimeError, NotImplementedError, ValueError):
            ok = False
        flags = [None] * dist.get_world_size(group)
        dist.all_gather_object(flags, ok, group=group)
        _A2A_WORKS[name] = all(flags)
    return AllToAllBackend(group) if _A2A_WORKS[name] else AllGatherBackend(group)


# ------------------------------------------------------------------------------------------------ dispatcher --
def wgrad_accumulate_mask(num_local_experts: int, num_spare: int, device=None) -> torch.Tensor:
    """``[L + k]`` bool for ``grouped_gemm_wgrad(..., accumulate=mask)`` over home + spare experts: accumulate into
    the home experts' ``main_grad``, overwrite the spare slots' separate buffers."""
    m = torch.zeros(num_local_experts + num_spare, dtype=torch.bool, device=device)
    m[:num_local_experts] = True
    return m


def spare_grad_buffers(home_weights: Sequence[torch.Tensor], num_spare: int, dtype=torch.float32) -> List[torch.Tensor]:
    """Separate fp32 gradient buffers ``[k, ...]`` for the spare slots, one per weight tensor."""
    return [torch.zeros((num_spare,) + tuple(w.shape[1:]), dtype=dtype, device=w.device) for w in home_weights]


class EchoExpertDispatcher:
    """Moves home expert weights into spare slots and spare-slot gradients back home, with static buffer sizes.

    Args:
        num_experts: ``E`` (all home experts). num_ep_ranks: ``R``. ep_rank: this rank's index in the EP group.
        num_spare_experts_per_ep_rank: ``k``.
        backend: an :class:`EchoBackend` (default: :func:`default_backend` of ``group``, resolved in the
            constructor when torch.distributed is initialized, so construct the dispatcher before capturing).
        group: the EP process group (``None``: the default group).

    Example (4 ranks, 2 experts each, ``k = 1``; the plan put a copy of expert 5 (rank 2) into slot 1)::

        d = EchoExpertDispatcher(8, 4, rank, 1)
        fc1_spare, fc2_spare = d.dispatch(offloading_map, [fc1, fc2])   # on rank 1: fc1[1] of rank 2, ...
        ...  # backward produced fc1_spare_grad, fc2_spare_grad ([1, ...] each)
        d.aggregate_grads(offloading_map, [g1, g2], [fc1, fc2])          # rank 2 adds them into expert 5's grads
    """

    def __init__(
        self,
        num_experts: int,
        num_ep_ranks: int,
        ep_rank: int,
        num_spare_experts_per_ep_rank: int = 1,
        backend: Optional[EchoBackend] = None,
        group=None,
    ):
        if num_experts % num_ep_ranks != 0:
            raise ValueError(f"num_experts={num_experts} must be divisible by num_ep_ranks={num_ep_ranks}")
        if not 0 <= ep_rank < num_ep_ranks:
            raise ValueError(f"ep_rank must be in [0, {num_ep_ranks}), got {ep_rank}")
        if num_spare_experts_per_ep_rank < 1:
            raise ValueError(f"num_spare_experts_per_ep_rank must be >= 1, got {num_spare_experts_per_ep_rank}")
        self.E = num_experts
        self.R = num_ep_ranks
        self.rank = ep_rank
        self.k = num_spare_experts_per_ep_rank
        self.L = num_experts // num_ep_ranks
        self.S = self.R * self.k
        self._backend = backend
        self.group = group
        if backend is None and dist.is_available() and dist.is_initialized():
            # resolve (and probe) the backend now, at setup time: the probe is a collective with a host sync and
            # must not run inside a CUDA-graph capture
            self._backend = default_backend(group)

    @property
    def backend(self) -> EchoBackend:
        if self._backend is None:
            self._backend = default_backend(self.group)
        return self._backend

    # -- plan decoding (device tensors only) --
    def slot_homes(self, expert_offloading_map: torch.Tensor):
        """``(home_rank[S], home_local[S], has_home[S])`` from ``expert_offloading_map [E, S]`` (first true row)."""
        m = expert_offloading_map
        if m.dim() != 2 or m.shape != (self.E, self.S):
            raise ValueError(
                f"expert_offloading_map must have shape [E, S] = [{self.E}, {self.S}], got {tuple(m.shape)}"
            )
        m = m.to(torch.bool)
        home = torch.argmax(m.to(torch.int8), dim=0)
        return home // self.L, home % self.L, m.any(0)

    def _check_weights(self, home_weights: Sequence[torch.Tensor]) -> None:
        if len(home_weights) == 0:
            raise ValueError("home_weights must hold at least one tensor [L, ...]")
        for i, w in enumerate(home_weights):
            if w.dim() < 1 or w.shape[0] != self.L:
                raise ValueError(
                    f"home_weights[{i}] must stack this rank's L={self.L} home experts on dim 0, got shape {tuple(w.shape)}"
                )
            if w.dtype != home_weights[0].dtype or w.device != home_weights[0].device:
                raise ValueError(
                    f"home_weights[{i}] must have the dtype/device of home_weights[0] ({home_weights[0].dtype}, "
                    f"{home_weights[0].device}), got {w.dtype}, {w.device}"
                )

    @staticmethod
    def _pack(tensors: Sequence[torch.Tensor], n: int) -> torch.Tensor:
        return torch.cat([t.reshape(n, -1) for t in tensors], dim=1)

    @staticmethod
    def _unpack(flat: torch.Tensor, like: Sequence[torch.Tensor], n: int) -> List[torch.Tensor]:
        out, off = [], 0
        for t in like:
            size = math.prod(t.shape[1:])
            out.append(flat[:, off : off + size].reshape((n,) + tuple(t.shape[1:])))
            off += size
        return out

    # -- forward: weights to spare slots --
    def dispatch(self, expert_offloading_map: torch.Tensor, home_weights: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Copies of the home experts for this rank's ``k`` spare slots: one ``[k, ...]`` tensor per input tensor
        (zeros for an unused slot). Collective: every rank of the group must call it with the same plan."""
        self._check_weights(home_weights)
        home_rank, home_local, has_home = self.slot_homes(expert_offloading_map.to(home_weights[0].device))
        flat = self._pack([w.detach() for w in home_weights], self.L)  # [L, N]
        mine = (has_home & (home_rank == self.rank))[:, None]  # [S, 1]: slots hosting one of our experts
        send = torch.where(mine, flat.index_select(0, home_local), torch.zeros((), dtype=flat.dtype, device=flat.device))
        recv = self.backend.exchange(send.view(self.R, self.k, -1))  # recv[s, i]: rank s's copy for our slot i
        my = slice(self.rank * self.k, (self.rank + 1) * self.k)
        src = home_rank[my].view(1, self.k, 1).expand(1, self.k, recv.shape[2])
        spare = torch.gather(recv, 0, src).squeeze(0)  # [k, N]: the block from each slot's home rank
        spare = torch.where(has_home[my][:, None], spare, torch.zeros((), dtype=spare.dtype, device=spare.device))
        return self._unpack(spare, home_weights, self.k)

    # -- backward: spare-slot gradients home --
    def exchange_grads(self, expert_offloading_map: torch.Tensor, spare_grads: Sequence[torch.Tensor]):
        """Sends the spare slots' gradients to their home ranks. Returns ``(recv [S, N], home_local [S],
        for_me [S])``: slot ``j``'s gradient, its home expert's local index, whether that expert lives here."""
        for i, g in enumerate(spare_grads):
            if g.dim() < 1 or g.shape[0] != self.k:
                raise ValueError(f"spare_grads[{i}] must have k={self.k} slots on dim 0, got shape {tuple(g.shape)}")
        dev = spare_grads[0].device
        dtype = torch.promote_types(spare_grads[0].dtype, torch.float32) if spare_grads[0].is_floating_point() else spare_grads[0].dtype
        home_rank, home_local, has_home = self.slot_homes(expert_offloading_map.to(dev))
        flat = self._pack([g.to(dtype) for g in spare_grads], self.k)  # [k, N]
        my = slice(self.rank * self.k, (self.rank + 1) * self.k)
        dest = torch.arange(self.R, device=dev)[:, None] == home_rank[my][None, :]  # [R, k]
        dest = dest & has_home[my][None, :]
        send = torch.where(dest[:, :, None], flat[None], torch.zeros((), dtype=flat.dtype, device=dev))
        recv = self.backend.exchange(send).reshape(self.S, -1)  # row s*k+i: slot s*k+i's gradient (if ours)
        for_me = has_home & (home_rank == self.rank)
        return recv, home_local, for_me

    def aggregate_grads(
        self,
        expert_offloading_map: torch.Tensor,
        spare_grads: Sequence[torch.Tensor],
        home_params: Optional[Sequence[torch.Tensor]] = None,
        out: Optional[Sequence[torch.Tensor]] = None,
    ) -> List[torch.Tensor]:
        """Adds the spare slots' gradients into their home experts' gradients.

        Args:
            spare_grads: one ``[k, ...]`` tensor per weight tensor (this rank's slots).
            home_params: the home weight tensors ``[L, ...]``; the sums go into ``p.main_grad`` when present, else
                into ``p.grad`` (created as zeros when ``None``).
            out: explicit ``[L, ...]`` gradient tensors to add into instead of ``home_params``.

        Returns:
            the tensors added into. Collective, like :meth:`dispatch`. Slots of the same expert are summed in slot
            order by ``index_add_`` (deterministic on CPU; on CUDA under ``torch.use_deterministic_algorithms``).
        """
        recv, home_local, for_me = self.exchange_grads(expert_offloading_map, spare_grads)
        if out is None:
            if home_params is None:
                raise ValueError("aggregate_grads needs home_params or out")
            out = []
            for p in home_params:
                if getattr(p, "main_grad", None) is not None:
                    out.append(p.main_grad)
                else:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    out.append(p.grad)
        target = torch.where(for_me, home_local, torch.full_like(home_local, self.L))  # row L: sink
        acc = torch.zeros(self.L + 1, recv.shape[1], dtype=recv.dtype, device=recv.device)
        acc.index_add_(0, target, recv)
        parts = self._unpack(acc[: self.L], list(out), self.L)
        for o, part in zip(out, parts):
            if o.shape[0] != self.L:
                raise ValueError(f"gradient tensors must have L={self.L} experts on dim 0, got shape {tuple(o.shape)}")
            o.add_(part.to(o.dtype))
        return list(out)


class _DispatchSpare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dispatcher, expert_offloading_map, *home_weights):
        ctx.dispatcher = dispatcher
        ctx.shapes = [(w.shape, w.dtype) for w in home_weights]
        ctx.params = home_weights  # to find main_grad in backward
        ctx.save_for_backward(expert_offloading_map)
        return tuple(dispatcher.dispatch(expert_offloading_map, home_weights))

    @staticmethod
    def backward(ctx, *spare_grads):
        (offloading_map,) = ctx.saved_tensors
        d: EchoExpertDispatcher = ctx.dispatcher
        grads = [
            g if g is not None else torch.zeros((d.k,) + tuple(s[1:]), dtype=dt, device=offloading_map.device)
            for g, (s, dt) in zip(spare_grads, ctx.shapes)
        ]
        use_main = [getattr(p, "main_grad", None) is not None for p in ctx.params]
        outs = [
            p.main_grad if m else torch.zeros(s, dtype=torch.promote_types(dt, torch.float32), device=g.device)
            for p, m, (s, dt), g in zip(ctx.params, use_main, ctx.shapes, grads)
        ]
        d.aggregate_grads(offloading_map, grads, out=outs)
        home = [None if m else o.to(dt) for m, o, (_, dt) in zip(use_main, outs, ctx.shapes)]
        return (None, None, *home)


def dispatch_spare_weights(
    dispatcher: EchoExpertDispatcher, expert_offloading_map: torch.Tensor, home_weights: Sequence[torch.Tensor]
) -> List[torch.Tensor]:
    """Autograd-aware :meth:`EchoExpertDispatcher.dispatch`: returns the ``[k, ...]`` spare weights; in backward
    their gradients go home (collective) and are added to the home weights' gradients, or straight into
    ``main_grad`` for weights that have one (then autograd gets no gradient for that weight)."""
    return list(_DispatchSpare.apply(dispatcher, expert_offloading_map, *home_weights))


class _EchoGroupedGemmFn(torch.autograd.Function):
    """``y = grouped(a_e @ W_e^T)`` over ``L`` home experts (``home_weight [L, N, K]``, a parameter with
    ``main_grad``) followed by ``k`` spare slots (``spare_weight [k, N, K]``, detached copies from
    :meth:`EchoExpertDispatcher.dispatch`).

    Backward: dgrad through all ``L + k`` experts; wgrad in one :func:`~moe_graph.ops.grouped_gemm.grouped_gemm_wgrad`
    call into ``main_grad[0..L)`` (accumulate) and ``spare_grad[0..k)`` (overwrite) per ``accumulate_mask``;
    the spare slots' gradients are then sent home and added into ``main_grad`` (a collective: every EP rank runs
    it, in the same order). The weight's returned gradient is a cached zero tensor, with
    ``grad_added_to_main_grad = True``, as the DDP hook expects.

    ``accumulate_mask`` and ``spare_grad`` are static buffers shared across microbatches: kept as ctx attributes
    (not saved tensors) so that rewriting ``spare_grad`` in one backward does not trip the version check of
    another microbatch's saved tensors.
    """

    @staticmethod
    def forward(ctx, a, m_splits, home_weight, spare_weight, expert_offloading_map, dispatcher, accumulate_mask,
                spare_grad):
        from .ops.grouped_gemm import grouped_gemm

        weights = list(home_weight.unbind(0)) + list(spare_weight.unbind(0))
        out = grouped_gemm(a, weights, m_splits)
        ctx.dispatcher = dispatcher
        ctx.accumulate_mask = accumulate_mask
        ctx.spare_grad = spare_grad
        ctx.save_for_backward(a, m_splits, home_weight, spare_weight, expert_offloading_map)
        return out

    @staticmethod
    def backward(ctx, dy):
        from .ops.grouped_gemm import _dummy_wgrad, grouped_gemm, grouped_gemm_wgrad

        a, m_splits, home, spare, omap = ctx.saved_tensors
        dy = dy.contiguous()
        da = dw = None
        if ctx.needs_input_grad[0]:
            weights = list(home.unbind(0)) + list(spare.unbind(0))
            da = grouped_gemm(dy, weights, m_splits, trans_b=False)
        if ctx.needs_input_grad[2]:
            main_grad = home.main_grad
            outs = list(main_grad.unbind(0)) + list(ctx.spare_grad.unbind(0))
            grouped_gemm_wgrad(a, dy, m_splits, out=outs, accumulate=ctx.accumulate_mask)
            ctx.dispatcher.aggregate_grads(omap, [ctx.spare_grad], out=[main_grad])
            home.grad_added_to_main_grad = True
            dw = _dummy_wgrad(home)
        return da, None, dw, None, None, None, None, None


def echo_grouped_gemm(
    a: torch.Tensor,
    home_weight: torch.Tensor,
    spare_weight: torch.Tensor,
    m_splits: torch.Tensor,
    dispatcher: EchoExpertDispatcher,
    expert_offloading_map: torch.Tensor,
    accumulate_mask: torch.Tensor,
    spare_grad: torch.Tensor,
) -> torch.Tensor:
    """Grouped GEMM over home + spare experts with the weight gradient fused into ``home_weight.main_grad``.

    Args:
        a: ``[M, K]`` rows grouped by local expert (``L`` home, then ``k`` spare slots).
        home_weight: ``[L, N, K]`` parameter with ``main_grad`` (same shape; fp32 or the weight dtype).
        spare_weight: ``[k, N, K]`` copies from :meth:`EchoExpertDispatcher.dispatch` (no autograd).
        m_splits: ``[L + k]`` device tensor.
        accumulate_mask: ``[L + k]`` bool on the device, :func:`wgrad_accumulate_mask` (built once).
        spare_grad: ``[k, N, K]`` buffer of ``main_grad``'s dtype (:func:`spare_grad_buffers`), overwritten in
            every backward.

    Returns ``[M, N]``. Backward is collective over the EP group (the spare gradients' exchange).
    """
    from .ops.grouped_gemm import _as_splits

    L, k = home_weight.shape[0], spare_weight.shape[0]
    m_splits = _as_splits(m_splits, a.device)
    mg = getattr(home_weight, "main_grad", None)
    if mg is None:
        raise RuntimeError("echo_grouped_gemm: home_weight needs a .main_grad tensor (e.g. from DistributedDataParallel)")
    if mg.shape != home_weight.shape:
        raise ValueError(f"echo_grouped_gemm: main_grad must have shape {tuple(home_weight.shape)}, got {tuple(mg.shape)}")
    if spare_grad.shape != spare_weight.shape or spare_grad.dtype != mg.dtype:
        raise ValueError(
            f"echo_grouped_gemm: spare_grad must be {tuple(spare_weight.shape)} of main_grad's dtype {mg.dtype}, "
            f"got {tuple(spare_grad.shape)} {spare_grad.dtype}")
    if accumulate_mask.shape != (L + k,) or accumulate_mask.dtype != torch.bool:
        raise ValueError(f"echo_grouped_gemm: accumulate_mask must be a [{L + k}] bool tensor")
    return _EchoGroupedGemmFn.apply(a, m_splits, home_weight, spare_weight.detach(), expert_offloading_map,
                                    dispatcher, accumulate_mask, spare_grad)
