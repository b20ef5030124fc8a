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
by expert-data-parallel rank 0). The optimizer files keep the saving rank's own names; ``meta.json`` (format v2)
holds an *index*: per rank, how its optimizer names map to whole-model names (``naming``: the global layers of each
model chunk, the rank's first global expert) and which whole-model tensors its two files hold. So a checkpoint
loads into any pipeline / virtual pipeline / expert / data-parallel layout of the same model: each rank opens only
the files that hold its tensors (:func:`files_holding`), :func:`read_model_state` gives the model tensors by
whole-model name, and :func:`reshard_optimizer` turns the saved ZeRO-1 pieces into shards of the new rank's own
optimizer (Adam moments, fp32 master weights, step, lr, loss scale), which
:meth:`~moe_graph.distributed.optimizer.DistributedOptimizer.load_state_dict` then validates and cuts for its
data-parallel rank. Loading validates everything (names, shapes, dtypes, coverage, checksums) before the caller
copies anything.

Format versions (:data:`FORMAT`, :func:`read_meta`): v1 checkpoints (no index) still load at any layout (every
file is read, the index is rebuilt from the saved layout, :func:`index_v1`); those written before the package-layout
change of 2026-11-25 name expert weights ``blocks.N.moe.fc1.weight[e]`` (now ``blocks.N.moe.experts.fc1.weight[e]``)
and are migrated on load (:func:`migrate_name`). ``python -m moe_graph.train.checkpoint`` inspects, converts and
reshards checkpoints offline (:data:`moe_graph.train.flags.CHECKPOINT_DOC`, :func:`main`).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import sys
import zlib
from typing import Dict, Iterable, List, Optional, Set, Tuple

from moe_graph.train import flags

if __name__ == "__main__":  # a bad flag is refused (exit 2) before torch is imported
    flags.parse_checkpoint()

import torch  # noqa: E402
import torch.distributed as dist
from torch import nn

try:
    from safetensors.torch import save_file
except ImportError:  # optional: only ``convert CKPT OUT.safetensors`` needs it
    save_file = None

from moe_graph.distributed.agreement import AllOrNone
from moe_graph.distributed.optimizer import state_checksum
from moe_graph.train.schedules import chunk_layer_ids

__all__ = ["FORMAT", "FORMAT_V1", "step_dirname", "resolve_checkpoint", "read_meta", "save_checkpoint",
           "read_model_state", "read_optimizer_shards", "read_rank_state", "tensor_crc32", "global_name", "is_expert",
           "is_expert_name", "split_expert_name", "global_tensors", "copy_plan", "migrate_name", "naming_of",
           "optimizer_global_names", "optimizer_tensor_names", "held_index", "index_v1", "files_holding",
           "optimizer_pieces", "consolidate_optimizer", "reshard_optimizer", "rank_files", "atomic_torch_save",
           "atomic_text", "read_checkpoint_file", "inspect_checkpoint", "whole_model_state_dict", "convert_checkpoint", "reshard_checkpoint",
           "main"]

FORMAT = "moe_graph.train.checkpoint.v2"  # v1 + meta["index"] (per rank: naming, tensors held)
FORMAT_V1 = "moe_graph.train.checkpoint.v1"
_FORMATS = (FORMAT_V1, FORMAT)
# before the package-layout change (2bd393a, 2026-11-25) MoELayer held its experts directly: moe.fc1 -> moe.experts.fc1
_OLD_EXPERT_NAME = re.compile(r"(^|\.)moe\.(fc1|fc2)\.")
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
    """``write(file)`` into ``path + ".tmp"``, then renamed to ``path``; the temporary file is removed on any
    failure (a full disk included)."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read_checkpoint_file(path: str, expected: str, parse, mode: str = "r"):
    """``parse(open file)`` of the checkpoint file ``path`` (``mode`` ``"r"`` text, ``"rb"`` bytes): the one reader
    of every checkpoint file (``meta.json``, ``latest``, the ``.pt`` shards, safetensors files and their index), so
    that a missing, truncated or corrupted file is named. Raises ``FileNotFoundError`` for a missing file and
    ``ValueError("<path>: not readable as <expected> (<error>) ...")`` for any error of ``parse``."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint file {path} is missing (expected {expected})")
    try:
        with open(path, mode) as f:
            return parse(f)
    except Exception as exc:  # noqa: BLE001 - any parse error (JSON, pickle, zip, safetensors header) names the file
        raise ValueError(f"{path}: not readable as {expected} ({type(exc).__name__}: {exc}); the file is truncated "
                         "or corrupted") from exc


def atomic_torch_save(obj, path: str) -> None:
    _atomic_write(path, lambda f: torch.save(obj, f))


def atomic_text(path: str, text: str) -> None:
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
    name = read_checkpoint_file(marker, "a step_<N> folder name", lambda f: f.read().strip())
    if not name.startswith("step_") or os.sep in name:
        raise ValueError(f"--load {path}: 'latest' holds {name!r}, expected a step_<N> folder name")
    folder = os.path.join(path, name)
    if not os.path.isfile(os.path.join(folder, "meta.json")):
        raise FileNotFoundError(f"--load {path}: 'latest' names {name} but {folder}/meta.json is missing")
    return folder


