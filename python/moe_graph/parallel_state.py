"""Model-parallel rank groups: which ranks talk to which, for dense and expert (MoE) layers.

Every rank of a ``world_size``-rank job owns one coordinate per parallel axis. The axes are

* ``tp``: tensor parallel, ``cp``: context parallel, ``ep``: expert parallel,
* ``dp``: data parallel, ``pp``: pipeline parallel,

and an *order* string such as ``"tp-cp-ep-dp-pp"`` fixes how a rank's coordinates map onto its global
rank: the first axis varies fastest (neighbouring ranks, ideally on one node, share everything but
their ``tp`` coordinate), the last slowest::

    global_rank = tp_rank + cp_rank*tp + dp_rank*tp*cp + pp_rank*tp*cp*dp      (dense, ep = 1)

A *group* for a set of axes (a token like ``"dp"`` or ``"tp-pp"``) collects the ranks that agree on
every other axis. :func:`generate_masked_orthogonal_rank_groups` enumerates them: the masked axes
(the ones in the token) run inside a group, the unmasked axes number the groups.

MoE folding: attention layers use the dense generator (``tp, cp, dp, pp``, ``ep = 1``) and expert
layers a second generator over the same ranks with ``tp := etp``, ``ep``, ``dp := edp``, ``cp = 1``::

    world_size = tp * cp * dp * pp = etp * ep * edp * pp

so e.g. CP8 attention and EP8 experts fit on 8 GPUs instead of 64. The rank lists equal those of
Megatron-core (``RankGenerator`` / ``generate_masked_orthogonal_rank_groups``) for the same sizes
and order.

Example (16 ranks, TP4 PP2 -> DP2; experts ETP1 EP4 -> EDP2)::

    >>> dense = RankGenerator(tp=4, ep=1, dp=2, pp=2, cp=1)
    >>> dense.get_ranks("dp")
    [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    >>> dense.get_ranks("pp")[:2]
    [[0, 8], [1, 9]]
    >>> expert = RankGenerator(tp=1, ep=4, dp=2, pp=2, cp=1)
    >>> expert.get_ranks("ep")
    [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]

:func:`initialize_model_parallel` turns these lists into ``torch.distributed`` process groups and
the ``get_*`` accessors return the calling rank's group, rank (index inside the group) and world
size (group length) for each kind:

=====================  ==========================  ==============================================
kind                   generator token             accessors
=====================  ==========================  ==============================================
tensor parallel        dense ``tp``                ``get_tensor_model_parallel_{group,rank,world_size}``
pipeline parallel      dense ``pp``                ``get_pipeline_model_parallel_*``, ``is_pipeline_{first,last}_stage``
data parallel          dense ``dp`` / ``dp-cp``    ``get_data_parallel_*(with_context_parallel=False)``
context parallel       dense ``cp``                ``get_context_parallel_*``
model parallel         dense ``tp-pp``             ``get_model_parallel_group``
expert parallel        expert ``ep``               ``get_expert_model_parallel_*``
expert tensor par.     expert ``tp``               ``get_expert_tensor_parallel_*``
expert data parallel   expert ``dp``               ``get_expert_data_parallel_*``
embeddings             first/last of each ``pp``   ``get_embedding_group``, ``get_position_embedding_group``
=====================  ==========================  ==============================================

Accessors raise ``RuntimeError`` before :func:`initialize_model_parallel` (or after
:func:`destroy_model_parallel`). Run
``python -m moe_graph.parallel_state --world-size 16 --tp 4 --pp 2 --ep 4 --etp 1`` to print the groups.
"""

from __future__ import annotations

import argparse
import sys
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Sequence, Tuple

AXES: Tuple[str, ...] = ("tp", "cp", "ep", "dp", "pp")
DEFAULT_ORDER = "tp-cp-ep-dp-pp"


# --------------------------------------------------------------------------------------------------
# Pure rank arithmetic (no torch.distributed)
# --------------------------------------------------------------------------------------------------


def _is_pos_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _prefix_products(sizes: Sequence[int]) -> List[int]:
    """``[1, s0, s0*s1, ...]`` (length ``len(sizes) + 1``): the stride of each axis."""
    out = [1]
    for s in sizes:
        out.append(out[-1] * s)
    return out


def _digits(index: int, sizes: Sequence[int]) -> List[int]:
    """Mixed-radix digits of ``index`` (least significant first) for the given axis sizes."""
    out = []
    for s in sizes:
        out.append(index % s)
        index //= s
    if index != 0:
        raise ValueError(f"index out of range for sizes {list(sizes)}")
    return out


