"""Token rerouting for echo experts: ``reroute_tokens`` over the native op ``torch.ops.moe_graph.reroute_tokens``
(C++ on CPU, CUDA kernels on GPU), its fake (meta) implementation and autograd (through ``probs``), and
``reroute_indices``, the same rule on the router's top-k indices (``torch.ops.moe_graph.reroute_indices``: no
probabilities involved, so no autograd).

Semantics (also in ``csrc/reroute/reroute.h``): slot ``j`` hosts the home expert ``e`` with
``offload_map[e, j]`` (the first one if several: that also sets the device error flag). For each home
expert, its slots in ascending order take its routed tokens in ascending token order: the first
``tokens_to_spare[j1]`` go to ``j1``, the next ``tokens_to_spare[j2]`` to ``j2``, ... A moved route leaves column
``e`` (map ``False``, probability ``+0``) for column ``E + j`` with the bit-identical probability; every token keeps
exactly its number of routes. Requests beyond the routed tokens are clamped and set ``kErrRerouteOverAsk``
(``moe_graph.check_errors()`` reports it); negative requests count as 0. No host sync, capturable.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch._subclasses.fake_tensor import FakeTensor

from moe_graph.ops._lib import has_kernel

__all__ = ["reroute_tokens", "reroute_indices", "native_available", "echo_best_fit", "best_fit_available", "echo_plan", "plan_available",
           "MAX_TOTAL_TOKENS", "real_host_values"]

_OP = "moe_graph::reroute_tokens"
_IDX = "moe_graph::reroute_indices"
_BF = "moe_graph::echo_best_fit"
_PLAN = "moe_graph::echo_plan"
_PLAN_MODES = {"auto": 0, "greedy": 1, "best_fit": 2}

# Largest total token count (counts.sum()) a plan accepts: the allocation multiplies two counts (int64), so both stay
# below 2**31. Above it: ValueError for CPU counts; on CUDA the plan moves nothing (all counts read as 0) and the
# device error flag's "inconsistent plan input" bit is set (moe_graph.check_errors() reports it): raising would sync.
MAX_TOTAL_TOKENS = 2**31 - 1



def real_host_values(t: torch.Tensor) -> bool:
    """True when ``t``'s values can be read on the host without tracing or faking (eager CPU)."""
    if isinstance(t, FakeTensor) or torch.compiler.is_compiling():
        return False
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is None


@torch.compiler.assume_constant_result  # fixed per process: traced once by torch.compile
def native_available() -> bool:
    """True when the loaded ``moe_graph._C`` has the reroute op (CPU kernel at least)."""
    return has_kernel(_OP, "cpu")


@torch.compiler.assume_constant_result  # fixed per process: traced once by torch.compile
def best_fit_available(device_type: str = "cpu") -> bool:
    """True when the loaded extension has ``echo_best_fit`` for ``device_type`` ("cpu" or "cuda")."""
    return has_kernel(_BF, device_type)


def echo_best_fit(counts: torch.Tensor, num_spare_experts_per_ep_rank: int = 1, donor_mask=None) -> torch.Tensor:
    """Native best-fit placement: ``counts [R, E]`` int32/int64 -> ``home_to_spare [E, R*k]`` int64, identical to
    the pure-torch ``moe_graph.moe.echo_planner.best_fit_assignment`` (the ``echo_plan`` kernel in best-fit mode: one
    launch instead of rounds of tiny kernels; with a restrictive donor mask, the level search). ``donor_mask``:
    optional ``[R, R]`` bool (``moe_graph.moe.echo_planner.donor_mask``)."""
    _check_total(counts)
    return torch.ops.moe_graph.echo_best_fit(counts, int(num_spare_experts_per_ep_rank), donor_mask)


@torch.compiler.assume_constant_result  # fixed per process: traced once by torch.compile
def plan_available(device_type: str = "cpu") -> bool:
    """True when the loaded extension has ``echo_plan`` for ``device_type`` ("cpu" or "cuda")."""
    return has_kernel(_PLAN, device_type)


