"""Point-to-point communication between neighbouring pipeline stages (Megatron's ``p2p_communication``).

:class:`P2PCommunicator` sends activations forward and activation gradients backward (``batch_isend_irecv``
or plain ``isend``/``irecv``); received tensors land in preallocated buffers that are reused every iteration (the
k-th receive of a step always uses the same buffer), so addresses are static, as a CUDA-graph capture of a whole
step with NCCL requires. The module-level ``send_*`` / ``recv_*`` functions use the communicator of
``parallel_state``'s pipeline group.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from moe_graph import parallel_state as ps

Shape = Sequence[int]


_TAG_FORWARD = 0   # activations, rank r -> r + 1
_TAG_BACKWARD = 1  # activation gradients, rank r -> r - 1


class P2PCommunicator:
    """Sends and receives between neighbouring pipeline stages.

    Args:
        group: the pipeline process group. ``None``: take group, ranks and neighbours from
            :mod:`moe_graph.parallel_state` (which must be initialized), unless ``rank``,
            ``world_size``, ``prev_rank`` and ``next_rank`` are all given.
        prev_rank / next_rank: global ranks of the previous / next stage (default: neighbours in
            ``group``, wrapping around).
        rank / world_size: this rank's stage index and the number of stages.
        batch_p2p_comm: one ``batch_isend_irecv`` per exchange (True) or individual
            ``isend``/``irecv`` ordered by rank parity (False).
        device: where receive buffers live (default: cuda if available, else cpu).
        static_buffers: reuse preallocated receive buffers (see :meth:`reset_buffers`).

    Receive buffers: the i-th receive of a given ``(direction, shape, dtype)`` since the last
    :meth:`reset_buffers` returns the i-th buffer of that kind, allocated on first use. The
    schedules reset at the start of every call, so iteration after iteration the same tensors
    are used in the same places (memory: one buffer per receive of a step).
    """

    def __init__(
        self,
        group=None,
        *,
        prev_rank: Optional[int] = None,
        next_rank: Optional[int] = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        batch_p2p_comm: bool = True,
        device: Optional[Union[str, torch.device]] = None,
        static_buffers: bool = True,
    ) -> None:
        explicit = None not in (prev_rank, next_rank, rank, world_size)
        if group is None and not explicit:
            group = ps.get_pipeline_model_parallel_group()
            ranks = ps.get_pipeline_model_parallel_global_ranks()
            rank = ps.get_pipeline_model_parallel_rank() if rank is None else rank
        elif group is not None:
            ranks = dist.get_process_group_ranks(group)
            if rank is None:
                rank = ranks.index(dist.get_rank())
        else:
            ranks = None
        if ranks is not None:
            world_size = len(ranks) if world_size is None else world_size
            prev_rank = ranks[(rank - 1) % len(ranks)] if prev_rank is None else prev_rank
            next_rank = ranks[(rank + 1) % len(ranks)] if next_rank is None else next_rank
        self.group = group
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.prev_rank = prev_rank
        self.next_rank = next_rank
        self.batch_p2p_comm = batch_p2p_comm
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.static_buffers = static_buffers
        self._pool: Dict[Tuple, List[torch.Tensor]] = {}
        self._cursor: Dict[Tuple, int] = {}

    @property
    def is_first_stage(self) -> bool:
        return self.rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.rank == self.world_size - 1

    # ---------------------------------------------------------------- buffers
    def reset_buffers(self) -> None:
        """Start a new step: the next receives reuse the buffers from the start of the pool."""
        self._cursor.clear()

    def num_buffers(self) -> int:
        """Total preallocated receive buffers."""
        return sum(len(v) for v in self._pool.values())

    def _recv_buffer(self, direction: str, shape: Shape, dtype: torch.dtype) -> torch.Tensor:
        # Activations are leaves that need .grad (the input of the stage's backward).
        requires_grad = direction == "fwd" and dtype.is_floating_point
        if not self.static_buffers:
            return torch.empty(tuple(shape), dtype=dtype, device=self.device, requires_grad=requires_grad)
        key = (direction, tuple(shape), dtype)
        pool = self._pool.setdefault(key, [])
        i = self._cursor.get(key, 0)
        if i == len(pool):
            pool.append(torch.empty(tuple(shape), dtype=dtype, device=self.device, requires_grad=requires_grad))
        self._cursor[key] = i + 1
        buf = pool[i]
        buf.grad = None
        return buf

    # ---------------------------------------------------------------- core
    def _communicate(
        self,
        *,
        tensor_send_next: Optional[torch.Tensor],
        tensor_send_prev: Optional[torch.Tensor],
        recv_prev: bool,
        recv_next: bool,
        tensor_shape: Optional[Shape],
        dtype: Optional[torch.dtype],
    ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Exchange with both neighbours at once; returns ``(tensor_recv_prev, tensor_recv_next)``.

        Sends go out as given; a receive of ``tensor_shape``/``dtype`` is posted for each of
        ``recv_prev``/``recv_next``. All requests are waited on before returning.

        Ordering: activations travel with tag 0, gradients with tag 1, and ops are issued as
        send_next, recv_prev, send_prev, recv_next. With pp == 2 both neighbours are the same rank;
        this order makes the k-th message between a pair the same kind on both sides even for
        backends that ignore tags (NCCL matches p2p messages per peer in issue order).
        """
        if (recv_prev or recv_next) and (tensor_shape is None or dtype is None):
            raise ValueError("tensor_shape and dtype are required to receive")
        recv_prev_t = self._recv_buffer("fwd", tensor_shape, dtype) if recv_prev else None
        recv_next_t = self._recv_buffer("bwd", tensor_shape, dtype) if recv_next else None
        send_next_t = None if tensor_send_next is None else tensor_send_next.detach().contiguous()
        send_prev_t = None if tensor_send_prev is None else tensor_send_prev.detach().contiguous()
        ops = []  # (op, tensor, peer, tag), in the order described above
        if send_next_t is not None:
            ops.append((dist.isend, send_next_t, self.next_rank, _TAG_FORWARD))
        if recv_prev_t is not None:
            ops.append((dist.irecv, recv_prev_t, self.prev_rank, _TAG_FORWARD))
        if send_prev_t is not None:
            ops.append((dist.isend, send_prev_t, self.prev_rank, _TAG_BACKWARD))
        if recv_next_t is not None:
            ops.append((dist.irecv, recv_next_t, self.next_rank, _TAG_BACKWARD))
        if not ops:
            return recv_prev_t, recv_next_t
        if self.batch_p2p_comm:
            reqs = dist.batch_isend_irecv(
                [dist.P2POp(op, t, peer, self.group, tag) for op, t, peer, tag in ops]
            )
        else:
            # Even ranks send first, odd ranks receive first, per direction: every blocking
            # send meets a posted receive even on backends that serialize p2p calls.
            if self.rank % 2 == 1:
                ops.sort(key=lambda o: (o[3], o[0] is dist.isend))
            reqs = [op(t, peer, group=self.group, tag=tag) for op, t, peer, tag in ops]
        for req in reqs:
            if req is not None:
                req.wait()
        return recv_prev_t, recv_next_t

    # ---------------------------------------------------------------- helpers
    def recv_forward(self, tensor_shape: Shape, dtype: torch.dtype, is_first_stage: Optional[bool] = None):
        """Activation from the previous stage (``None`` on the first stage)."""
        if self.is_first_stage if is_first_stage is None else is_first_stage:
            return None
        return self._communicate(tensor_send_next=None, tensor_send_prev=None, recv_prev=True, recv_next=False,
                                 tensor_shape=tensor_shape, dtype=dtype)[0]

    def recv_backward(self, tensor_shape: Shape, dtype: torch.dtype, is_last_stage: Optional[bool] = None):
        """Gradient of this stage's output from the next stage (``None`` on the last stage)."""
        if self.is_last_stage if is_last_stage is None else is_last_stage:
            return None
        return self._communicate(tensor_send_next=None, tensor_send_prev=None, recv_prev=False, recv_next=True,
                                 tensor_shape=tensor_shape, dtype=dtype)[1]

    def send_forward(self, output_tensor: Optional[torch.Tensor], is_last_stage: Optional[bool] = None) -> None:
        """Activation to the next stage (no-op on the last stage or for ``None``)."""
        if (self.is_last_stage if is_last_stage is None else is_last_stage) or output_tensor is None:
            return
        self._communicate(tensor_send_next=output_tensor, tensor_send_prev=None, recv_prev=False, recv_next=False,
                          tensor_shape=None, dtype=None)

    def send_backward(self, input_tensor_grad: Optional[torch.Tensor], is_first_stage: Optional[bool] = None) -> None:
        """Input gradient to the previous stage (no-op on the first stage or for ``None``)."""
        if (self.is_first_stage if is_first_stage is None else is_first_stage) or input_tensor_grad is None:
            return
        self._communicate(tensor_send_next=None, tensor_send_prev=input_tensor_grad, recv_prev=False,
                          recv_next=False, tensor_shape=None, dtype=None)

    def send_forward_recv_backward(self, output_tensor, tensor_shape: Shape, dtype: torch.dtype,
                                   is_last_stage: Optional[bool] = None):
        """Send the activation forward and receive its gradient (``None`` on the last stage)."""
        if self.is_last_stage if is_last_stage is None else is_last_stage:
            return None
        return self._communicate(tensor_send_next=output_tensor, tensor_send_prev=None, recv_prev=False,
                                 recv_next=True, tensor_shape=tensor_shape, dtype=dtype)[1]

    def send_backward_recv_forward(self, input_tensor_grad, tensor_shape: Shape, dtype: torch.dtype,
                                   is_first_stage: Optional[bool] = None):
        """Send the input gradient back and receive the next activation (``None`` on the first stage)."""
        if self.is_first_stage if is_first_stage is None else is_first_stage:
            return None
        return self._communicate(tensor_send_next=None, tensor_send_prev=input_tensor_grad, recv_prev=True,
                                 recv_next=False, tensor_shape=tensor_shape, dtype=dtype)[0]

    def send_forward_recv_forward(self, output_tensor, recv_prev: bool, tensor_shape: Shape, dtype: torch.dtype):
        """Send ``output_tensor`` (may be None) forward and optionally receive an activation."""
        return self._communicate(tensor_send_next=output_tensor, tensor_send_prev=None, recv_prev=recv_prev,
                                 recv_next=False, tensor_shape=tensor_shape, dtype=dtype)[0]

    def send_backward_recv_backward(self, input_tensor_grad, recv_next: bool, tensor_shape: Shape,
                                    dtype: torch.dtype):
        """Send ``input_tensor_grad`` (may be None) back and optionally receive an output gradient."""
        return self._communicate(tensor_send_next=None, tensor_send_prev=input_tensor_grad, recv_prev=False,
                                 recv_next=recv_next, tensor_shape=tensor_shape, dtype=dtype)[1]

    def send_forward_backward_recv_forward_backward(self, output_tensor, input_tensor_grad, recv_prev: bool,
                                                    recv_next: bool, tensor_shape: Shape, dtype: torch.dtype):
        """Both directions at once; returns ``(input_tensor, output_tensor_grad)``."""
        return self._communicate(tensor_send_next=output_tensor, tensor_send_prev=input_tensor_grad,
                                 recv_prev=recv_prev, recv_next=recv_next, tensor_shape=tensor_shape, dtype=dtype)