def generate_masked_orthogonal_rank_groups(
    world_size: int, parallel_size: Sequence[int], mask: Sequence[bool]
) -> List[List[int]]:
    """All groups of the axes selected by ``mask``.

    Args:
        world_size: number of ranks; must equal ``prod(parallel_size)``.
        parallel_size: size of each axis, fastest-varying first (the order string's order).
        mask: ``mask[i]`` is True when axis ``i`` runs *inside* a group.

    Returns:
        ``world_size // prod(masked sizes)`` lists of ``prod(masked sizes)`` global ranks. Group
        ``g`` holds the ranks whose unmasked coordinates are the mixed-radix digits of ``g``
        (unmasked axes in order, first fastest); inside a group the masked coordinates count up the
        same way. A rank's global number is ``sum(coord[i] * prod(parallel_size[:i]))``.

    Example: sizes ``[tp, dp, pp] = [2, 3, 4]`` with only ``dp`` masked gives 8 groups of 3,
    ``[[0, 2, 4], [1, 3, 5], [6, 8, 10], ..., [19, 21, 23]]``.
    """
    if len(parallel_size) != len(mask):
        raise ValueError(f"parallel_size {list(parallel_size)} and mask {list(mask)} differ in length")
    if any(not _is_pos_int(v) for v in parallel_size):
        raise ValueError(f"parallel_size must hold positive ints, got {list(parallel_size)}")
    total = _prefix_products(parallel_size)[-1]
    if total != world_size:
        raise ValueError(
            f"world_size {world_size} != product of parallel sizes {list(parallel_size)} = {total}"
        )
    strides = _prefix_products(parallel_size)[:-1]
    in_sizes = [s for s, m in zip(parallel_size, mask) if m]
    in_strides = [d for d, m in zip(strides, mask) if m]
    out_sizes = [s for s, m in zip(parallel_size, mask) if not m]
    out_strides = [d for d, m in zip(strides, mask) if not m]
    group_size = _prefix_products(in_sizes)[-1]
    # offsets of the members relative to the group's first rank
    member_offsets = [
        sum(c * d for c, d in zip(_digits(i, in_sizes), in_strides)) for i in range(group_size)
    ]
    groups = []
    for g in range(world_size // group_size):
        base = sum(c * d for c, d in zip(_digits(g, out_sizes), out_strides))
        groups.append([base + off for off in member_offsets])
    return groups


def _parse_tokens(text: str, what: str) -> List[str]:
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{what} must be a non-empty string like 'tp-dp', got {text!r}")
    tokens = [t.strip().lower() for t in text.split("-")]
    unknown = [t for t in tokens if t not in AXES]
    if unknown:
        raise ValueError(f"unknown parallel axis {unknown} in {what} {text!r}; known axes: {list(AXES)}")
    dups = sorted({t for t in tokens if tokens.count(t) > 1})
    if dups:
        raise ValueError(f"axis {dups} repeated in {what} {text!r}")
    return tokens


class RankGenerator:
    """Rank groups of one orthogonal decomposition ``tp x cp x ep x dp x pp`` of the ranks.

    Args:
        tp, ep, dp, pp, cp: axis sizes (positive ints). At most one of ``ep`` and ``cp`` may exceed
            1: the dense generator carries ``cp`` (``ep = 1``), the expert generator carries ``ep``
            (``cp = 1``, ``tp`` = expert-tensor-parallel size, ``dp`` = expert-data-parallel size).
        order: axes joined by ``-``, fastest-varying first. Axes of size 1 may be left out (they are
            appended); an axis of size > 1 must appear.
        rank_offset: added to every rank (for a generator covering ranks
            ``[rank_offset, rank_offset + world_size)``).

    Attributes: ``world_size`` (product of the sizes), ``order`` (completed order string),
    ``ordered_size`` (sizes in that order), ``sizes`` (``{"tp": .., ...}``).

    Example::

        >>> RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-pp-dp").get_ranks("pp")
        [[0, 2], [1, 3], [4, 6], [5, 7]]
    """

    def __init__(
        self,
        tp: int,
        ep: int,
        dp: int,
        pp: int,
        cp: int,
        order: str = DEFAULT_ORDER,
        rank_offset: int = 0,
    ) -> None:
        sizes = {"tp": tp, "cp": cp, "ep": ep, "dp": dp, "pp": pp}
        for name, s in sizes.items():
            if not isinstance(s, int) or isinstance(s, bool) or s < 1:
                raise ValueError(f"parallel size {name}={s!r} must be a positive int")
        if not isinstance(rank_offset, int) or rank_offset < 0:
            raise ValueError(f"rank_offset must be a non-negative int, got {rank_offset!r}")
        if ep > 1 and cp > 1:
            raise ValueError(
                f"ep={ep} and cp={cp} cannot both exceed 1 in one RankGenerator: cp belongs to the "
                "dense generator (ep=1), ep to the expert generator (cp=1)"
            )
        tokens = _parse_tokens(order, "order")
        for name in AXES:
            if name not in tokens:
                if sizes[name] != 1:
                    raise ValueError(
                        f"order {order!r} does not name axis {name!r}, whose size is {sizes[name]}"
                    )
                tokens.append(name)
        self.sizes: Dict[str, int] = sizes
        self.tp, self.cp, self.ep, self.dp, self.pp = tp, cp, ep, dp, pp
        self.order = "-".join(tokens)
        self.ordered_size = [sizes[t] for t in tokens]
        self.rank_offset = rank_offset
        self.world_size = _prefix_products(self.ordered_size)[-1]

    def get_mask(self, token: str) -> List[bool]:
        """``[axis in token for axis in self.order]``."""
        wanted = _parse_tokens(token, "token")
        return [t in wanted for t in self.order.split("-")]

    def get_ranks(self, token: str) -> List[List[int]]:
        """All groups for the axes in ``token`` (e.g. ``"tp"``, ``"dp-cp"``, ``"tp-ep-pp"``).

        The axes' order inside ``token`` does not matter; the generator's order decides.
        Returns ``world_size // prod(sizes in token)`` lists of global ranks (``rank_offset`` added).
        """
        groups = generate_masked_orthogonal_rank_groups(
            self.world_size, self.ordered_size, self.get_mask(token)
        )
        if self.rank_offset:
            groups = [[r + self.rank_offset for r in g] for g in groups]
        return groups

    def coordinates(self, rank: int) -> Dict[str, int]:
        """Axis coordinates of global ``rank``, e.g. ``{"tp": 1, "cp": 0, "ep": 0, "dp": 1, "pp": 0}``."""
        if not isinstance(rank, int) or isinstance(rank, bool):
            raise ValueError(f"rank must be an int, got {rank!r}")
        local = rank - self.rank_offset
        if not 0 <= local < self.world_size:
            raise ValueError(
                f"rank {rank} outside [{self.rank_offset}, {self.rank_offset + self.world_size})"
            )
        digits = _digits(local, self.ordered_size)
        return {t: d for t, d in zip(self.order.split("-"), digits)}

    def __repr__(self) -> str:
        return (
            f"RankGenerator(tp={self.tp}, ep={self.ep}, dp={self.dp}, pp={self.pp}, cp={self.cp}, "
            f"order={self.order!r}, rank_offset={self.rank_offset})"
        )


def make_rank_generators(
    world_size: int,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: Optional[int] = None,
    order: str = DEFAULT_ORDER,
    rank_offset: int = 0,
) -> Tuple[RankGenerator, RankGenerator]:
    """The (dense, expert) generators for a job, with the checks Megatron applies.

    ``dp = world_size / (tp*pp*cp)``; ``edp = world_size / (etp*ep*pp)``; ``etp`` defaults to ``tp``.
    Raises ``ValueError`` naming the sizes when they do not divide ``world_size``, when the order is
    not pp-last while ``pp > 1`` and ``dp != edp``, or when the two generators' pipeline groups differ.

    Example::

        >>> dense, expert = make_rank_generators(16, 4, 2, expert_model_parallel_size=4,
        ...                                      expert_tensor_parallel_size=1)
        >>> (dense.dp, expert.dp)
        (2, 2)
    """
    tp, pp, cp, ep = (
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        context_parallel_size,
        expert_model_parallel_size,
    )
    etp = tp if expert_tensor_parallel_size is None else expert_tensor_parallel_size
    for name, v in (("world_size", world_size), ("tensor_model_parallel_size", tp),
                    ("pipeline_model_parallel_size", pp), ("context_parallel_size", cp),
                    ("expert_model_parallel_size", ep), ("expert_tensor_parallel_size", etp)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    model_size = tp * pp * cp
    if world_size % model_size:
        raise ValueError(
            f"world_size {world_size} is not divisible by tp*pp*cp = {tp}*{pp}*{cp} = {model_size}"
        )
    expert_size = etp * ep * pp
    if world_size % expert_size:
        raise ValueError(
            f"world_size {world_size} is not divisible by etp*ep*pp = {etp}*{ep}*{pp} = {expert_size}"
        )
    dp, edp = world_size // model_size, world_size // expert_size
    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order, rank_offset=rank_offset)
    expert = RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order=order, rank_offset=rank_offset)
    # the user's order (the generators append omitted size-1 axes after it, so dense.order may not end with pp)
    if not (_parse_tokens(order, "order")[-1] == "pp" or pp == 1 or dp == edp):
        raise ValueError(
            f"order {order!r} does not put pp last; then attention and expert layers need the same "
            f"data-parallel size, but dp={dp} (tp={tp}, cp={cp}, pp={pp}) and edp={edp} "
            f"(etp={etp}, ep={ep}, pp={pp})"
        )
    if dense.get_ranks("pp") != expert.get_ranks("pp"):
        raise ValueError(
            f"pipeline groups differ between dense ({dense.get_ranks('pp')}) and expert "
            f"({expert.get_ranks('pp')}) layers for order {order!r}"
        )
    return dense, expert


