"""The per-pair rule's aligned index maps as the dispatcher composed them before the layout ops aligned the groups
themselves (the tests' oracle for ``dispatch_layout(..., align=)`` / ``receive_layout(..., align=)``):
:func:`moe_graph.ops.dispatch_layout.aligned_groups` of the counts composed into the align-1 maps with torch ops
(pad with the sentinel, ``index_select``)."""

import torch

from moe_graph.ops.dispatch_layout import aligned_groups


def compose(index: torch.Tensor, table: torch.Tensor, sentinel: int) -> torch.Tensor:
    """``table[index]`` with ``index == len(table)`` (the sentinel of ``index``'s map) mapped to ``sentinel``."""
    return torch.nn.functional.pad(table, (0, 1), value=sentinel).index_select(0, index)


def aligned_send(route_slot, route_of_slot, send_counts, align):
    """R = 1: the align-1 ``dispatch_layout`` maps (send slots = expert rows) -> ``(route_slot into [0, P],
    route_of_slot [P], padded counts)``."""
    N, n = route_of_slot.shape[0], route_slot.shape[0]
    m, source_of_padded, padded_of_source = aligned_groups(send_counts.reshape(-1), N, align)
    P = source_of_padded.shape[0]
    return compose(route_slot, padded_of_source, P), compose(source_of_padded, route_of_slot, n), m


def aligned_receive(expert_row_source, recv_row_target, m_splits, align):
    """R > 1: the align-1 ``receive_layout`` maps -> ``(expert_row_source [P], recv_row_target into [0, P], padded
    counts)``."""
    N = expert_row_source.shape[0]
    m, source_of_padded, padded_of_source = aligned_groups(m_splits, N, align)
    P = source_of_padded.shape[0]
    return compose(source_of_padded, expert_row_source, N), compose(recv_row_target, padded_of_source, P), m