def echo_plan(counts: torch.Tensor, num_spare_experts_per_ep_rank: int = 1, assignment: str = "auto", donor_mask=None):
    """The whole echo plan in one native step: ``counts [R, E]`` -> ``(home_to_spare [E, R*k],
    allocation [R, R*k])`` int64, identical to ``moe_graph.moe.echo_planner.gen_assignment(counts, k, assignment)`` followed by
    ``gen_allocation``. One kernel launch on CUDA (one block of 16 warps, state in a global workspace), no host sync;
    cost in ``csrc/reroute/echo_plan_impl.h``. ``donor_mask``: optional ``[R, R]`` bool
    (``moe_graph.moe.echo_planner.donor_mask``): a slot on rank ``r`` hosts only experts of ranks ``q`` with ``mask[r, q]``."""
    if assignment not in _PLAN_MODES:
        raise ValueError(f"assignment must be one of {tuple(_PLAN_MODES)}, got {assignment!r}")
    _check_total(counts)
    return torch.ops.moe_graph.echo_plan(counts, int(num_spare_experts_per_ep_rank), _PLAN_MODES[assignment],
                                         donor_mask)


def _check_total(counts) -> None:
    """The planner's documented count limit (``moe_graph.moe.echo_planner.MAX_TOTAL_TOKENS``) for eager CPU counts; device
    counts go through ``moe_graph.moe.echo_planner.gen_plan``, which flags them instead (no sync)."""
    if isinstance(counts, torch.Tensor) and counts.device.type == "cpu" and counts.numel() and \
            not counts.dtype.is_floating_point and real_host_values(counts):
        total = int(counts.to(torch.int64).clamp(min=0).sum())
        if total > MAX_TOTAL_TOKENS:
            raise ValueError(f"counts: the total token count {total} exceeds MAX_TOTAL_TOKENS={MAX_TOTAL_TOKENS} "
                             f"(int64 products of two counts would overflow)")


