"""torch's NVSHMEM ``all_to_all_vdev_2d`` / ``all_to_all_vdev_2d_offset`` modelled on a gloo process group, so
``moe_graph.moe.exchange.SymmMemExchange`` runs on CPUs in tests. Written from torch's documented semantics
(``torch/csrc/distributed/c10d/symm_mem/nvshmem_extension.cu``), not from moe_graph's code:

* ``all_to_all_vdev_2d(input, out, in_splits, out_splits_offsets, group, major_align=None)``: ``in_splits [R * ne]``
  rank-major (chunk ``d * ne + e`` goes to rank ``d``'s local expert ``e``; the chunks lie back to back in
  ``input``). Rank ``d`` receives expert-major: expert ``e``'s tile holds the chunks of sources ``0 .. R-1`` back to
  back; tile ``e + 1`` starts ``max(ceil(len_e / a) * a, a)`` rows after tile ``e`` (``a = major_align``, 1 when
  unset: an empty tile still takes ``a`` rows). ``out_splits_offsets [2, ne * R]``: the rows and the landing row of
  chunk ``(e, s)`` at ``e * R + s``. Rows of ``out`` no chunk lands on are left as they were.
* ``all_to_all_vdev_2d_offset(input, out, in_splits_offsets, out_splits_offsets, group)``: the reverse; chunk
  ``(e, s)`` of rank ``q`` (rows ``in_splits_offsets[0][e * R + s]`` at ``in_splits_offsets[1][e * R + s]``) goes
  to rank ``s``, which lays them out rank-major, back to back (``(q, e)`` at ``q * ne + e``)."""

from __future__ import annotations

import types

import torch
import torch.distributed as dist


def _gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class FakeSymmOps:
    """Stands in for ``torch.ops.symm_mem`` (the two ops above) on the default gloo group."""

    def __init__(self):
        self.calls = []

    def all_to_all_vdev_2d(self, input, out, in_splits, out_splits_offsets, group_name, major_align=None):
        self.calls.append(("all_to_all_vdev_2d", major_align))
        R, me = dist.get_world_size(), dist.get_rank()
        ne = in_splits.numel() // R
        a = 1 if major_align is None else int(major_align)
        peers = _gather((input.clone(), in_splits.clone()))
        tile = 0
        for e in range(ne):
            inner = 0
            for s, (rows, splits) in enumerate(peers):
                c = me * ne + e
                n, src = int(splits[c]), int(splits[:c].sum())
                out[tile + inner:tile + inner + n] = rows[src:src + n]
                out_splits_offsets[0][e * R + s] = n
                out_splits_offsets[1][e * R + s] = tile + inner
                inner += n
            tile += max(-(-inner // a) * a, a)

    def all_to_all_vdev_2d_offset(self, input, out, in_splits_offsets, out_splits_offsets, group_name):
        self.calls.append(("all_to_all_vdev_2d_offset", None))
        R, me = dist.get_world_size(), dist.get_rank()
        ne = in_splits_offsets.shape[1] // R
        peers = _gather((input.clone(), in_splits_offsets.clone()))
        at = 0
        for q, (rows, so) in enumerate(peers):
            for e in range(ne):
                c = e * R + me
                n, src = int(so[0][c]), int(so[1][c])
                out[at:at + n] = rows[src:src + n]
                out_splits_offsets[0][q * ne + e] = n
                out_splits_offsets[1][q * ne + e] = at
                at += n


def fake_symm_module():
    """Stands in for ``torch.distributed._symmetric_memory`` (what ``SymmMemExchange`` calls): ``empty`` returns
    memory filled with a NaN pattern (what uninitialised memory may hold), ``rendezvous`` does nothing."""
    def empty(shape, dtype, device):
        t = torch.empty(shape, dtype=dtype, device=device)
        if t.is_floating_point():
            return t.fill_(float("nan"))
        return t.view(torch.uint8).fill_(0xA5).view(dtype) if t.element_size() == 1 else t.fill_(-7)
    return types.SimpleNamespace(enable_symm_mem_for_group=lambda name: None, get_backend=lambda device: "NVSHMEM",
                                 set_backend=lambda name: None, empty=empty, rendezvous=lambda t, name: None)


def install(layer):
    """Replaces ``layer.dispatcher``'s exchange (a ``HostSizedExchange`` on gloo) with ``SymmMemExchange`` on the
    fakes above; returns the fake ops (their ``calls``)."""
    import moe_graph.moe.exchange as exchange

    before = exchange._symm
    exchange._symm = fake_symm_module()
    try:
        backend = exchange.SymmMemExchange(layer.dispatcher.group, device="cpu")
    finally:
        exchange._symm = before
    backend._ops = FakeSymmOps()
    layer.dispatcher.exchange_backend = backend
    return backend._ops