# Which generator and token make each group kind, in the order the groups are created.
# (Megatron-core's creation order; gloo duplicates and the embedding groups are handled separately.)
GROUP_SPECS: Tuple[Tuple[str, str, str], ...] = (
    ("dp_cp", "dense", "dp-cp"),       # data parallel with context parallel (dense grad reduce)
    ("dp", "dense", "dp"),             # data parallel without cp
    ("cp", "dense", "cp"),
    ("mp", "dense", "tp-pp"),          # model parallel
    ("tp", "dense", "tp"),
    ("pp", "dense", "pp"),
    ("tp_dp_cp", "dense", "tp-dp-cp"),
    ("tp_dp", "dense", "tp-dp"),
    ("tp_cp", "dense", "tp-cp"),
    ("ep", "expert", "ep"),
    ("etp", "expert", "tp"),           # expert tensor parallel
    ("etp_ep", "expert", "tp-ep"),     # expert tensor and model parallel
    ("etp_ep_pp", "expert", "tp-ep-pp"),
    ("edp", "expert", "dp"),           # expert data parallel
)


def default_embedding_ranks(pp_ranks: List[int]) -> List[int]:
    """First and last pipeline stage (where tied word embeddings live); one rank when pp == 1."""
    return [pp_ranks[0]] if len(pp_ranks) == 1 else [pp_ranks[0], pp_ranks[-1]]