def read_meta(folder: str) -> Dict:
    """``meta.json`` of a checkpoint folder, any known format (v1 gets its index rebuilt: :func:`index_v1`).
    Raises ``ValueError`` naming the format found and the ones this version reads."""
    path = os.path.join(folder, "meta.json")
    meta = read_checkpoint_file(path, "the checkpoint's JSON description", json.load)
    fmt = meta.get("format") if isinstance(meta, dict) else None
    if fmt not in _FORMATS:
        raise ValueError(f"{folder}: checkpoint format {fmt!r} is not one this moe_graph reads "
                         f"({', '.join(_FORMATS)}); "
                         "a newer format needs a newer moe_graph, and a file that is no moe_graph.train.checkpoint "
                         "cannot be loaded with --load")
    if fmt == FORMAT_V1:
        meta["index"] = index_v1(meta)
    return meta


def migrate_name(name: str) -> str:
    """A whole-model name of a v1 checkpoint saved before the package-layout change, in today's naming: a MoE
    layer's ``moe.fc1`` / ``moe.fc2`` (its grouped experts) became ``moe.experts.fc1`` / ``moe.experts.fc2``;
    every other name is unchanged."""
    return _OLD_EXPERT_NAME.sub(r"\1moe.experts.\2.", name)


def _renumber(name: str, layer_ids) -> str:
    """``blocks.<i>.rest`` of a stage numbering its blocks from 0 as ``blocks.<layer_ids[i]>.rest``."""
    if layer_ids is not None and name.startswith("blocks."):
        _, i, rest = name.split(".", 2)
        return f"blocks.{layer_ids[int(i)]}.{rest}"
    return name


def split_expert_name(name: str) -> Tuple[str, Optional[int]]:
    """``("...fc1.weight", 5)`` for ``"...fc1.weight[5]"``; ``(name, None)`` for a dense name."""
    if not is_expert_name(name):
        return name, None
    base, e = name[:-1].rsplit("[", 1)
    return base, int(e)


def naming_of(stages: List[nn.Module], ep_rank: int) -> Dict:
    """How a rank's optimizer names (``chunk<c>.`` prefixed when it has several model chunks, blocks numbered from
    0 per chunk, expert rows local) map to whole-model names: ``{"layer_ids": [[global layer of each block] per
    chunk], "chunked": bool, "ep_rank": int}``; stored per rank in ``meta.json``."""
    return {"layer_ids": [list(getattr(s, "layer_ids", None) or []) for s in stages], "chunked": len(stages) > 1,
            "ep_rank": int(ep_rank)}


def optimizer_global_names(metadata: Dict, naming: Dict) -> Dict[str, Tuple[str, Optional[int], Tuple[int, ...]]]:
    """For each parameter of an optimizer state's ``metadata`` (``DistributedOptimizer.checkpoint_metadata()``):
    ``(whole-model name, first global expert or None, shape of one whole-model tensor)``; an expert parameter
    ``[L, ...]`` stands for the ``L`` whole-model tensors ``name[first + i]``."""
    out = {}
    for name, m in metadata["params"].items():
        rest, c = name, 0
        if naming["chunked"]:
            head, rest = name.split(".", 1)
            c = int(head[len("chunk"):])
        ids = naming["layer_ids"][c] if c < len(naming["layer_ids"]) else None
        g = _renumber(rest, ids or None)
        shape = tuple(m["shape"])
        if m["expert"]:
            out[name] = (g, naming["ep_rank"] * shape[0], shape[1:])
        else:
            out[name] = (g, None, shape)
    return out


def optimizer_tensor_names(metadata: Dict, naming: Dict) -> List[str]:
    """The whole-model names of every tensor an optimizer with ``metadata`` and ``naming`` holds state for."""
    out = []
    for n, (g, first, _) in optimizer_global_names(metadata, naming).items():
        out += [g] if first is None else [f"{g}[{first + i}]" for i in range(metadata["params"][n]["shape"][0])]
    return out


def held_index(names: Iterable[str]) -> Dict[str, Optional[List[int]]]:
    """The index entry of a file holding the whole-model tensors ``names``: ``{base: [first expert, last expert + 1]
    or None (a dense tensor)}``."""
    out: Dict[str, Optional[List[int]]] = {}
    for base, e in map(split_expert_name, names):
        if e is None:
            out[base] = None
        else:
            lo, hi = out.get(base) or [e, e + 1]
            out[base] = [min(lo, e), max(hi, e + 1)]
    return out


def _optim_held(sd: Dict, naming: Dict) -> Dict[str, Optional[List[int]]]:
    params = sd["metadata"]["params"]
    return held_index(optimizer_tensor_names({"params": {n: params[n] for n in sd["shard"]}}, naming))


