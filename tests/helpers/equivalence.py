"""Training equivalence: the library's whole training machinery against an independent single-process oracle.

For each configuration (:data:`MATRIX`) the same model (same initial parameters, seeded by their *global* names)
is trained for :data:`STEPS` steps twice:

* **machinery** (:func:`machinery_worker`, on gloo ranks): parallel_state, ``MoELayer`` with expert parallelism and
  echo, ``DistributedDataParallel`` (buffers, fused ``main_grad``, optional ``overlap_grad_reduce``),
  ``DistributedOptimizer`` (ZeRO-1, clipping, loss scaler), the pipeline schedules and
  :func:`moe_graph.train.step.train_step`;
* **oracle** (:func:`oracle_train`): ONE process, the whole global batch in one forward, plain autograd,
  ``torch.optim.AdamW`` and ``torch.nn.utils.clip_grad_norm_``; no DDP, no distributed optimizer, no echo, no
  pipeline, no microbatch split, no loss scaler, dropless routing. It uses the model classes (their per-token math
  is tested elsewhere) with ``aux_loss_coeff = z_loss_coeff = 0``: it computes the router losses itself from the
  routers' outputs, and applies the expert-bias sign rule itself.

The objective both must minimize: the global batch is split into ``D x M`` token groups (``D`` data-parallel ranks,
``M`` microbatches; group ``(d, j)`` is microbatch ``j`` of rank ``d``), and

    loss = mean over tokens of cross-entropy + mean over groups of (aux_coeff * aux_g + z_coeff * z_g)

summed over layers, with ``aux_g`` the load-balancing loss of the group's tokens (``local``), of the group's
scores against the expert fractions of microbatch ``j`` over the rank's EP group (``global``), or averaged over
the group's sequences (``sequence``), as Megatron defines them per microbatch.

Equal math gives equal parameters because (1) Adam's ``eps`` is 1e-3, not 1e-8: the update ``m / (sqrt(v) + eps)``
of a gradient near 0 has slope ``lr / eps`` in the gradient, so with eps = 1e-8 a rounding difference of 1e-9 in a
tiny gradient summed in another order (microbatches, ranks, echo's spare-slot gradients) moves a weight by 1e-3;
with eps = 1e-3 it moves it by 1e-8, while the gradients that matter (1e-2 .. 1) still get Adam's normalized step;
(2) no parameter starts at a value its update dwarfs: LayerNorm weights and biases start at random values, not 1
and 0 (a zero-initialized bias compared relative to its own size after three steps magnifies the same effect);
(3) the data are continuous random values (no exact routing ties) and the router weights are large (std 0.5) so
that top-k margins are far above fp32 rounding; (4) the loss scale is a power of two (exact in fp32).
With eps = 1e-4 and LayerNorm at 1/0 the 4-layer rows differed by 2e-5 relative on a LayerNorm bias.

Dropless rows (``capacity`` set): the machinery runs at a tight static capacity factor (1.0, 1.1) on the skewed
routing of :func:`init_model`. With ``overflow="rerun"`` (:class:`moe_graph.train.step.OverflowRerun`, no adaptive
raise) an overflowed step is skipped and rerun, and the row must equal the dropless oracle and have rerun at least
one step (or it proves nothing); with ``overflow="drop"`` (the control) routes are dropped and the row must differ
from the oracle.

FP8 rows (``fp8`` set; :func:`fp8_recipe`): the machinery trains with ``train_step(fp8_recipe=...)`` (fused fp32
``main_grad``; echo through the FP8 ``echo_grouped_gemm``), the oracle replaces each MoE layer's experts with
:func:`fp8_oracle_moe`: its own router, then every expert GEMM group the machinery's ranks form (per microbatch,
destination rank and local column, rows by source rank then token order; :func:`fp8_groups`) through the plain
PyTorch quantize-dequantize of :mod:`helpers.fp8_reference` (TE-reference quantizers, float64 products), plain
autograd. The groups matter: the wgrad's columnwise tiles run along each group's rows. With echo the oracle takes
which routes moved to a spare slot from the machinery (see :func:`record_echo_plans`).
With power-of-two scales (TE's default ``Float8BlockScaling``, MXFP8's E8M0) the rows use the fp32 tolerances:
a tile's amax only picks the exponent of its scale, so an fp32 rounding difference flips an element's FP8 value
only if that element itself lies within an ulp of an FP8 rounding boundary (oracles whose initial parameters differ
by 2e-7 relative noise agree to 7e-7, 3 seeds each); for the same reason those rows barely depend on the tile
layout (an oracle quantizing each expert as one group differs by 5e-7). With fp32 scales (``blockwise_fp32_scales``:
``power_2_scale=False``, scale = 448 / amax) every element's FP8 value depends on its tile's amax, so the layout
matters (that naive oracle differs by 1.3e-2, ``test_fp8_rows_pin_down_the_expert_layout``), and so does fp32
rounding: an ulp of the amax rescales the whole tile, and 2e-7 noise on the initial parameters moves that oracle by
up to 3.2e-4 (parameters), 2.5e-5 (loss) and 7.6e-4 (grad norm) in 3 steps (3 seeds at EP 2, 5 at EP 2 x DP 2):
FP8 rounding amplifies an fp32 ulp up to 2^20-fold where an element crosses a boundary. Those rows are compared at
:data:`TOL_FP8_FP32_SCALES` (param 2e-3, loss 1e-4, norm 2e-3), still 6x below the naive layout's difference.

Tolerances (fp32): parameters 1e-5 relative (max |diff| / max |oracle| per tensor), losses 1e-5, grad norm 1e-4.
bf16 parameters with fp32 ``main_grad`` against the fp32 oracle: losses 5e-3 relative, grad norm 5e-2 relative,
parameters 3e-2 *absolute* (the weights are O(1)). bf16 keeps 8 bits of mantissa: every stored weight and
activation is off by up to 2^-9 relative, so gradients differ by about 1e-2 relative, and Adam's first steps are
about ``lr * sign(g)``: a small gradient whose sign flips moves its weight by up to ``2 lr`` per step, i.e.
``STEPS * 2 lr = 6e-2`` at worst, far more than 1e-5 relative for the zero-initialized LayerNorm biases.

CLI (from the checkout's root): ``PYTHONPATH=python:tests python -m helpers.equivalence [--all] [--only NAME ...] [--out PATH]`` prints one line per
configuration (PASS/FAIL and the max differences) and a total; without ``--all`` it runs the CI subset
(:data:`CI_ROWS`). It writes nothing unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import subprocess
import sys
import time
import traceback
import zlib
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe_graph import parallel_state as ps
from moe_graph.distributed.ddp import DistributedDataParallel
from moe_graph.distributed.launch import run_distributed
from moe_graph.distributed.optimizer import DistributedOptimizer, DynamicLossScaler
from moe_graph.grouped_linear import GroupedLinear
from moe_graph.moe.layer import MoELayer
from moe_graph.moe.router import aux_loss_scores, router_aux_loss, router_z_loss, routing_map, sequence_aux_loss
from moe_graph.train import schedules
from moe_graph.train.checkpoint import global_name, global_tensors, is_expert
from moe_graph.train.step import OverflowRerun, make_train_step, train_step

STEPS = 3
VOCAB, HIDDEN, FFN, EXPERTS, TOPK, SEQ, GLOBAL_BATCH = 13, 16, 12, 8, 2, 8, 8
LR, EPS, WD, BETAS = 1e-2, 1e-3, 0.01, (0.9, 0.999)
PAD = 0  # token id whose positions are MoE padding (padding_mask rows)
TOL = {"param": 1e-5, "loss": 1e-5, "norm": 1e-4}
TOL_BF16 = {"param": 3e-2, "loss": 5e-3, "norm": 5e-2}  # bf16 "param": absolute (see the module docstring)
TOL_FP8_FP32_SCALES = {"param": 2e-3, "loss": 1e-4, "norm": 2e-3}  # FP8 with fp32 block scales (module docstring)


@dataclasses.dataclass
class Row:
    """One configuration of the matrix (``world = pp * dp``; EP ranks are data-parallel ranks too)."""

    name: str
    world: int = 1
    ep: int = 1
    pp: int = 1
    vpp: Optional[int] = None
    microbatches: int = 1
    layers: int = 2
    overlap: bool = False
    echo: int = 0
    echo_donors: Optional[int] = None  # w < R: donor-constrained echo (a rank's spare slots host w donors' experts)
    aux: Optional[str] = None  # "local" | "global" | "sequence"
    z_loss: bool = False
    expert_bias: bool = False
    shared_expert: bool = False
    padding: bool = False
    loss_scaler: bool = False
    clip: float = 0.0
    default_groups: bool = False
    grouped: Optional[str] = None  # None | "fused" | "delay" | "delay_fused": a GroupedLinear block per layer
    bf16: bool = False
    expect_error: Optional[str] = None  # the machinery must raise this (regex), e.g. overlap without no_sync
    capacity: Optional[float] = None  # a static capacity factor (the oracle stays dropless)
    overflow: str = "rerun"  # with capacity: "rerun" (must equal the oracle) or "drop" (the control: must differ)
    exchange: str = "auto"  # "symm_mem": the per-destination capacity rule (host-sized exchange on gloo)
    ranks_per_node: Optional[int] = None  # exchange="nvlink": the node-aware two-level exchange
    fp8: Optional[str] = None  # a key of FP8_RECIPES: train_step(fp8_recipe=...); the oracle quantizes per group
    side_stream: bool = False  # overlap_shared_expert: the shared expert and router losses beside the exchange
    overlap_microbatches: bool = False  # train_step(overlap_microbatches=True): F(i+1) beside B(i)
    interleave_stages: bool = False  # train_step(interleave_stages=True): F(i+1) and B(i) alternating at the exchanges
    recompute: bool = False  # MoELayer(recompute=True): the layer's forward run again in backward
    fp8_param_gather: bool = False  # DistributedOptimizer(fp8_param_gather=the row's recipe): FP8 weights gathered in FP8

    @property
    def dp(self) -> int:
        return self.world // self.pp


MATRIX: List[Row] = [
    Row("dp1_mb1"),
    Row("dp1_mb4", microbatches=4),
    Row("dp2_mb1", world=2),
    Row("dp2_mb2", world=2, microbatches=2),
    Row("dp2_mb4", world=2, microbatches=4),
    Row("dp2_mb4_overlap", world=2, microbatches=4, overlap=True),
    Row("dp2_mb2_overlap_without_no_sync", world=2, microbatches=2, overlap=True,
        expect_error=r"Cannot set grad twice.*no_sync"),
    Row("ep2_mb2", world=2, ep=2, microbatches=2),
    Row("ep2xdp2_mb2", world=4, ep=2, microbatches=2),
    Row("ep2_echo1", world=2, ep=2, microbatches=2, echo=1),
    Row("ep2_echo2", world=2, ep=2, microbatches=2, echo=2),
    Row("ep2xdp2_echo2_overlap", world=4, ep=2, microbatches=2, echo=2, overlap=True),
    Row("ep4_echo2_donors_w1", world=4, ep=4, microbatches=2, echo=2, echo_donors=1),
    Row("ep2_aux_local", world=2, ep=2, microbatches=2, aux="local"),
    Row("ep2_aux_global", world=2, ep=2, microbatches=2, aux="global"),
    Row("ep2_aux_sequence", world=2, ep=2, microbatches=2, aux="sequence"),
    Row("ep2_zloss", world=2, ep=2, microbatches=2, z_loss=True),
    Row("ep2_expert_bias", world=2, ep=2, microbatches=2, expert_bias=True, aux="sequence"),
    Row("ep2_shared_expert", world=2, ep=2, microbatches=2, shared_expert=True),
    Row("ep2_padding_aux_z", world=2, ep=2, microbatches=2, padding=True, aux="local", z_loss=True),
    Row("ep2_loss_scaler_aux", world=2, ep=2, microbatches=2, loss_scaler=True, aux="local", z_loss=True),
    Row("ep2_clip", world=2, ep=2, microbatches=2, clip=0.05, aux="local"),
    Row("ep2_default_groups", world=2, ep=2, microbatches=2, default_groups=True, aux="local", echo=1),
    Row("ep2xdp2_default_groups", world=4, ep=2, microbatches=2, default_groups=True, aux="global"),
    Row("pp2_1f1b_mb4", world=2, pp=2, microbatches=4, aux="local", echo=0),
    Row("pp2_vpp2_mb4", world=2, pp=2, vpp=2, layers=4, microbatches=4, aux="local"),
    Row("pp2xep2_1f1b_mb4_echo1", world=4, pp=2, ep=2, microbatches=4, aux="local", echo=1),
    Row("grouped_fused_main_grad", world=2, microbatches=2, grouped="fused"),
    Row("grouped_delay_wgrad", world=2, microbatches=2, grouped="delay"),
    Row("grouped_delay_wgrad_fused_overlap", world=2, microbatches=2, grouped="delay_fused", overlap=True),
    Row("bf16_ep2_main_grad_fp32", world=2, ep=2, microbatches=2, bf16=True, aux="local"),
]
for _cf in (1.0, 1.1):  # dropless at a static capacity: rerun rows equal the oracle, drop rows (the control) differ
    for _mode in ("rerun", "drop"):
        MATRIX += [
            Row(f"ep2_cap{_cf}_{_mode}", world=2, ep=2, microbatches=2, capacity=_cf, overflow=_mode),
            Row(f"ep2xdp2_cap{_cf}_{_mode}", world=4, ep=2, microbatches=2, capacity=_cf, overflow=_mode),
            Row(f"ep2_echo1_cap{_cf}_{_mode}", world=2, ep=2, microbatches=2, echo=1, capacity=_cf, overflow=_mode),
            Row(f"pp2xep2_1f1b_cap{_cf}_{_mode}", world=4, pp=2, ep=2, microbatches=4, aux="local", capacity=_cf,
                overflow=_mode),
        ]
for _cf in (0.9, 1.0):  # the per-destination capacity rule (exchange="symm_mem": variable-size, host-sized on gloo)
    for _mode in ("rerun", "drop"):
        MATRIX += [
            Row(f"ep2_dest_cap{_cf}_{_mode}", world=2, ep=2, microbatches=2, capacity=_cf, overflow=_mode,
                exchange="symm_mem"),
            Row(f"ep4_dest_cap{_cf}_{_mode}", world=4, ep=4, microbatches=2, capacity=_cf, overflow=_mode,
                exchange="symm_mem"),
            Row(f"ep4_echo1_dest_cap{_cf}_{_mode}", world=4, ep=4, microbatches=2, echo=1, capacity=_cf,
                overflow=_mode, exchange="symm_mem"),
            Row(f"pp2xep2_1f1b_dest_cap{_cf}_{_mode}", world=4, pp=2, ep=2, microbatches=4, aux="local", capacity=_cf,
                overflow=_mode, exchange="symm_mem"),
        ]
MATRIX += [
    Row("ep2_dest_dropless", world=2, ep=2, microbatches=2, exchange="symm_mem"),
    Row("ep4_echo2_dest_dropless_aux", world=4, ep=4, microbatches=2, echo=2, aux="global", exchange="symm_mem"),
    Row("ep2xdp2_dest_cap1.0_rerun", world=4, ep=2, microbatches=2, capacity=1.0, exchange="symm_mem"),
]
# the fused exchange's semantics (exchange="nvlink": HostSizedFusedExchange on gloo), flat and node-aware
MATRIX += [
    Row("ep2_nvlink_dropless", world=2, ep=2, microbatches=2, exchange="nvlink"),
    Row("ep2_nvlink_cap1.0_rerun", world=2, ep=2, microbatches=2, capacity=1.0, exchange="nvlink"),
    Row("ep2_nvlink_cap0.9_drop", world=2, ep=2, microbatches=2, capacity=0.9, overflow="drop", exchange="nvlink"),
    Row("ep4_echo1_nvlink_cap1.0_rerun", world=4, ep=4, microbatches=2, echo=1, capacity=1.0, exchange="nvlink"),
    Row("ep4_nvlink_2x2_dropless_aux", world=4, ep=4, microbatches=2, aux="global", exchange="nvlink",
        ranks_per_node=2),
    Row("ep4_nvlink_2x2_cap1.0_rerun", world=4, ep=4, microbatches=2, capacity=1.0, exchange="nvlink",
        ranks_per_node=2),
    Row("ep4_echo2_nvlink_2x2_cap0.9_rerun", world=4, ep=4, microbatches=2, echo=2, capacity=0.9, exchange="nvlink",
        ranks_per_node=2),
    Row("pp2xep2_1f1b_nvlink_cap1.0_rerun", world=4, pp=2, ep=2, microbatches=4, aux="local", capacity=1.0,
        exchange="nvlink"),
    Row("bf16_ep2_nvlink", world=2, ep=2, microbatches=2, bf16=True, aux="local", exchange="nvlink"),
]
for _fp8 in ("blockwise", "mxfp8", "blockwise_fp32_scales"):  # FP8 experts (train_step's fp8_recipe) against the per-group QDQ oracle
    MATRIX += [
        Row(f"fp8_{_fp8}_ep2", world=2, ep=2, microbatches=2, fp8=_fp8),
        Row(f"fp8_{_fp8}_ep2_echo1", world=2, ep=2, microbatches=2, echo=1, fp8=_fp8),
        Row(f"fp8_{_fp8}_ep2_cap1.0_rerun", world=2, ep=2, microbatches=2, capacity=1.0, overflow="rerun", fp8=_fp8),
        Row(f"fp8_{_fp8}_ep2xdp2", world=4, ep=2, microbatches=2, fp8=_fp8),
        Row(f"fp8_{_fp8}_grouped_delay_wgrad_fused_overlap", world=2, microbatches=2, grouped="delay_fused",
            overlap=True, fp8=_fp8),
    ]
MATRIX += [  # FP8 experts on the per-destination (host-sized) and fused exchanges: the receive side writes the FP8
    # expert input and fc2's FP8 dy (aligned groups placed by the exchange)
    Row("fp8_blockwise_ep2_dest", world=2, ep=2, microbatches=2, fp8="blockwise", exchange="symm_mem"),
    Row("fp8_mxfp8_ep2_nvlink", world=2, ep=2, microbatches=2, fp8="mxfp8", exchange="nvlink"),
]
MATRIX += [  # the shared expert and the router losses on a side stream beside the exchange (overlap_shared_expert)
    Row("ep2_shared_side_aux_z", world=2, ep=2, microbatches=2, shared_expert=True, aux="local", z_loss=True,
        side_stream=True),
    Row("ep2_shared_side_cap1.0_rerun", world=2, ep=2, microbatches=2, shared_expert=True, capacity=1.0,
        side_stream=True),
    Row("ep2xdp2_shared_side_overlap", world=4, ep=2, microbatches=2, overlap=True, shared_expert=True,
        side_stream=True),
    Row("pp2xep2_1f1b_shared_side_echo1", world=4, pp=2, ep=2, microbatches=4, aux="local", echo=1,
        shared_expert=True, side_stream=True),
    Row("ep2_mb4_overlap_microbatches_shared_side_aux_z", world=2, ep=2, microbatches=4, aux="local", z_loss=True,
        shared_expert=True, side_stream=True, overlap_microbatches=True),
    Row("ep2xdp2_echo1_overlap_microbatches_grad_reduce", world=4, ep=2, microbatches=2, echo=1, overlap=True,
        overlap_microbatches=True),
    Row("ep2_cap1.0_rerun_overlap_microbatches", world=2, ep=2, microbatches=2, capacity=1.0,
        overlap_microbatches=True),
    Row("ep2_mb4_overlap_microbatches_recompute_shared_side_aux", world=2, ep=2, microbatches=4, aux="local",
        shared_expert=True, side_stream=True, overlap_microbatches=True, recompute=True),
    Row("pp2_vpp2_mb4_overlap_microbatches", world=2, pp=2, vpp=2, layers=4, microbatches=4, aux="local",
        overlap_microbatches=True),  # the interleaved schedule's steady forward beside its backward
    # the stage interleave (F(i+1) in a worker thread, alternating with B(i) at the token exchanges)
    Row("ep2xdp2_echo1_interleave_stages_grad_reduce", world=4, ep=2, microbatches=2, echo=1, overlap=True,
        overlap_microbatches=True, interleave_stages=True),
    Row("ep2_cap1.0_rerun_interleave_stages", world=2, ep=2, microbatches=2, capacity=1.0,
        overlap_microbatches=True, interleave_stages=True),
    Row("ep2_mb4_interleave_stages_recompute_shared_side_aux", world=2, ep=2, microbatches=4, aux="local",
        shared_expert=True, side_stream=True, overlap_microbatches=True, interleave_stages=True, recompute=True),
]
MATRIX += [Row(f"fp8_{_fp8}_dp2_fp8_param_gather", world=2, microbatches=2, fp8=_fp8, fp8_param_gather=True)
           for _fp8 in ("blockwise", "blockwise_fp32_scales")]  # expert DP 2: the expert shards are gathered in FP8
MATRIX += [Row("fp8_blockwise_ep2xdp2_fp8_param_gather", world=4, ep=2, microbatches=2, fp8="blockwise",
               fp8_param_gather=True)]
MATRIX += [Row(f"fp8_{_fp8}_hybrid_ep2_echo1", world=2, ep=2, microbatches=2, echo=1, fp8=f"{_fp8}_hybrid")
           for _fp8 in ("blockwise", "mxfp8")]
# CI keeps one row per mechanism (15 rows, a few minutes on 2 cores); the 4-rank variants of the rerun, the
# node-aware exchange and the drop control of the per-pair rule run in the full matrix (--all)
CI_ROWS = ["dp2_mb4_overlap", "ep2xdp2_echo2_overlap", "ep2_loss_scaler_aux",
           "pp2_vpp2_mb4", "grouped_delay_wgrad_fused_overlap", "ep2_cap1.0_rerun",
           "ep2_dest_cap1.0_rerun", "ep4_echo1_dest_cap1.0_rerun",
           "fp8_blockwise_fp32_scales_ep2_echo1", "fp8_mxfp8_ep2_cap1.0_rerun",
           "ep2_nvlink_cap1.0_rerun", "ep2_mb4_overlap_microbatches_shared_side_aux_z"]


# ================================================================================================ the model ==
class Block(nn.Module):
    def __init__(self, moe_kwargs: Dict, dtype, grouped: Optional[str]):
        super().__init__()
        self.ln = nn.LayerNorm(HIDDEN, dtype=dtype)
        self.moe = MoELayer(HIDDEN, FFN, EXPERTS, TOPK, device="cpu", params_dtype=dtype, **moe_kwargs)
        self.gl = None
        if grouped is not None:  # two token halves through two weights: TE's GroupedLinear surface
            self.gl = GroupedLinear(2, HIDDEN, HIDDEN, bias=True, params_dtype=dtype, device="cpu",
                                    fuse_wgrad_accumulation="fused" in grouped, delay_wgrad_compute="delay" in grouped)

    def forward(self, x, pad):
        x = x + self.moe(self.ln(x), padding_mask=pad)
        if self.gl is not None:  # GEMM 0 for the first half of the sequence positions, GEMM 1 for the second
            B, S, H = x.shape
            h = torch.cat([x[:, :S // 2].reshape(-1, H), x[:, S // 2:].reshape(-1, H)])
            if self.gl.delay_wgrad_compute and h.requires_grad:
                gl = self.gl
                h.register_hook(lambda g: gl.backward_dw())  # the delayed wgrad GEMM, later in backward
            n0 = B * (S // 2)
            y = torch.tanh(self.gl(h, [n0, h.shape[0] - n0]))
            x = x + torch.cat([y[:n0].view(B, S // 2, H), y[n0:].view(B, S - S // 2, H)], dim=1)
        return x


class EquivLM(nn.Module):
    """Embedding -> blocks (LayerNorm, MoE with residual, optional GroupedLinear) -> LayerNorm -> head -> CE.

    A pipeline stage with ``layer_ids`` / ``first`` / ``last`` (``set_input_tensor`` takes the previous stage's
    activation). ``forward(tokens, labels)`` returns the mean cross-entropy (last stage) or the activation;
    MoE padding: positions whose token is :data:`PAD` (when ``padding``)."""

    def __init__(self, moe_kwargs: Dict, dtype=torch.float32, layer_ids=None, first=True, last=True, layers=2,
                 grouped=None, padding=False):
        super().__init__()
        self.layer_ids = list(range(layers)) if layer_ids is None else list(layer_ids)
        self.first, self.last, self.padding = first, last, padding
        if first:
            self.emb = nn.Embedding(VOCAB, HIDDEN, dtype=dtype)
        self.blocks = nn.ModuleList([Block(moe_kwargs, dtype, grouped) for _ in self.layer_ids])
        if last:
            self.ln_f = nn.LayerNorm(HIDDEN, dtype=dtype)
            self.head = nn.Linear(HIDDEN, VOCAB, bias=False, dtype=dtype)
        self.input_tensor = None

    def set_input_tensor(self, t) -> None:
        self.input_tensor = t

    def moe_layers(self):
        return [b.moe for b in self.blocks]

    def forward(self, tokens, labels):
        x = self.emb(tokens) if self.first else self.input_tensor
        pad = (tokens == PAD) if self.padding else None
        for b in self.blocks:
            x = b(x, pad)
        if not self.last:
            return x
        logits = self.head(self.ln_f(x)).float()
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def init_model(stage: EquivLM, ep_rank: int) -> None:
    """Every parameter from a generator seeded by its global name (experts: the global ``[E, ...]`` tensor, then
    this EP rank's slice), so that every layout holds the same model. Routing is skewed: a direction ``u`` is
    added to every embedding and to the router rows of experts 0..E/2-1 (homed on EP rank 0 with EP 2), so that rank 0
    is overloaded at init and echo has routes to move (k = 2 fills both spare slots)."""
    gu = torch.Generator().manual_seed(7)
    u = torch.randn(HIDDEN, generator=gu)
    u = u - u.mean()
    u = u / u.norm()
    with torch.no_grad():
        for name, p in stage.named_parameters():
            g = global_name(stage, name)
            gen = torch.Generator().manual_seed(zlib.crc32(g.encode()))
            if ".ln" in name or name.startswith("ln_f"):  # LayerNorm: weight 1 + noise, bias not at 0
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.2 * torch.randn(p.shape, generator=gen))
                continue
            if is_expert(p):
                L = p.shape[0]
                full = torch.randn((EXPERTS,) + tuple(p.shape[1:]), generator=gen) * 0.3
                p.copy_(full[ep_rank * L:(ep_rank + 1) * L])
            elif name.endswith("router.weight"):
                w = torch.randn(p.shape, generator=gen) * 0.5
                w[:EXPERTS // 2] += 2.0 * u
                p.copy_(w)
            elif name == "emb.weight":
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5 + 1.5 * u)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


def moe_kwargs(row: Row, oracle: bool) -> Dict:
    kw: Dict = dict(capacity_factor=None)
    if row.shared_expert:
        kw.update(shared_expert_ffn_size=8, shared_expert_gate=True)
    if row.expert_bias:
        kw.update(score_func="sigmoid", enable_expert_bias=True, expert_bias_update_rate=0.05)
    if oracle:
        return dict(kw, ep_size=1)
    if row.aux:
        kw.update(aux_loss_coeff=0.05, aux_loss_type=row.aux)
    if row.z_loss:
        kw.update(z_loss_coeff=0.01)
    if row.echo:
        kw.update(num_spare_experts_per_ep_rank=row.echo)
    if row.echo_donors is not None:
        kw.update(echo_donors=row.echo_donors)
    if row.capacity is not None:
        kw.update(capacity_factor=row.capacity, overflow=row.overflow)
    if row.exchange != "auto":
        kw.update(exchange=row.exchange)
    if row.side_stream:
        kw.update(overlap_shared_expert=True)
    if row.recompute:
        kw.update(recompute=True)
    if row.ranks_per_node is not None:
        kw.update(ranks_per_node=row.ranks_per_node)
    return kw


def global_batch(step: int, padding: bool):
    """``(tokens, labels)`` ``[GLOBAL_BATCH, SEQ]`` of a step (fresh random data every step)."""
    gen = torch.Generator().manual_seed(1000 + step)
    t = torch.randint(1 if not padding else 0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=gen)
    if padding:  # about a quarter of the positions are padding; one sequence of the batch is all padding
        t = torch.where(torch.rand(t.shape, generator=gen) < 0.25, torch.zeros_like(t), t.clamp(min=1))
        t[3] = PAD
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def microbatch_rows(row: Row, d: int, j: int) -> slice:
    """Sequences of the global batch that data-parallel rank ``d`` gets as microbatch ``j``."""
    per = GLOBAL_BATCH // (row.dp * row.microbatches)
    start = (d * row.microbatches + j) * per
    return slice(start, start + per)


# ============================================================================================= the oracle ==
def oracle_train(row: Row, outs: Optional[List[Dict]] = None, naive_fp8_layout: bool = False) -> Dict:
    """Plain single-process training of the whole global batch (see the module docstring). Returns per-step
    losses and grad norms and the final parameters by global name (experts per expert index). FP8 rows: the MoE
    layers' experts are :func:`fp8_oracle_moe` (``outs``: the machinery ranks' results, for echo's plans)."""
    torch.manual_seed(0)
    model = EquivLM(moe_kwargs(row, oracle=True), torch.float32, layers=row.layers,
                    grouped=None if row.grouped is None else "plain", padding=row.padding)
    init_model(model, 0)
    fp8_step = [0]
    if row.fp8:
        plans = [o.get("plans", []) for o in outs] if outs else None
        for layer, b in enumerate(model.blocks):
            b.moe.forward = (lambda x, padding_mask=None, moe=b.moe, layer=layer:
                             fp8_oracle_moe(moe, x, row, fp8_step[0], layer, plans, naive_fp8_layout))
            if b.gl is not None:
                b.gl.forward = lambda h, m_splits, gl=b.gl: fp8_oracle_grouped_linear(gl, h, row)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    captured: List = []
    for b in model.blocks:
        b.moe.router.register_forward_hook(lambda mod, inp, out: captured.append((out, mod.last_logits)))
    D, M = row.dp, row.microbatches
    ep = row.ep
    groups = [(d, j, microbatch_rows(row, d, j)) for d in range(D) for j in range(M)]
    losses, norms = [], []
    for step in range(STEPS):
        fp8_step[0] = step
        tokens, labels = global_batch(step, row.padding)
        captured.clear()
        opt.zero_grad(set_to_none=True)
        ce = model(tokens, labels)
        real = (tokens != PAD) if row.padding else torch.ones_like(tokens, dtype=torch.bool)
        total = ce
        for r, logits in captured:
            scores = r.scores if r.scores is not None else torch.softmax(logits, -1)
            rm = routing_map(r.indices, EXPERTS, r.token_mask).view(GLOBAL_BATCH, SEQ, EXPERTS)
            sc = scores.view(GLOBAL_BATCH, SEQ, EXPERTS)
            lg = logits.view(GLOBAL_BATCH, SEQ, EXPERTS)
            asc = aux_loss_scores(sc, "sigmoid" if row.expert_bias else "softmax")
            extra = 0.0
            for d, j, rows in groups:
                m = real[rows].reshape(-1)
                if row.aux == "local":
                    extra = extra + 0.05 * router_aux_loss(asc[rows].reshape(-1, EXPERTS), rm[rows].reshape(
                        -1, EXPERTS), TOPK, None, m if row.padding else None)
                elif row.aux == "global":  # expert fractions of microbatch j over the rank's EP group
                    e0 = (d // ep) * ep
                    counts = sum(rm[microbatch_rows(row, e, j)].reshape(-1, EXPERTS).sum(0).to(torch.float32)
                                 for e in range(e0, e0 + ep))
                    extra = extra + 0.05 * router_aux_loss(asc[rows].reshape(-1, EXPERTS), rm[rows].reshape(
                        -1, EXPERTS), TOPK, counts, m if row.padding else None)
                elif row.aux == "sequence":
                    extra = extra + 0.05 * sequence_aux_loss(asc[rows], rm[rows], TOPK,
                                                             real[rows] if row.padding else None)
                if row.z_loss:
                    extra = extra + 0.01 * router_z_loss(lg[rows].reshape(-1, EXPERTS), m if row.padding else None)
            total = total + extra / len(groups)
        total.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), row.clip if row.clip > 0 else float("inf"))
        opt.step()
        if row.expert_bias:  # DeepSeek-V3's sign rule on the whole global batch's routes per expert
            with torch.no_grad():
                for b, (r, _l) in zip(model.blocks, captured):
                    counts = routing_map(r.indices, EXPERTS, r.token_mask).sum(0).to(torch.float32)
                    b.moe.router.expert_bias.add_(torch.sign(counts.mean() - counts), alpha=0.05)
                    b.moe.router.local_tokens_per_expert.zero_()
        losses.append(float(ce.detach()))
        norms.append(float(norm))
    return {"losses": losses, "norms": norms, "params": {k: v.clone() for k, v in global_tensors(model).items()}}


