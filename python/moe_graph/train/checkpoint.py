"""Atomic, sharded training checkpoints (model, ZeRO-1 optimizer, RNG and data position) for any rank layout.

A checkpoint folder ``ROOT`` holds::

    ROOT/latest                     # "step_00000006": the newest complete checkpoint; written last
    ROOT/step_00000006/meta.json    # format, step, layout, model config, files (written by rank 0 after all shards)
    ROOT/step_00000006/state_rank00003.pt   # rank 3: its model tensors under global names, their CRC32
                                            # checksums, its RNG states and the data position
    ROOT/step_00000006/optim_rank00003.pt   # rank 3: DistributedOptimizer.state_dict() (its ZeRO-1 shard)

Saving (:func:`save_checkpoint`, a collective over the world) writes every file under a temporary name and renames
it; the ranks' files go into ``ROOT/.step_00000006.partial``, which rank 0 renames to ``step_00000006`` only after
every rank has finished (a barrier) and it has written ``meta.json``; ``latest`` is replaced last. A crash at any
point (a rank killed mid-save) leaves ``latest`` naming the previous complete checkpoint, which still loads.
The folder must be on a file system every rank sees (one shared folder for all nodes).

Model tensors are stored under their *whole-model* names (:func:`global_tensors`: layer ``blocks.<global layer>``,
expert ``...fc1.weight[<global expert>]``), each once (dense tensors by data-parallel rank 0 of each stage, experts
by expert-data-parallel rank 0), so a checkpoint loads into another data-parallel size. Loading
(:func:`read_model_state`, :func:`read_optimizer_shards`, :func:`copy_plan`) validates everything before the caller
copies anything.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import zlib
from typing import Dict, Iterable, List

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["FORMAT", "step_dirname", "resolve_checkpoint", "read_meta", "save_checkpoint", "read_model_state",
           "read_optimizer_shards", "read_rank_state", "tensor_crc32", "global_name", "is_expert", "is_expert_name",
           "global_tensors", "copy_plan"]

FORMAT = "moe_graph.train.checkpoint.v1"
FAULT_ENV = "MOE_GRAPH_CHECKPOINT_FAULT"  # testing only: "RANK:STEP" -> that rank SIGKILLs itself mid-save


def step_dirname(step: int) -> str:
    return f"step_{step:08d}"


def _state_file(rank: int) -> str:
    return f"state_rank{rank:05d}.pt"


def _optim_file(rank: int) -> str:
    return f"optim_rank{rank:05d}.pt"


def tensor_crc32(t: torch.Tensor) -> int:
    """CRC32 of a tensor's bytes (any dtype)."""
    t = t.detach().contiguous().cpu()
    return zlib.crc32(t.reshape(-1).view(torch.uint8).numpy().tobytes()) if t.numel() else 0


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic_write(path: str, write) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _atomic_torch_save(obj, path: str) -> None:
    _atomic_write(path, lambda f: torch.save(obj, f))


def _atomic_text(path: str, text: str) -> None:
    _atomic_write(path, lambda f: f.write(text.encode()))


