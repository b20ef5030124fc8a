"""The experts of one MoE layer: :class:`GroupedMLP` (``fc1 -> activation -> fc2``, one grouped GEMM each over the
rank's ``L`` home experts followed by its ``k`` echo spare slots) and :class:`SharedExpert`.

Expert parameters are marked ``param.allreduce = False`` (Megatron's convention: reduced over the
expert-data-parallel group by :class:`moe_graph.distributed.ddp.DistributedDataParallel`).

Weight gradients: when both expert weights carry ``main_grad`` (views into a DDP grad buffer) the GEMMs take the
fused path: wgrad goes straight into ``main_grad`` (``grad_added_to_main_grad = True``, zero placeholders returned
to autograd so that the DDP hooks fire but add nothing). With echo, each GEMM's backward runs one
``grouped_gemm_wgrad`` with the per-expert accumulate mask (home experts accumulate into ``main_grad``, spare slots
overwrite the static buffers :attr:`GroupedMLP.spare_grads`), then sends the spare slots' gradients home and adds
them into ``main_grad`` (:func:`moe_graph.moe.echo.echo_grouped_gemm`). Without ``main_grad`` the gradients reach
``.grad`` through ordinary autograd (:func:`moe_graph.moe.echo.dispatch_spare_weights` for the spare copies).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from moe_graph.grouped_linear import GroupedLinear
from moe_graph.moe.echo import (
    EchoExpertDispatcher,
    dispatch_spare_weights,
    echo_grouped_gemm,
    spare_grad_buffers,
    wgrad_accumulate_mask,
)
from moe_graph.ops.grouped_gemm import grouped_gemm, grouped_gemm_autograd

__all__ = ["ACTIVATIONS", "GroupedMLP", "SharedExpert", "activation_fn"]

ACTIVATIONS = ("swiglu", "gelu")


def activation_fn(h: torch.Tensor, activation: str) -> torch.Tensor:
    """``"swiglu"``: ``silu(a) * b`` of the two halves of ``h``'s last dimension; ``"gelu"``: ``gelu(h)``."""
    if activation == "swiglu":
        a, b = h.chunk(2, dim=-1)
        return F.silu(a) * b
    return F.gelu(h)


def _fc1_out(ffn_hidden_size: int, activation: str) -> int:
    return 2 * ffn_hidden_size if activation == "swiglu" else ffn_hidden_size