# ================================================================================== FP8: the oracle's experts ==
# FP8 tiles along the tokens (the columnwise 128x1 / 32x1 copies of each GEMM's input and output gradient for the
# wgrad) make an expert's weight gradient depend on which tokens share a tile, i.e. on how the machinery's ranks
# lay out each expert's rows. The oracle reproduces that layout from its own routing and the documented rule
# (docs/training.md: a rank's expert input holds, per microbatch, its local columns in order, each column's rows
# by source rank, then in the sender's token order; with echo the spare slots follow the home experts) and runs
# each group through helpers.fp8_reference's quantize-dequantize (TE-reference quantizers, float64 products).
# With echo, which routes move to a spare slot is the planner's load-balancing choice (it changes no math in
# exact arithmetic, only the FP8 tile composition): the oracle takes the machinery's rerouted columns of each
# forward as input (recorded by record_echo_plans), checks them against its own top-k experts, the slot's hosted
# expert and the reroute rule (docs of moe_graph.ops.reroute: a home expert's slots in ascending order take its
# routes in ascending token order), and lays the groups out itself.
def fp8_recipe(row: Row):
    """The row's ``moe_graph.fp8.Recipe`` (None without FP8): TE's defaults by name ("blockwise": power-of-two
    scales, "mxfp8": E8M0), and "blockwise_fp32_scales" (``power_2_scale=False``, scale = 448 / amax: every
    element's FP8 value depends on its tile's amax, so on which tokens share a tile); a ``_hybrid`` suffix: TE's
    HYBRID format (gradients in E5M2)."""
    from moe_graph.ops import fp8

    if row.fp8 is None:
        return None
    if row.fp8 == "blockwise_fp32_scales":
        return fp8.Float8BlockScaling(power_2_scale=False)
    if row.fp8.endswith("_hybrid"):  # TE's Format.HYBRID: E4M3 forward, E5M2 gradients
        return dataclasses.replace(fp8.as_recipe(row.fp8[:-len("_hybrid")]), fp8_format="HYBRID")
    return fp8.as_recipe(row.fp8)


