"""Echo experts: copy home expert weights into the spare slots the planner chose, and send the spare slots' weight
gradients back to the home experts.

Layout (legend in :mod:`moe_graph.moe`): ``R`` EP ranks, ``E`` home experts (``L = E // R`` local ones per rank,
expert ``e`` on rank ``e // L`` at local index ``e % L``), ``k`` spare slots per rank (``S = R * k``, slot ``j``
on rank ``j // k`` at local index ``j % k``). ``offload_map [E, S]`` bool (identical on every rank)
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
* :class:`PeerBackend` (donor-constrained placement, ``donors=w``): the plan lets a rank's slots host only
  experts of its ``w`` fixed donor ranks (:func:`moe_graph.moe.echo_planner.donor_ranks`), so the exchange is ``w`` static
  peer blocks of ``k*N`` (one ``batch_isend_irecv`` of ``w`` sends and ``w`` receives; capturable with NCCL):
  per-rank memory and traffic ``O(w*k*N)``, independent of ``R``.

:func:`echo_buffer_bytes` returns the bytes these exchanges allocate per layer for a configuration.

Gradients: the spare slots' weight gradients live in their own buffers (the grouped GEMM's per-expert accumulate
mask overwrites those while it accumulates the home experts into ``main_grad``, see :func:`wgrad_accumulate_mask`);
:meth:`EchoExpertDispatcher.aggregate_grads` sends them home and adds them into the home experts' gradients
(``main_grad`` when present). :func:`dispatch_spare_weights` wraps dispatch + aggregation as an autograd function.

Fused path (weights with ``main_grad``, e.g. under :class:`moe_graph.distributed.ddp.DistributedDataParallel`):
:func:`echo_grouped_gemm` runs one grouped GEMM over the ``L`` home + ``k`` spare experts; its backward computes
dgrad, then ONE ``grouped_gemm_wgrad`` call with the per-expert mask (home experts accumulate into ``main_grad``,
spare slots overwrite their own buffers), then :meth:`EchoExpertDispatcher.aggregate_grads` adds the spare slots'
gradients into the home experts' ``main_grad``, sets ``grad_added_to_main_grad`` and returns a zero weight
gradient (the DDP hook still fires, adds nothing).
"""

from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Sequence, Union

import torch
import torch.distributed as dist

from moe_graph.grouped_linear import fp8_dgrad, fp8_forward, fp8_wgrad, split_quantized
from moe_graph.moe import echo_planner
from moe_graph.ops import fp8 as _fp8
from moe_graph.ops.grouped_gemm import (
    as_splits,
    grouped_bias_grad,
    grouped_gemm,
    grouped_gemm_wgrad,
    zero_wgrad_placeholder,
)

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
    "PeerBackend",
    "echo_buffer_bytes",
    "SlotPlan",
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