_DEFAULT_COMM: Dict[int, P2PCommunicator] = {}


def get_default_communicator(batch_p2p_comm: bool = True) -> P2PCommunicator:
    """The communicator for parallel_state's pipeline group (one per group and mode, reused)."""
    group = ps.get_pipeline_model_parallel_group()
    key = (id(group), batch_p2p_comm)
    comm = _DEFAULT_COMM.get(key)
    if comm is None or comm.group is not group:
        comm = P2PCommunicator(batch_p2p_comm=batch_p2p_comm)
        _DEFAULT_COMM[key] = comm
    return comm


def _comm(communicator: Optional[P2PCommunicator]) -> P2PCommunicator:
    return communicator if communicator is not None else get_default_communicator()


def recv_forward(tensor_shape: Shape, dtype: torch.dtype = torch.float32, *, is_first_stage: Optional[bool] = None,
                 communicator: Optional[P2PCommunicator] = None):
    """Receive an activation ``[*tensor_shape]`` from the previous stage; ``None`` on the first stage."""
    return _comm(communicator).recv_forward(tensor_shape, dtype, is_first_stage)


def recv_backward(tensor_shape: Shape, dtype: torch.dtype = torch.float32, *, is_last_stage: Optional[bool] = None,
                  communicator: Optional[P2PCommunicator] = None):
    """Receive the gradient of this stage's output from the next stage; ``None`` on the last stage."""
    return _comm(communicator).recv_backward(tensor_shape, dtype, is_last_stage)