def record_echo_plans(moe: MoELayer, log: List) -> None:
    """Wraps ``moe.echo.plan`` to append each forward's rerouted columns ``[T, K]`` and slot placement."""
    plan = moe.echo.plan

    def recorded(*args, **kwargs):
        out = plan(*args, **kwargs)
        log.append((out[0].detach().clone(), out[2].detach().clone()))
        return out

    moe.echo.plan = recorded


def _fp8_columns(experts: torch.Tensor, recorded) -> torch.Tensor:
    """``[T, K]`` routing columns of one source rank's microbatch: the expert itself, or with echo the recorded
    column after checking it (home expert or a slot hosting it, moved routes per the reroute rule)."""
    if recorded is None:
        return experts
    cols, home_to_spare = recorded
    E = EXPERTS
    spare = cols >= E
    slot = (cols - E).clamp(min=0)
    if not torch.equal(torch.where(spare, experts, cols), experts):
        raise AssertionError("echo: a recorded home column differs from the oracle's top-k expert")
    if bool((spare & (home_to_spare[experts, slot] <= 0)).any()):
        raise AssertionError("echo: a route moved to a slot that does not host its expert")
    # the reroute rule: per expert, slots in ascending order take its routes in ascending token order
    flat_e, flat_c = experts.reshape(-1), cols.reshape(-1)
    for e in range(E):
        idx = (flat_e == e).nonzero().flatten()  # routes of e in token order (then k: one per token)
        got = flat_c[idx]
        if not torch.equal(got, torch.cat([torch.sort(got[got >= E]).values, got[got < E]])):
            raise AssertionError(f"echo: the routes of expert {e} did not move in token order")
    return cols


