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
from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

from moe_graph.grouped_linear import GroupedLinear, fp8_grouped_linear, fp8_grouped_linear_activation
from moe_graph.moe.echo import (
    EchoExpertDispatcher,
    dispatch_spare_weights,
    echo_grouped_gemm,
    spare_grad_buffers,
    wgrad_accumulate_mask,
)
from moe_graph.ops.activation import ACTIVATIONS, GATED_ACTIVATIONS, expert_activation, gated_kind
from moe_graph.ops.dispatch_layout import aligned_groups
from moe_graph.ops import fp8 as _fp8
from moe_graph.moe.token_dispatcher import take_rows
from moe_graph.ops.grouped_gemm import grouped_gemm, grouped_gemm_autograd
from moe_graph.ops.permute import expand_rows

__all__ = ["ACTIVATIONS", "GATED_ACTIVATIONS", "GroupedMLP", "SharedExpert", "check_activation",
           "fc1_out_features"]

def check_activation(activation: str, swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0) -> None:
    """Raises ``ValueError`` naming a bad activation option."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    for name, v in (("swiglu_alpha", swiglu_alpha), ("swiglu_limit", swiglu_limit)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
            raise ValueError(f"{name} must be a finite number > 0, got {v!r}")


def fc1_out_features(ffn_hidden_size: int, activation: str) -> int:
    """Rows of fc1 per expert: ``2F`` for a gated activation, else ``F``."""
    return 2 * ffn_hidden_size if gated_kind(activation) else ffn_hidden_size


class GroupedMLP(nn.Module):
    """``num_local_experts`` (``L``) expert MLPs as two :class:`moe_graph.GroupedLinear` (``fc1 [L, fc1_out, H]``,
    ``fc2 [L, H, F]``, ``fc1_out = 2F`` for a gated activation), run over the rows of ``L + k`` local experts: the
    home experts, then ``k = num_spare_experts_per_ep_rank`` echo spare slots whose weights are copies of other
    ranks' experts.

    Args:
        activation, swiglu_alpha, swiglu_limit: :func:`moe_graph.ops.activation.expert_activation`.
        bias: biases ``fc1.bias [L, fc1_out]``, ``fc2.bias [L, H]`` (zero-initialized), added in the grouped GEMM
            epilogue; the echo spare slots carry copies of them and send their gradients home like the weights'.
        init_std: normal init of ``fc1``; ``fc2`` gets ``init_std / sqrt(2)``.
    """

    def __init__(self, num_local_experts: int, hidden_size: int, ffn_hidden_size: int, activation: str = "swiglu",
                 num_spare_experts_per_ep_rank: int = 0, params_dtype: Optional[torch.dtype] = None, device=None,
                 init_std: float = 0.02, *, swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0,
                 bias: bool = False):
        super().__init__()
        check_activation(activation, swiglu_alpha, swiglu_limit)
        self.num_local_experts = num_local_experts
        self.num_spare_experts_per_ep_rank = num_spare_experts_per_ep_rank
        self.activation = activation
        self.swiglu_alpha, self.swiglu_limit = float(swiglu_alpha), float(swiglu_limit)
        self.fc1 = GroupedLinear(num_local_experts, hidden_size, fc1_out_features(ffn_hidden_size, activation),
                                 bias=bias, params_dtype=params_dtype, device=device, single_grouped_weight=True,
                                 init_method=lambda t: nn.init.normal_(t, std=init_std))
        self.fc2 = GroupedLinear(num_local_experts, ffn_hidden_size, hidden_size, bias=bias,
                                 params_dtype=params_dtype, device=device, single_grouped_weight=True,
                                 init_method=lambda t: nn.init.normal_(t, std=init_std / math.sqrt(2)))
        for p in self.parameters():
            p.allreduce = False  # expert parameters: reduced over the expert-data-parallel group
        self._spare_grad_key = None
        self._accumulate_mask: Optional[torch.Tensor] = None
        self.spare_grads: Optional[Tuple[torch.Tensor, ...]] = None

    def _act(self, h: torch.Tensor, row_scale: Optional[torch.Tensor]) -> torch.Tensor:
        return expert_activation(h, self.activation, row_scale, swiglu_alpha=self.swiglu_alpha,
                                 swiglu_limit=self.swiglu_limit)

    def _fp8_act(self, h: torch.Tensor, m_splits: torch.Tensor, recipe, row_scale: Optional[torch.Tensor]):
        """fc2's FP8 input: the activation writes both FP8 copies directly (``ops.fp8.quantize_activation``, one
        op from fc1's output, bit-equal to quantizing :meth:`_act`'s output); with ``FUSED_FP8_ACTIVATION`` off,
        :meth:`_act`'s 16-bit output (quantized by fc2)."""
        if not FUSED_FP8_ACTIVATION:
            return self._act(h, row_scale)
        return _fp8.quantize_activation(h, m_splits, recipe, self.activation, row_scale,
                                        swiglu_alpha=self.swiglu_alpha, swiglu_limit=self.swiglu_limit)

    def _fp8_fc1_act(self, expert_in, m_splits: torch.Tensor, weights1, b1, recipe,
                     row_scale: Optional[torch.Tensor], fuse: bool = False):
        """fc1 and the activation under ``recipe``: fc2's FP8 input. With ``FUSED_FP8_ACTIVATION_BACKWARD`` one
        autograd node (``grouped_linear.fp8_grouped_linear_activation``: fc1's FP8 output gradient quantized straight
        from the activation's output gradient, without the 16-bit ``grad_h`` in memory); else fc1 then
        :meth:`_fp8_act` (the same results bit for bit)."""
        if FUSED_FP8_ACTIVATION and FUSED_FP8_ACTIVATION_BACKWARD:
            return fp8_grouped_linear_activation(expert_in, m_splits, weights1, b1, recipe, self.activation,
                                                 row_scale, swiglu_alpha=self.swiglu_alpha,
                                                 swiglu_limit=self.swiglu_limit, fuse=fuse)
        return self._fp8_act(fp8_grouped_linear(expert_in, m_splits, weights1, b1, recipe, fuse=fuse), m_splits,
                             recipe, row_scale)

    def weights(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(fc1 [L, fc1_out, H], fc2 [L, H, F])``: this rank's home expert weights."""
        return self.fc1.weight, self.fc2.weight

    def biases(self) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """``(fc1 [L, fc1_out], fc2 [L, H])`` biases, ``None`` without ``bias``."""
        return (self.fc1.bias, self.fc2.bias) if self.fc1.use_bias else None

    def expert_params(self) -> List[torch.Tensor]:
        """Every per-expert tensor echo copies into a spare slot, stacked over the ``L`` home experts on dim 0:
        the weights, then the biases (when present)."""
        return list(self.weights()) + list(self.biases() or ())

    @property
    def expert_numel(self) -> int:
        """Elements of one expert over all its tensors (what echo copies per spare slot)."""
        return sum(t[0].numel() for t in self.expert_params())

    def uses_fused_wgrad(self) -> bool:
        """Fused weight-gradient path: grad enabled, both weights need grad and have ``main_grad`` (the biases'
        gradients go through autograd, as :class:`moe_graph.GroupedLinear` delivers them)."""
        return torch.is_grad_enabled() and all(
            w.requires_grad and getattr(w, "main_grad", None) is not None for w in self.weights())

    def _prepare_spare_grads(self) -> torch.Tensor:
        """The accumulate mask ``[L + k]`` and :attr:`spare_grads` (``[k, ...]`` per :meth:`expert_params` tensor:
        the weights' in ``main_grad``'s dtype, the biases' in fp32 or wider): static device buffers built on the
        first fused forward (warm-up, before any capture) and reused; rebuilt only if the ``main_grad``
        dtype/device changes."""
        w1, w2 = self.weights()
        key = (w1.main_grad.dtype, w2.main_grad.dtype, w1.main_grad.device)
        if self._spare_grad_key != key:
            L, k = self.num_local_experts, self.num_spare_experts_per_ep_rank
            self._accumulate_mask = wgrad_accumulate_mask(L, k, device=w1.main_grad.device)
            grads = [spare_grad_buffers([w], k, dtype=w.main_grad.dtype)[0] for w in (w1, w2)]
            grads += [spare_grad_buffers([b], k, dtype=torch.promote_types(b.dtype, torch.float32))[0]
                      for b in self.biases() or ()]
            self.spare_grads = tuple(grads)
            self._spare_grad_key = key
        return self._accumulate_mask

    def row_alignment(self) -> Optional[int]:
        """The row alignment this forward's expert groups need, for the dispatcher to place the rows at
        (:meth:`moe_graph.moe.token_dispatcher.TokenDispatcher.dispatch`'s ``align_rows``; then ``forward(...,
        aligned=True)``): :data:`FP8_ROW_ALIGNMENT` under an FP8 recipe (with :data:`ALIGNED_DISPATCH`), else
        ``None``."""
        return aligned_rows_for(_fp8.current_recipe())

    def input_recipe(self, hidden: torch.Tensor, echo: bool = False):
        """The recipe under which the dispatcher may hand this forward its input as both FP8 copies
        (:meth:`moe_graph.moe.token_dispatcher.TokenDispatcher.dispatch`'s ``quantize_recipe``): the current FP8
        recipe when :data:`FUSED_FP8_EXPERT_INPUT` is on, ``hidden`` (the rows to dispatch) already has the
        parameters' dtype (the rows the GEMM would quantize) and there is no echo; else ``None``."""
        recipe = _fp8.current_recipe()
        if recipe is None or not FUSED_FP8_EXPERT_INPUT or echo or hidden.dtype != self.fc1.weight.dtype:
            return None
        return recipe

    def output_grad_handoff(self, m_splits: torch.Tensor, aligned: bool, echo: bool = False):
        """A ``moe_graph.fp8.GradHandoff`` for fc2's output gradient, to give both :meth:`forward` (``grad_handoff``)
        and the combine (:meth:`moe_graph.moe.token_dispatcher.TokenDispatcher.combine`), whose backward then
        writes fc2's two FP8 ``dy`` copies itself (the 16-bit ``dy`` never written): under an FP8 recipe with
        :data:`FUSED_FP8_COMBINE_BACKWARD`, the rows already aligned (``aligned``: fc2's output is then the
        combine's input itself), no echo, no fc2 bias (its gradient sums the 16-bit ``dy``) and grad enabled;
        else ``None``."""
        recipe = _fp8.current_recipe()
        if (recipe is None or not FUSED_FP8_COMBINE_BACKWARD or not aligned or echo or self.fc2.use_bias
                or not torch.is_grad_enabled()):
            return None
        return _fp8.GradHandoff(recipe, m_splits)

    def forward(self, expert_in: torch.Tensor, m_splits: torch.Tensor,
                echo: Optional[EchoExpertDispatcher] = None, offload_map: Optional[torch.Tensor] = None,
                spare_weights: Optional[Sequence[torch.Tensor]] = None,
                row_scale: Optional[torch.Tensor] = None, aligned: bool = False,
                grad_handoff: Optional["_fp8.GradHandoff"] = None) -> torch.Tensor:
        """See :meth:`_forward`. Under an FP8 recipe every expert's group must start at a multiple of
        :data:`FP8_ROW_ALIGNMENT` rows (zero rows between the groups): the FP8 weight-gradient GEMM on a GPU reads
        each group's transposed FP8 copy through TMA, whose base address must be 16-byte aligned
        (``UNALIGNED_SPLIT`` otherwise). ``aligned``: the rows come so already (``m_splits`` the padded counts,
        ``row_scale`` padded alike): the dispatcher placed them there (:meth:`row_alignment`). Otherwise the rows
        are regrouped here (:class:`AlignedGroups`) and the output regrouped back. The zero rows change nothing
        (partial tiles are zero-padded anyway; they add nothing to any gradient; no output reads them), on the CPU
        too, which runs the same layout. ``grad_handoff``: :meth:`output_grad_handoff`'s (``aligned``, no echo),
        given to fc2 (``grouped_linear.fp8_grouped_linear``)."""
        if grad_handoff is not None and (not aligned or echo is not None):
            raise ValueError("grad_handoff: needs aligned rows and no echo (GroupedMLP.output_grad_handoff)")
        if _fp8.current_recipe() is None or aligned:
            return self._forward(expert_in, m_splits, echo, offload_map, spare_weights, row_scale, grad_handoff)
        groups = AlignedGroups(m_splits, expert_in.shape[0], FP8_ROW_ALIGNMENT)
        rs = None if row_scale is None else groups.pad(row_scale.view(-1, 1)).view(-1)
        out = self._forward(groups.pad(expert_in), groups.m_splits, echo, offload_map, spare_weights, rs)
        return groups.unpad(out)

    def _forward(self, expert_in: torch.Tensor, m_splits: torch.Tensor,
                 echo: Optional[EchoExpertDispatcher] = None, offload_map: Optional[torch.Tensor] = None,
                 spare_weights: Optional[Sequence[torch.Tensor]] = None,
                 row_scale: Optional[torch.Tensor] = None, grad_handoff=None) -> torch.Tensor:
        """``expert_in [M, H]`` rows grouped by local expert, ``m_splits [L + k]`` device tensor -> ``[M, H]``.

        ``row_scale [M]`` (fp32 or the activation dtype, optional): each row's factor, applied to the activation
        before fc2 (:func:`moe_graph.ops.activation.expert_activation`): the result is the expert MLP's output
        times ``row_scale``. Not with ``bias`` (the fc2 bias would escape the scale: weight the outputs after the
        experts instead). Autograd saves fc1's output, fc2's input and ``row_scale``.

        ``echo`` and ``offload_map [E, S]``: the echo weight dispatcher and this forward's plan (both ``None``
        without echo); ``spare_weights``: the spare copies (one per :meth:`expert_params` tensor) already
        dispatched for this plan (a plan reused for the iteration), else the copies are dispatched here. Backward
        is collective over the EP group with echo."""
        w1, w2 = self.weights()
        b1, b2 = self.biases() or (None, None)
        if row_scale is not None and b2 is not None:
            raise ValueError("row_scale: the experts have biases (the fc2 bias would not be scaled); weight the "
                             "expert outputs after the experts instead")
        recipe = _fp8.current_recipe()
        fused = self.uses_fused_wgrad()
        if recipe is not None and not (fused and echo is not None):
            return self._fp8_forward(expert_in, m_splits, recipe, echo, offload_map, spare_weights, row_scale,
                                     grad_handoff)
        if fused:
            if echo is None:
                mid = self._act(grouped_gemm_autograd(expert_in, [w1], m_splits, bias=b1, fuse_main_grad=True),
                                row_scale)
                return grouped_gemm_autograd(mid, [w2], m_splits, bias=b2, fuse_main_grad=True)
            mask = self._prepare_spare_grads()
            spares = spare_weights or echo.dispatch(offload_map, self.expert_params())  # detached copies
            s1, s2 = spares[0], spares[1]
            g1, g2 = self.spare_grads[0], self.spare_grads[1]
            sb1 = sb2 = gb1 = gb2 = None
            if b1 is not None:
                sb1, sb2 = spares[2], spares[3]
                gb1, gb2 = self.spare_grads[2], self.spare_grads[3]
            mid = self._act(echo_grouped_gemm(expert_in, w1, s1, m_splits, echo, offload_map, mask, g1,
                                              home_bias=b1, spare_bias=sb1, spare_bias_grad=gb1, recipe=recipe),
                            row_scale)
            return echo_grouped_gemm(mid, w2, s2, m_splits, echo, offload_map, mask, g2,
                                     home_bias=b2, spare_bias=sb2, spare_bias_grad=gb2, recipe=recipe)
        weights1, weights2 = w1, w2
        if echo is not None:
            weights1, weights2, b1, b2 = self._with_spares(echo, offload_map, spare_weights)
        mid = self._act(grouped_gemm(expert_in, weights1, m_splits, bias=b1), row_scale)
        return grouped_gemm(mid, weights2, m_splits, bias=b2)

    def _with_spares(self, echo, offload_map, spare_weights):
        """The non-fused echo path's operands: one 2-D weight per local expert (home views + spare copies, no
        concatenated copy of all weights) for fc1 and fc2, and the biases with the spare copies appended."""
        w1, w2 = self.weights()
        b1, b2 = self.biases() or (None, None)
        spares = dispatch_spare_weights(echo, offload_map, self.expert_params(), spare=spare_weights)
        weights1 = list(w1.unbind(0)) + list(spares[0].to(w1.dtype).unbind(0))
        weights2 = list(w2.unbind(0)) + list(spares[1].to(w2.dtype).unbind(0))
        if b1 is not None:
            b1 = torch.cat([b1, spares[2].to(b1.dtype)])
            b2 = torch.cat([b2, spares[3].to(b2.dtype)])
        return weights1, weights2, b1, b2

    def _fp8_forward(self, expert_in, m_splits, recipe, echo, offload_map, spare_weights, row_scale,
                     grad_handoff=None):
        """Both expert GEMMs in FP8 (``moe_graph.fp8.autocast``), the weights quantized at every forward (the
        distributed optimizer updates them through buffers that version counters do not see, so no copy is kept
        across forwards; ``GroupedLinear``'s ``is_first_microbatch`` is the per-step cache). Fused ``main_grad``
        without echo; echo without ``main_grad`` here (the spare copies' gradients go home through autograd); echo
        with fused ``main_grad`` runs :func:`moe_graph.moe.echo.echo_grouped_gemm` with the recipe (``forward``)."""
        w1, w2 = self.weights()
        b1, b2 = self.biases() or (None, None)
        if echo is None:
            fuse = self.uses_fused_wgrad()
            mid = self._fp8_fc1_act(expert_in, m_splits, [w1], b1, recipe, row_scale, fuse)
            return fp8_grouped_linear(mid, m_splits, [w2], b2, recipe, fuse=fuse, grad_handoff=grad_handoff)
        weights1, weights2, b1, b2 = self._with_spares(echo, offload_map, spare_weights)
        mid = self._fp8_fc1_act(expert_in, m_splits, weights1, b1, recipe, row_scale)
        return fp8_grouped_linear(mid, m_splits, weights2, b2, recipe)

    def extra_repr(self) -> str:
        return (f"local={self.num_local_experts}, spare={self.num_spare_experts_per_ep_rank}, "
                f"activation={self.activation}, bias={self.fc1.use_bias}")


# FP8 experts: the activation writes fc2's FP8 input (both copies) directly; False: the 16-bit activation output,
# quantized by fc2 (the same bytes; tests compare the two)
FUSED_FP8_ACTIVATION = True
# ... and its backward writes fc1's FP8 output gradient (both copies) directly, with the row scale's gradient from the
# same op (blockwise / MXFP8), fc1 and the activation one autograd node; False: the activation's backward writes the
# 16-bit grad_h, quantized by fc1's backward (the same bytes; the same row-scale gradient on the CPU)
FUSED_FP8_ACTIVATION_BACKWARD = True

# ... and the combine's backward writes fc2's two FP8 output-gradient copies directly, the routing probabilities
# applied first (GroupedMLP.output_grad_handoff, ops.permute.reduce_rows' grad_handoff; EP 1), or the regrouping of
# the returned gradient (ops.permute.expand_rows' grad_handoff; EP > 1, fixed-split exchange) or the per-destination
# exchange's receive side (moe.exchange.ToSources; host-sized, NVSHMEM); False: the 16-bit
# dy, quantized by fc2's backward (the same bytes; tests compare the two)
FUSED_FP8_COMBINE_BACKWARD = True

# ... and the dispatcher writes the expert input's two FP8 copies straight from the tokens where it can
# (GroupedMLP.input_recipe, ops.permute.expand_quantize); False: the 16-bit expert input, quantized by fc1 (the same
# bytes; tests compare the two)
FUSED_FP8_EXPERT_INPUT = True

# Rows per expert group boundary under FP8 (the GPU wgrad's TMA alignment of the transposed FP8 copies: 16 bytes)
FP8_ROW_ALIGNMENT = 16

# The dispatcher places the rows at their aligned rows itself where its path composes the alignment into its index
# maps (GroupedMLP.row_alignment); False: the experts always regroup (AlignedGroups; the tests' reference)
ALIGNED_DISPATCH = True


def aligned_rows_for(recipe) -> Optional[int]:
    """The row alignment the dispatcher places the expert groups at under ``recipe`` (the experts' FP8 recipe or
    ``None``): :data:`FP8_ROW_ALIGNMENT` under an FP8 recipe with :data:`ALIGNED_DISPATCH` on (read at each call),
    else ``None`` (no alignment, or the experts regroup)."""
    return FP8_ROW_ALIGNMENT if recipe is not None and ALIGNED_DISPATCH else None


class AlignedGroups:
    """Rows grouped by expert (``m_splits [G]`` on the device, groups clamped to ``rows`` as the grouped GEMM does)
    regrouped so that group ``g`` starts at a multiple of ``align`` rows, zero rows after each group, in a static
    ``padded_rows = ceil_align(rows + (align - 1) * G)`` buffer; :attr:`m_splits` are the padded counts. The index
    maps come from one native op (:func:`moe_graph.ops.dispatch_layout.aligned_groups`, two launches on CUDA, no
    sync); the rows move with the native row gather (differentiable), FP8-dispatched rows
    (``ops.fp8.QuantizedRows``) with bit-exact byte gathers."""

    def __init__(self, m_splits: torch.Tensor, rows: int, align: int):
        self.rows = rows
        self.m_splits, self.source_of_padded, self.padded_of_source = aligned_groups(m_splits, rows, align)
        self.padded_rows = self.source_of_padded.shape[0]

    def pad(self, x):
        """``[rows, X]`` -> ``[padded_rows, X]`` (differentiable), or a ``QuantizedRows`` regrouped."""
        if isinstance(x, _fp8.QuantizedRows):
            def take(t):
                return take_rows(t.view(torch.uint8), self.source_of_padded).view(t.dtype)
            return _fp8.QuantizedRows(_fp8.carrier(x.carrier, self.padded_rows, self.unpad), take(x.data),
                                      take(x.scale), x.kind)
        return expand_rows(x, self.source_of_padded, self.padded_of_source.view(-1, 1))

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        """``[padded_rows, X]`` -> ``[rows, X]`` (differentiable; rows past the groups are zero)."""
        return expand_rows(y, self.padded_of_source, self.source_of_padded.view(-1, 1))


class SharedExpert(nn.Module):
    """An MLP every token goes through, added to the routed output (DeepSeek-V3, Qwen2-MoE): ``fc1``, the
    activation (:func:`moe_graph.ops.activation.expert_activation`), ``fc2`` (with biases when ``bias``); with
    ``gate`` its output is scaled by ``sigmoid(x @ w_gate)`` per token (Qwen2-MoE). Dense parameters (reduced over
    the data-parallel group like any other)."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, activation: str = "swiglu", gate: bool = False,
                 params_dtype: Optional[torch.dtype] = None, device=None, init_std: float = 0.02, *,
                 swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0, bias: bool = False):
        super().__init__()
        check_activation(activation, swiglu_alpha, swiglu_limit)
        self.activation = activation
        self.swiglu_alpha, self.swiglu_limit = float(swiglu_alpha), float(swiglu_limit)
        self.fc1 = nn.Linear(hidden_size, fc1_out_features(ffn_hidden_size, activation), bias=bias, device=device,
                             dtype=params_dtype)
        self.fc2 = nn.Linear(ffn_hidden_size, hidden_size, bias=bias, device=device, dtype=params_dtype)
        nn.init.normal_(self.fc1.weight, std=init_std)
        nn.init.normal_(self.fc2.weight, std=init_std / math.sqrt(2))
        for lin in (self.fc1, self.fc2):
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        self.gate = None
        if gate:
            self.gate = nn.Linear(hidden_size, 1, bias=False, device=device, dtype=params_dtype)
            nn.init.normal_(self.gate.weight, std=init_std)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = self.fc2(expert_activation(self.fc1(h), self.activation, swiglu_alpha=self.swiglu_alpha,
                                         swiglu_limit=self.swiglu_limit))
        if self.gate is not None:
            out = torch.sigmoid(self.gate(h)) * out
        return out
