"""Hugging Face checkpoints of models trained with moe_graph: out of a model swapped with
:func:`moe_graph.integrations.hf.swap_moe_blocks` (its experts sliced over expert-parallel ranks), and back in.

* :func:`gather_hf_state_dict` (a collective over each MoE layer's EP group): the transformers state dict of the
  model, with transformers' in-memory names (the v5 fused experts ``mlp.experts.gate_up_proj [E, 2F, H]``), each
  layer's experts gathered from the expert-parallel ranks.
* :func:`save_hf_pretrained`: that state dict written as a ``save_pretrained`` folder (``config.json``,
  ``generation_config.json`` when the model has one, ``model.safetensors``) by global rank 0, in layout ``"v5"``
  (the fused in-memory names) or ``"v4"`` (transformers' own ``save_pretrained`` of it: per-expert modules under
  the family's on-disk names, e.g. Mixtral's ``block_sparse_moe.experts.<e>.w1``; GPT-OSS has one layout). Either
  loads with ``AutoModelForCausalLM.from_pretrained``.
* :func:`swapped_from_pretrained`: a transformers model of a ``save_pretrained`` folder, swapped, with this rank's
  experts only and no expert ever materialized whole (built on the meta device, swapped, materialized: transformers'
  own initialization for the dense part and its buffers, each MoE layer built with its ``E / ep`` experts; then
  :func:`load_hf_checkpoint`).
* :func:`load_hf_checkpoint`: a ``save_pretrained`` folder (either layout, one or several safetensors files) into a
  swapped model: dense tensors by name, each MoE layer's from its block's tensors
  (:func:`moe_graph.integrations.hf.hf_to_moe_state_dict`), reading only this rank's experts from the files
  (safetensors slices of the fused tensors, only the per-expert tensors of this rank). Every tensor is checked
  (present, shape, dtype) before the first copy; a failure raises on every rank of the model's groups.

Example (each rank; ``ep_group`` the expert-parallel group)::

    model = swapped_from_pretrained("ckpt_in", ep_group=ep_group)   # this rank's experts only
    ...                                                        # train (DDP / ZeRO-1 / EP)
    save_hf_pretrained(model, "ckpt_out", layout="v5")         # a collective; rank 0 writes
"""

from __future__ import annotations

import json
import os
import re
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

try:  # transformers' renames between its on-disk (v4) and in-memory names, e.g. Mixtral's block_sparse_moe -> mlp
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
except ImportError:  # an older transformers: on-disk names are the in-memory ones
    get_checkpoint_conversion_mapping = None
try:
    from transformers import AutoConfig, AutoModelForCausalLM
except ImportError:  # swapped_from_pretrained needs transformers; the rest works on any model with a .config
    AutoConfig = AutoModelForCausalLM = None

from moe_graph.distributed.agreement import AllOrNone
from moe_graph.integrations.hf import (HFMoEBlock, HFSplitExperts, hf_to_moe_state_dict, moe_to_hf_state_dict,
                                       swap_moe_blocks)
from moe_graph.moe.layer import MoELayer
from moe_graph.train.checkpoint import is_expert, read_checkpoint_file

__all__ = ["gather_hf_state_dict", "save_hf_pretrained", "load_hf_checkpoint", "swapped_from_pretrained"]

def _text_config(model: nn.Module):
    get = getattr(model.config, "get_text_config", None)
    return get() if callable(get) else model.config


def _blocks(model: nn.Module) -> List[Tuple[str, HFMoEBlock]]:
    blocks = [(n, m) for n, m in model.named_modules() if isinstance(m, HFMoEBlock)]
    if any(isinstance(m, HFSplitExperts) for _, m in blocks):
        raise NotImplementedError("hf_checkpoint: a split MoE block (Gemma 4: router and experts are modules of the "
                                  "decoder layer) is not supported yet; moe_to_hf_state_dict converts its state dict")
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no swapped MoE block (call swap_moe_blocks first)")
    return blocks


def _ep(layer) -> Tuple[int, int]:
    size = layer.num_ep_ranks
    return (dist.get_rank(layer.ep_group) if size > 1 else 0), size


