"""The fused ("nvlink") token exchange on torch symmetric memory: the CUDA backend object of the fused-exchange
interface (dispatch / combine / gather_routes and their async forms), over the native ops
``torch.ops.moe_graph.exchange_{dispatch, combine, gather}`` (``csrc/exchange/``), and the fake (meta)
implementations of those ops.

Semantics (``csrc/exchange/exchange.h``, the host reference ``exchange_*_reference`` runs them for all ranks in one
process): each token row is read once from ``rows`` and stored straight into each destination's symmetric receive
buffer at its final row (local expert, then source rank, then the sender's slot order; the chunks cut in
source-major order at ``capacity``, as ``HostSizedExchange``; with ``align`` every local expert's group starts at a
multiple of ``align`` rows, zero rows between, in ``P = aligned_padded_rows(capacity, Lc, align)`` rows), its weight
beside it; ``combine`` pulls each route's
row from the destination's symmetric expert-output buffer and reduces the K routes in fp32 (fp64 for fp64);
``gather_routes`` pulls without reduction. Completion by per-peer signals (system-scope release / acquire) with
epochs kept on the device: no host sync, capturable, replayable with changing counts.

Buffers: the symmetric buffers of each shape are allocated and exchanged (``rendezvous``, a collective) on the
first call of that shape, so run one eager step before CUDA-graph capture. Every rank must make the same sequence of
calls with the same ``num_sms``. ``dispatch`` returns ``expert_in`` / ``row_weights`` as fresh tensors by default
(one local copy each); ``copy=False`` returns views of the receive buffer, valid until the next dispatch of the same
shape; ``reader=fn`` returns ``fn(expert_in view, m_splits, row_weights view)`` in ``expert_in``'s place, run on the
exchange's stream before the buffer can be reused (e.g. the FP8 copies of the rows written straight from the
buffer), ``row_weights`` copied. ``combine`` / ``gather_routes`` copy ``expert_out`` into the symmetric buffer unless it already is
:meth:`NvlinkExchange.combine_buffer` (let the expert GEMM write there to skip the copy).

Compiled only: no GPU has run these kernels yet; their CPU emulation on R devices (tests/emulator, the ``exchange``
family) equals the host reference bit for bit.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from moe_graph.ops import _lib

_OPS = ("moe_graph::exchange_dispatch", "moe_graph::exchange_combine", "moe_graph::exchange_gather")
DEFAULT_NUM_SMS = 20


class FusedDispatch(NamedTuple):
    """What a fused backend's ``dispatch`` returns (this module's :class:`NvlinkExchange` and, on CPU process groups,
    ``moe_graph.moe.exchange.HostSizedFusedExchange``)."""

    expert_in: torch.Tensor  # [P, *X] the rows at their final receive rows, zeros on every other row
    m_splits: torch.Tensor  # [Lc] int64 rows per local expert group (rounded up to a multiple of align)
    row_weights: Optional[torch.Tensor]  # [P] fp32 weight carried beside each row, 0 on the zero rows; or None
    route_row: torch.Tensor  # [T*K] int64: dest * P + row of each route, -1 if not sent
    counts: Optional[torch.Tensor] = None  # [Lc] int64 rows that arrived per local expert (m_splits at align 1)


def kernels_available() -> bool:
    """True when the loaded extension has the CUDA exchange kernels (a build with CUDA). Never raises."""
    return _lib.has_kernel(_OPS[0], "cuda")


class OrderedStream:
    """One stream per exchange object on which all its calls run in issue order, as ProcessGroupNCCL runs its
    collectives on its own stream. The exchanges keep persistent symmetric buffers and device epochs: two calls
    issued from different streams (``overlap_microbatches``: microbatch ``i + 1``'s dispatch beside microbatch
    ``i``'s backward exchange; the shared expert's side stream) could otherwise run at once on the device, or in a
    different order on different ranks, and pair the wrong epochs (a hang) or overwrite a buffer being read. Each
    call: the exchange stream waits for the calling stream, runs the call, and the calling stream waits for it;
    results made on the exchange stream are marked as used by the calling stream (the caching allocator keeps
    their memory until that stream is done). Capturable: the waits are events of the capturing stream."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None

    def run(self, fn, *args, **kwargs):
        if self.stream is None:
            return fn(*args, **kwargs)
        caller = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(caller)
        with torch.cuda.stream(self.stream):
            out = fn(*args, **kwargs)
        caller.wait_stream(self.stream)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                t.record_stream(caller)
        return out


class _Handle:
    """The async form's handle: ``wait()`` makes the current stream wait for the work and returns its result."""

    def __init__(self, result, event: Optional[torch.cuda.Event]):
        self._result = result
        self._event = event

    def wait(self):
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
        return self._result


def layout(num_ranks: int, num_local: int, capacity: int, row_bytes: int, align: int = 1):
    """``(control words, receive-buffer bytes, weights offset, epoch words, largest R*Lc, receive rows P)`` (native
    op; ``P = aligned_padded_rows(capacity, num_local, align)``)."""
    _lib.require()
    return tuple(_lib.ops.exchange_layout(num_ranks, num_local, capacity, row_bytes, align))