def default_position_embedding_ranks(pp_ranks: List[int]) -> List[int]:
    """The first pipeline stage."""
    return [pp_ranks[0]]


def build_rank_groups(
    world_size: int,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: Optional[int] = None,
    order: str = DEFAULT_ORDER,
    get_embedding_ranks: Optional[Callable[[List[int]], List[int]]] = None,
    get_position_embedding_ranks: Optional[Callable[[List[int]], List[int]]] = None,
) -> Dict[str, List[List[int]]]:
    """Every group list of the job, keyed by kind (see ``GROUP_SPECS``; plus ``"embd"``, ``"pos_embd"``).

    This is exactly what :func:`initialize_model_parallel` turns into process groups, computed
    without ``torch.distributed``. Example: ``build_rank_groups(8, 2, 2)["pp"] ==
    [[0, 4], [1, 5], [2, 6], [3, 7]]``.
    """
    dense, expert = make_rank_generators(
        world_size,
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        context_parallel_size,
        expert_model_parallel_size,
        expert_tensor_parallel_size,
        order,
    )
    gens = {"dense": dense, "expert": expert}
    out = {kind: gens[gen].get_ranks(token) for kind, gen, token in GROUP_SPECS}
    for name, fn in (("get_embedding_ranks", get_embedding_ranks),
                     ("get_position_embedding_ranks", get_position_embedding_ranks)):
        if fn is not None and not callable(fn):
            raise ValueError(f"{name} must be None or a function of a pipeline group's ranks, got {fn!r}")
    emb = get_embedding_ranks or default_embedding_ranks
    pos = get_position_embedding_ranks or default_position_embedding_ranks
    for kind, name, fn in (("embd", "get_embedding_ranks", emb), ("pos_embd", "get_position_embedding_ranks", pos)):
        out[kind] = []
        for g in out["pp"]:
            got = fn(list(g))
            if (not isinstance(got, (list, tuple)) or not got
                    or any(isinstance(r, bool) or not isinstance(r, int) or r not in g for r in got)
                    or len(set(got)) != len(got)):
                raise ValueError(f"{name}({list(g)}) must return a non-empty list of distinct ranks of that "
                                 f"pipeline group, got {got!r}")
            out[kind].append(list(got))
    return out