def fp8_groups(row: Row, experts: torch.Tensor, step: int, layer: int, plans, naive: bool = False) -> List:
    """Every expert GEMM group of the machinery for one layer's forward over the global batch: ``(expert,
    route ids)`` with route id ``t * K + k`` of the global token ``t``, rows in the order they reach the GEMM.
    ``experts [T, K]``: the oracle's top-k experts. ``naive``: one group per expert over the whole batch (the
    single-process layout; the control that shows the rows depend on the layout)."""
    if naive:
        out = []
        for e in range(EXPERTS):
            t, kk = (experts == e).nonzero(as_tuple=True)
            out.append((e, t * TOPK + kk))
        return out
    D, M, ep, k = row.dp, row.microbatches, row.ep, row.echo
    L = EXPERTS // ep
    per = GLOBAL_BATCH // (D * M) * SEQ  # tokens of one microbatch
    groups = []
    for g in range(D // ep):
        for j in range(M):
            cols = {}
            for s in range(ep):
                d = g * ep + s
                t0 = (d * M + j) * per
                rec = None if plans is None or not k else plans[d][(step * M + j) * row.layers + layer]
                cols[s] = (t0, _fp8_columns(experts[t0:t0 + per], rec), rec)
            for r in range(ep):
                for c in range(L + k):
                    ids, host = [], None
                    for s in range(ep):
                        t0, col, rec = cols[s]
                        want = r * L + c if c < L else EXPERTS + r * k + (c - L)
                        t, kk = (col == want).nonzero(as_tuple=True)  # token order (row-major)
                        ids.append((t0 + t) * TOPK + kk)
                        if c >= L and t.numel():
                            host = int(rec[1][:, want - EXPERTS].argmax())
                    ids = torch.cat(ids)
                    if ids.numel():
                        groups.append((r * L + c if c < L else host, ids))
    return groups


def fp8_oracle_moe(moe: MoELayer, x: torch.Tensor, row: Row, step: int, layer: int, plans,
                   naive: bool = False) -> torch.Tensor:
    """The oracle's MoE layer for FP8 rows: the layer's router (its hooks still record), then every group of
    :func:`fp8_groups` through :func:`helpers.fp8_reference.qdq_swiglu_mlp` with the group's expert weights and its
    routes' probabilities applied before fc2 (as the layer does when ``ffn < hidden``), summed per token."""
    from helpers.fp8_reference import qdq_swiglu_mlp

    assert moe.scale_rows and moe.experts.activation == "swiglu" and moe.shared_expert is None
    recipe = fp8_recipe(row)
    h = x.reshape(-1, HIDDEN)
    routing = moe.router(h, None, moe.last_tokens_per_expert)
    w1, w2 = moe.experts.weights()
    probs = routing.probs.reshape(-1)
    out = torch.zeros_like(h)
    for e, ids in fp8_groups(row, routing.indices, step, layer, plans, naive):
        t = torch.div(ids, TOPK, rounding_mode="floor")
        y = qdq_swiglu_mlp(h[t], w1[e], w2[e], recipe, probs[ids])
        out = out.index_add(0, t, y)
    return out.reshape(x.shape)


def fp8_oracle_grouped_linear(gl: GroupedLinear, h: torch.Tensor, row: Row) -> torch.Tensor:
    """The oracle's FP8 ``Block.gl`` over the global batch (``h``: all sequences' first halves, then all second
    halves, as :class:`Block` builds it): each microbatch's half is one group of the machinery's GEMM (its
    columnwise tiles run over that microbatch's rows only), through ``qdq_linear`` plus the bias."""
    from helpers.fp8_reference import qdq_linear

    recipe = fp8_recipe(row)
    half = SEQ // 2
    n0 = GLOBAL_BATCH * half
    per = GLOBAL_BATCH // (row.dp * row.microbatches) * half  # rows of one microbatch's half
    outs = []
    for g in range(2):
        w, b = getattr(gl, f"weight{g}"), getattr(gl, f"bias{g}")
        for m in range(row.dp * row.microbatches):  # microbatch (d, j) is number d * M + j, in sequence order
            rows = h[g * n0 + m * per:g * n0 + (m + 1) * per]
            outs.append(qdq_linear(rows, w, recipe) + b)
    return torch.cat(outs)


# ========================================================================================== the machinery ==
def machinery_worker(rank: int, world: int, row: Row) -> Dict:
    """The library's machinery on this rank (parallel_state, MoELayer EP/echo, DDP, DistributedOptimizer, pipeline
    schedules, :func:`moe_graph.train.step.train_step`)."""
    ps.initialize_model_parallel(pipeline_model_parallel_size=row.pp, expert_model_parallel_size=row.ep,
                                 virtual_pipeline_model_parallel_size=row.vpp)
    try:
        pp_rank, dp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank()
        ep_rank = ps.get_expert_model_parallel_rank()
        chunk_ids = schedules.chunk_layer_ids(row.layers, row.pp, pp_rank, row.vpp)
        nc = len(chunk_ids)
        dtype = torch.bfloat16 if row.bf16 else torch.float32
        kw = moe_kwargs(row, oracle=False)
        if not row.default_groups:
            kw.update(ep_group=ps.get_expert_model_parallel_group(), ep_size=row.ep)
        moved = [0]
        plans: List = []  # FP8 rows with echo: each forward's rerouted columns (see fp8_groups)
        slots = [0]

        def count_moved(mod, inp, out):  # routes echo moved, and the most spare slots in use on this rank
            moved[0] += int((mod.last_load_before - mod.last_load_after).clamp(min=0).sum())
            slots[0] = max(slots[0], int((mod.last_m_splits[mod.num_local_experts:] > 0).sum()))

        stages, ddps = [], []
        for c, ids in enumerate(chunk_ids):
            torch.manual_seed(0)
            stage = EquivLM(kw, dtype, layer_ids=ids, first=pp_rank == 0 and c == 0,
                            last=pp_rank == row.pp - 1 and c == nc - 1, layers=row.layers, grouped=row.grouped,
                            padding=row.padding)
            init_model(stage, ep_rank)
            for m in stage.moe_layers():
                m.register_forward_hook(count_moved)
                if row.fp8 and row.echo:
                    record_echo_plans(m, plans)
            stages.append(stage)
            groups = {} if row.default_groups else dict(
                data_parallel_group=ps.get_data_parallel_group(),
                expert_data_parallel_group=ps.get_expert_data_parallel_group())
            ddps.append(DistributedDataParallel(stage, use_distributed_optimizer=True, overlap_grad_reduce=row.overlap,
                                                bucket_size=200 if row.overlap else None,
                                                grad_reduce_in_fp32=row.bf16, **groups))
        scaler = DynamicLossScaler(initial_scale=2.0 ** 12) if row.loss_scaler else None
        opt = DistributedOptimizer(ddps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, clip_grad=row.clip,
                                   loss_scaler=scaler,
                                   fp8_param_gather=fp8_recipe(row) if row.fp8_param_gather else None)
        model = ddps if row.vpp else ddps[0]

        def my_microbatches(step):
            tokens, labels = global_batch(step, row.padding)
            return [(tokens[microbatch_rows(row, dp_rank, j)], labels[microbatch_rows(row, dp_rank, j)])
                    for j in range(row.microbatches)]

        if row.expect_error is not None:  # the wiring without no_sync must fail loudly, on every rank
            try:
                opt.zero_grad()
                for mb in my_microbatches(0):
                    (model(*mb) / row.microbatches).backward()
                opt.step()
            except RuntimeError as e:
                return {"error": str(e), "matched": bool(re.search(row.expect_error, str(e), re.S))}
            return {"error": None, "matched": False}

        shape = (GLOBAL_BATCH // (row.dp * row.microbatches), SEQ, HIDDEN)
        losses, norms, skipped = [], [], []
        rerun = None
        if row.capacity is not None and row.overflow == "rerun":  # every overflowed step reruns (no raise)
            rerun = OverflowRerun(model, opt, threshold=None, tensor_shape=shape, dtype=dtype)
            step_fn = make_train_step(model, opt, tensor_shape=shape, dtype=dtype, overflow="rerun",
                                      fp8_recipe=fp8_recipe(row), overlap_microbatches=row.overlap_microbatches,
                                      interleave_stages=row.interleave_stages)
        for step in range(STEPS):
            if rerun is not None:
                res = rerun.step(step_fn, my_microbatches(step))
            else:
                res = train_step(model, opt, my_microbatches(step), tensor_shape=shape, dtype=dtype,
                                 fp8_recipe=fp8_recipe(row), overlap_microbatches=row.overlap_microbatches,
                                 interleave_stages=row.interleave_stages)
            losses.append(None if res.loss is None else float(res.loss))
            norms.append(float(res.grad_norm))
            skipped.append(bool(res.skipped))
        if row.fp8_param_gather:  # the FP8 weights' 16-bit copy is current only on this rank's shard
            opt.gather_16bit_params()
        params = {k: v.float().clone() for stage in stages for k, v in global_tensors(stage, ep_rank).items()}
        dropped = sum(m.dispatcher.check_drops() for s in stages for m in s.moe_layers())
        return {"rank": rank, "losses": losses, "norms": norms, "skipped": skipped, "params": params,
                "moved": moved[0], "slots": slots[0], "dropped": dropped, "world": dist.get_world_size(),
                "reruns": rerun.reruns if rerun is not None else 0,
                "passes": rerun.rerun_passes if rerun is not None else 0, "plans": plans}
    finally:
        ps.destroy_model_parallel()


# ============================================================================================= comparison ==
def compare(row: Row, ref: Dict, outs: List[Dict]) -> Dict:
    """Max relative differences of parameters (every rank's copy), losses and grad norms; PASS/FAIL."""
    if row.expect_error is not None:
        ok = all(o.get("matched") for o in outs)
        return {"name": row.name, "ok": ok, "param": float("nan"), "loss": float("nan"), "norm": float("nan"),
                "note": "raised: " + (outs[0].get("error") or "nothing").splitlines()[0][:90]}
    tol = TOL_BF16 if row.bf16 else TOL_FP8_FP32_SCALES if row.fp8 == "blockwise_fp32_scales" else TOL
    pdiff, seen = 0.0, set()
    for o in outs:
        for name, t in o["params"].items():
            r = ref["params"][name]
            denom = 1.0 if row.bf16 else max(float(r.abs().max()), 1e-12)
            pdiff = max(pdiff, float((t - r).abs().max()) / denom)
            seen.add(name)
    missing = set(ref["params"]) - seen
    ldiff = ndiff = 0.0
    for o in outs:
        for a, b in zip(o["losses"], ref["losses"]):
            if a is not None:
                ldiff = max(ldiff, abs(a - b) / max(abs(b), 1e-12))
        for a, b in zip(o["norms"], ref["norms"]):
            ndiff = max(ndiff, abs(a - b) / max(abs(b), 1e-12))
    have_loss = any(a is not None for o in outs for a in o["losses"])
    skipped = any(any(o["skipped"]) for o in outs)
    clipped = row.clip > 0 and min(ref["norms"]) > row.clip
    note = f"dropped {sum(o['dropped'] for o in outs)}"
    if row.echo:
        slots = max(o["slots"] for o in outs)
        note = f"echo moved {sum(o['moved'] for o in outs)} routes, {slots} of {row.echo} spare slots used, " + note
        ok_slots = slots == row.echo
    else:
        ok_slots = True
    equal = pdiff <= tol["param"] and ldiff <= tol["loss"] and ndiff <= tol["norm"]
    ok = (equal and not missing and have_loss and not skipped and (row.clip == 0 or clipped) and ok_slots)
    if row.capacity is not None:
        reruns = outs[0]["reruns"]
        if row.overflow == "rerun":
            note += f"; reran {reruns} of {STEPS} steps ({outs[0]['passes']} passes) at capacity factor {row.capacity}"
            ok = ok and reruns > 0 and all(o["reruns"] == reruns for o in outs)
        else:  # the control: dropping at this capacity must change the training
            note += f"; control: {'equals' if equal else 'differs from'} the oracle"
            ok = (not equal) and sum(o["dropped"] for o in outs) > 0 and not missing and have_loss
    if missing:
        note += f"; params missing: {sorted(missing)[:3]}"
    if row.clip:
        note += f"; clip {row.clip} < oracle norms {min(ref['norms']):.3g}" if clipped else "; clip never clipped"
    if skipped:
        note += "; a step was skipped"
    return {"name": row.name, "ok": ok, "param": pdiff, "loss": ldiff, "norm": ndiff, "note": note}


def rows_worker(rank: int, world: int, rows: List[Row]) -> List[Dict]:
    """:func:`machinery_worker` for several configurations in one spawn (imports cost seconds per process); an
    exception of one configuration is returned as ``{"exception": text}`` and the next one still runs."""
    out = []
    for row in rows:
        try:
            out.append(machinery_worker(rank, world, row))
        except Exception:  # noqa: BLE001
            out.append({"exception": traceback.format_exc()})
    return out


def run_rows(rows: List[Row], report=None) -> List[Dict]:
    """Oracle and machinery for ``rows`` (one spawn per world size); ``report(result)`` after each row."""
    results: Dict[str, Dict] = {}
    for world in sorted({r.world for r in rows}):
        batch = [r for r in rows if r.world == world]
        t = time.perf_counter()
        try:
            per_rank = run_distributed(rows_worker, world, batch, timeout=120.0 + 90.0 * len(batch))
        except Exception as e:  # noqa: BLE001 - every row of the spawn fails, the other spawns still run
            per_rank = [[{"exception": str(e)}] * len(batch)] * world
        spawn_s = (time.perf_counter() - t) / len(batch)
        for i, row in enumerate(batch):
            outs = [per_rank[r][i] for r in range(world)]
            t = time.perf_counter()
            bad = [o["exception"] for o in outs if "exception" in o]
            if bad:
                res = {"name": row.name, "ok": False, "param": math.nan, "loss": math.nan, "norm": math.nan,
                       "note": "error: " + bad[0].strip().splitlines()[-1][:160]}
            else:
                try:
                    ref = oracle_train(row, outs)
                except Exception:  # noqa: BLE001 - e.g. the recorded echo plans contradict the oracle's routing
                    ref = None
                    res = {"name": row.name, "ok": False, "param": math.nan, "loss": math.nan, "norm": math.nan,
                           "note": "oracle error: " + traceback.format_exc().strip().splitlines()[-1][:160]}
                if ref is not None:
                    res = compare(row, ref, outs)
            res["seconds"] = spawn_s + time.perf_counter() - t
            results[row.name] = res
            if report is not None:
                report(res)
    return [results[r.name] for r in rows]


def run_row(row: Row) -> Dict:
    return run_rows([row])[0]


def format_result(r: Dict) -> str:
    return (f"{'PASS' if r['ok'] else 'FAIL'}  {r['name']:<36} param {r['param']:.2e}  loss {r['loss']:.2e}  "
            f"grad-norm {r['norm']:.2e}  ({r['note']})")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m helpers.equivalence", description=__doc__.split("\n")[0])
    ap.add_argument("--all", action="store_true", help="the whole matrix (default: the CI subset)")
    ap.add_argument("--only", nargs="*", default=None, help="run these configurations by name")
    ap.add_argument("--out", default=None, help="also write the output (and the commit measured) to this file")
    args = ap.parse_args(argv)
    names = {r.name for r in MATRIX}
    if args.only:
        bad = [n for n in args.only if n not in names]
        if bad:
            ap.error(f"unknown configuration(s) {bad}; known: {sorted(names)}")
        rows = [r for r in MATRIX if r.name in args.only]
    else:
        rows = MATRIX if args.all else [r for r in MATRIX if r.name in CI_ROWS]
    lines = []

    def emit(s):
        print(s, flush=True)
        lines.append(s)

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=__file__.rsplit("/", 1)[0]).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    emit(f"training equivalence vs the single-process AdamW oracle: {len(rows)} configurations, {STEPS} steps each, "
         f"commit {commit}, torch {torch.__version__}")
    emit(f"tolerances (relative): params {TOL['param']}, loss {TOL['loss']}, grad norm {TOL['norm']} "
         f"(bf16 rows: {TOL_BF16['param']}, {TOL_BF16['loss']}, {TOL_BF16['norm']}; FP8 with fp32 scales: "
         f"{TOL_FP8_FP32_SCALES['param']}, {TOL_FP8_FP32_SCALES['loss']}, {TOL_FP8_FP32_SCALES['norm']})")
    t0 = time.perf_counter()
    results = run_rows(rows, report=lambda r: emit(format_result(r) + f"  [{r['seconds']:.1f} s]"))
    n_ok = sum(bool(r["ok"]) for r in results)
    emit(f"total: {n_ok}/{len(rows)} PASS in {time.perf_counter() - t0:.1f} s")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0 if n_ok == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