class _Symmetric:
    """One symmetric tensor of this rank and the device array [R] of every rank's copy (int64 addresses)."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, group_name: str, zero: bool):
        from torch.distributed import _symmetric_memory as symm

        self.tensor = symm.empty(max(numel, 1), dtype=dtype, device=device)
        if zero:
            self.tensor.zero_()
        handle = symm.rendezvous(self.tensor, group_name)
        self.ptrs = torch.tensor([int(p) for p in handle.buffer_ptrs], dtype=torch.int64, device=device)
        if zero:
            handle.barrier()  # every rank's zeroed signals exist before any peer signals into them


class NvlinkExchange:
    """The fused exchange between the ranks of ``group`` (one CUDA device each, peers reachable by NVLink / P2P).

    ``num_sms`` bounds the blocks of every kernel (the same on every rank), so the exchange can run beside
    computation on the other SMs."""

    def __init__(self, group=None, device=None, num_sms: int = DEFAULT_NUM_SMS):
        _lib.require()
        if not kernels_available():
            raise RuntimeError("NvlinkExchange needs the CUDA build of moe_graph._C (exchange kernels)")
        if not isinstance(num_sms, int) or num_sms < 1 or num_sms > 1024:
            raise ValueError(f"NvlinkExchange: num_sms must be an int in [1, 1024], got {num_sms!r}")
        self.group = group if group is not None else dist.group.WORLD
        self.group_name = self.group.group_name
        self.rank = dist.get_rank(self.group)
        self.num_ranks = dist.get_world_size(self.group)
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        self.num_sms = num_sms
        from torch.distributed import _symmetric_memory as symm

        symm.enable_symm_mem_for_group(self.group_name)
        self._recv = {}  # (receive rows P, row_bytes) -> _Symmetric (uint8)
        self._ctrl = {}  # num_local -> (_Symmetric control words, epoch [4] int64)
        self._pull = {}  # (capacity, row shape, dtype) -> _Symmetric
        self._pull_ctrl = None
        self._ordered = OrderedStream(self.device)

    # ---- buffers (collective on first use of a shape) -----------------------------------------------------------
    def _control(self, num_local: int):
        if num_local not in self._ctrl:
            words, _, _, epoch_words, max_chunks, _ = layout(self.num_ranks, num_local, 0, 0)
            if self.num_ranks * num_local > max_chunks:
                raise ValueError(f"NvlinkExchange: R * Lc = {self.num_ranks * num_local} exceeds {max_chunks}")
            ctrl = _Symmetric(words, torch.int64, self.device, self.group_name, zero=True)
            self._ctrl[num_local] = (ctrl, torch.zeros(epoch_words, dtype=torch.int64, device=self.device))
        return self._ctrl[num_local]

    def _receive(self, rows: int, row_bytes: int, nbytes: int) -> _Symmetric:
        key = (rows, row_bytes)
        if key not in self._recv:
            self._recv[key] = _Symmetric(nbytes, torch.uint8, self.device, self.group_name, zero=False)
        return self._recv[key]

    def combine_buffer(self, capacity: int, row_shape, dtype: torch.dtype) -> torch.Tensor:
        """This rank's symmetric expert-output buffer ``[capacity, *row_shape]`` (write the expert output here to
        spare combine's copy)."""
        key = (capacity, tuple(row_shape), dtype)
        if key not in self._pull:
            n = capacity * math.prod(row_shape)
            self._pull[key] = _Symmetric(n, dtype, self.device, self.group_name, zero=False)
        return self._pull[key].tensor[:capacity * math.prod(row_shape)].view((capacity,) + tuple(row_shape))

    def _pull_state(self, expert_out: torch.Tensor):
        buf = self.combine_buffer(expert_out.shape[0], tuple(expert_out.shape[1:]), expert_out.dtype)
        sym = self._pull[(expert_out.shape[0], tuple(expert_out.shape[1:]), expert_out.dtype)]
        if expert_out.data_ptr() != buf.data_ptr():
            buf.copy_(expert_out)
        if self._pull_ctrl is None:
            self._pull_ctrl = self._control_pull()
        return buf, sym.ptrs, self._pull_ctrl

    def _control_pull(self):
        words, _, _, epoch_words, _, _ = layout(self.num_ranks, 1, 0, 0)
        ctrl = _Symmetric(words, torch.int64, self.device, self.group_name, zero=True)
        return ctrl, torch.zeros(epoch_words, dtype=torch.int64, device=self.device)

    # ---- the interface (every call in issue order on the exchange's own stream: OrderedStream) -----------------
    def dispatch(self, *args, **kwargs) -> FusedDispatch:
        return self._ordered.run(self._dispatch, *args, **kwargs)

    def combine(self, *args, **kwargs) -> torch.Tensor:
        return self._ordered.run(self._combine, *args, **kwargs)

    def gather_routes(self, *args, **kwargs) -> torch.Tensor:
        return self._ordered.run(self._gather_routes, *args, **kwargs)

    def _dispatch(self, rows: torch.Tensor, route_of_slot: torch.Tensor, send_counts: torch.Tensor, topk: int,
                 capacity: int, weights: Optional[torch.Tensor] = None, copy: bool = True,
                 align: int = 1, reader=None) -> FusedDispatch:
        rows = rows.contiguous()
        R, Lc = send_counts.shape
        if R != self.num_ranks:
            raise ValueError(f"NvlinkExchange.dispatch: send_counts must be [{self.num_ranks}, Lc], got "
                             f"{tuple(send_counts.shape)}")
        X = tuple(rows.shape[1:])
        row_bytes = rows.element_size() * math.prod(X)
        ctrl, epoch = self._control(Lc)
        _, nbytes, woff, _, _, P = layout(R, Lc, capacity, row_bytes, align)
        recv = self._receive(P, row_bytes, nbytes)
        m_splits, route_row, counts = _lib.ops.exchange_dispatch(
            rows, route_of_slot, send_counts, weights, topk, capacity, self.rank, recv.tensor, recv.ptrs,
            ctrl.tensor, ctrl.ptrs, epoch, self.num_sms, align)
        expert_in = recv.tensor[:P * row_bytes].view(rows.dtype).view((P,) + X)
        row_weights = recv.tensor[woff:woff + 4 * P].view(torch.float32) if weights is not None else None
        if reader is not None:  # read the receive buffer in place, on the exchange's stream, before any reuse
            expert_in = reader(expert_in, m_splits, row_weights)
        elif copy:
            expert_in = expert_in.clone()
        if (copy or reader is not None) and row_weights is not None:
            row_weights = row_weights.clone()
        return FusedDispatch(expert_in, m_splits, row_weights, route_row, counts)

    def _combine(self, expert_out: torch.Tensor, route_row: torch.Tensor, topk: int,
                 weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        buf, ptrs, (ctrl, epoch) = self._pull_state(expert_out.contiguous())
        return _lib.ops.exchange_combine(buf, ptrs, ctrl.tensor, ctrl.ptrs, epoch, route_row, weights, topk,
                                         self.rank, self.num_sms)

    def _gather_routes(self, expert_out: torch.Tensor, route_row: torch.Tensor) -> torch.Tensor:
        buf, ptrs, (ctrl, epoch) = self._pull_state(expert_out.contiguous())
        return _lib.ops.exchange_gather(buf, ptrs, ctrl.tensor, ctrl.ptrs, epoch, route_row, self.rank,
                                        self.num_sms)

    def _on(self, stream: Optional[torch.cuda.Stream], fn, *args, **kwargs) -> _Handle:
        if stream is None:
            return _Handle(fn(*args, **kwargs), None)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            result = fn(*args, **kwargs)
            event = torch.cuda.Event()
            event.record(stream)
        return _Handle(result, event)

    def dispatch_async(self, *args, stream: Optional[torch.cuda.Stream] = None, **kwargs) -> _Handle:
        """:meth:`dispatch` enqueued on ``stream`` (after the current stream's work); ``handle.wait()`` joins."""
        return self._on(stream, self.dispatch, *args, **kwargs)

    def combine_async(self, *args, stream: Optional[torch.cuda.Stream] = None, **kwargs) -> _Handle:
        return self._on(stream, self.combine, *args, **kwargs)

    def gather_routes_async(self, *args, stream: Optional[torch.cuda.Stream] = None, **kwargs) -> _Handle:
        return self._on(stream, self.gather_routes, *args, **kwargs)


def _register() -> None:
    if not _lib.available() or not hasattr(torch.library, "register_fake"):
        return
    if not _lib.has_kernel(_OPS[0], "cuda"):
        return  # CPU builds: the CUDA ops have no kernel to stand in for

    @torch.library.register_fake(_OPS[0])
    def _(rows, route_of_slot, send_counts, weights, topk, capacity, rank, recv_buffer, recv_ptrs, ctrl_buffer,
          ctrl_ptrs, epoch, num_ctas, align=1):
        torch._check(send_counts.dim() == 2, lambda: "exchange_dispatch: send_counts must be [R, Lc]")
        return (send_counts.new_empty((send_counts.shape[1],)), send_counts.new_empty((rows.shape[0] * topk,)),
                send_counts.new_empty((send_counts.shape[1],)))

    @torch.library.register_fake(_OPS[1])
    def _(expert_out, src_ptrs, ctrl_buffer, ctrl_ptrs, epoch, route_row, weights, topk, rank, num_ctas):
        return expert_out.new_empty((route_row.shape[0] // topk,) + tuple(expert_out.shape[1:]))

    @torch.library.register_fake(_OPS[2])
    def _(expert_out, src_ptrs, ctrl_buffer, ctrl_ptrs, epoch, route_row, rank, num_ctas):
        return expert_out.new_empty((route_row.shape[0],) + tuple(expert_out.shape[1:]))


_register()
