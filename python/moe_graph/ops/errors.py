"""The device error flag: kernels set bits for conditions only the device can see (instead of reading or writing
out of bounds); ``check_errors()`` reads and clears them (the one call that syncs, by design).

Only real errors set bits (a buffer overflow, negative counts, an inconsistent plan). Statistics of normal training
(routes dropped over a capacity, tokens per expert) are device counters read through
:func:`moe_graph.moe.layer.moe_statistics` / :func:`moe_graph.moe.layer.read_moe_statistics` (or
``TokenDispatcher.check_drops()``), so a periodic ``check_errors()`` never raises because of a capacity factor."""

from __future__ import annotations

from typing import Union

import torch

from moe_graph.ops._lib import available, cuda_built, ops

__all__ = ["check_errors", "read_error_flag", "flag_error_if", "ERROR_BITS", "SPLITS_OVERFLOW", "NEGATIVE_SPLIT",
           "REROUTE_OVER_ASK", "PLAN_INVALID", "INDEX_OUT_OF_RANGE", "EXCHANGE_COUNTS", "UNALIGNED_SPLIT"]

# Mirrors csrc/common/error_flag.h (bit 16, once "capacity drop", is retired: drops are statistics, not errors).
SPLITS_OVERFLOW = 1
NEGATIVE_SPLIT = 2
REROUTE_OVER_ASK = 4
PLAN_INVALID = 8
INDEX_OUT_OF_RANGE = 32
EXCHANGE_COUNTS = 64
UNALIGNED_SPLIT = 128
ERROR_BITS = {
    SPLITS_OVERFLOW: "sum(m_splits) exceeded the rows of the buffer (clamped; rows past the buffer were not computed)",
    NEGATIVE_SPLIT: "m_splits contained a negative count (treated as 0)",
    REROUTE_OVER_ASK: "reroute_tokens: the plan asked to move more tokens than are routed locally (clamped)",
    PLAN_INVALID: "an offloading plan input was inconsistent (negative counts)",
    INDEX_OUT_OF_RANGE: ("expand_rows/reduce_rows/dispatch_layout: a row, route or column index was outside its range "
                         "(read as the sentinel: no row, no route)"),
    EXCHANGE_COUNTS: ("the per-destination exchange's counts were inconsistent (negative, past the routes a rank has, "
                      "disagreeing between ranks, or past a receive buffer): clamped, nothing written past a buffer"),
    UNALIGNED_SPLIT: ("FP8 scaled grouped wgrad (CUDA): an expert's rows started at a token offset that is not a multiple "
                      "of 16 (pad m_splits to multiples of 16): that expert's gradient was not computed (zero, or "
                      "unchanged when accumulating)"),
}


if available():

    @torch.library.register_fake("moe_graph::error_flag")
    def _(device_like):
        return torch.empty(1, dtype=torch.int32, device=device_like.device)


@torch.library.custom_op("moe_graph::flag_error_if", mutates_args=())
def _flag_error_if(cond: torch.Tensor, bit: int) -> None:
    flag = ops.error_flag(cond)
    flag.bitwise_or_((cond != 0).any().to(torch.int32).mul(bit).view(1))


@_flag_error_if.register_fake
def _(cond, bit):
    return None


# The op writes global state (the flag) and returns nothing: without this, torch.compile drops it as dead code.
if hasattr(torch.fx.node, "has_side_effect"):
    torch.fx.node.has_side_effect(torch.ops.moe_graph.flag_error_if.default)


def flag_error_if(cond: torch.Tensor, bit: int) -> None:
    """Sets ``bit`` in the error flag of ``cond.device`` if any element of ``cond`` is true/non-zero.

    Sync-free and capturable (an in-place op on the flag), kept by ``torch.compile`` (an op marked
    side-effectful); the first call on a CUDA device must happen outside graph capture (it allocates the flag).
    """
    if bit not in ERROR_BITS:
        raise ValueError(f"flag_error_if: bit must be one of {sorted(ERROR_BITS)}, got {bit}")
    _flag_error_if(cond, bit)


def _default_device() -> torch.device:
    if torch.cuda.is_available() and cuda_built():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def read_error_flag(device: Union[str, torch.device, None] = None) -> int:
    """Reads and clears the raw error bits of ``device`` (default: the current CUDA device if any, else CPU)."""
    device = torch.device(device) if device is not None else _default_device()
    return int(ops.read_error_flag(torch.empty(0, device=device)))


def check_errors(device: Union[str, torch.device, None] = None) -> None:
    """Raises RuntimeError if a moe_graph kernel flagged a device-side error since the last check (and clears it).
    Capacity drops are not errors and never make it raise (read them with ``moe_graph.moe.layer.read_moe_statistics``).

    Checks the CPU flag and the CUDA flag of ``device`` (default: the current CUDA device when available). This is
    the one call that syncs, by design: call it outside the hot path (e.g. once every N iterations).
    """
    if device is not None and not isinstance(device, (str, torch.device)):
        raise TypeError(f"check_errors: device must be a str, a torch.device or None, got {type(device).__name__}")
    try:
        dev = torch.device(device) if device is not None else _default_device()
    except RuntimeError as e:
        raise ValueError(f"check_errors: device must name a device such as 'cpu' or 'cuda:0', got {device!r}") from e
    bits = read_error_flag("cpu")
    if dev.type == "cuda":
        bits |= read_error_flag(dev)
    if bits:
        msgs = [text for bit, text in ERROR_BITS.items() if bits & bit]
        raise RuntimeError("moe_graph device error: " + "; ".join(msgs))