def reroute_tokens(
    routing_map: torch.Tensor,
    probs: torch.Tensor,
    tokens_to_spare: torch.Tensor,
    offload_map: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Move routed tokens of home experts to their spare slots.

    Args:
        routing_map: ``[T, E]`` bool, this rank's routes.
        probs: ``[T, E]`` float32/bf16/fp16/float64 routing probabilities.
        tokens_to_spare: ``[S]`` int32/int64 on the same device, tokens this rank sends to each spare slot (its
            row of the planner's allocation).
        offload_map: ``[E, S]`` bool: slot ``j`` hosts home expert ``e`` (the planner's ``home_to_spare > 0``).

    Returns:
        ``(rerouted_routing_map [T, E+S] bool, rerouted_probs [T, E+S])``.

    Example::

        routing_map = [[1, 0], [1, 1], [0, 1], [1, 0]]   (T=4, E=2), one slot hosting expert 0, tokens_to_spare=[2]
        -> tokens 0 and 1 (the lowest routed to expert 0) move to column 2:
           [[0, 0, 1], [0, 1, 1], [0, 1, 0], [1, 0, 0]]
    """
    return torch.ops.moe_graph.reroute_tokens(routing_map, probs, tokens_to_spare, offload_map)


def reroute_indices(
    indices: torch.Tensor,
    tokens_to_spare: torch.Tensor,
    offload_map: torch.Tensor,
    valid: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Move routes of home experts to their spare slots, on top-k indices: the rule of :func:`reroute_tokens` (the
    same routes move to the same slots), without a dense ``[T, E]`` map. The probabilities stay as they are: a
    route keeps its position in its token's row, only its column changes.

    Args:
        indices: ``[T, K]`` int64, the home expert of each route (a token routes to an expert at most once).
        tokens_to_spare: ``[S]`` int32/int64, tokens this rank sends to each spare slot (its row of the planner's
            allocation).
        offload_map: ``[E, S]`` bool, or the planner's int32/int64 ``home_to_spare`` read as ``> 0``: slot ``j``
            hosts home expert ``e``.
        valid: optional ``[T, K]`` bool; an invalid route (or one outside ``[0, E)``) is neither counted nor moved.

    Returns:
        ``(indices [T, K] int64 in [0, E+S), slot_home [S] int64)``: a moved route's entry becomes ``E + j``;
        ``slot_home[j]`` is the expert slot ``j`` hosts (``E``: none).

    Example::

        indices = [[0], [1], [1], [0], [0]] (T=5, K=1, E=2), one slot hosting expert 0, tokens_to_spare=[2]
        -> tokens 0 and 3 (the first two routed to expert 0) move to column 2: [[2], [1], [1], [2], [0]],
           slot_home = [0]
    """
    return torch.ops.moe_graph.reroute_indices(indices, tokens_to_spare, offload_map, valid)


def _register() -> None:
    if not native_available():  # pragma: no cover - a build without the op
        return

    @torch.library.register_fake(_OP)
    def _(routing_map, probs, tokens_to_spare, offload_map):
        torch._check(routing_map.dim() == 2, lambda: "reroute_tokens: routing_map must be a 2-D tensor [T, E]")
        torch._check(offload_map.dim() == 2, lambda: "reroute_tokens: offload_map must be [E, S]")
        T, E = routing_map.shape
        S = offload_map.shape[1]
        return (
            routing_map.new_empty((T, E + S), dtype=torch.bool),
            probs.new_empty((T, E + S)),
        )

    def _setup_context(ctx, inputs, output):
        routing_map, _probs, _tts, offload_map = inputs
        ctx.save_for_backward(routing_map, offload_map, output[0])

    def _backward(ctx, grad_map, grad_probs):
        # The op permutes probability entries: a moved (t, e) now lives in (t, E + j) with home(j) = e.
        routing_map, offload_map, out_map = ctx.saved_tensors
        if grad_probs is None:
            return None, None, None, None
        T, E = routing_map.shape
        S = offload_map.shape[1]
        zero = torch.zeros((), dtype=grad_probs.dtype, device=grad_probs.device)
        moved = routing_map & ~out_map[:, :E]
        base = torch.where(moved, zero, grad_probs[:, :E])
        home = torch.argmax(offload_map.to(torch.int8), dim=0)  # [S] first true
        spare_routed = out_map[:, E:]
        tgt = torch.where(spare_routed, home[None, :], E)  # sink column E for unused entries
        full = torch.cat([base, base.new_zeros(T, 1)], dim=1)
        full = full.scatter(1, tgt, torch.where(spare_routed, grad_probs[:, E:], zero))
        return None, full[:, :E], None, None

    torch.library.register_autograd(_OP, _backward, setup_context=_setup_context)

    if has_kernel(_IDX, "cpu"):

        @torch.library.register_fake(_IDX)
        def _(indices, tokens_to_spare, offload_map, valid=None):
            torch._check(indices.dim() == 2, lambda: "reroute_indices: indices must be a 2-D tensor [T, K]")
            torch._check(offload_map.dim() == 2, lambda: "reroute_indices: offload_map must be [E, S]")
            return torch.empty_like(indices), indices.new_empty((offload_map.shape[1],))

    if best_fit_available():

        @torch.library.register_fake(_BF)
        def _(counts, num_spare_experts_per_ep_rank, donor_mask=None):
            R, E = counts.shape
            return counts.new_empty((E, R * num_spare_experts_per_ep_rank), dtype=torch.int64)

    if plan_available():

        @torch.library.register_fake(_PLAN)
        def _(counts, num_spare_experts_per_ep_rank, mode, donor_mask=None):
            R, E = counts.shape
            S = R * num_spare_experts_per_ep_rank
            return counts.new_empty((E, S), dtype=torch.int64), counts.new_empty((R, S), dtype=torch.int64)


_register()