class GroupedMLP(nn.Module):
    """``num_local_experts`` (``L``) expert MLPs as two :class:`moe_graph.GroupedLinear` (``fc1 [L, fc1_out, H]``,
    ``fc2 [L, H, F]``, ``fc1_out = 2F`` for SwiGLU), run over the rows of ``L + k`` local experts: the home experts,
    then ``k = num_spare_experts_per_ep_rank`` echo spare slots whose weights are copies of other ranks' experts.

    Args:
        init_std: normal init of ``fc1``; ``fc2`` gets ``init_std / sqrt(2)``.
    """

    def __init__(self, num_local_experts: int, hidden_size: int, ffn_hidden_size: int, activation: str = "swiglu",
                 num_spare_experts_per_ep_rank: int = 0, params_dtype: Optional[torch.dtype] = None, device=None,
                 init_std: float = 0.02):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be 'swiglu' or 'gelu', got {activation!r}")
        self.num_local_experts = num_local_experts
        self.num_spare_experts_per_ep_rank = num_spare_experts_per_ep_rank
        self.activation = activation
        self.fc1 = GroupedLinear(num_local_experts, hidden_size, _fc1_out(ffn_hidden_size, activation), bias=False,
                                 params_dtype=params_dtype, device=device, single_grouped_weight=True,
                                 init_method=lambda t: nn.init.normal_(t, std=init_std))
        self.fc2 = GroupedLinear(num_local_experts, ffn_hidden_size, hidden_size, bias=False,
                                 params_dtype=params_dtype, device=device, single_grouped_weight=True,
                                 init_method=lambda t: nn.init.normal_(t, std=init_std / math.sqrt(2)))
        for p in self.parameters():
            p.allreduce = False  # expert parameters: reduced over the expert-data-parallel group
        self._spare_grad_key = None
        self._accumulate_mask: Optional[torch.Tensor] = None
        self.spare_grads: Optional[Tuple[torch.Tensor, torch.Tensor]] = None

    def weights(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(fc1 [L, fc1_out, H], fc2 [L, H, F])``: this rank's home expert weights."""
        return self.fc1.weight, self.fc2.weight

    @property
    def expert_numel(self) -> int:
        """Elements of one expert over both weights (what echo copies per spare slot)."""
        return self.fc1.weight[0].numel() + self.fc2.weight[0].numel()

    def uses_fused_wgrad(self) -> bool:
        """Fused weight-gradient path: grad enabled, both weights need grad and have ``main_grad``."""
        return torch.is_grad_enabled() and all(
            w.requires_grad and getattr(w, "main_grad", None) is not None for w in self.weights())

    def _prepare_spare_grads(self) -> torch.Tensor:
        """The accumulate mask ``[L + k]`` and :attr:`spare_grads` (``[k, ...]`` per weight, ``main_grad``'s dtype):
        static device buffers built on the first fused forward (warm-up, before any capture) and reused; rebuilt
        only if the ``main_grad`` dtype/device changes."""
        w1, w2 = self.weights()
        key = (w1.main_grad.dtype, w2.main_grad.dtype, w1.main_grad.device)
        if self._spare_grad_key != key:
            L, k = self.num_local_experts, self.num_spare_experts_per_ep_rank
            self._accumulate_mask = wgrad_accumulate_mask(L, k, device=w1.main_grad.device)
            self.spare_grads = (spare_grad_buffers([w1], k, dtype=w1.main_grad.dtype)[0],
                                spare_grad_buffers([w2], k, dtype=w2.main_grad.dtype)[0])
            self._spare_grad_key = key
        return self._accumulate_mask

    def forward(self, expert_in: torch.Tensor, m_splits: torch.Tensor,
                echo: Optional[EchoExpertDispatcher] = None, offload_map: Optional[torch.Tensor] = None,
                spare_weights: Optional[Sequence[torch.Tensor]] = None) -> torch.Tensor:
        """``expert_in [M, H]`` rows grouped by local expert, ``m_splits [L + k]`` device tensor -> ``[M, H]``.

        ``echo`` and ``offload_map [E, S]``: the echo weight dispatcher and this forward's plan (both ``None``
        without echo); ``spare_weights``: the spare copies already dispatched for this plan (a plan reused for the
        iteration), else the copies are dispatched here. Backward is collective over the EP group with echo."""
        w1, w2 = self.weights()
        if self.uses_fused_wgrad():
            if echo is None:
                mid = activation_fn(grouped_gemm_autograd(expert_in, [w1], m_splits, fuse_main_grad=True),
                                    self.activation)
                return grouped_gemm_autograd(mid, [w2], m_splits, fuse_main_grad=True)
            mask = self._prepare_spare_grads()
            b1, b2 = self.spare_grads
            s1, s2 = spare_weights or echo.dispatch(offload_map, [w1, w2])  # detached copies
            mid = activation_fn(echo_grouped_gemm(expert_in, w1, s1, m_splits, echo, offload_map, mask, b1),
                                self.activation)
            return echo_grouped_gemm(mid, w2, s2, m_splits, echo, offload_map, mask, b2)
        weights1, weights2 = w1, w2
        if echo is not None:
            s1, s2 = dispatch_spare_weights(echo, offload_map, [w1, w2], spare=spare_weights)
            # one 2-D weight per local expert (home views + spare copies): no concatenated copy of all weights
            weights1 = list(w1.unbind(0)) + list(s1.to(w1.dtype).unbind(0))
            weights2 = list(w2.unbind(0)) + list(s2.to(w2.dtype).unbind(0))
        mid = activation_fn(grouped_gemm(expert_in, weights1, m_splits), self.activation)
        return grouped_gemm(mid, weights2, m_splits)

    def extra_repr(self) -> str:
        return (f"local={self.num_local_experts}, spare={self.num_spare_experts_per_ep_rank}, "
                f"activation={self.activation}")


class SharedExpert(nn.Module):
    """An MLP every token goes through, added to the routed output (DeepSeek-V3, Qwen2-MoE): ``fc1``, the
    activation, ``fc2``; with ``gate`` its output is scaled by ``sigmoid(x @ w_gate)`` per token (Qwen2-MoE).
    Dense parameters (reduced over the data-parallel group like any other)."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, activation: str = "swiglu", gate: bool = False,
                 params_dtype: Optional[torch.dtype] = None, device=None, init_std: float = 0.02):
        super().__init__()
        self.activation = activation
        self.fc1 = nn.Linear(hidden_size, _fc1_out(ffn_hidden_size, activation), bias=False, device=device,
                             dtype=params_dtype)
        self.fc2 = nn.Linear(ffn_hidden_size, hidden_size, bias=False, device=device, dtype=params_dtype)
        nn.init.normal_(self.fc1.weight, std=init_std)
        nn.init.normal_(self.fc2.weight, std=init_std / math.sqrt(2))
        self.gate = None
        if gate:
            self.gate = nn.Linear(hidden_size, 1, bias=False, device=device, dtype=params_dtype)
            nn.init.normal_(self.gate.weight, std=init_std)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = self.fc2(activation_fn(self.fc1(h), self.activation))
        if self.gate is not None:
            out = torch.sigmoid(self.gate(h)) * out
        return out