def send_forward(output_tensor, *, is_last_stage: Optional[bool] = None,
                 communicator: Optional[P2PCommunicator] = None) -> None:
    """Send an activation to the next stage (no-op on the last stage)."""
    _comm(communicator).send_forward(output_tensor, is_last_stage)


def send_backward(input_tensor_grad, *, is_first_stage: Optional[bool] = None,
                  communicator: Optional[P2PCommunicator] = None) -> None:
    """Send an input gradient to the previous stage (no-op on the first stage)."""
    _comm(communicator).send_backward(input_tensor_grad, is_first_stage)


def send_forward_recv_backward(output_tensor, tensor_shape: Shape, dtype: torch.dtype = torch.float32, *,
                               is_last_stage: Optional[bool] = None, communicator: Optional[P2PCommunicator] = None):
    """Send an activation forward, receive its gradient."""
    return _comm(communicator).send_forward_recv_backward(output_tensor, tensor_shape, dtype, is_last_stage)


def send_backward_recv_forward(input_tensor_grad, tensor_shape: Shape, dtype: torch.dtype = torch.float32, *,
                               is_first_stage: Optional[bool] = None, communicator: Optional[P2PCommunicator] = None):
    """Send an input gradient back, receive the next activation."""
    return _comm(communicator).send_backward_recv_forward(input_tensor_grad, tensor_shape, dtype, is_first_stage)