def index_v1(meta: Dict) -> List[Dict]:
    """The index of a v1 checkpoint (which had none), rebuilt from its layout: every rank's naming (global layers
    of its chunks from ``--layers``, ``--pp``, ``--vpp``; its expert rank), and ``None`` for the tensors held (not
    known without opening the files: every file is read)."""
    lay, layers = meta["layout"], meta["model"]["layers"]
    out = []
    for c in meta["coords"]:
        ids = chunk_layer_ids(layers, lay["pp"], c["pp_rank"], lay.get("vpp"))
        out.append({"naming": {"layer_ids": ids, "chunked": len(ids) > 1, "ep_rank": c["ep_rank"]},
                    "model": None, "optim": None})
    return out


def files_holding(meta: Dict, kind: str, wanted: Iterable[str]) -> List[int]:
    """The saved ranks whose ``kind`` file (``"model"``: state_rank, ``"optim"``: optim_rank) holds any of the
    whole-model names ``wanted``: every rank for a v1 checkpoint (no index)."""
    want: Dict[str, Set[Optional[int]]] = {}
    for n in wanted:
        base, e = split_expert_name(n)
        want.setdefault(base, set()).add(e)
    out = []
    for r, idx in enumerate(meta["index"]):
        held = idx.get(kind)
        if held is None:
            out.append(r)
            continue
        for base, rows in held.items():
            es = want.get(base)
            if es and (rows is None or any(e is not None and rows[0] <= e < rows[1] for e in es)):
                out.append(r)
                break
    return out


def save_checkpoint(root: str, step: int, *, rank: int, world: int, model_state: Dict[str, torch.Tensor],
                    optimizer, rank_state: Dict, meta: Dict, naming: Dict, group=None) -> str:
    """Write one checkpoint (a collective over ``group``, default the world; every rank calls it).

    ``model_state``: the tensors this rank saves, under global names (each global tensor saved by one rank);
    ``optimizer``: a :class:`moe_graph.distributed.optimizer.DistributedOptimizer` (its ``state_dict()``, this rank's shard);
    ``rank_state``: small picklable extras (RNG states, data position, the rank's coordinates);
    ``meta``: JSON-serializable description (layout, model config) written by rank 0 into ``meta.json``;
    ``naming``: how this rank's optimizer names map to whole-model names (:func:`naming_of`), into the index.
    Returns the final folder. Any failure on any rank (a full disk, any exception) raises on every rank naming the
    file (:class:`~moe_graph.distributed.agreement.AllOrNone`; no rank waits), the partial folder is removed and
    ``latest`` still names the previous checkpoint (a rank killed mid-save leaves the partial folder, which the
    next save of that step replaces).
    """
    name = step_dirname(step)
    final = os.path.join(root, name)
    partial = os.path.join(root, "." + name + ".partial")
    try:
        return _save_agreed(root, step, name, final, partial, rank=rank, world=world, model_state=model_state,
                            optimizer=optimizer, rank_state=rank_state, meta=meta, naming=naming, group=group)
    except Exception as exc:
        if rank == 0 and hasattr(exc, "failures"):  # agreed on: nobody writes into the partial folder any more
            shutil.rmtree(partial, ignore_errors=True)
        raise


def _save_agreed(root, step, name, final, partial, *, rank, world, model_state, optimizer, rank_state, meta, naming,
                 group) -> str:
    """:func:`save_checkpoint`'s three phases, each ended by an agreement of every rank (any failure on any rank
    raises on all, naming the file: :class:`~moe_graph.distributed.agreement.AllOrNone`)."""

    def agreement():
        return AllOrNone(f"save_checkpoint({final})", action="save its part",
                         outcome="'latest' still names the previous checkpoint", groups=[group])

    with agreement() as at:
        if rank == 0:
            at.at(f"preparing the folder {partial}")
            os.makedirs(root, exist_ok=True)
            if os.path.exists(partial):  # leftovers of a crashed save of the same step
                shutil.rmtree(partial)
            os.makedirs(partial)
    with agreement() as at:
        at.at(f"copying this rank's {len(model_state)} model tensors to the host")
        tensors = {k: v.detach().to("cpu", copy=True) for k, v in model_state.items()}
        state = {"format": FORMAT, "step": step, "rank": rank, "world": world, "model": tensors,
                 "crc32": {k: tensor_crc32(v) for k, v in tensors.items()}, **rank_state}
        at.at(f"writing {os.path.join(partial, _state_file(rank))}")
        atomic_torch_save(state, os.path.join(partial, _state_file(rank)))
        _maybe_fault(rank, step)
        at.at(f"writing {os.path.join(partial, _optim_file(rank))}")
        optim = optimizer.state_dict()
        atomic_torch_save(optim, os.path.join(partial, _optim_file(rank)))
        _fsync_dir(partial)
        entry = {"naming": naming, "model": held_index(tensors), "optim": _optim_held(optim, naming)}
    index = [None] * world
    dist.all_gather_object(index, entry, group=group)
    with agreement() as at:
        if rank == 0:
            at.at(f"writing {os.path.join(partial, 'meta.json')} and renaming {partial} to {final}")
            full = dict(meta, format=FORMAT, step=step, world=world,
                        files=[[_state_file(r), _optim_file(r)] for r in range(world)], index=index)
            atomic_text(os.path.join(partial, "meta.json"), json.dumps(full, indent=1, default=str))
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
            at.at(f"writing {os.path.join(root, 'latest')}")
            atomic_text(os.path.join(root, "latest"), name + "\n")
            _fsync_dir(root)
    return final


