"""FP8 expert weights quantized once per optimizer step and all-gathered in FP8 (Megatron-core's
``--fp8-param-gather``): ``DistributedOptimizer(..., fp8_param_gather=recipe)``.

Which weights: every 3-D parameter marked ``fp8_grouped_weight`` (the single ``[E, N, K]`` weight of a
``moe_graph.GroupedLinear(single_grouped_weight=True)``, hence ``MoELayer``'s ``fc1`` / ``fc2``): the weights the
recipe quantizes in the FP8 grouped GEMMs. Each gets ``param.fp8_gathered``, a :class:`Fp8GatheredWeight` holding
static buffers with both copies the GEMMs read (``q``, ``scale`` for the forward, ``qt``, ``st`` for dgrad), which
``grouped_linear.fp8_forward`` / ``fp8_dgrad`` use instead of quantizing the 16-bit weight at every microbatch.

After the update, per bucket holding such weights (``Fp8BucketGather.sync``):

1. each rank quantizes its shard of every FP8 weight from its 16-bit values (the ``model_param`` shard, i.e. the
   fp32 master rounded to the parameter dtype): the scale of a tile needs the tile's amax, and a ZeRO-1 shard may
   cut a 128 x 128 tile (or an expert, for per-tensor scales), so every rank first writes the amax of its part of
   every tile it touches into a small fp32 grid (one value per tile, ``numel / 16384`` for blockwise) and one
   all-reduce (MAX) over the data-parallel group completes it; the scales follow on every rank from the complete
   grid (TransformerEngine's rule, ``csrc/fp8/fp8_math.h``), so they are never sent;
2. one all-gather moves, per rank, the FP8 bytes of its shard of the FP8 weights and the 16-bit bytes of the rest of
   its shard (biases, padding): 1 byte per FP8-weight element instead of 2 (bf16) or 4 (fp32);
3. each rank copies the gathered bytes into the weights' FP8 buffers (and the other params' 16-bit storage) and
   writes the dgrad copy (the exact transpose, square tiles).

The result equals ``moe_graph.fp8.quantize_weight`` of the fully gathered 16-bit weight bit for bit (tested in
``tests/test_fp8_param_gather.py`` with shards that cut tiles). What is not gathered: the 16-bit values of the FP8
weights outside this rank's shard (stale after a step): :meth:`DistributedOptimizer.gather_16bit_params` runs the
ordinary 16-bit all-gather (before a model checkpoint save, a 16-bit evaluation, or any other reader of those
weights). Recipes: "blockwise" (128 x 128 weight tiles) and "tensor" (one scale per expert); "mxfp8" is refused: its
dgrad copy (32 x 1 blocks along N) cannot be derived from the rowwise bytes, so gathering both copies moves more
than the 16-bit weight (Megatron-core gathers MXFP8 parameters in bf16 for the same reason). Echo spare slots are
refused (they copy the 16-bit home weights). No host sync, static buffers made at construction: capturable.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe_graph.distributed.buffers import all_gather_tensor
from moe_graph.ops import fp8 as _fp8

__all__ = ["Fp8GatheredWeight", "Fp8BucketGather", "fp8_weight_tiles", "scale_from_amax", "gather_bytes"]


def fp8_weight_tiles(recipe: "_fp8.Recipe", shape: Tuple[int, int, int]) -> Tuple[int, int]:
    """``(tile_rows, tile_cols)`` of the recipe's weight quantization of an ``[E, N, K]`` weight."""
    if recipe.kind == "blockwise":
        return 128, 128
    if recipe.kind == "tensor":
        return max(shape[1], 1), max(shape[2], 1)
    raise NotImplementedError(
        f"fp8_param_gather: recipe {recipe.kind!r} is not supported (blockwise and per-tensor only): the MXFP8 dgrad "
        "copy (32x1 blocks along N) is not derived from the rowwise bytes, so gathering both copies moves more bytes "
        "than the 16-bit weight")