def send_forward_recv_forward(output_tensor, recv_prev: bool, tensor_shape: Shape, dtype: torch.dtype = torch.float32,
                              *, communicator: Optional[P2PCommunicator] = None):
    """Send an activation forward (if not None) and receive one from the previous stage (if ``recv_prev``)."""
    return _comm(communicator).send_forward_recv_forward(output_tensor, recv_prev, tensor_shape, dtype)


def send_backward_recv_backward(input_tensor_grad, recv_next: bool, tensor_shape: Shape,
                                dtype: torch.dtype = torch.float32, *, communicator: Optional[P2PCommunicator] = None):
    """Send a gradient back (if not None) and receive one from the next stage (if ``recv_next``)."""
    return _comm(communicator).send_backward_recv_backward(input_tensor_grad, recv_next, tensor_shape, dtype)


def send_forward_backward_recv_forward_backward(output_tensor, input_tensor_grad, recv_prev: bool, recv_next: bool,
                                                tensor_shape: Shape, dtype: torch.dtype = torch.float32, *,
                                                communicator: Optional[P2PCommunicator] = None):
    """Both directions at once; returns ``(input_tensor, output_tensor_grad)``."""
    return _comm(communicator).send_forward_backward_recv_forward_backward(
        output_tensor, input_tensor_grad, recv_prev, recv_next, tensor_shape, dtype)