# --------------------------------------------------------------------------------------------------
# torch.distributed process groups
# --------------------------------------------------------------------------------------------------

_GROUPS: Dict[str, Tuple[object, List[int]]] = {}  # kind -> (process group, global ranks)
_GLOO_GROUPS: Dict[str, object] = {}
_SIZES: Dict[str, int] = {}
_VIRTUAL_PP_RANK: Optional[int] = None
_VIRTUAL_PP_SIZE: Optional[int] = None


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: Optional[int] = None,
    order: str = DEFAULT_ORDER,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    *,
    get_embedding_ranks: Optional[Callable[[List[int]], List[int]]] = None,
    get_position_embedding_ranks: Optional[Callable[[List[int]], List[int]]] = None,
    create_gloo_process_groups: bool = False,
    distributed_timeout_minutes: Optional[float] = None,
    backend: Optional[str] = None,
) -> None:
    """Create the process groups of every kind for the current ``torch.distributed`` job.

    Collective over the whole world: every rank calls ``new_group`` for every group, in the same
    order (kinds in ``GROUP_SPECS`` order, then per pipeline group its embedding groups). A rank
    list that recurs under another kind (e.g. ``dp_cp`` == ``dp`` when ``cp == 1``) reuses the same
    process group object.

    Args:
        tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size: dense axes;
            the data-parallel size is ``world_size // (tp * pp * cp)``.
        expert_model_parallel_size, expert_tensor_parallel_size: expert axes (``etp`` defaults to
            ``tp``); expert-data-parallel size is ``world_size // (etp * ep * pp)``.
        order: axis order, fastest first (default ``"tp-cp-ep-dp-pp"``).
        virtual_pipeline_model_parallel_size: model chunks per pipeline rank (interleaved
            schedule); requires ``pp > 1``. The virtual rank starts at 0.
        get_embedding_ranks / get_position_embedding_ranks: map a pipeline group to the ranks of
            its (position) embedding group (defaults: first+last stage / first stage).
        create_gloo_process_groups: also create gloo copies of the dp, dp-cp and expert-dp groups.
        distributed_timeout_minutes: timeout of the new groups (default: torch's).
        backend: backend of the new groups (default: the world's).

    Raises ``RuntimeError`` if ``torch.distributed`` is not initialized or the groups already
    exist, ``ValueError`` for inconsistent sizes or orders (before any group is created).
    """
    import torch.distributed as dist

    global _VIRTUAL_PP_RANK, _VIRTUAL_PP_SIZE
    for name, v in (("tensor_model_parallel_size", tensor_model_parallel_size),
                    ("pipeline_model_parallel_size", pipeline_model_parallel_size),
                    ("context_parallel_size", context_parallel_size),
                    ("expert_model_parallel_size", expert_model_parallel_size)):
        if not _is_pos_int(v):
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if expert_tensor_parallel_size is not None and not _is_pos_int(expert_tensor_parallel_size):
        raise ValueError(f"expert_tensor_parallel_size must be a positive int or None, got {expert_tensor_parallel_size!r}")
    t = distributed_timeout_minutes
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0 or t == float("inf")):
        raise ValueError(f"distributed_timeout_minutes must be None or a finite number > 0, got {t!r}")
    if backend is not None and not isinstance(backend, str):
        raise ValueError(f"backend must be None or a backend name such as 'nccl' or 'gloo', got {backend!r}")
    if virtual_pipeline_model_parallel_size is not None:
        v = virtual_pipeline_model_parallel_size
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"virtual_pipeline_model_parallel_size must be a positive int or None, got {v!r}")
        if pipeline_model_parallel_size <= 1:
            raise ValueError(
                f"virtual_pipeline_model_parallel_size={v} (interleaved schedule) needs "
                f"pipeline_model_parallel_size > 1, got {pipeline_model_parallel_size}"
            )
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("initialize_model_parallel needs torch.distributed.init_process_group() first")
    if _GROUPS:
        raise RuntimeError("model parallel groups are already initialized; call destroy_model_parallel() first")
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    groups = build_rank_groups(
        world_size,
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        context_parallel_size,
        expert_model_parallel_size,
        expert_tensor_parallel_size,
        order,
        get_embedding_ranks,
        get_position_embedding_ranks,
    )
    kwargs = {}
    if distributed_timeout_minutes is not None:
        kwargs["timeout"] = timedelta(minutes=distributed_timeout_minutes)
    if backend is not None:
        kwargs["backend"] = backend
    cache: Dict[Tuple[str, Tuple[int, ...]], object] = {}

    def new_group(ranks: List[int], gloo: bool = False):
        key = ("gloo" if gloo else "default", tuple(ranks))
        if key not in cache:
            kw = dict(kwargs)
            if gloo:
                kw["backend"] = "gloo"
            cache[key] = dist.new_group(ranks, **kw)
        return cache[key]

    mine: Dict[str, Tuple[object, List[int]]] = {}
    gloo_mine: Dict[str, object] = {}
    for kind, _, _ in GROUP_SPECS:
        for ranks in groups[kind]:
            g = new_group(ranks)
            if create_gloo_process_groups and kind in ("dp_cp", "dp", "edp"):
                gg = new_group(ranks, gloo=True)
                if rank in ranks:
                    gloo_mine[kind] = gg
            if rank in ranks:
                mine[kind] = (g, list(ranks))
            if kind == "pp":  # embedding groups hang off each pipeline group, as in Megatron
                idx = groups["pp"].index(ranks)
                for ekind in ("embd", "pos_embd"):
                    eranks = groups[ekind][idx]
                    eg = new_group(eranks)
                    if rank in eranks:
                        mine[ekind] = (eg, list(eranks))
    _GROUPS.update(mine)
    _GLOO_GROUPS.update(gloo_mine)
    etp = tensor_model_parallel_size if expert_tensor_parallel_size is None else expert_tensor_parallel_size
    _SIZES.update(
        tp=tensor_model_parallel_size,
        pp=pipeline_model_parallel_size,
        cp=context_parallel_size,
        ep=expert_model_parallel_size,
        etp=etp,
        world=world_size,
    )
    if virtual_pipeline_model_parallel_size is not None:
        _VIRTUAL_PP_RANK = 0
        _VIRTUAL_PP_SIZE = virtual_pipeline_model_parallel_size


