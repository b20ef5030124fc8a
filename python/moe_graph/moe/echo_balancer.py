"""``EchoBalancer``: echo for one MoE layer. From the all-gathered per-rank counts it plans which home experts the
spare slots host (:mod:`moe_graph.moe.echo_planner`), reroutes this rank's top-k routes to those slots
(:func:`moe_graph.ops.reroute.reroute_indices`: only the indices change, the probabilities stay), decodes the plan
once for the weight dispatch and the gradient aggregation (:class:`moe_graph.moe.echo.SlotPlan`), and provides the
spare weight copies (:class:`moe_graph.moe.echo.EchoExpertDispatcher`).

Plan modes: ``"microbatch"`` plans and moves weights in every forward. ``"iteration"`` plans and moves them only in
the forward of an iteration's first microbatch and keeps the plan and the copies in static buffers; the later
microbatches (``reuse=True``) keep that placement and rescale its token amounts to their own counts
(:func:`moe_graph.moe.echo_planner.reuse_plan`). All buffers are written in place (graph-safe).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

from moe_graph.moe import echo_planner
from moe_graph.moe.echo import PLAN_MODES, EchoExpertDispatcher, LocalBackend, SlotPlan, echo_buffer_bytes
from moe_graph.ops.reroute import reroute_indices

__all__ = ["EchoBalancer"]


class EchoBalancer(nn.Module):
    """Plans, reroutes and holds the spare copies for ``num_spare_experts_per_ep_rank`` (``k >= 1``) slots per rank.

    Args:
        num_experts, num_ep_ranks, ep_rank, num_spare_experts_per_ep_rank: ``E``, ``R``, this rank, ``k``.
        assignment: the planner's assignment (:data:`moe_graph.moe.echo_planner.ASSIGNMENTS`).
        plan_mode: ``"microbatch"`` or ``"iteration"`` (module docstring).
        donors: ``w`` donor ranks per rank (:class:`moe_graph.moe.echo.EchoExpertDispatcher`; ignored for ``R = 1``).
        group: the EP process group. expert_numel, dtype: one expert's weight elements and their dtype (the
            static spare-copy buffer of ``"iteration"``). device: of every buffer.
    """

    def __init__(self, num_experts: int, num_ep_ranks: int, ep_rank: int, num_spare_experts_per_ep_rank: int, *,
                 assignment: str = "auto", plan_mode: str = "microbatch", donors: Optional[int] = None, group=None,
                 expert_numel: int = 0, dtype: Optional[torch.dtype] = None, device=None):
        super().__init__()
        if plan_mode not in PLAN_MODES:
            raise ValueError(f"plan_mode must be one of {PLAN_MODES}, got {plan_mode!r}")
        R, k = num_ep_ranks, num_spare_experts_per_ep_rank
        self.num_experts, self.num_ep_ranks, self.ep_rank = num_experts, R, ep_rank
        self.num_spare_experts_per_ep_rank = k
        self.assignment, self.plan_mode = assignment, plan_mode
        self.dispatcher = EchoExpertDispatcher(num_experts, R, ep_rank, k, backend=LocalBackend() if R == 1 else None,
                                               group=group, donors=donors if R > 1 else None, device=device)
        mask = self.dispatcher.donor_mask
        self.register_buffer("donor_mask", mask.to(device) if mask is not None else None, persistent=False)
        if plan_mode == "iteration":  # the iteration's plan and spare copies (written in place)
            for name, shape, dt in (("ref_home_to_spare", (num_experts, R * k), torch.int64),
                                    ("ref_expert_loads", (num_experts,), torch.int64),
                                    ("spare_weights", (k, expert_numel), dtype)):
                self.register_buffer(name, torch.zeros(shape, dtype=dt, device=device), persistent=False)
        if R > 1:
            _ = self.dispatcher.backend  # probe the process group now, never during capture

    def plan(self, counts: torch.Tensor, indices: torch.Tensor, valid: Optional[torch.Tensor] = None,
             reuse: bool = False) -> Tuple[torch.Tensor, SlotPlan, torch.Tensor]:
        """``counts [R, E]`` (all-gathered), this rank's top-k ``indices [T, K]`` (home experts; ``valid``: optional
        ``[T, K]`` bool) -> ``(indices [T, K]`` in ``[0, E+S)``, the decoded plan, ``home_to_spare [E, S]`` int64).
        The routes' probabilities are unchanged (a moved route keeps its place in its token's row). ``reuse``: keep
        the iteration's placement (``"iteration"`` mode, not its first microbatch)."""
        if reuse:
            home_to_spare, allocation = echo_planner.reuse_plan(counts, self.ref_home_to_spare, self.ref_expert_loads)
            placement = self.ref_home_to_spare  # the slots keep their experts even where no token moves now
        else:
            home_to_spare, allocation = echo_planner.gen_plan(counts, self.num_spare_experts_per_ep_rank,
                                                              self.assignment, donor_mask=self.donor_mask)
            placement = home_to_spare
            if self.plan_mode == "iteration":
                with torch.no_grad():
                    self.ref_home_to_spare.copy_(home_to_spare)
                    self.ref_expert_loads.copy_(counts.sum(0))
        new_indices, slot_home = reroute_indices(indices, allocation[self.ep_rank], placement, valid)
        return new_indices, self.dispatcher.decode(slot_home), home_to_spare

    def load_after(self, load_before: torch.Tensor, home_to_spare: torch.Tensor) -> torch.Tensor:
        """``[R]`` tokens each EP rank receives with the plan: ``load_before`` (:func:`echo_planner.rank_loads`)
        plus what its slots take minus what its home experts send away (``moved[a, b]``: tokens of rank ``a``'s
        experts planned into rank ``b``'s slots)."""
        R, k = self.num_ep_ranks, self.num_spare_experts_per_ep_rank
        moved = home_to_spare.view(R, self.num_experts // R, R, k).sum((1, 3))
        return load_before + (moved - moved.t()).sum(0)

    def iteration_spares(self, plan: SlotPlan, home_weights: Sequence[torch.Tensor], reuse: bool
                         ) -> Optional[List[torch.Tensor]]:
        """``"iteration"`` mode: the iteration's spare copies, one ``[k, ...]`` view of :attr:`spare_weights` per
        tensor of ``home_weights`` (the first microbatch dispatches them into it, a collective; ``reuse`` only
        reads). ``None`` in ``"microbatch"`` mode (the experts dispatch in every forward)."""
        if self.plan_mode != "iteration":
            return None
        if not reuse:
            return self.dispatcher.dispatch(plan, home_weights, out=self.spare_weights)
        return self.dispatcher.unpack(self.spare_weights, home_weights, self.num_spare_experts_per_ep_rank)

    def buffer_bytes(self, expert_numel: int, dtype: torch.dtype, num_microbatches: int = 1) -> dict:
        """:func:`moe_graph.moe.echo.echo_buffer_bytes` of this layer's configuration."""
        return echo_buffer_bytes(self.num_experts, self.num_ep_ranks, self.num_spare_experts_per_ep_rank,
                                 self.dispatcher.donors, expert_numel, dtype, num_microbatches=num_microbatches)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, ep={self.num_ep_ranks}, spare={self.num_spare_experts_per_ep_rank}, "
                f"assignment={self.assignment}, plan_mode={self.plan_mode}, donors={self.dispatcher.donors}")