def _load(path: str):
    return read_checkpoint_file(path, "a torch.save file of moe_graph.train.checkpoint",
                                lambda _: torch.load(path, map_location="cpu", weights_only=True, mmap=True))


def read_rank_state(folder: str, rank: int) -> Dict:
    return _load(os.path.join(folder, _state_file(rank)))


def rank_files(meta: Dict, rank: int) -> Tuple[str, str]:
    """The (state, optimizer) file names of saved rank ``rank``."""
    return _state_file(rank), _optim_file(rank)


def read_model_state(folder: str, meta: Dict, verify: bool = True,
                     wanted: Optional[Iterable[str]] = None) -> Dict[str, torch.Tensor]:
    """The saved model tensors under their whole-model names (memory-mapped; a v1 checkpoint's pre-layout-change
    names migrated, :func:`migrate_name`): with ``wanted`` (whole-model names) only the files holding them are
    opened (:func:`files_holding`) and only those tensors returned, else every rank's. Checks each tensor's CRC32
    (``verify``) and that no name was saved twice. Raises ``ValueError`` naming the file and tensor."""
    wanted = None if wanted is None else set(wanted)
    ranks = range(meta["world"]) if wanted is None else files_holding(meta, "model", wanted)
    out: Dict[str, torch.Tensor] = {}
    for r in ranks:
        path = os.path.join(folder, _state_file(r))
        st = _load(path)
        if st.get("format") != meta["format"] or st.get("step") != meta["step"]:
            raise ValueError(f"{path}: format {st.get('format')!r} step {st.get('step')!r}, expected "
                             f"{meta['format']!r} step {meta['step']}")
        for k, t in st["model"].items():
            name = migrate_name(k) if meta["format"] == FORMAT_V1 else k
            if wanted is not None and name not in wanted:
                continue
            if name in out:
                raise ValueError(f"{path}: tensor {name!r} saved by more than one rank")
            if verify and tensor_crc32(t) != st["crc32"].get(k):
                raise ValueError(f"{path}: checksum mismatch for {k!r} (the file is corrupted)")
            out[name] = t
    return out


def read_optimizer_shards(folder: str, ranks: Iterable[int], verify: bool = True, migrate: bool = False) -> List[Dict]:
    """The optimizer files of the saved ``ranks``, each checked against its sha256 checksum (``verify``); with
    ``migrate`` (a v1 checkpoint) pre-layout-change names are renamed (:func:`migrate_name`). Raises ``ValueError``
    naming the file."""
    out = []
    for r in ranks:
        path = os.path.join(folder, _optim_file(r))
        sd = _load(path)
        if verify and sd.get("checksum") != state_checksum(sd):
            raise ValueError(f"{path}: the optimizer shard fails its checksum (the file is corrupted)")
        if migrate and any(migrate_name(n) != n for n in sd["metadata"]["params"]):
            sd = dict(sd, shard={migrate_name(n): e for n, e in sd["shard"].items()},
                      metadata=dict(sd["metadata"], params={migrate_name(n): m
                                                            for n, m in sd["metadata"]["params"].items()}))
            sd.pop("checksum", None)
        out.append(sd)
    return out