def model_parallel_is_initialized() -> bool:
    """True between :func:`initialize_model_parallel` and :func:`destroy_model_parallel`."""
    return bool(_GROUPS)


def destroy_model_parallel() -> None:
    """Forget all groups and sizes (the process groups themselves are left to torch.distributed)."""
    global _VIRTUAL_PP_RANK, _VIRTUAL_PP_SIZE
    _GROUPS.clear()
    _GLOO_GROUPS.clear()
    _SIZES.clear()
    _VIRTUAL_PP_RANK = None
    _VIRTUAL_PP_SIZE = None


def _entry(kind: str) -> Tuple[object, List[int]]:
    if not _GROUPS:
        raise RuntimeError("model parallel groups are not initialized; call initialize_model_parallel() first")
    if kind not in _GROUPS:
        raise RuntimeError(f"this rank is not a member of any {kind!r} group")
    return _GROUPS[kind]


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _group(kind):
    return _entry(kind)[0]


def _ranks(kind) -> List[int]:
    return list(_entry(kind)[1])


def _rank_in(kind) -> int:
    return _entry(kind)[1].index(_global_rank())


def _size(kind) -> int:
    return len(_entry(kind)[1])


def get_rank_groups(kind: str) -> List[int]:
    """Global ranks of this rank's group of ``kind`` (a key of ``GROUP_SPECS`` or embd/pos_embd)."""
    kinds = [k for k, _, _ in GROUP_SPECS] + ["embd", "pos_embd"]
    if kind not in kinds:
        raise ValueError(f"kind must be one of {kinds}, got {kind!r}")
    return _ranks(kind)


# tensor parallel
def get_tensor_model_parallel_group():
    return _group("tp")


def get_tensor_model_parallel_rank() -> int:
    return _rank_in("tp")


def get_tensor_model_parallel_world_size() -> int:
    return _size("tp")


def get_tensor_model_parallel_global_ranks() -> List[int]:
    return _ranks("tp")


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of tp-rank 0 of this rank's tensor-parallel group."""
    return _ranks("tp")[0]


# pipeline parallel
def get_pipeline_model_parallel_group():
    return _group("pp")


def get_pipeline_model_parallel_rank() -> int:
    return _rank_in("pp")


def get_pipeline_model_parallel_world_size() -> int:
    return _size("pp")


def get_pipeline_model_parallel_global_ranks() -> List[int]:
    return _ranks("pp")


def get_pipeline_model_parallel_first_rank() -> int:
    return _ranks("pp")[0]


def get_pipeline_model_parallel_last_rank() -> int:
    return _ranks("pp")[-1]