def scale_from_amax(amax: torch.Tensor, recipe: "_fp8.Recipe", inf_value: float) -> torch.Tensor:
    """TransformerEngine's fp32 quantization scale from a tile amax (``csrc/fp8/fp8_math.h::scale_from_amax``):
    ``fp8_max / max(amax, eps)``, an infinite scale -> ``inf_value``, ``pow2``: rounded down to a power of two,
    ``amax == 0`` -> 1. Plain device ops, no sync."""
    fp8_max = torch.finfo(recipe.fwd_dtype).max
    a = torch.clamp(amax, min=recipe.amax_epsilon)
    scale = torch.full_like(a, fp8_max) / a  # a true division (``float / tensor`` multiplies by a reciprocal)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, inf_value), scale)
    if recipe.power_2_scale:
        scale = (scale.view(torch.int32) & 0x7F800000).view(torch.float32)
        scale = torch.where(torch.isinf(a), torch.zeros_like(scale), scale)
    return torch.where(a == 0, torch.ones_like(scale), scale)


class Fp8GatheredWeight:
    """The FP8 copies of one expert weight ``[E, N, K]`` under ``fp8_param_gather``: ``q`` (recipe's forward dtype),
    ``scale`` (fp32 ``scale_inv`` grid ``[E, ceil(N / TR), ceil(K / TC)]``), ``qt [E, K, N]`` and ``st`` (the dgrad
    copy), static buffers rewritten in place once per optimizer step (``moe_graph.fp8.quantize_weight``'s layout)."""

    def __init__(self, param: torch.Tensor, recipe: "_fp8.Recipe"):
        if param.dim() != 3:
            raise ValueError(f"fp8_param_gather: an FP8 weight must be [E, N, K], got shape {tuple(param.shape)}")
        self.recipe = recipe
        E, N, K = param.shape
        self.tiles = fp8_weight_tiles(recipe, (E, N, K))
        tr, tc = self.tiles
        self.grid = (E, -(-N // tr), -(-K // tc))
        # what an infinite scale becomes: the input dtype's largest value (blockwise) or fp32's (per tensor)
        self.inf_value = torch.finfo(param.dtype if recipe.kind == "blockwise" else torch.float32).max
        dev = param.device
        self.q = torch.zeros(E, N, K, dtype=recipe.fwd_dtype, device=dev)
        self.scale = torch.ones(self.grid, dtype=torch.float32, device=dev)
        self.qt = torch.zeros(E, K, N, dtype=recipe.fwd_dtype, device=dev)
        self.st = torch.ones(E, self.grid[2], self.grid[1], dtype=torch.float32, device=dev)
        self.refresh_local(param.detach())

    def copies(self, recipe) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q, scale, qt, st)`` for the FP8 GEMMs under ``recipe`` (which must be the one gathered)."""
        if _fp8.as_recipe(recipe) != self.recipe:
            raise ValueError(f"fp8_param_gather: this weight is gathered in FP8 for {self.recipe}, but the active "
                             f"recipe is {recipe} (its 16-bit copy is not current): use the same recipe in "
                             "DistributedOptimizer(fp8_param_gather=...) and the autocast")
        return self.q, self.scale, self.qt, self.st

    @torch.no_grad()
    def refresh_local(self, weight: torch.Tensor) -> None:
        """Quantize the whole (current, 16-bit) ``weight`` here, without communication (at construction and after
        every full 16-bit all-gather, e.g. a checkpoint load)."""
        q, s, qt, st = _fp8.quantize_weight(weight.contiguous(), self.recipe)
        self.q.copy_(q)
        self.scale.copy_(s.view(self.scale.shape))
        self.finish()

    def finish(self) -> None:
        """The dgrad copy from the rowwise one (square tiles / one scale: the exact transpose)."""
        self.qt.copy_(self.q.transpose(1, 2))
        self.st.copy_(self.scale.transpose(1, 2))


class _Part:
    """This rank's part of one FP8 weight in one bucket shard (static slices and buffers)."""

    __slots__ = ("param", "cache", "lo", "hi", "e0", "x16", "amax_off", "local", "send_off")


def _runs(shard: Tuple[int, int], fp8_spans: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """The complement of ``fp8_spans`` (sorted, inside ``shard``) in ``shard``: runs of 16-bit elements."""
    out, pos = [], shard[0]
    for a, b in sorted(fp8_spans):
        if a > pos:
            out.append((pos, a))
        pos = max(pos, b)
    if pos < shard[1]:
        out.append((pos, shard[1]))
    return out


def gather_bytes(bucket_numel: int, fp8_spans: List[Tuple[int, int]], dp: int, element_size: int) -> int:
    """Bytes one rank contributes to a bucket's FP8 parameter all-gather: the largest over the ranks of
    ``fp8 elements + element_size * other elements`` of its shard (``fp8_spans``: the FP8 weights' element spans,
    bucket-relative), rounded up to 16."""
    n = bucket_numel // dp
    worst = 0
    for r in range(dp):
        shard = (r * n, (r + 1) * n)
        f = sum(max(0, min(b, shard[1]) - max(a, shard[0])) for a, b in fp8_spans)
        worst = max(worst, f + element_size * (n - f))
    return -(-worst // 16) * 16


class Fp8BucketGather:
    """The FP8 parameter all-gather of one bucket (see the module doc). Built once (static buffers, before any
    capture); :meth:`sync` runs after the optimizer wrote its 16-bit shard."""

    def __init__(self, bucket, buffer, group, dp: int, rank: int, recipe: "_fp8.Recipe"):
        self.bucket, self.group, self.dp, self.rank = bucket, group, dp, rank
        self.recipe = recipe
        n = bucket.param_data.numel() // dp
        self.n = n
        fp8_params = [p for p in bucket.params_list if getattr(p, "fp8_gathered", None) is not None]
        spans = {p: bucket.param_to_index[p] for p in fp8_params}  # bucket-relative (start, end)
        self.esize = bucket.param_data.element_size()
        self.block = gather_bytes(bucket.param_data.numel(), list(spans.values()), dp, self.esize)
        dev = bucket.param_data.device
        self.blob = torch.zeros(self.block * dp, dtype=torch.uint8, device=dev)
        amax_numel = sum(p.fp8_gathered.scale.numel() for p in fp8_params)
        self.amax = torch.zeros(amax_numel, dtype=torch.float32, device=dev)
        self.amax_off: Dict[torch.Tensor, int] = {}
        off = 0
        for p in fp8_params:
            self.amax_off[p] = off
            off += p.fp8_gathered.scale.numel()
        # per rank r: (fp8 copies: (param, param lo, param hi, blob offset), 16-bit runs: (lo, hi, blob offset))
        self.plan = []
        for r in range(dp):
            shard = (r * n, (r + 1) * n)
            pos, fp8_runs, mine = 0, [], []
            for p, (a, b) in spans.items():
                lo, hi = max(a, shard[0]), min(b, shard[1])
                if lo >= hi:
                    continue
                fp8_runs.append((p, lo - a, hi - a, pos))
                mine.append((lo, hi))
                pos += hi - lo
            runs = []
            for lo, hi in _runs(shard, mine):
                runs.append((lo, hi, pos))
                pos += (hi - lo) * self.esize
            self.plan.append((fp8_runs, runs))
        # this rank's parts: the experts its shard touches, a zero-filled 16-bit staging copy of them
        self.parts: List[_Part] = []
        for p, lo, hi, send_off in self.plan[rank][0]:
            E, N, K = p.shape
            part = _Part()
            part.param, part.cache, part.lo, part.hi, part.send_off = p, p.fp8_gathered, lo, hi, send_off
            part.e0 = lo // (N * K)
            e1 = -(-hi // (N * K))
            part.x16 = torch.zeros(e1 - part.e0, N, K, dtype=p.dtype, device=dev)  # zero outside the shard
            part.local = (lo - part.e0 * N * K, hi - part.e0 * N * K)
            part.amax_off = self.amax_off[p]
            self.parts.append(part)
        self.fp8_params = fp8_params

    def wire_bytes(self) -> Dict[str, int]:
        """Bytes on the wire per rank and step: the all-gather's (``block * dp``, as a 16-bit gather's is
        ``numel * element_size``) and the amax all-reduce's."""
        return {"all_gather": self.block * self.dp, "amax_all_reduce": self.amax.numel() * 4,
                "sixteen_bit_all_gather": self.bucket.param_data.numel() * self.esize}

    @torch.no_grad()
    def sync(self) -> None:
        """Quantize this rank's shard, complete the tile amaxes, all-gather the bytes, unpack (no host sync)."""
        pd = self.bucket.param_data
        mine = self.blob[self.rank * self.block:(self.rank + 1) * self.block]
        self.amax.zero_()
        tiled = []
        for part in self.parts:
            tr, tc = part.cache.tiles
            E_, N, K = part.x16.shape
            a, b = part.local
            world = part.param.data.view(-1)[part.lo:part.hi]  # this rank's current 16-bit values
            part.x16.view(-1)[a:b].copy_(world)
            xp = F.pad(part.x16.float(), (0, (-K) % tc, 0, (-N) % tr))
            t = xp.view(E_, xp.shape[1] // tr, tr, xp.shape[2] // tc, tc)
            grid = part.cache.grid
            amax = self.amax[part.amax_off:part.amax_off + part.cache.scale.numel()].view(grid)
            amax[part.e0:part.e0 + E_].copy_(t.abs().amax(dim=(2, 4)))
            tiled.append(t)
        if self.dp > 1:
            dist.all_reduce(self.amax, op=dist.ReduceOp.MAX, group=self.group)
        qscale = {}
        for p in self.fp8_params:  # every rank: every tile's scale from the complete amax grid
            c = p.fp8_gathered
            qscale[p] = scale_from_amax(self.amax[self.amax_off[p]:self.amax_off[p] + c.scale.numel()].view(c.grid),
                                        c.recipe, c.inf_value)
            c.scale.copy_(torch.reciprocal(qscale[p]))
        fmax = torch.finfo(self.recipe.fwd_dtype).max
        for part, t in zip(self.parts, tiled):
            E_, N, K = part.x16.shape
            s = qscale[part.param][part.e0:part.e0 + E_]
            q = (t * s[:, :, None, :, None]).clamp(-fmax, fmax).to(self.recipe.fwd_dtype)
            q = q.view(E_, t.shape[1] * t.shape[2], t.shape[3] * t.shape[4])[:, :N, :K].reshape(-1)
            a, b = part.local
            mine[part.send_off:part.send_off + (b - a)].copy_(q[a:b].view(torch.uint8))
        for lo, hi, off in self.plan[self.rank][1]:
            mine[off:off + (hi - lo) * self.esize].copy_(pd[lo:hi].view(torch.uint8))
        if self.dp > 1:
            all_gather_tensor(self.blob, mine, group=self.group)
        for r in range(self.dp):
            src = self.blob[r * self.block:(r + 1) * self.block]
            fp8_runs, runs = self.plan[r]
            for p, lo, hi, off in fp8_runs:
                p.fp8_gathered.q.view(-1)[lo:hi].view(torch.uint8).copy_(src[off:off + hi - lo])
            if r == self.rank:
                continue
            for lo, hi, off in runs:
                pd[lo:hi].view(torch.uint8).copy_(src[off:off + (hi - lo) * self.esize])
        for p in self.fp8_params:
            p.fp8_gathered.finish()