def optimizer_pieces(saved: List[Dict], namings: List[Dict]) -> Tuple[Dict[str, List[Tuple[int, int, Dict]]],
                                                                       Dict[str, Tuple[Tuple[int, ...], str]]]:
    """The saved optimizer states ``saved`` (``namings[i]`` the naming of the rank that saved ``saved[i]``) by
    whole-model tensor: ``(pieces, kinds)``, ``pieces[name]`` the ``(start, end, {field: 1-D fp32 slice})`` saved for
    elements ``[start, end)`` of that tensor (an expert piece cut per global expert), ``kinds[name]`` its
    ``(shape, dtype)``. Raises ``ValueError`` when the states disagree on step, lr, hyper-parameters or loss scale."""
    pieces: Dict[str, List[Tuple[int, int, Dict]]] = {}
    kinds: Dict[str, Tuple[Tuple[int, ...], str]] = {}
    for sd, nm in zip(saved, namings):
        for k in ("step", "lr", "hyper", "loss_scaler"):
            if _plain(sd[k]) != _plain(saved[0][k]):
                raise ValueError(f"the optimizer files disagree on {k!r} ({_plain(sd[k])} vs {_plain(saved[0][k])}): "
                                 "files of different steps or runs")
        md = sd["metadata"]
        names = optimizer_global_names(md, nm)
        for n, (g, first, shape) in names.items():
            rows = md["params"][n]["shape"][0] if first is not None else 1
            for i in range(rows):
                kinds[g if first is None else f"{g}[{first + i}]"] = (shape, md["params"][n]["dtype"])
        for n, e in sd["shard"].items():
            g, first, shape = names[n]
            a, b = e["range"]
            fields = {k: v for k, v in e.items() if k != "range"}
            if first is None:
                pieces.setdefault(g, []).append((a, b, fields))
                continue
            rs = math.prod(shape)
            for i in range(a // rs, -(-b // rs)) if rs else ():
                lo, hi = max(a, i * rs), min(b, (i + 1) * rs)
                if lo < hi:
                    pieces.setdefault(f"{g}[{first + i}]", []).append(
                        (lo - i * rs, hi - i * rs, {k: v[lo - a:hi - a] for k, v in fields.items()}))
    return pieces, kinds


def _check_covered(name: str, pieces: List[Tuple[int, int, Dict]], numel: int) -> None:
    at = 0
    for a, b in sorted((a, b) for a, b, _ in pieces):
        if a > at:
            break
        at = max(at, b)
    if at < numel:
        raise ValueError(f"the optimizer files read do not cover elements [{at}, {numel}) of {name!r} (a missing or "
                         "incomplete file)")


def consolidate_optimizer(saved: List[Dict], namings: List[Dict]) -> Dict[str, Dict[str, torch.Tensor]]:
    """Every whole-model tensor's optimizer state in one piece: ``{name: {field: fp32 tensor of the tensor's
    shape}}`` (fields ``exp_avg``, ``exp_avg_sq`` and, for 16-bit parameters, ``main_param``) from the optimizer
    files of every saved rank. Raises ``ValueError`` naming a tensor that is not covered."""
    pieces, kinds = optimizer_pieces(saved, namings)
    out = {}
    for name, (shape, _) in kinds.items():
        numel = math.prod(shape)
        _check_covered(name, pieces.get(name, []), numel)
        fields = {}
        for a, b, f in pieces[name]:
            for k, v in f.items():
                fields.setdefault(k, torch.empty(numel, dtype=v.dtype))[a:b] = v
        out[name] = {k: v.view(shape) for k, v in fields.items()}
    return out


def reshard_optimizer(saved: List[Dict], namings: List[Dict], target: Dict, naming: Dict) -> List[Dict]:
    """Shards for ``DistributedOptimizer.load_state_dict(..., verify_checksum=False)`` of a rank whose optimizer
    has ``target`` metadata (``checkpoint_metadata()``) and ``naming`` (:func:`naming_of`), built from saved
    optimizer states ``saved`` (any layout; ``namings[i]`` the naming of the rank that saved ``saved[i]``): every
    saved piece is taken to whole-model names (:func:`optimizer_pieces`) and then to this rank's names and element
    ranges. Checks that the saved states agree (step, lr, hyper-parameters, loss scale), that every whole-model
    tensor this rank needs has the same shape and dtype and is covered element by element. Raises ``ValueError`` /
    ``KeyError`` naming the whole-model tensor."""
    if not saved:
        raise ValueError("no optimizer file of the checkpoint holds this rank's parameters")
    pieces, kinds = optimizer_pieces(saved, namings)
    per_name: Dict[str, List[Dict]] = {}
    for n, (g, first, shape) in optimizer_global_names(target, naming).items():
        m = target["params"][n]
        rows = [(g, 0)] if first is None else [(f"{g}[{first + i}]", i) for i in range(m["shape"][0])]
        rs = math.prod(shape)
        for gname, i in rows:
            if gname not in kinds:
                raise KeyError(f"the checkpoint's optimizer state has no tensor {gname!r}")
            if (tuple(kinds[gname][0]), kinds[gname][1]) != (tuple(shape), m["dtype"]):
                raise ValueError(f"optimizer state of {gname!r} is {kinds[gname][1]} {tuple(kinds[gname][0])} in "
                                 f"the checkpoint, this run expects {m['dtype']} {tuple(shape)}")
            _check_covered(gname, pieces.get(gname, []), rs)
            for a, b, fields in pieces[gname]:
                per_name.setdefault(n, []).append({"range": (i * rs + a, i * rs + b), **fields})
    head = {k: saved[0][k] for k in ("format", "step", "lr", "hyper", "loss_scaler")}
    depth = max((len(v) for v in per_name.values()), default=0)
    return [dict(head, metadata=target, shard={n: v[j] for n, v in per_name.items() if j < len(v)})
            for j in range(max(depth, 1))]


def _plain(v):
    """A comparable host value of a saved scalar, dict or tuple (tensors as Python numbers)."""
    if isinstance(v, torch.Tensor):
        return v.tolist()
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def global_name(module: nn.Module, name: str) -> str:
    """The whole-model name of ``module``'s parameter or buffer ``name``. A pipeline stage (a module with
    ``layer_ids``: the global layer of each of its ``blocks``) numbers its blocks from 0, the whole model by layer:
    ``blocks.<i>.rest`` is ``blocks.<layer_ids[i]>.rest``; every other name is the same in every layout."""
    return _renumber(name, getattr(module, "layer_ids", None))


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


# ------------------------------------------------------------------------------------------ offline tool --


def _open(path: str):
    folder = resolve_checkpoint(path)
    return folder, read_meta(folder)


def _all_optimizer(folder: str, meta: Dict):
    ranks = list(range(meta["world"]))
    saved = read_optimizer_shards(folder, ranks, migrate=meta["format"] == FORMAT_V1)
    return saved, [meta["index"][r]["naming"] for r in ranks]


def inspect_checkpoint(path: str, tensors: bool = False) -> Dict:
    """A description of the checkpoint at ``path``: format, step, layout, model flags, files with their sizes,
    tensor count and bytes (and every tensor's shape and dtype with ``tensors``)."""
    folder, meta = _open(path)
    files = []
    for r in range(meta["world"]):
        for f in rank_files(meta, r):
            p = os.path.join(folder, f)
            files.append({"file": f, "bytes": os.path.getsize(p) if os.path.exists(p) else None})
    model = read_model_state(folder, meta)
    out = {"folder": folder, "format": meta["format"], "step": meta["step"], "layout": meta["layout"],
           "model": meta.get("model"), "data": meta.get("data"), "dropless": meta.get("dropless"), "files": files,
           "num_tensors": len(model), "tensor_bytes": sum(t.numel() * t.element_size() for t in model.values())}
    if tensors:
        out["tensors"] = {k: {"shape": list(t.shape), "dtype": str(t.dtype)} for k, t in model.items()}
    return out


def _stack_experts(flat: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Whole-model entries with each ``name[e]`` family stacked into ``name`` ``[E, ...]`` (order kept)."""
    rows: Dict[str, Dict[int, torch.Tensor]] = {}
    out: Dict[str, Optional[torch.Tensor]] = {}
    for k, t in flat.items():
        base, e = split_expert_name(k)
        if e is None:
            out[k] = t
        else:
            out.setdefault(base, None)
            rows.setdefault(base, {})[e] = t
    for base, r in rows.items():
        if sorted(r) != list(range(len(r))):
            missing = sorted(set(range(max(r) + 1)) - set(r))
            raise ValueError(f"{base}: experts {missing} are missing from the checkpoint")
        out[base] = torch.stack([r[e] for e in range(len(r))])
    return out


def whole_model_state_dict(path: str, optimizer: bool = False) -> Dict:
    """The whole-model state dict of the checkpoint at ``path`` (experts stacked; see the module docstring); with
    ``optimizer`` the dict ``{"model", "optimizer", "step", "lr", "hyper", "loss_scaler", "meta"}``."""
    folder, meta = _open(path)
    model = _stack_experts({k: t.clone() for k, t in read_model_state(folder, meta).items()})
    if not optimizer:
        return model
    saved, namings = _all_optimizer(folder, meta)
    per_tensor = consolidate_optimizer(saved, namings)
    fields = {k: v for k, v in per_tensor.items() if not is_expert_name(k)}
    for f in ("exp_avg", "exp_avg_sq", "main_param"):
        stacked = _stack_experts({k: v[f] for k, v in per_tensor.items() if f in v
                                  and is_expert_name(k)})
        for base, t in stacked.items():
            fields.setdefault(base, {})[f] = t
    head = saved[0]
    return {"model": model, "optimizer": fields, "step": int(head["step"]), "lr": float(head["lr"]),
            "hyper": head["hyper"], "loss_scaler": head["loss_scaler"], "meta": meta}


def convert_checkpoint(path: str, out: str, optimizer: bool = False) -> Dict:
    """Write :func:`whole_model_state_dict` to ``out`` (``.safetensors``: model tensors only; else ``torch.save``).
    Returns the state dict written."""
    if out.endswith(".safetensors") and optimizer:
        raise ValueError(f"convert {out}: --optimizer needs a .pt file (safetensors holds tensors only)")
    sd = whole_model_state_dict(path, optimizer)
    if out.endswith(".safetensors") and save_file is None:
        raise ValueError(f"convert {out}: the safetensors package is not installed (pip install safetensors)")
    parent, base = os.path.split(os.path.abspath(out))
    with _temporary_folder(parent, "." + base + ".partial", f"convert {out}") as tmp:
        written = os.path.join(tmp, base)
        if out.endswith(".safetensors"):
            save_file({k: v.contiguous() for k, v in sd.items()}, written)
        else:
            with open(written, "wb") as f:
                torch.save(sd, f)
                f.flush()
                os.fsync(f.fileno())
        os.replace(written, out)
    return sd


class _temporary_folder:
    """``with _temporary_folder(parent, name, what) as tmp``: ``parent/name`` made empty (``parent`` created if
    needed); on leaving it is removed, and on any failure so is ``parent`` when this made it and it is empty; an
    ``OSError`` (a full disk) is re-raised naming ``what`` and the folder."""

    def __init__(self, parent: str, name: str, what: str):
        self.parent, self.path, self.what = parent, os.path.join(parent, name), what

    def __enter__(self) -> str:
        self.made_parent = not os.path.isdir(self.parent)
        os.makedirs(self.parent, exist_ok=True)
        if os.path.exists(self.path):  # leftovers of a killed run
            shutil.rmtree(self.path)
        os.makedirs(self.path)
        return self.path

    def __exit__(self, typ, exc, tb) -> bool:
        shutil.rmtree(self.path, ignore_errors=True)
        if exc is not None and self.made_parent:
            try:
                os.rmdir(self.parent)
            except OSError:
                pass  # not empty: something else is in it
        if isinstance(exc, OSError) and self.path not in str(exc):
            raise OSError(exc.errno, f"{self.what}: writing into {self.path} failed ({exc.strerror or exc}); "
                                     "nothing was written") from exc
        return False


def _stage_of_extra_names(folder: str, meta: Dict) -> Dict[str, str]:
    """``"first"`` / ``"last"`` for each model tensor outside ``blocks.*`` (embeddings, the final norm, the head):
    where it stands in the module order of the rank that saved it, before or after the blocks."""
    out = {}
    for r in range(meta["world"]):
        st = read_rank_state(folder, r)
        seen_block = False
        for k in st["model"]:
            if k.startswith("blocks."):
                seen_block = True
            else:
                out.setdefault(migrate_name(k), "last" if seen_block else "first")
    return out


def reshard_checkpoint(path: str, out: str, pp: int, ep: int, dp: int, vpp: Optional[int] = None) -> str:
    """Write the checkpoint at ``path`` for the layout ``pp x vpp``, ``dp`` ranks per stage of which ``ep`` expert
    ranks, into ``out`` (a checkpoint root: ``out/step_<n>``, ``out/latest``). Everything is checked (the layout
    fits the model, every tensor and its optimizer state present) before the first file is written. Returns the
    folder written."""
    folder, meta = _open(path)
    layers = meta["model"]["layers"]
    for flag, v in (("--pp", pp), ("--ep", ep), ("--dp", dp)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"reshard {flag} must be an integer >= 1, got {v!r}")
    if vpp is not None and (vpp < 1 or pp == 1):
        raise ValueError(f"reshard --vpp {vpp}: needs --pp > 1 and --vpp >= 1")
    if dp % ep:
        raise ValueError(f"reshard --ep {ep} must divide --dp {dp}")
    if layers % (pp * (vpp or 1)):
        raise ValueError(f"reshard: the model's {layers} layers are not divisible by --pp {pp} x --vpp {vpp or 1}")
    experts = meta["model"].get("experts")
    if experts and experts % ep:
        raise ValueError(f"reshard --ep {ep} must divide the model's {experts} experts")
    model = read_model_state(folder, meta)
    saved, namings = _all_optimizer(folder, meta)
    per_tensor = consolidate_optimizer(saved, namings)
    _, kinds = optimizer_pieces(saved, namings)
    extra = _stage_of_extra_names(folder, meta)
    n_experts: Dict[str, int] = {}
    for k in list(model) + list(kinds):
        base, e = split_expert_name(k)
        if e is not None:
            n_experts[base] = max(n_experts.get(base, 0), e + 1)
    for base, n in n_experts.items():
        if n % ep:
            raise ValueError(f"reshard --ep {ep} must divide the {n} experts of {base!r}")
    head = {k: saved[0][k] for k in ("format", "step", "lr", "hyper", "loss_scaler")}
    world, edp = pp * dp, dp // ep
    ranks = []
    for r in range(world):
        p, d = divmod(r, dp)
        e, x = d % ep, d // ep
        chunks = chunk_layer_ids(layers, pp, p, vpp)
        naming = {"layer_ids": chunks, "chunked": len(chunks) > 1, "ep_rank": e}
        ranks.append({"coords": {"rank": r, "pp_rank": p, "dp_rank": d, "ep_rank": e, "edp_rank": x},
                      "naming": naming, "model": {}, "params": {}, "shard": {}})

    def local(name: str, p: int):
        """(chunk prefix + local name) of whole-model base ``name`` on pipeline rank ``p``, or None."""
        chunks = chunk_layer_ids(layers, pp, p, vpp)
        pre = (lambda c: f"chunk{c}." if len(chunks) > 1 else "")
        if name.startswith("blocks."):
            _, i, rest = name.split(".", 2)
            for c, ids in enumerate(chunks):
                if int(i) in ids:
                    return f"{pre(c)}blocks.{ids.index(int(i))}.{rest}"
            return None
        if extra.get(name, "first") == "first":
            return f"{pre(0)}{name}" if p == 0 else None
        return f"{pre(len(chunks) - 1)}{name}" if p == pp - 1 else None

    for rk in ranks:
        c, naming = rk["coords"], rk["naming"]
        # model tensors: dense ones on data-parallel rank 0 of the stage, experts on expert-data-parallel rank 0
        for k, t in model.items():
            base, e = split_expert_name(k)
            if local(base, c["pp_rank"]) is None:
                continue
            if e is None and c["dp_rank"] == 0:
                rk["model"][k] = t
            elif e is not None and c["edp_rank"] == 0 and e // (n_experts[base] // ep) == c["ep_rank"]:
                rk["model"][k] = t
        # optimizer: every parameter of the stage described, whole tensors on the owning rank
        for base in {split_expert_name(k)[0] for k in kinds}:
            name = local(base, c["pp_rank"])
            if name is None:
                continue
            if base in kinds:
                shape, dtype = kinds[base]
                rk["params"][name] = {"shape": tuple(shape), "dtype": dtype, "expert": False}
                if c["dp_rank"] == 0:
                    rk["shard"][name] = dict({"range": (0, math.prod(shape))},
                                             **{f: v.reshape(-1) for f, v in per_tensor[base].items()})
            else:
                per = n_experts[base] // ep
                rows = [f"{base}[{c['ep_rank'] * per + i}]" for i in range(per)]
                shape, dtype = kinds[rows[0]]
                rk["params"][name] = {"shape": (per, *shape), "dtype": dtype, "expert": True}
                if c["edp_rank"] == 0:
                    fields = per_tensor[rows[0]].keys()
                    rk["shard"][name] = dict({"range": (0, per * math.prod(shape))},
                                             **{f: torch.cat([per_tensor[g][f].reshape(-1) for g in rows])
                                                for f in fields})
    # write: everything into a temporary folder, renamed when complete; 'latest' last; all removed on any failure
    name = step_dirname(meta["step"])
    final = os.path.join(out, name)
    if os.path.exists(final):
        raise FileExistsError(f"reshard: {final} exists (choose an empty OUT)")
    with _temporary_folder(out, "." + name + ".partial", f"reshard {out}") as tmp:
        index, coords = [], []
        for r, rk in enumerate(ranks):
            c = rk["coords"]
            state_f, optim_f = rank_files(meta, r)
            tensors = {k: t.contiguous().clone() for k, t in rk["model"].items()}
            atomic_torch_save({"format": FORMAT, "step": meta["step"], "rank": r, "world": world,
                               "model": tensors, "crc32": {k: tensor_crc32(t) for k, t in tensors.items()},
                               "data": {"step": meta["step"]}, "coords": c}, os.path.join(tmp, state_f))
            md = {"dp_size": dp, "dp_rank": c["dp_rank"], "expert_dp_size": edp, "expert_dp_rank": c["edp_rank"],
                  "ep_size": ep, "ep_rank": c["ep_rank"], "params": rk["params"]}
            sd = dict(head, metadata=md, shard=rk["shard"])
            sd["checksum"] = state_checksum(sd)
            atomic_torch_save(sd, os.path.join(tmp, optim_f))
            held = optimizer_tensor_names({"params": {n: rk["params"][n] for n in rk["shard"]}}, rk["naming"])
            index.append({"naming": rk["naming"], "model": held_index(tensors), "optim": held_index(held)})
            coords.append(c)
        layout = {"world": world, "pp": pp, "vpp": vpp, "ep": ep, "dp": dp, "edp": edp}
        new_meta = {k: v for k, v in meta.items() if k not in ("index", "coords", "layout", "files", "format")}
        new_meta.update(format=FORMAT, layout=layout, coords=coords, world=world, index=index,
                        files=[list(rank_files(meta, r)) for r in range(world)],
                        resharded_from={"folder": folder, "layout": meta["layout"], "format": meta["format"]})
        atomic_text(os.path.join(tmp, "meta.json"), json.dumps(new_meta, indent=1, default=str))
        os.replace(tmp, final)
        try:
            atomic_text(os.path.join(out, "latest"), name + "\n")
        except BaseException:  # no half-published checkpoint either
            shutil.rmtree(final, ignore_errors=True)
            raise
    return final


def main(argv=None) -> int:
    """``python -m moe_graph.train.checkpoint inspect|convert|reshard`` (flags: :mod:`moe_graph.train.flags`)."""
    a = flags.parse_checkpoint(argv)
    try:
        if a.cmd == "inspect":
            d = inspect_checkpoint(a.ckpt, a.tensors)
            if a.json:
                print(json.dumps(d, indent=1, default=str))
            else:
                lay = d["layout"]
                print(f"{d['folder']}: {d['format']}, step {d['step']}, layout pp {lay['pp']} vpp {lay.get('vpp')} "
                      f"ep {lay['ep']} dp {lay['dp']} ({lay['world']} ranks)")
                print(f"model: {d['model']}")
                print(f"{d['num_tensors']} tensors, {d['tensor_bytes'] / 2**20:.2f} MiB; files: "
                      + ", ".join(f"{f['file']} {f['bytes']}" for f in d["files"]))
                for k, t in d.get("tensors", {}).items():
                    print(f"  {k} {t['dtype']} {tuple(t['shape'])}")
        elif a.cmd == "convert":
            sd = convert_checkpoint(a.ckpt, a.out, a.optimizer)
            n = len(sd["model"] if a.optimizer else sd)
            print(f"wrote {a.out}: {n} tensors{' + optimizer state' if a.optimizer else ''}")
        else:
            print(f"wrote {reshard_checkpoint(a.ckpt, a.out, a.pp, a.ep, a.dp, a.vpp)}")
    except Exception as e:  # noqa: BLE001 - any failure (a broken file, a full disk): one line, exit status 2
        print(f"error: {e}" if isinstance(e, (OSError, ValueError, KeyError)) else f"error: {type(e).__name__}: {e}",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