def gather_hf_state_dict(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The transformers state dict of a model swapped with ``swap_moe_blocks`` (in-memory names, fused experts),
    every MoE layer's experts gathered over its expert-parallel group (a collective: every rank of each layer's EP
    group calls it; every rank gets the whole dict). Tensors on the CPU, detached copies."""
    config = _text_config(model)
    blocks = _blocks(model)
    out: Dict[str, torch.Tensor] = {}
    inside = tuple(f"{n}." for n, _ in blocks)
    for k, t in model.state_dict().items():
        if not k.startswith(inside):
            out[k] = t.detach().to("cpu", copy=True)
    for name, block in blocks:
        layer = block.moe
        _, ep_size = _ep(layer)
        sd = {k: t.detach() for k, t in layer.state_dict(keep_vars=True).items()}
        if ep_size > 1:
            for k, t in list(layer.named_parameters()):
                if is_expert(t):
                    parts = [torch.empty_like(t) for _ in range(ep_size)]
                    dist.all_gather(parts, t.detach().contiguous(), group=layer.ep_group)
                    sd[k] = torch.cat(parts)
        for k, t in moe_to_hf_state_dict(sd, config, layout="v5").items():
            out[f"{name}.{k}"] = t.detach().to("cpu", copy=True).contiguous()
    return out


def save_hf_pretrained(model: nn.Module, save_directory: str, *, layout: str = "v5") -> Optional[str]:
    """Write a model swapped with ``swap_moe_blocks`` (trained with moe_graph: EP slices on several ranks) as a
    transformers ``save_pretrained`` folder (see the module docstring for ``layout``). A collective over every
    rank of ``torch.distributed`` when it is initialized (global rank 0 writes; all return after the files are
    complete, or all raise naming rank 0's error: :class:`~moe_graph.distributed.agreement.AllOrNone`); returns
    the folder on the writing rank, else ``None``."""
    if layout not in ("v4", "v5"):
        raise ValueError(f"save_hf_pretrained: layout must be 'v4' or 'v5', got {layout!r}")
    sd = gather_hf_state_dict(model)
    distributed = dist.is_available() and dist.is_initialized()
    written = None
    # the other ranks wait for rank 0's files here: any failure of its writing raises on every rank
    with AllOrNone(f"save_hf_pretrained({save_directory})", action="save",
                   outcome="no folder was returned as saved") as step:
        if not distributed or dist.get_rank() == 0:
            step.at(f"writing {save_directory} (layout {layout})")
            os.makedirs(save_directory, exist_ok=True)
            if layout == "v4":  # transformers' own writer: its per-expert on-disk names
                model.save_pretrained(save_directory, state_dict=sd, safe_serialization=True)
            else:
                model.config.save_pretrained(save_directory)
                if getattr(model, "generation_config", None) is not None:
                    model.generation_config.save_pretrained(save_directory)
                tmp = os.path.join(save_directory, "model.safetensors.tmp")
                try:
                    save_file(_unshared(sd), tmp, metadata={"format": "pt"})
                    os.replace(tmp, os.path.join(save_directory, "model.safetensors"))
                finally:
                    if os.path.exists(tmp):
                        os.remove(tmp)
            written = save_directory
    return written


def _unshared(sd: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Tied tensors (one storage under two names) as separate copies: safetensors refuses shared storage."""
    seen, out = set(), {}
    for k, t in sd.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        out[k] = t.clone() if key in seen else t
        seen.add(key)
    return out


def _renames(model_type: Optional[str]) -> List[Tuple[str, str]]:
    """transformers' renames (regex, replacement) from its on-disk names to its in-memory ones for ``model_type``
    (its ``WeightRenaming`` rules; the per-expert tensors its ``WeightConverter`` rules fuse are read by
    ``hf_to_moe_state_dict`` itself)."""
    if get_checkpoint_conversion_mapping is None or model_type is None:
        return []
    out = []
    for rule in get_checkpoint_conversion_mapping(model_type) or []:
        if type(rule).__name__ == "WeightRenaming":
            out += list(zip(rule.source_patterns, rule.target_patterns))
    return out


class _Files:
    """The tensors of a ``save_pretrained`` folder (``model.safetensors`` or the files of its index) under
    transformers' in-memory names (on-disk names renamed: :func:`_renames`), opened lazily: ``get(name)`` reads one
    tensor, ``get_slice(name)`` a safetensors slice (``[a:b]`` reads those rows only)."""

    def __init__(self, folder: str, model_type: Optional[str]):
        self.handles: Dict[str, object] = {}
        index = os.path.join(folder, "model.safetensors.index.json")
        single = os.path.join(folder, "model.safetensors")
        if os.path.isfile(index):
            weight_map = read_checkpoint_file(index, "a safetensors index (JSON with a 'weight_map')",
                                              lambda f: json.load(f)["weight_map"])
            on_disk = {k: os.path.join(folder, v) for k, v in weight_map.items()}
        elif os.path.isfile(single):
            on_disk = {k: single for k in self._open(single).keys()}
        else:
            raise FileNotFoundError(f"{folder}: no model.safetensors or model.safetensors.index.json (a "
                                    "save_pretrained folder with safetensors)")
        renames = _renames(model_type)
        self.where: Dict[str, Tuple[str, str]] = {}  # in-memory name -> (file, on-disk name)
        for k, path in on_disk.items():
            name = k
            for pattern, repl in renames:
                name = re.sub(pattern, repl, name)
            self.where[name] = (path, k)

    def _open(self, path: str):
        if path not in self.handles:
            self.handles[path] = read_checkpoint_file(path, "a safetensors file", lambda _: safe_open(path, "pt"))
        return self.handles[path]

    def _h(self, name: str):
        path, key = self.where[name]
        return self._open(path), key

    def files_of(self, prefix: str) -> str:
        """The files holding the tensors named ``prefix.*`` (comma-separated), for messages."""
        return ", ".join(sorted({p for k, (p, _) in self.where.items() if k.startswith(f"{prefix}.")})) or "no file"

    def get(self, name: str) -> torch.Tensor:
        h, key = self._h(name)
        return h.get_tensor(key)

    def get_slice(self, name: str):
        h, key = self._h(name)
        return h.get_slice(key)


def _block_source(files: _Files, name: str, ep_rank: int, ep_size: int, num_experts: int) -> Dict:
    """The block's tensors (names relative to the block) from the files: fused expert tensors as safetensors slices
    (read by ``hf_to_moe_state_dict`` for this rank's experts only), per-expert tensors of this rank only."""
    L = num_experts // ep_size
    mine = range(ep_rank * L, (ep_rank + 1) * L)
    src: Dict[str, object] = {}
    shapes: Dict[str, Tuple[str, Tuple[int, ...]]] = {}  # per-expert tensor kind -> (first name, its shape)
    for k in files.where:
        if not k.startswith(f"{name}."):
            continue
        rel = k[len(name) + 1:]
        m = re.match(r"experts\.(\d+)\.", rel)
        if m:
            if int(m.group(1)) in mine:
                src[rel] = files.get(k)
                kind = rel[m.end():]
                first, shape = shapes.setdefault(kind, (k, tuple(src[rel].shape)))
                if tuple(src[rel].shape) != shape:  # one expert's tensor cut short or grown: name it
                    raise ValueError(f"{files.where[k][0]}: tensor {files.where[k][1]!r} is {tuple(src[rel].shape)}, "
                                     f"expected {shape} like {first!r} (every expert's {kind} has one shape)")
        elif ep_size > 1 and _is_fused(files.get_slice(k).get_shape(), num_experts):
            src[rel] = _Rows(files.get_slice(k))
        else:
            src[rel] = files.get(k)
    return src


def _is_fused(shape, num_experts: int) -> bool:
    """A fused expert weight (``[E, ., .]``): read by rows (routers, biases and the rest are read whole)."""
    return len(shape) >= 3 and shape[0] == num_experts


class _Rows:
    """A fused expert tensor in the files: indexing with a slice reads those experts' rows only (``[:]``: all)."""

    def __init__(self, sl):
        self.sl = sl

    def __getitem__(self, idx):
        return self.sl[idx]


def load_hf_checkpoint(model: nn.Module, folder: str) -> List[str]:
    """Fill a model swapped with ``swap_moe_blocks`` from a transformers ``save_pretrained`` folder (v5 fused or v4
    per-expert layout, detected per block): dense tensors by name, each MoE layer's tensors converted from its
    block's (this rank's experts only: nothing is read for another expert-parallel rank's experts). Everything is
    read and checked (every tensor present, same shape and dtype) before the first copy, and when
    ``torch.distributed`` is initialized the ranks agree (:class:`~moe_graph.distributed.agreement.AllOrNone` over
    the world) so that any failure on any rank (a broken file, a tensor of the wrong shape, any exception) raises
    on every rank naming the file and the tensor, with the model unchanged. Returns the names of the tensors
    loaded."""
    config = _text_config(model)
    family = getattr(config, "model_type", None)
    plan = []
    with AllOrNone(f"load_hf_checkpoint({folder})", outcome="nothing was loaded") as step:
        step.at(f"opening {folder} (expected a save_pretrained folder with safetensors files)")
        files = _Files(folder, family)
        blocks = _blocks(model)
        inside = tuple(f"{n}." for n, _ in blocks)
        targets = {k: t for k, t in model.state_dict(keep_vars=True).items() if not k.startswith(inside)}
        tied = set(getattr(model, "_tied_weights_keys", None) or [])
        for k, dst in targets.items():
            if k not in files.where:
                if k in tied:
                    continue  # tied to another tensor, which is loaded
                raise KeyError(f"{folder}: the checkpoint has no tensor {k!r} (transformers' writer may have converted "
                               "it beyond a rename, as GLM5-Next's v4 conv1d: save with layout='v5')")
            step.at(f"reading tensor {k!r} from {files.where[k][0]} (expected {dst.dtype} {tuple(dst.shape)})")
            plan.append((k, dst, files.get(k)))
        for name, block in blocks:
            layer = block.moe
            ep_rank, ep_size = _ep(layer)
            step.at(f"reading the tensors of the MoE block {name!r} from {files.files_of(name)} (expected "
                    f"{layer.num_experts} experts, hidden {layer.hidden_size}, ffn {layer.ffn_hidden_size}; this "
                    f"rank's are {ep_rank * layer.num_local_experts}..{(ep_rank + 1) * layer.num_local_experts - 1})")
            src = _block_source(files, name, ep_rank, ep_size, layer.num_experts)
            if not src:
                raise KeyError(f"{folder}: the checkpoint has no tensor of the MoE block {name!r}")
            own = layer.state_dict(keep_vars=True)
            step.at(step.where.replace("reading", "converting (hf_to_moe_state_dict)", 1))
            for k, t in hf_to_moe_state_dict(src, config, ep_rank=ep_rank, ep_size=ep_size).items():
                t = t[:] if isinstance(t, _Rows) else t  # a fused tensor the conversion takes whole
                if k not in own:
                    raise KeyError(f"{name}: MoELayer has no {k!r}")
                plan.append((f"{name}.moe.{k}", own[k], t))
        step.at(None)
        for k, dst, src in plan:
            if not isinstance(src, torch.Tensor) or tuple(src.shape) != tuple(dst.shape) or src.dtype != dst.dtype:
                got = f"{src.dtype} {tuple(src.shape)}" if isinstance(src, torch.Tensor) else type(src).__name__
                raise ValueError(f"{folder}: {k!r} is {got} in the checkpoint, the model has {dst.dtype} "
                                 f"{tuple(dst.shape)}")
    with torch.no_grad():
        for _, dst, src in plan:
            dst.copy_(src)
    return [k for k, _, _ in plan]


def swapped_from_pretrained(folder: str, *, ep_group=None, model_class=None, device="cpu",
                            model_kwargs: Optional[Dict] = None, **overrides) -> nn.Module:
    """The transformers model saved in ``folder`` (``save_pretrained``: config and safetensors), its sparse-MoE
    blocks swapped onto :class:`MoELayer` (:func:`swap_moe_blocks` with ``ep_group`` and ``overrides``), each rank
    holding only its ``E / ep`` experts, which are never materialized whole: the model is built on the meta device
    (``model_class``: a transformers class or auto class, default ``AutoModelForCausalLM``; built from the folder's
    config with ``model_kwargs``), swapped, moved to
    ``device`` empty, given transformers' own initialization (``initialize_weights``: the buffers such as rotary
    tables; ``tie_weights``), every MoE layer rebuilt there with its experts, and filled by
    :func:`load_hf_checkpoint` (every tensor checked before the first copy). A collective when ``ep_group`` spans
    several ranks."""
    if AutoConfig is None:
        raise RuntimeError("swapped_from_pretrained needs transformers")
    config = AutoConfig.from_pretrained(folder)
    cls = model_class or AutoModelForCausalLM
    build = getattr(cls, "from_config", None) or cls._from_config  # auto classes / transformers' model classes
    with torch.device("meta"):
        model = build(config, **(model_kwargs or {}))
    swap_moe_blocks(model, ep_group=ep_group, **overrides)
    model.to_empty(device=device)
    model.initialize_weights()
    model.tie_weights()
    for _, block in _blocks(model):
        block.moe = MoELayer.from_config(block.moe.config, ep_group=ep_group, device=device)
    load_hf_checkpoint(model, folder)
    return model