def get_pipeline_model_parallel_next_rank() -> int:
    """Global rank of the next stage (wraps around from the last stage to the first)."""
    r = _ranks("pp")
    return r[(_rank_in("pp") + 1) % len(r)]


def get_pipeline_model_parallel_prev_rank() -> int:
    """Global rank of the previous stage (wraps around from the first stage to the last)."""
    r = _ranks("pp")
    return r[(_rank_in("pp") - 1) % len(r)]


def is_pipeline_first_stage(ignore_virtual: bool = True, vp_stage: Optional[int] = None) -> bool:
    """True on pipeline rank 0 (and, with ``ignore_virtual=False`` under interleaving, model chunk 0).

    ``vp_stage`` defaults to the current virtual pipeline rank.
    """
    if not ignore_virtual and _VIRTUAL_PP_SIZE is not None:
        vp = _VIRTUAL_PP_RANK if vp_stage is None else vp_stage
        if vp != 0:
            return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = True, vp_stage: Optional[int] = None) -> bool:
    """True on the last pipeline rank (and, with ``ignore_virtual=False``, the last model chunk)."""
    if not ignore_virtual and _VIRTUAL_PP_SIZE is not None:
        vp = _VIRTUAL_PP_RANK if vp_stage is None else vp_stage
        if vp != _VIRTUAL_PP_SIZE - 1:
            return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def get_virtual_pipeline_model_parallel_rank() -> Optional[int]:
    return _VIRTUAL_PP_RANK


def set_virtual_pipeline_model_parallel_rank(rank: Optional[int]) -> None:
    global _VIRTUAL_PP_RANK
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 0):
        raise ValueError(f"virtual pipeline rank must be None or an int >= 0, got {rank!r}")
    if rank is not None and _VIRTUAL_PP_SIZE is not None and not 0 <= rank < _VIRTUAL_PP_SIZE:
        raise ValueError(f"virtual pipeline rank {rank} outside [0, {_VIRTUAL_PP_SIZE})")
    _VIRTUAL_PP_RANK = rank


def get_virtual_pipeline_model_parallel_world_size() -> Optional[int]:
    return _VIRTUAL_PP_SIZE


def set_virtual_pipeline_model_parallel_world_size(size: Optional[int]) -> None:
    global _VIRTUAL_PP_SIZE
    if size is not None and not _is_pos_int(size):
        raise ValueError(f"virtual pipeline world size must be None or a positive int, got {size!r}")
    _VIRTUAL_PP_SIZE = size


# data / context parallel
def get_data_parallel_group(with_context_parallel: bool = False):
    return _group("dp_cp" if with_context_parallel else "dp")


def get_data_parallel_group_gloo(with_context_parallel: bool = False):
    kind = "dp_cp" if with_context_parallel else "dp"
    _entry(kind)
    if kind not in _GLOO_GROUPS:
        raise RuntimeError("gloo groups were not created; pass create_gloo_process_groups=True")
    return _GLOO_GROUPS[kind]


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    return _rank_in("dp_cp" if with_context_parallel else "dp")


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    return _size("dp_cp" if with_context_parallel else "dp")


def get_data_parallel_global_ranks(with_context_parallel: bool = False) -> List[int]:
    return _ranks("dp_cp" if with_context_parallel else "dp")


def get_data_parallel_src_rank(with_context_parallel: bool = False) -> int:
    return get_data_parallel_global_ranks(with_context_parallel)[0]


def get_context_parallel_group():
    return _group("cp")


def get_context_parallel_rank() -> int:
    return _rank_in("cp")


def get_context_parallel_world_size() -> int:
    return _size("cp")


def get_context_parallel_global_ranks() -> List[int]:
    return _ranks("cp")


def get_tensor_and_context_parallel_group():
    return _group("tp_cp")


def get_tensor_and_context_parallel_rank() -> int:
    return _rank_in("tp_cp")


def get_tensor_and_context_parallel_world_size() -> int:
    return _size("tp_cp")


def get_tensor_and_data_parallel_group(with_context_parallel: bool = False):
    return _group("tp_dp_cp" if with_context_parallel else "tp_dp")


# model parallel (tp x pp)
def get_model_parallel_group():
    return _group("mp")


def get_model_parallel_global_ranks() -> List[int]:
    return _ranks("mp")


def get_model_parallel_src_rank() -> int:
    return _ranks("mp")[0]


# embeddings
def get_embedding_group():
    return _group("embd")


def get_position_embedding_group():
    return _group("pos_embd")