class PeerBackend(EchoBackend):
    """``w`` static peer blocks: ``exchange(send [w, ...], to_ranks, from_ranks)`` sends ``send[o]`` to group rank
    ``to_ranks[o]`` and receives ``recv[o]`` from ``from_ranks[o]``, all in one ``batch_isend_irecv`` (NCCL groups
    them into one fused launch, capturable; gloo runs them as point-to-point messages)."""

    def __init__(self, group=None):
        self.group = group

    def _global(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def exchange(self, send: torch.Tensor, to_ranks: Sequence[int] = (), from_ranks: Sequence[int] = ()) -> torch.Tensor:
        send = send.contiguous()
        recv = torch.empty_like(send)
        self._send_recv(send, recv, to_ranks, from_ranks)
        return recv

    def _send_recv(self, send, recv, to_ranks, from_ranks) -> None:
        ops = []
        for o, (t, f) in enumerate(zip(to_ranks, from_ranks)):
            ops.append(dist.P2POp(dist.irecv, recv[o], self._global(f), group=self.group))
            ops.append(dist.P2POp(dist.isend, send[o], self._global(t), group=self.group))
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()


PLAN_MODES = ("microbatch", "iteration")


def echo_buffer_bytes(
    num_experts: int,
    num_ep_ranks: int,
    num_spare_experts_per_ep_rank: int,
    donors: Optional[int],
    expert_numel: int,
    dtype: torch.dtype = torch.bfloat16,
    plan_mode: str = "microbatch",
    num_microbatches: int = 1,
    grad_dtype: torch.dtype = torch.float32,
) -> dict:
    """Bytes of the echo buffers one MoE layer allocates, for ``E`` experts, ``R`` EP ranks, ``k`` spare slots,
    ``w = donors`` donor ranks (``None`` or ``>= R``: unconstrained, all-to-all of ``R`` blocks), ``N =
    expert_numel`` parameters per expert (all expert weight tensors together, e.g. fc1 + fc2), weights in
    ``dtype`` and gradients (``main_grad``) in ``grad_dtype``. With ``B = R`` (unconstrained) or ``w``:

    * ``dispatch_send`` / ``dispatch_recv``: ``B*k*N`` weight elements each (:meth:`EchoExpertDispatcher.dispatch`);
    * ``spare_weights``: ``k*N`` per dispatch, held until the backward of every microbatch that uses it: one copy per
      microbatch in flight with ``plan_mode="microbatch"`` (``num_microbatches``), one static buffer per layer with
      ``"iteration"`` (the dispatch writes into it);
    * ``grad_send`` / ``grad_recv``: ``B*k*N`` gradient elements each (:meth:`EchoExpertDispatcher.aggregate_grads`,
      per backward; the received rows are added straight into the home experts' gradients, no accumulator);
    * ``spare_grads``: ``k*N``, the spare slots' static wgrad buffers (fused ``main_grad`` path).

    With ``R = 1`` nothing is exchanged: the dispatch gathers the copies straight into the spare buffer
    (``dispatch_send = dispatch_recv = 0``) and the aggregation adds the masked spare gradients (``grad_recv = 0``).
    ``total`` sums them (an upper bound of what a CUDA graph's pool holds: the send/receive blocks are transient
    and reused across microbatches). Everything is ``O(B*k*N)``: with donors, independent of ``R``.
    The tests check the per-call numbers against the tensors the dispatcher actually allocates.

    Example: DeepSeek-V3-sized experts (``N = 3 * 7168 * 2048``, bf16), ``E=256``, ``R=64``, ``k=2``: the
    unconstrained dispatch send buffer is ``64*2*N*2`` bytes = 11.3 GB; with ``w=2`` it is 0.35 GB.
    """
    R = int(num_ep_ranks)
    if R < 1 or num_experts < 1 or num_experts % R:
        raise ValueError(f"num_experts={num_experts} must be a positive multiple of num_ep_ranks={num_ep_ranks}")
    k = int(num_spare_experts_per_ep_rank)
    if k < 1 or expert_numel < 0 or num_microbatches < 1:
        raise ValueError(f"need num_spare_experts_per_ep_rank >= 1, expert_numel >= 0, num_microbatches >= 1; got "
                         f"{k}, {expert_numel}, {num_microbatches}")
    if plan_mode not in PLAN_MODES:
        raise ValueError(f"plan_mode must be one of {PLAN_MODES}, got {plan_mode!r}")
    d = echo_planner.donor_ranks(R, donors)
    B = R if d is None else len(d[0])
    N = int(expert_numel)
    wb = torch.empty((), dtype=dtype).element_size()
    gb = torch.empty((), dtype=grad_dtype).element_size()
    copies = num_microbatches if plan_mode == "microbatch" else 1
    x = 0 if R == 1 else 1  # a one-rank group exchanges nothing
    out = {
        "dispatch_send": x * B * k * N * wb,
        "dispatch_recv": x * B * k * N * wb,
        "spare_weights": copies * k * N * wb,
        "grad_send": B * k * N * gb,
        "grad_recv": x * B * k * N * gb,
        "spare_grads": k * N * gb,
    }
    out["total"] = sum(out.values())
    out["blocks"] = B
    return out


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


class SlotPlan(NamedTuple):
    """One plan decoded for one rank (:meth:`EchoExpertDispatcher.decode`), once per forward, for the weight
    dispatch and the gradient aggregation of every expert GEMM: device tensors only. ``B`` exchange blocks
    (``R``, or ``w`` with donors) of ``k`` rows each."""

    slot_home: torch.Tensor  # [S] int64: the home expert of each slot (E: none)
    send_src: torch.Tensor  # [B*k] int64: local expert copied into each weight-send row (0 where none)
    send_off: torch.Tensor  # [B*k, 1] bool: the row carries none of our experts (sent as zeros)
    recv_rows: Optional[torch.Tensor]  # [k] int64: the receive row holding each of our slots' copy (R > 1)
    recv_off: Optional[torch.Tensor]  # [k, 1] bool: our slot hosts nothing a donor sends (zeros; R > 1)
    grad_off: torch.Tensor  # [B, k, 1] bool: our slot i's gradient does not go to block b
    grad_target: torch.Tensor  # [B*k] int64: home expert of the j-th received gradient row in summation order


class EchoExpertDispatcher:
    """Moves home expert weights into spare slots and spare-slot gradients back home, with static buffer sizes.

    Args:
        num_experts: ``E`` (all home experts). num_ep_ranks: ``R``. ep_rank: this rank's index in the EP group.
        num_spare_experts_per_ep_rank: ``k``.
        backend: an :class:`EchoBackend` (default: :func:`default_backend` of ``group``, resolved in the
            constructor when torch.distributed is initialized, so construct the dispatcher before capturing; with
            ``donors < R``: a :class:`PeerBackend`).
        group: the EP process group (``None``: the default group).
        donors: ``w``, the fixed donor ranks per rank (``None`` or ``>= R``: any rank, the all-to-all of ``R``
            blocks). The plans must come from the planner with the matching
            :func:`moe_graph.moe.echo_planner.donor_mask` (:attr:`donor_mask`); slots hosting an expert of a non-donor rank
            get zeros. donor_pattern, node_size: see :func:`moe_graph.moe.echo_planner.donor_ranks`.

    Example (4 ranks, 2 experts each, ``k = 1``; the plan put a copy of expert 5 (rank 2) into slot 1)::

        d = EchoExpertDispatcher(8, 4, rank, 1)
        fc1_spare, fc2_spare = d.dispatch(offload_map, [fc1, fc2])   # on rank 1: fc1[1] of rank 2, ...
        ...  # backward produced fc1_spare_grad, fc2_spare_grad ([1, ...] each)
        d.aggregate_grads(offload_map, [g1, g2], [fc1, fc2])          # rank 2 adds them into expert 5's grads
    """

    def __init__(
        self,
        num_experts: int,
        num_ep_ranks: int,
        ep_rank: int,
        num_spare_experts_per_ep_rank: int = 1,
        backend: Optional[EchoBackend] = None,
        group=None,
        donors: Optional[int] = None,
        donor_pattern: str = "ring",
        node_size: Optional[int] = None,
        device=None,
    ):
        for name, v in (("num_experts", num_experts), ("num_ep_ranks", num_ep_ranks), ("ep_rank", ep_rank),
                        ("num_spare_experts_per_ep_rank", num_spare_experts_per_ep_rank)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if num_ep_ranks < 1:
            raise ValueError(f"num_ep_ranks must be >= 1, got {num_ep_ranks}")
        if num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {num_experts}")
        if num_experts % num_ep_ranks != 0:
            raise ValueError(f"num_experts={num_experts} must be divisible by num_ep_ranks={num_ep_ranks}")
        if not 0 <= ep_rank < num_ep_ranks:
            raise ValueError(f"ep_rank must be in [0, {num_ep_ranks}), got {ep_rank}")
        if num_spare_experts_per_ep_rank < 1:
            raise ValueError(f"num_spare_experts_per_ep_rank must be >= 1, got {num_spare_experts_per_ep_rank}")
        self.num_experts = num_experts
        self.num_ep_ranks = num_ep_ranks
        self.ep_rank = ep_rank
        self.num_spare_experts_per_ep_rank = num_spare_experts_per_ep_rank
        self.num_local_experts = num_experts // num_ep_ranks
        self.num_spare_slots = self.num_ep_ranks * self.num_spare_experts_per_ep_rank
        self.donor_pattern, self.node_size = donor_pattern, node_size
        # donor_ranks[r]: the ranks whose experts rank r's slots may host; None (and donors None): unconstrained
        self.donor_ranks = echo_planner.donor_ranks(num_ep_ranks, donors, donor_pattern, node_size)
        self.donors = None
        self.group = group
        if self.donor_ranks is not None:
            R, me = self.num_ep_ranks, self.ep_rank
            self.donors = len(self.donor_ranks[0])
            self.from_ranks = list(self.donor_ranks[me])  # block o of the weights comes from my o-th donor
            # block o of my weights goes to the rank whose o-th donor I am (each offset is a permutation)
            self.to_ranks = [next(r for r in range(R) if self.donor_ranks[r][o] == me) for o in range(self.donors)]
            pos = [-1] * R
            for o, q in enumerate(self.from_ranks):
                pos[q] = o
            k = self.num_spare_experts_per_ep_rank
            # gradient rows in ascending source slot order (source rank, then slot): a fixed summation order, the
            # same as the all-to-all path's, so both give bit-identical sums
            order = sorted(range(self.donors), key=lambda o: self.to_ranks[o])
            self._grad_rows = [o * k + i for o in order for i in range(k)]
            self._consts = {
                "donor_pos": pos,  # [R]: block index of a donor rank, -1 otherwise
                "send_slots": [r * k + i for r in self.to_ranks for i in range(k)],  # slots of block o's receiver
                "from": self.from_ranks,
                "grad_src_slots": [self.to_ranks[o] * k + i for o in order for i in range(k)],
            }
            if backend is None:
                backend = PeerBackend(group)
        else:
            self._grad_rows = list(range(self.num_spare_slots))
            self._consts = {"grad_src_slots": list(range(self.num_spare_slots))}
        R, k, L, me = self.num_ep_ranks, self.num_spare_experts_per_ep_rank, self.num_local_experts, self.ep_rank
        # per home expert e (index E: no expert): its local index if it is ours (else 0), whether it is not ours,
        # and the exchange block of its rank (-1: none, or not a donor)
        ours = [me * L <= e < (me + 1) * L for e in range(num_experts)] + [False]
        if self.donor_ranks is None:
            block = [e // L for e in range(num_experts)] + [-1]
        else:
            block = [self._consts["donor_pos"][e // L] for e in range(num_experts)] + [-1]
        self._consts.update({
            "local_or0": [e - me * L if o else 0 for e, o in enumerate(ours)],
            "not_ours": ([not o for o in ours], torch.bool),
            "block_of": block,
            "ar_k": list(range(k)),
            "ar_B": list(range(self._blocks())),
            "zero": (0.0, torch.float32),  # the masked gradient value (0-dim: where() keeps the gradients' dtype)
        })
        self._backend = backend
        self._tables = {}  # (name, device) -> the constant index tensors above, copied once (prepare())
        if device is not None:
            self.prepare(device)
        if backend is None and dist.is_available() and dist.is_initialized():
            # resolve (and probe) the backend now, at setup time: the probe is a collective with a host sync and
            # must not run inside a CUDA-graph capture
            self._backend = default_backend(group)

    @property
    def backend(self) -> EchoBackend:
        if self._backend is None:
            self._backend = default_backend(self.group)
        return self._backend

    @property
    def donor_mask(self) -> Optional[torch.Tensor]:
        """``[R, R]`` bool for the planner (:func:`moe_graph.moe.echo_planner.gen_plan`'s ``donor_mask``), ``None`` when
        unconstrained."""
        return echo_planner.donor_mask(self.num_ep_ranks, self.donors, self.donor_pattern, self.node_size)

    def prepare(self, device) -> None:
        """Copies the constant index tables to ``device`` now (the constructor does it for its ``device``; a table
        missing at the first dispatch is copied then, which must not happen inside a CUDA-graph capture)."""
        for name in self._consts:
            self._const(name, device)

    def _const(self, name: str, device) -> torch.Tensor:
        device = torch.device(device)
        t = self._tables.get((name, device))
        if t is None:
            v = self._consts[name]
            values, dtype = v if isinstance(v, tuple) else (v, torch.int64)
            t = torch.tensor(values, dtype=dtype, device=device)
            self._tables[(name, device)] = t
        return t

    def _blocks(self) -> int:
        return self.num_ep_ranks if self.donor_ranks is None else self.donors

    # -- plan decoding (device tensors only) --
    def slot_home(self, offload_map: torch.Tensor) -> torch.Tensor:
        """``[S]`` int64: the home expert of each slot (the first true row of ``offload_map [E, S]``; ``E``: none)."""
        m = offload_map
        if m.dim() != 2 or m.shape != (self.num_experts, self.num_spare_slots):
            raise ValueError(
                f"offload_map must have shape [E, S] = [{self.num_experts}, {self.num_spare_slots}], got "
                f"{tuple(m.shape)}"
            )
        m = m.to(torch.bool)
        home = torch.argmax(m.to(torch.int8), dim=0)
        return torch.where(m.any(0), home, self.num_experts)

    def slot_homes(self, offload_map: torch.Tensor):
        """``(home_rank[S], home_local[S], has_home[S])`` from ``offload_map [E, S]`` (first true row)."""
        home = self.slot_home(offload_map)
        return home // self.num_local_experts, home % self.num_local_experts, home < self.num_experts

    def decode(self, slot_home: torch.Tensor) -> SlotPlan:
        """The :class:`SlotPlan` of ``slot_home [S]`` int64 (``E``: none; e.g. the second output of
        :func:`moe_graph.ops.reroute.reroute_indices`): a few gathers from constant tables, no host sync. Every rank
        decodes the same ``slot_home``."""
        if slot_home.shape != (self.num_spare_slots,):
            raise ValueError(f"slot_home must have shape [S] = [{self.num_spare_slots}], got {tuple(slot_home.shape)}")
        dev = slot_home.device
        B, k, R = self._blocks(), self.num_spare_experts_per_ep_rank, self.num_ep_ranks
        sent = slot_home if self.donor_ranks is None else slot_home.index_select(0, self._const("send_slots", dev))
        send_src = self._const("local_or0", dev).index_select(0, sent)
        send_off = self._const("not_ours", dev).index_select(0, sent)[:, None]
        if R == 1:  # nothing to exchange: our slots' copies come from our own experts
            return SlotPlan(slot_home, send_src, send_off, None, None, send_off.view(1, k, 1), send_src)
        mine = slot_home[self.ep_rank * k:(self.ep_rank + 1) * k]
        blk = self._const("block_of", dev).index_select(0, mine)  # [k] block of each of our slots' home rank
        recv_rows = torch.add(self._const("ar_k", dev), blk.clamp(min=0), alpha=k)
        grad_off = (blk[None, :] != self._const("ar_B", dev)[:, None])[:, :, None]
        if self.donor_ranks is None:  # summation row j is slot j
            target = send_src
        else:
            target = self._const("local_or0", dev).index_select(
                0, slot_home.index_select(0, self._const("grad_src_slots", dev)))
        return SlotPlan(slot_home, send_src, send_off, recv_rows, (blk < 0)[:, None], grad_off, target)

    def _plan(self, plan: Union[SlotPlan, torch.Tensor], device) -> SlotPlan:
        """``plan`` as a :class:`SlotPlan` on ``device``: decoded here when it is an ``offload_map [E, S]``."""
        if isinstance(plan, SlotPlan):
            return plan
        return self.decode(self.slot_home(plan.to(device)))

    def _check_weights(self, home_weights: Sequence[torch.Tensor]) -> None:
        if len(home_weights) == 0:
            raise ValueError("home_weights must hold at least one tensor [L, ...]")
        for i, w in enumerate(home_weights):
            if w.dim() < 1 or w.shape[0] != self.num_local_experts:
                raise ValueError(
                    f"home_weights[{i}] must stack this rank's L={self.num_local_experts} home experts on dim 0, got "
                    f"shape {tuple(w.shape)}"
                )
            if w.dtype != home_weights[0].dtype or w.device != home_weights[0].device:
                raise ValueError(
                    f"home_weights[{i}] must have the dtype/device of home_weights[0] ({home_weights[0].dtype}, "
                    f"{home_weights[0].device}), got {w.dtype}, {w.device}"
                )

    @staticmethod
    def unpack(flat: torch.Tensor, like: Sequence[torch.Tensor], n: int) -> List[torch.Tensor]:
        """Views of ``flat [n, N]`` (``N``: one expert's elements over all tensors of ``like``, in their order) as one
        ``[n, ...]`` tensor per tensor of ``like`` (whose expert shapes, ``shape[1:]``, they take): the layout of the
        spare copies :meth:`dispatch` writes into its ``out`` buffer."""
        out, off = [], 0
        for t in like:
            size = math.prod(t.shape[1:])
            out.append(flat[:, off : off + size].reshape((n,) + tuple(t.shape[1:])))
            off += size
        return out

    # -- forward: weights to spare slots --
    def dispatch(self, plan: Union[SlotPlan, torch.Tensor], home_weights: Sequence[torch.Tensor],
                 out: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
        """Copies of the home experts for this rank's ``k`` spare slots: one ``[k, ...]`` tensor per input tensor
        (zeros for an unused slot). ``plan``: a :class:`SlotPlan` (:meth:`decode`) or an ``offload_map [E, S]``.
        Collective: every rank of the group must call it with the same plan.

        Allocates exactly three ``N``-sized buffers (``N`` = one expert's elements over all tensors, in the weights'
        dtype): the send and receive blocks ``[B, k, N]`` (``B = R``, or ``w`` with donors; none for ``R = 1``) and
        the spare copies ``[k, N]`` (the returned tensors are views of it; ``out``: a contiguous ``[k, N]`` buffer of
        the weights' dtype to write them into instead, e.g. a static one); see :func:`echo_buffer_bytes`."""
        self._check_weights(home_weights)
        dev = home_weights[0].device
        p = self._plan(plan, dev)
        B, k, L = self._blocks(), self.num_spare_experts_per_ep_rank, self.num_local_experts
        sizes = [math.prod(w.shape[1:]) for w in home_weights]
        N = sum(sizes)
        dtype = home_weights[0].dtype
        if out is not None and (out.shape != (k, N) or out.dtype != dtype or out.device != dev
                                or not out.is_contiguous()):
            raise ValueError(f"out must be a contiguous [{k}, {N}] {dtype} tensor on {dev}, got "
                             f"{tuple(out.shape)} {out.dtype} {out.device}")
        single = self.num_ep_ranks == 1
        if single:  # our slots take our own experts: gather straight into the spare buffer
            send = torch.empty(k, N, dtype=dtype, device=dev) if out is None else out
        else:
            send = torch.empty(B * k, N, dtype=dtype, device=dev)
        off = 0
        for w, n in zip(home_weights, sizes):
            torch.index_select(w.detach().reshape(L, n), 0, p.send_src, out=send[:, off:off + n])
            off += n
        send.masked_fill_(p.send_off, 0)
        if single:
            return self.unpack(send, home_weights, k)
        if self.donor_ranks is None:
            recv = self.backend.exchange(send.view(B, k, N))  # recv[s, i]: rank s's copy for our slot i
        else:
            recv = self.backend.exchange(send.view(B, k, N), self.to_ranks, self.from_ranks)
        spare = torch.empty(k, N, dtype=dtype, device=dev) if out is None else out
        torch.index_select(recv.view(B * k, N), 0, p.recv_rows, out=spare)
        spare.masked_fill_(p.recv_off, 0)
        return self.unpack(spare, home_weights, k)

    # -- backward: spare-slot gradients home --
    def exchange_grads(self, plan: Union[SlotPlan, torch.Tensor], spare_grads: Sequence[torch.Tensor]):
        """Sends the spare slots' gradients to their home ranks. Returns ``(recv [B*k, N], target [B*k])``: the
        received rows and, for the ``j``-th row in summation order (ascending source slot; row
        ``self._grad_rows[j]`` of ``recv``), the local home expert it adds into. A row that is not ours arrives as
        zeros (its sender masks it) and targets expert 0. Allocates the send and receive blocks ``[B, k, N]`` in
        fp32 (or the gradients' wider dtype); with ``R = 1`` only the send block, which is also the result."""
        self._check_grads(spare_grads)
        dev = spare_grads[0].device
        g0 = spare_grads[0].dtype
        dtype = torch.float32 if g0.is_floating_point and g0 != torch.float64 else g0  # fp32 or wider
        p = self._plan(plan, dev)
        B, k = self._blocks(), self.num_spare_experts_per_ep_rank
        sizes = [math.prod(g.shape[1:]) for g in spare_grads]
        N = sum(sizes)
        send = torch.empty(B, k, N, dtype=dtype, device=dev)
        zero = self._const("zero", dev)
        off = 0
        for g, n in zip(spare_grads, sizes):
            torch.where(p.grad_off, zero, g.reshape(1, k, n), out=send[:, :, off:off + n])
            off += n
        if self.num_ep_ranks == 1:
            recv = send.view(k, N)
        elif self.donor_ranks is None:
            # row s*k+i: slot s*k+i's gradient (if ours)
            recv = self.backend.exchange(send).reshape(self.num_spare_slots, N)
        else:  # row o*k+i: slot i of to_ranks[o]
            recv = self.backend.exchange(send, self.from_ranks, self.to_ranks).reshape(B * k, N)
        return recv, p.grad_target

    def _check_grads(self, spare_grads: Sequence[torch.Tensor]) -> None:
        if len(spare_grads) == 0:
            raise ValueError("spare_grads must hold at least one tensor [k, ...]")
        for i, g in enumerate(spare_grads):
            if not isinstance(g, torch.Tensor) or g.dim() < 1 or g.shape[0] != self.num_spare_experts_per_ep_rank:
                k = self.num_spare_experts_per_ep_rank
                raise ValueError(f"spare_grads[{i}] must have k={k} slots on dim 0, got shape "
                                 f"{tuple(getattr(g, 'shape', ()))}")
            if g.device != spare_grads[0].device:
                raise ValueError(f"spare_grads[{i}] must be on {spare_grads[0].device}, got {g.device}")

    def aggregate_grads(
        self,
        offload_map: torch.Tensor,
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

        Every input and output is validated before anything is written (a bad one raises and leaves all gradients
        unchanged). Returns the tensors added into. Collective, like :meth:`dispatch`.

        ``offload_map``: a :class:`SlotPlan` (:meth:`decode`) or the ``[E, S]`` map.

        Traffic ``O(B*k*N)``, independent of ``L``: each received row is added straight into its home expert's rows
        of the gradient (one single-row ``index_add_`` per row and tensor, a row not ours is zeros added to expert
        0). Deterministic on every device: the rows are added one at a time in ascending source slot order (a static
        loop, no atomics racing on a row); two runs give identical bits, and the all-to-all and the donor (peer)
        exchange give the same sums.
        """
        self._check_grads(spare_grads)
        if out is None:
            if home_params is None:
                raise ValueError("aggregate_grads needs home_params or out")
            if len(home_params) != len(spare_grads):
                raise ValueError(f"home_params must hold one tensor per spare gradient ({len(spare_grads)}), got "
                                 f"{len(home_params)}")
            targets = [getattr(p, "main_grad", None) for p in home_params]
            shapes = [tuple(p.shape) for p in home_params]
        else:
            if len(out) != len(spare_grads):
                raise ValueError(f"out must hold one tensor per spare gradient ({len(spare_grads)}), got {len(out)}")
            targets = list(out)
            shapes = [tuple(o.shape) for o in out]
        for i, (shape, g) in enumerate(zip(shapes, spare_grads)):
            if len(shape) < 1 or shape[0] != self.num_local_experts or tuple(shape[1:]) != tuple(g.shape[1:]):
                expert_shape = ", ".join(map(str, g.shape[1:]))
                raise ValueError(f"gradient tensor {i} must have shape [L={self.num_local_experts}, {expert_shape}] "
                                 f"(the spare gradient's expert shape), got {list(shape)}")
        for i, t in enumerate(targets):
            # (inference tensors cannot exist inside a compiled graph: dynamo cannot ask, and need not)
            if t is not None and (t.device != spare_grads[0].device
                                  or (not torch.compiler.is_compiling() and t.is_inference())):
                raise ValueError(f"gradient tensor {i} must be a writable tensor on {spare_grads[0].device}")
        recv, target = self.exchange_grads(offload_map, spare_grads)
        if out is None:  # only now create missing .grad tensors: nothing is written before validation
            out = []
            for p, t in zip(home_params, targets):
                if t is None:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    t = p.grad
                out.append(t)
        off = 0
        for o in out:
            n = math.prod(o.shape[1:])
            src = recv[:, off:off + n]
            src = src if src.dtype == o.dtype else src.to(o.dtype)
            for j, r in enumerate(self._grad_rows):  # fixed order, one row per add: no atomics racing on a row
                o.index_add_(0, target[j:j + 1], src[r:r + 1].view((1,) + tuple(o.shape[1:])))
            off += n
        return list(out)


class _DispatchSpare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dispatcher, plan, spare, *home_weights):
        ctx.dispatcher = dispatcher
        ctx.shapes = [(w.shape, w.dtype) for w in home_weights]
        ctx.params = home_weights  # to find main_grad in backward
        ctx.device = home_weights[0].device
        # decoded integer tables, never written in place: kept as an attribute (a SlotPlan is no tensor to save)
        ctx.plan = dispatcher._plan(plan, ctx.device)
        if spare is not None:  # a plan reused within the iteration: the copies are already here (no exchange)
            return tuple(t.view_as(t) for t in spare)
        return tuple(dispatcher.dispatch(ctx.plan, home_weights))

    @staticmethod
    def backward(ctx, *spare_grads):
        d: EchoExpertDispatcher = ctx.dispatcher
        grads = [
            g if g is not None
            else torch.zeros((d.num_spare_experts_per_ep_rank,) + tuple(s[1:]), dtype=dt, device=ctx.device)
            for g, (s, dt) in zip(spare_grads, ctx.shapes)
        ]
        use_main = [getattr(p, "main_grad", None) is not None for p in ctx.params]
        outs = [
            p.main_grad if m else torch.zeros(s, dtype=torch.promote_types(dt, torch.float32), device=g.device)
            for p, m, (s, dt), g in zip(ctx.params, use_main, ctx.shapes, grads)
        ]
        d.aggregate_grads(ctx.plan, grads, out=outs)
        home = [None if m else o.to(dt) for m, o, (_, dt) in zip(use_main, outs, ctx.shapes)]
        return (None, None, None, *home)


def dispatch_spare_weights(
    dispatcher: EchoExpertDispatcher, offload_map: Union[SlotPlan, torch.Tensor], home_weights: Sequence[torch.Tensor],
    spare: Optional[Sequence[torch.Tensor]] = None,
) -> List[torch.Tensor]:
    """Autograd-aware :meth:`EchoExpertDispatcher.dispatch`: returns the ``[k, ...]`` spare weights; in backward
    their gradients go home (collective) and are added to the home weights' gradients, or straight into
    ``main_grad`` for weights that have one (then autograd gets no gradient for that weight).

    ``spare``: copies already dispatched for this plan (a plan reused for all microbatches of an iteration): they
    are returned as views, nothing is exchanged in forward; the backward still sends the gradients home."""
    return list(_DispatchSpare.apply(dispatcher, offload_map, None if spare is None else tuple(spare),
                                     *home_weights))


class _EchoGroupedGemmFn(torch.autograd.Function):
    """``y = grouped(a_e @ W_e^T + b_e)`` over ``L`` home experts (``home_weight [L, N, K]``, a parameter with
    ``main_grad``; optional ``home_bias [L, N]``) followed by ``k`` spare slots (``spare_weight [k, N, K]``,
    ``spare_bias [k, N]``: detached copies from :meth:`EchoExpertDispatcher.dispatch`).

    Backward: dgrad through all ``L + k`` experts; wgrad in one :func:`~moe_graph.ops.grouped_gemm.grouped_gemm_wgrad`
    call into ``main_grad[0..L)`` (accumulate) and ``spare_grad[0..k)`` (overwrite) per ``accumulate_mask``; the
    bias gradient (per-expert row sums) of the spare slots goes into ``spare_bias_grad``; the spare slots' gradients
    are then sent home (one exchange for weight and bias) and added into ``main_grad`` and the home bias gradient
    (a collective: every EP rank runs it, in the same order). The weight's returned gradient is a cached zero
    tensor, with ``grad_added_to_main_grad = True``, as the DDP hook expects; the bias gradient is returned to
    autograd, as :class:`moe_graph.GroupedLinear` (and TransformerEngine) return it.

    ``accumulate_mask`` and the spare gradient buffers are static buffers shared across microbatches: kept as ctx
    attributes (not saved tensors) so that rewriting them in one backward does not trip the version check of
    another microbatch's saved tensors.
    """

    @staticmethod
    def forward(ctx, a, m_splits, home_weight, spare_weight, offload_map, dispatcher, accumulate_mask,
                spare_grad, home_bias, spare_bias, spare_bias_grad, recipe, xq):
        bias = torch.cat([home_bias, spare_bias.to(home_bias.dtype)]) if home_bias is not None else None
        ctx.recipe = recipe
        if recipe is None:
            out = grouped_gemm(a, list(home_weight.unbind(0)) + list(spare_weight.unbind(0)), m_splits, bias=bias)
        else:  # FP8: the L + k weights quantized together (per expert), x's columnwise copy kept for the wgrad
            with torch.no_grad():
                wq = _fp8.quantize_weight(torch.cat([home_weight.detach(), spare_weight.to(home_weight.dtype)]),
                                          recipe)
            out, xt = fp8_forward(a, m_splits, recipe, wq, bias, True, xq)
        ctx.dispatcher = dispatcher
        ctx.accumulate_mask = accumulate_mask
        ctx.spare_grad, ctx.spare_bias_grad = spare_grad, spare_bias_grad
        ctx.bias_dtype = home_bias.dtype if home_bias is not None else None
        ctx.home_param = home_weight  # main_grad's owner: a saved tensor unpacks without it under saved_tensors_hooks
        ctx.plan = dispatcher._plan(offload_map, a.device)  # decoded integer tables, never written in place
        ctx.a_dtype = a.dtype
        if recipe is None:
            ctx.save_for_backward(a, m_splits, home_weight, spare_weight)
        else:  # the quantized copies only: the weights' dgrad copy and a's columnwise copy
            ctx.save_for_backward(None, m_splits, home_weight, None, wq[2], wq[3], *xt)
        return out

    @staticmethod
    def backward(ctx, dy):
        a, m_splits, home, spare, *fp8_saved = ctx.saved_tensors
        dy = dy.contiguous()
        da = dw = db = None
        recipe = ctx.recipe
        if ctx.needs_input_grad[0]:
            if recipe is None:
                da = grouped_gemm(dy, list(home.unbind(0)) + list(spare.unbind(0)), m_splits, trans_b=False)
            else:
                da = fp8_dgrad(dy, m_splits, recipe, fp8_saved[0], fp8_saved[1], ctx.a_dtype)
        if ctx.needs_input_grad[2] or ctx.needs_input_grad[8]:
            main_grad = ctx.home_param.main_grad
            if recipe is None:
                outs = list(main_grad.unbind(0)) + list(ctx.spare_grad.unbind(0))
                grouped_gemm_wgrad(a, dy, m_splits, out=outs, accumulate=ctx.accumulate_mask)
            else:  # the accumulate mask's rule: home experts add into main_grad, spare slots overwrite theirs
                L = main_grad.shape[0]
                g = fp8_wgrad(dy, m_splits, recipe, fp8_saved[2:])  # fp32 [L + k, N, K]
                main_grad.add_(g[:L].to(main_grad.dtype))
                ctx.spare_grad.copy_(g[L:])
            spare_grads, targets = [ctx.spare_grad], [main_grad]
            if ctx.bias_dtype is not None:
                L = main_grad.shape[0]
                bias_grads = grouped_bias_grad(dy, m_splits)  # [L + k, N], fp32 (fp64 for fp64)
                db = bias_grads[:L].clone()
                ctx.spare_bias_grad.copy_(bias_grads[L:])
                spare_grads.append(ctx.spare_bias_grad)
                targets.append(db)
            ctx.dispatcher.aggregate_grads(ctx.plan, spare_grads, out=targets)
            ctx.home_param.grad_added_to_main_grad = True
            dw = zero_wgrad_placeholder(home)
            if db is not None:
                db = db.to(ctx.bias_dtype)
        return da, None, dw, None, None, None, None, None, db, None, None, None, None


def echo_grouped_gemm(
    a: torch.Tensor,
    home_weight: torch.Tensor,
    spare_weight: torch.Tensor,
    m_splits: torch.Tensor,
    dispatcher: EchoExpertDispatcher,
    offload_map: Union[SlotPlan, torch.Tensor],
    accumulate_mask: torch.Tensor,
    spare_grad: torch.Tensor,
    *,
    home_bias: Optional[torch.Tensor] = None,
    spare_bias: Optional[torch.Tensor] = None,
    spare_bias_grad: Optional[torch.Tensor] = None,
    recipe=None,
) -> torch.Tensor:
    """Grouped GEMM over home + spare experts with the weight gradient fused into ``main_grad``.

    Args:
        a: ``[M, K]`` rows grouped by local expert (``L`` home, then ``k`` spare slots).
        home_weight: ``[L, N, K]`` parameter with ``main_grad`` (same shape; fp32 or the weight dtype).
        spare_weight: ``[k, N, K]`` copies from :meth:`EchoExpertDispatcher.dispatch` (no autograd).
        m_splits: ``[L + k]`` device tensor.
        dispatcher, offload_map: the echo weight dispatcher and this forward's plan (a :class:`SlotPlan` from
            :meth:`EchoExpertDispatcher.decode`, or the ``[E, S]`` map, decoded here).
        accumulate_mask: ``[L + k]`` bool on the device, :func:`wgrad_accumulate_mask` (built once).
        spare_grad: ``[k, N, K]`` buffer of ``main_grad``'s dtype (:func:`spare_grad_buffers`), overwritten in
            every backward.
        home_bias, spare_bias, spare_bias_grad: all three or none: the ``[L, N]`` bias parameter (added in the
            GEMM epilogue; its gradient goes to autograd), its ``[k, N]`` spare copies and their ``[k, N]``
            gradient buffer (fp32), overwritten in every backward.
        recipe: a ``moe_graph.fp8.Recipe``: the three GEMMs in FP8 (``moe_graph.grouped_linear.fp8_forward`` /
            ``fp8_dgrad`` / ``fp8_wgrad``: the ``L + k`` weights quantized at every forward, ``a``'s columnwise
            copy saved); the fp32 wgrad of the home experts is added into ``main_grad`` in one add, the spare
            slots' written into ``spare_grad``, then sent home as above. ``a`` may then be a
            ``moe_graph.fp8.QuantizedRows`` (FP8 dispatch: its rowwise copy is used as is).

    Returns ``[M, N]``. Backward is collective over the EP group (the spare gradients' exchange).
    """
    L, k = home_weight.shape[0], spare_weight.shape[0]
    xq = None
    if recipe is not None:
        a, xq = split_quantized(a, recipe)
    m_splits = as_splits(m_splits, a.device)
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
    if (home_bias is None) != (spare_bias is None) or (home_bias is None) != (spare_bias_grad is None):
        raise ValueError("echo_grouped_gemm: home_bias, spare_bias and spare_bias_grad go together")
    if home_bias is not None:
        N = home_weight.shape[1]
        if home_bias.shape != (L, N) or spare_bias.shape != (k, N) or spare_bias_grad.shape != (k, N):
            raise ValueError(f"echo_grouped_gemm: home_bias must be [{L}, {N}], spare_bias and spare_bias_grad "
                             f"[{k}, {N}], got {tuple(home_bias.shape)}, {tuple(spare_bias.shape)}, "
                             f"{tuple(spare_bias_grad.shape)}")
        spare_bias = spare_bias.detach()
    return _EchoGroupedGemmFn.apply(a, m_splits, home_weight, spare_weight.detach(), offload_map,
                                    dispatcher, accumulate_mask, spare_grad, home_bias, spare_bias, spare_bias_grad,
                                    recipe, xq)
