"""megatron-core 0.19.2 on this machine's Python, and the CPU shims for the CUDA calls Megatron makes
unconditionally: shared by ``tests/test_megatron_client.py`` and ``benchmarks/bench_moe_cost.py``.

megatron-core 0.19.2 declares Python >= 3.12 but the modules used here are pure Python and run on 3.11: the wheel
is fetched once with ``pip download`` and unpacked under ``build/`` (git-ignored; ``MOE_GRAPH_MEGATRON_CACHE``
overrides the folder). :func:`provide_megatron` returns the reason when it cannot be had (no network, no pip).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable, Optional

import torch

MCORE_VERSION = "0.19.2"
ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("MOE_GRAPH_MEGATRON_CACHE", ROOT / "build" / f"megatron-core-{MCORE_VERSION}"))


def installed_version() -> Optional[str]:
    try:
        from megatron.core.package_info import __version__

        return __version__.split("+")[0]  # 0.19.2 appends the git hash of the current directory's repository
    except ImportError:
        return None


def _pip_unpack(requirement: str, dest: Path, marker: str, extra_args=()):
    """``pip download`` one wheel and unpack it into ``dest`` (atomically); returns an error string or None."""
    if (dest / marker).exists():
        return None
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", *extra_args, requirement,
               "-d", tmp, "-q"]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"cannot fetch {requirement} with pip: {exc}"
        wheels = list(Path(tmp).glob("*.whl"))
        if res.returncode != 0 or not wheels:
            return f"cannot fetch {requirement} with pip: {res.stderr.strip()[-300:]}"
        unpacked = Path(tmp) / "site"
        with zipfile.ZipFile(wheels[0]) as z:
            z.extractall(unpacked)
        try:
            os.replace(unpacked, dest)  # atomic: a concurrent run finds a complete folder or none
        except OSError:
            if not (dest / marker).exists():
                raise
    return None


def provide_megatron() -> Optional[str]:
    """Put megatron-core 0.19.2 (and psutil, which its checkpoint writer needs) on sys.path; returns the reason it
    cannot be had, or None."""
    if installed_version() != MCORE_VERSION:
        err = _pip_unpack(f"megatron-core=={MCORE_VERSION}", CACHE, "megatron/core/__init__.py",
                          ("--python-version", "3.12"))  # the wheel declares >= 3.12; the modules used run on 3.11
        if err:
            return err
        sys.path.insert(0, str(CACHE))
        for name in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
            del sys.modules[name]
        if installed_version() != MCORE_VERSION:
            return f"megatron-core {MCORE_VERSION} unpacked in {CACHE} does not import"
    try:
        import psutil  # noqa: F401
    except ImportError:
        deps = CACHE.parent / f"megatron-core-{MCORE_VERSION}-deps"
        err = _pip_unpack("psutil", deps, "psutil/__init__.py")
        if err:
            return err
        sys.path.insert(0, str(deps))
    return None


def _no_sync(what: str) -> None:
    pass


class CpuStream:
    """The one CPU "stream": CPU work runs in program order, so there is nothing to wait for and every recorded
    event is already complete. Megatron's all-to-all token dispatcher creates a device-to-host side stream
    (``torch.cuda.Stream()``), enters it (``torch.cuda.stream``), records an event there and synchronizes on it;
    its DDP bucket groups ask for the current stream to wait on CUDA-graph wgrad events (none exist on CPU).
    ``on_sync(what)`` is called where the host would wait for the device (a host sync on a GPU)."""

    def __init__(self, on_sync: Callable[[str], None] = _no_sync):
        self.on_sync = on_sync

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):  # pragma: no cover - only CUDA-graph wgrad events reach it
        raise AssertionError("no CUDA-graph events on CPU")

    def record_event(self, event=None):
        return CpuEvent(self.on_sync)

    def synchronize(self):
        self.on_sync("stream.synchronize")


class CpuEvent:
    def __init__(self, on_sync: Callable[[str], None] = _no_sync):
        self.on_sync = on_sync

    def synchronize(self):
        self.on_sync("event.synchronize")


@contextlib.contextmanager
def cpu_shims(on_sync: Callable[[str], None] = _no_sync, on_host_copy: Optional[Callable[[object], None]] = None):
    """The only CUDA calls Megatron makes on this path, redirected for CPU (each exists because Megatron calls
    it unconditionally, not because moe_graph needs it):

    * ``torch.cuda.current_device()``: Megatron's DDP allocates its grad buffers on it (``device=...``), and
      dist_checkpointing its status flags; "cpu" puts them where the parameters are.
    * ``torch.cuda.Stream()``, ``torch.cuda.stream(s)``, ``torch.cuda.current_stream()``: the all-to-all
      dispatcher's device-to-host copy stream and DDP's wait for CUDA-graph events: one CPU stream (see
      ``CpuStream``).
    * ``torch.cuda.synchronize()``: dist_checkpointing's save waits for device copies of the tensors it writes;
      on CPU every copy is already complete.
    * the all-to-all dispatcher's ``maybe_move_tensor_to_cpu``: on GPU it copies the EP split sizes to host numpy
      arrays (``as_numpy=True``), the form ``all_to_all_single`` takes; on CPU it returns host tensors unchanged,
      which ``all_to_all_single`` rejects. The shim applies the same conversion to host tensors.

    ``on_sync(what)``: called for every wait of the host on the device (stream/event/device synchronize);
    ``on_host_copy(value)``: called with what ``maybe_move_tensor_to_cpu`` returns (a device-to-host copy on GPU),
    so that a caller counting host syncs can tell host copies from device tensors.
    """
    from megatron.core.transformer.moe import token_dispatcher
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    move = token_dispatcher.maybe_move_tensor_to_cpu
    stream = CpuStream(on_sync)

    def move_on_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and tensor.device.type == "cpu" and as_numpy:
            out = tensor.numpy()
        else:
            out = move(tensor, as_numpy=as_numpy, record_stream=record_stream)
        if on_host_copy is not None and torch.is_tensor(tensor):
            on_host_copy(out)
        return out

    names = ("current_device", "Stream", "stream", "current_stream", "synchronize")
    saved = {n: getattr(torch.cuda, n) for n in names}
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.Stream = lambda *a, **k: stream
    torch.cuda.stream = lambda s=None: contextlib.nullcontext()
    torch.cuda.current_stream = lambda device=None: stream
    torch.cuda.synchronize = lambda device=None: on_sync("torch.cuda.synchronize")
    token_dispatcher.maybe_move_tensor_to_cpu = move_on_cpu
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.cuda, n, f)
        token_dispatcher.maybe_move_tensor_to_cpu = move
        if isinstance(MoEAlltoAllTokenDispatcher.cuda_dtoh_stream, CpuStream):  # a class attribute Megatron sets once
            MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = None