def _maybe_fault(rank: int, step: int) -> None:
    spec = os.environ.get(FAULT_ENV)
    if spec and spec == f"{rank}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def resolve_checkpoint(path: str) -> str:
    """The checkpoint folder for ``--load PATH``: ``PATH/<latest>`` for a checkpoint root, ``PATH`` itself for one
    ``step_*`` folder. Raises ``FileNotFoundError`` / ``ValueError`` with what was expected."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--load {path}: no such folder")
    if os.path.isfile(os.path.join(path, "meta.json")):
        return path
    marker = os.path.join(path, "latest")
    if not os.path.isfile(marker):
        raise FileNotFoundError(f"--load {path}: neither a checkpoint root (no 'latest' file) nor a checkpoint "
                                "folder (no meta.json); no complete checkpoint was saved there")
    with open(marker) as f:
        name = f.read().strip()
    if not name.startswith("step_") or os.sep in name:
        raise ValueError(f"--load {path}: 'latest' holds {name!r}, expected a step_<N> folder name")
    folder = os.path.join(path, name)
    if not os.path.isfile(os.path.join(folder, "meta.json")):
        raise FileNotFoundError(f"--load {path}: 'latest' names {name} but {folder}/meta.json is missing")
    return folder


def read_meta(folder: str) -> Dict:
    with open(os.path.join(folder, "meta.json")) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{folder}: unknown checkpoint format {meta.get('format')!r} (expected {FORMAT!r})")
    return meta


def save_checkpoint(root: str, step: int, *, rank: int, world: int, model_state: Dict[str, torch.Tensor],
                    optimizer, rank_state: Dict, meta: Dict, group=None) -> str:
    """Write one checkpoint (a collective over ``group``, default the world; every rank calls it).

    ``model_state``: the tensors this rank saves, under global names (each global tensor saved by one rank);
    ``optimizer``: a :class:`moe_graph.distributed.optimizer.DistributedOptimizer` (its ``state_dict()``, this rank's shard);
    ``rank_state``: small picklable extras (RNG states, data position, the rank's coordinates);
    ``meta``: JSON-serializable description (layout, model config) written by rank 0 into ``meta.json``.
    Returns the final folder.
    """
    name = step_dirname(step)
    final = os.path.join(root, name)
    partial = os.path.join(root, "." + name + ".partial")
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        if os.path.exists(partial):  # leftovers of a crashed save of the same step
            shutil.rmtree(partial)
        os.makedirs(partial)
    dist.barrier(group=group)
    tensors = {k: v.detach().to("cpu", copy=True) for k, v in model_state.items()}
    state = {"format": FORMAT, "step": step, "rank": rank, "world": world, "model": tensors,
             "crc32": {k: tensor_crc32(v) for k, v in tensors.items()}, **rank_state}
    _atomic_torch_save(state, os.path.join(partial, _state_file(rank)))
    _maybe_fault(rank, step)
    _atomic_torch_save(optimizer.state_dict(), os.path.join(partial, _optim_file(rank)))
    _fsync_dir(partial)
    dist.barrier(group=group)
    if rank == 0:
        full = dict(meta, format=FORMAT, step=step, world=world,
                    files=[[_state_file(r), _optim_file(r)] for r in range(world)])
        _atomic_text(os.path.join(partial, "meta.json"), json.dumps(full, indent=1, default=str))
        _fsync_dir(partial)
        if os.path.exists(final):  # re-saving a step (e.g. after resuming from an earlier one)
            old = os.path.join(root, "." + name + ".old")
            if os.path.exists(old):
                shutil.rmtree(old)
            os.replace(final, old)
            os.replace(partial, final)
            shutil.rmtree(old)
        else:
            os.replace(partial, final)
        _fsync_dir(root)
        _atomic_text(os.path.join(root, "latest"), name + "\n")
        _fsync_dir(root)
    dist.barrier(group=group)
    return final


def _load(path: str):
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint file {path} is missing")
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def read_rank_state(folder: str, rank: int) -> Dict:
    return _load(os.path.join(folder, _state_file(rank)))


def read_model_state(folder: str, meta: Dict, verify: bool = True) -> Dict[str, torch.Tensor]:
    """Every rank's saved model tensors merged under their global names (memory-mapped); checks each tensor's
    CRC32 (``verify``) and that no name was saved twice. Raises ``ValueError`` naming the file and tensor."""
    out: Dict[str, torch.Tensor] = {}
    for r in range(meta["world"]):
        path = os.path.join(folder, _state_file(r))
        st = _load(path)
        if st.get("format") != FORMAT or st.get("step") != meta["step"]:
            raise ValueError(f"{path}: format {st.get('format')!r} step {st.get('step')!r}, expected {FORMAT!r} "
                             f"step {meta['step']}")
        for k, t in st["model"].items():
            if k in out:
                raise ValueError(f"{path}: tensor {k!r} saved by more than one rank")
            if verify and tensor_crc32(t) != st["crc32"].get(k):
                raise ValueError(f"{path}: checksum mismatch for {k!r} (the file is corrupted)")
            out[k] = t
    return out


def read_optimizer_shards(folder: str, ranks: Iterable[int]) -> List[Dict]:
    """The optimizer files of the saved ``ranks`` (those holding this rank's pipeline stage)."""
    return [_load(os.path.join(folder, _optim_file(r))) for r in ranks]


def global_name(module: nn.Module, name: str) -> str:
    """The whole-model name of ``module``'s parameter or buffer ``name``. A pipeline stage (a module with
    ``layer_ids``: the global layer of each of its ``blocks``) numbers its blocks from 0, the whole model by layer:
    ``blocks.<i>.rest`` is ``blocks.<layer_ids[i]>.rest``; every other name is the same in every layout."""
    layer_ids = getattr(module, "layer_ids", None)
    if layer_ids is not None and name.startswith("blocks."):
        _, i, rest = name.split(".", 2)
        return f"blocks.{layer_ids[int(i)]}.{rest}"
    return name


def is_expert(param: torch.Tensor) -> bool:
    """An expert parameter: marked ``allreduce = False`` (Megatron's convention), ``[L, ...]`` with row ``i`` the
    rank's local expert ``i``."""
    return not getattr(param, "allreduce", True)


def is_expert_name(name: str) -> bool:
    """Whether a whole-model name (:func:`global_tensors`) is one global expert's entry ``<name>[<e>]``."""
    return name.endswith("]")


def global_tensors(module: nn.Module, ep_rank: int = 0) -> Dict[str, torch.Tensor]:
    """``module``'s parameters and persistent buffers under their whole-model names (:func:`global_name`), as
    detached views: writing an entry writes the module. An expert parameter ``[L, ...]`` on expert-parallel rank
    ``ep_rank`` gives one entry per global expert, ``<name>[<ep_rank * L + i>]`` for row ``i``, so that every
    pipeline / expert-parallel layout names the same tensors the same way."""
    persistent = module.state_dict(keep_vars=True)
    out: Dict[str, torch.Tensor] = {}
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        if name not in persistent:
            continue  # non-persistent buffers: per-step statistics and constant tables, not model state
        g = global_name(module, name)
        if is_expert(t):
            for i, row in enumerate(t.detach()):
                out[f"{g}[{ep_rank * t.shape[0] + i}]"] = row
        else:
            out[g] = t.detach()
    return out


def copy_plan(params: Dict[str, torch.Tensor], saved: Dict[str, torch.Tensor]) -> List:
    """(destination, source) pairs filling ``params`` (this rank's tensors by whole-model name,
    :func:`global_tensors`) from ``saved``. Raises ``KeyError`` / ``ValueError`` before anything is copied."""
    plan = []
    for name, dst in params.items():
        if name not in saved:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        _check(name, dst, saved[name])
        plan.append((dst, saved[name]))
    return plan


def _check(name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
    if tuple(dst.shape) != tuple(src.shape) or dst.dtype != src.dtype:
        raise ValueError(f"checkpoint tensor {name!r} is {src.dtype} {tuple(src.shape)}, this run expects "
                         f"{dst.dtype} {tuple(dst.shape)}")
