"""What the demo reports: one metrics record per logged step (``metrics.jsonl``), the progress line, the final
summary printed on rank 0 and written atomically (``demo_summary.json``), and the plot (``demo.png``: loss and load
balance; matplotlib when installed, else a built-in PNG writer)."""

from __future__ import annotations

import json
import os
import struct
import zlib
from typing import Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["load_imbalance", "metrics_record", "append_metrics", "progress_line", "write_json_atomic",
           "print_report", "plot", "png_fallback"]


def load_imbalance(loads: torch.Tensor) -> float:
    """Mean over MoE layers of max/mean tokens per expert-parallel rank; ``loads`` ``[layers, R]`` on the host."""
    return float((loads.max(1).values / loads.mean(1)).mean())


def metrics_record(step: int, loss: float, grad_norm: float, skipped: bool, load_before: torch.Tensor,
                   load_after: torch.Tensor, tok_s: float) -> Dict:
    """One ``metrics.jsonl`` line (and one entry of the summary's ``history``)."""
    return {"step": step, "loss": loss, "grad_norm": grad_norm, "skipped": skipped,
            "imb_before": load_imbalance(load_before), "imb_after": load_imbalance(load_after), "tok_s": tok_s}


def append_metrics(path: str, rec: Dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def progress_line(rec: Dict, steps: int, elapsed_s: float) -> str:
    done = rec["step"] / steps
    bar = "#" * int(24 * done) + "." * (24 - int(24 * done))
    rerun = (f"  reruns {rec['reruns']} (capacity factor {rec['capacity_factor']:.3g})"
             if rec.get("capacity_factor") is not None else "")
    return (f"[{bar}] step {rec['step']:4d}/{steps}  loss {rec['loss']:6.3f}  {rec['tok_s']:8.0f} tok/s  "
            f"max/mean load {rec['imb_before']:.2f} -> {rec['imb_after']:.2f} with echo{rerun}  ({elapsed_s:5.1f} s)")


def write_json_atomic(path: str, obj) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


def print_report(summary: Dict) -> None:
    """The end-of-run lines: per-rank load of layer 0 before and after echo, the mean imbalance over training,
    dropped routes, the loss, tokens/s and the step time (eager and, on a GPU, the full-iteration graph)."""
    lb, la = summary["load_before"][0], summary["load_after"][0]
    print("\nper-rank load of layer 0 at the last step (tokens received by each EP rank's experts):")
    print("  rank   " + " ".join(f"{r:>7d}" for r in range(len(lb))) + "   max/mean")
    for name, v in (("before", lb), ("echo  ", la)):
        print(f"  {name} " + " ".join(f"{int(x):>7d}" for x in v) + f"   {max(v) / (sum(v) / len(v)):.3f}")
    h = summary["history"]
    n = len(h["imb_before"])
    print(f"mean max/mean load over training: {sum(h['imb_before']) / n:.3f} without echo -> "
          f"{sum(h['imb_after']) / n:.3f} with echo; {_over_capacity(summary)}")
    d = summary.get("dropless")
    if d is not None:
        cf = d["capacity_factor"]
        print(f"dropless (overflow=rerun): {d['reruns']} of {d['steps']} steps reran ({100 * d['rerun_rate']:.1f}%); "
              f"capacity factor {d['user_capacity_factor']} -> {cf if cf is None else round(cf, 4)} "
              f"({d['recaptures']} raise(s), each a new capture)")
    print(f"loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f} in steps {summary['start_step'] + 1}-"
          f"{summary['steps']}; {sum(h['tok_s'][1:]) / max(len(h['tok_s']) - 1, 1):.0f} tokens/s")
    if summary["graph_step_ms"] is not None:
        e, g = summary["eager_step_ms"], summary["graph_step_ms"]
        print(f"step time: eager {e:.2f} ms, full-iteration CUDA graph {g:.2f} ms ({e / g:.2f}x)")
    else:
        ms = summary["eager_step_ms"]
        print(f"step time: eager {ms:.1f} ms ({summary['graph_note']})" if ms else summary["graph_note"])


def _over_capacity(summary: Dict) -> str:
    over = sum(summary["dropped_routes_all_ranks"])
    if summary.get("dropless") is not None:  # overflowed passes were skipped and rerun with the capacity they needed
        return f"routes over capacity (all ranks): {over}, all rerun (none dropped)"
    return f"dropped routes over capacity (all ranks): {over}"


def _run_label(summary: Dict) -> str:
    """``"bf16"``-style name of a run's precision from its flags (``--fp8`` [``--fp8-dispatch``])."""
    c = summary.get("config", {})
    if not c.get("fp8"):
        return "no FP8"
    return f"FP8 {c['fp8']}" + (" + FP8 dispatch" if c.get("fp8_dispatch") else "")


def plot(summary: Dict, path: str, baseline: Optional[Dict] = None) -> str:
    """Write ``demo.png``; returns how it was drawn. ``baseline``: another run's summary whose loss curve is drawn
    beside this run's (e.g. the same flags without ``--fp8``)."""
    h = summary["history"]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        png_fallback(summary, path)
        return "built-in PNG writer (matplotlib is not installed: no text labels)"
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    ax[0].plot(h["step"], h["loss"], "-o", ms=3, label=f"this run: {_run_label(summary)}")
    if baseline is not None:
        b = baseline["history"]
        ax[0].plot(b["step"], b["loss"], "--s", ms=3, label=f"baseline: {_run_label(baseline)}")
        ax[0].legend()
    ax[0].set(title="training loss (rank 0)", xlabel="step", ylabel="cross entropy")
    ax[1].plot(h["step"], h["imb_before"], label="without echo")
    ax[1].plot(h["step"], h["imb_after"], label="with echo")
    ax[1].axhline(1.0, color="gray", lw=0.5)
    ax[1].set(title="load imbalance (max/mean tokens per rank)", xlabel="step")
    ax[1].legend()
    xs = list(range(len(summary["load_before"][0])))
    ax[2].bar([x - 0.2 for x in xs], summary["load_before"][0], 0.4, label="before echo")
    ax[2].bar([x + 0.2 for x in xs], summary["load_after"][0], 0.4, label="after echo")
    ax[2].set(title="tokens per EP rank (layer 0, last step)", xlabel="EP rank", xticks=xs)
    top = max(max(summary["load_before"][0]), max(summary["load_after"][0]))
    ax[2].set_ylim(0, 1.3 * top)  # headroom for the legend
    ax[2].legend(loc="upper center", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return "matplotlib"


# ------------------------------------------------------------------------ PNG without matplotlib --
_Color = Tuple[int, int, int]


class _Canvas:
    """An RGB image on a white background, drawn with straight lines."""

    def __init__(self, width: int, height: int):
        self.width, self.height = width, height
        self.pixels = bytearray(b"\xff" * (width * height * 3))

    def dot(self, x: int, y: int, c: _Color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = (y * self.width + x) * 3
            self.pixels[i : i + 3] = bytes(c)

    def line(self, x0: int, y0: int, x1: int, y1: int, c: _Color) -> None:
        n = max(abs(x1 - x0), abs(y1 - y0), 1)
        for t in range(n + 1):
            self.dot(round(x0 + (x1 - x0) * t / n), round(y0 + (y1 - y0) * t / n), c)

    def panel(self, top: int, bottom: int, series: Sequence[Tuple[List[float], List[float], _Color]]) -> None:
        """Gray axes and one polyline per ``(xs, ys, color)``, all scaled to the panel's common y range."""
        left, right = 40, self.width - 20
        self.line(left, top, left, bottom, (128, 128, 128))
        self.line(left, bottom, right, bottom, (128, 128, 128))
        vals = [v for _, ys, _ in series for v in ys]
        lo, hi = min(vals), max(vals)
        hi = hi if hi > lo else lo + 1
        for xs, ys, c in series:
            x0, x1 = min(xs), max(max(xs), min(xs) + 1)
            pts = [(left + (x - x0) * (right - left) / (x1 - x0), bottom - (y - lo) * (bottom - top) / (hi - lo))
                   for x, y in zip(xs, ys)]
            for (a, b), (c2, d) in zip(pts, pts[1:]):
                self.line(round(a), round(b), round(c2), round(d), c)

    def png(self) -> bytes:
        w = self.width * 3
        raw = b"".join(b"\x00" + bytes(self.pixels[y * w : (y + 1) * w]) for y in range(self.height))
        return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0))
                + _png_chunk(b"IDAT", zlib.compress(raw, 6)) + _png_chunk(b"IEND", b""))


def _png_chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)


def png_fallback(summary: Dict, path: str, width: int = 640, height: int = 400) -> None:
    """A minimal line plot without matplotlib: top panel loss (blue), bottom panel load imbalance before (red) and
    after (green) echo; white background, gray axes."""
    canvas = _Canvas(width, height)
    h = summary["history"]
    canvas.panel(20, 190, [(h["step"], h["loss"], (30, 90, 200))])
    canvas.panel(220, 380, [(h["step"], h["imb_before"], (210, 50, 50)), (h["step"], h["imb_after"], (40, 160, 60))])
    with open(path, "wb") as f:
        f.write(canvas.png())