def is_rank_in_embedding_group(ignore_virtual: bool = True, vp_stage: Optional[int] = None) -> bool:
    """True if this rank holds a (tied) word embedding; with ``ignore_virtual=False`` only on the
    model chunk that has it (first chunk of the first stage, last chunk of the last stage)."""
    if "embd" not in _GROUPS:
        return False
    ranks = _GROUPS["embd"][1]
    me = _global_rank()
    if me not in ranks:
        return False
    if ignore_virtual:
        return True
    if me == ranks[0]:
        return is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if me == ranks[-1]:
        return is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    return True


def is_rank_in_position_embedding_group() -> bool:
    return "pos_embd" in _GROUPS and _global_rank() in _GROUPS["pos_embd"][1]


# experts
def get_expert_model_parallel_group():
    return _group("ep")


def get_expert_model_parallel_rank() -> int:
    return _rank_in("ep")


def get_expert_model_parallel_world_size() -> int:
    return _size("ep")


def get_expert_model_parallel_global_ranks() -> List[int]:
    return _ranks("ep")


def get_expert_tensor_parallel_group():
    return _group("etp")


def get_expert_tensor_parallel_rank() -> int:
    return _rank_in("etp")


def get_expert_tensor_parallel_world_size() -> int:
    return _size("etp")


def get_expert_tensor_and_model_parallel_group():
    return _group("etp_ep")


def get_expert_tensor_and_model_parallel_rank() -> int:
    return _rank_in("etp_ep")


def get_expert_tensor_and_model_parallel_world_size() -> int:
    return _size("etp_ep")


def get_expert_tensor_model_pipeline_parallel_group():
    return _group("etp_ep_pp")


def get_expert_data_parallel_group():
    return _group("edp")


def get_expert_data_parallel_group_gloo():
    _entry("edp")
    if "edp" not in _GLOO_GROUPS:
        raise RuntimeError("gloo groups were not created; pass create_gloo_process_groups=True")
    return _GLOO_GROUPS["edp"]


def get_expert_data_parallel_rank() -> int:
    return _rank_in("edp")


def get_expert_data_parallel_world_size() -> int:
    return _size("edp")


def get_expert_data_parallel_global_ranks() -> List[int]:
    return _ranks("edp")


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------

_CLI_DENSE = (("tp", "tp"), ("cp", "cp"), ("dp", "dp"), ("pp", "pp"), ("dp-cp", "dp-cp"), ("tp-pp", "tp-pp"))
_CLI_EXPERT = (("etp", "tp"), ("ep", "ep"), ("edp", "dp"), ("pp", "pp"), ("etp-ep", "tp-ep"))


def format_rank_groups(
    world_size: int,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    etp: Optional[int] = None,
    order: str = DEFAULT_ORDER,
) -> str:
    """The text the CLI prints: sizes, then one line per group kind with all its rank lists.

    Example (``format_rank_groups(8, tp=2, pp=2)``, first lines)::

        world_size=8 order=tp-cp-ep-dp-pp
        dense  generator: tp=2 cp=1 dp=2 pp=2
          tp     [[0, 1], [2, 3], [4, 5], [6, 7]]
    """
    dense, expert = make_rank_generators(world_size, tp, pp, cp, ep, etp, order)
    lines = [f"world_size={world_size} order={dense.order}"]
    lines.append(f"dense  generator: tp={dense.tp} cp={dense.cp} dp={dense.dp} pp={dense.pp}")
    for label, token in _CLI_DENSE:
        lines.append(f"  {label:<6} {dense.get_ranks(token)}")
    lines.append(f"expert generator: etp={expert.tp} ep={expert.ep} edp={expert.dp} pp={expert.pp}")
    for label, token in _CLI_EXPERT:
        lines.append(f"  {label:<6} {expert.get_ranks(token)}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m moe_graph.parallel_state --world-size 16 --tp 4 --pp 2 [--cp N] [--ep N --etp N] [--order O]``."""
    p = argparse.ArgumentParser(
        prog="python -m moe_graph.parallel_state",
        description="Print the dense and expert rank groups of a model-parallel layout.",
    )
    p.add_argument("--world-size", "--world_size", dest="world_size", type=int, required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--etp", type=int, default=None, help="expert tensor parallel size (default: tp)")
    p.add_argument("--order", default=DEFAULT_ORDER)
    args = p.parse_args(argv)
    try:
        text = format_rank_groups(args.world_size, args.tp, args.pp, args.cp, args.ep, args.etp, args.order)
    except ValueError as e:
        p.error(str(e))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
