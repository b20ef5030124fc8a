"""README.md and the pages it points to stay true.

* every ``python`` block of README is a marked example (``<!-- example: NAME -->`` on the line before it) and runs
  as written, in order, in one namespace (later examples continue earlier ones); its results are checked against
  plain-PyTorch references written here;
* every repository path and every ``moe_graph`` name those pages mention exists, and every ``python -m`` command
  they show names a module that exists with the flags they use;
* the Layout section lists every module of the package, at the floor ``tests/test_layout.py`` enforces;
* README keeps the order of its sections and stays under 230 lines.

The examples in ``python/moe_graph/integrations/README.md`` are run by the tests of their frameworks
(:data:`EXAMPLES_ELSEWHERE`: megatron-core's parallel state, transformers).
"""

from __future__ import annotations

import contextlib
import glob
import importlib
import importlib.util
import io
import os
import re
import runpy
import sys
import warnings
from typing import Dict, List, Tuple

import pytest
import torch

import test_layout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = "README.md"
INTEGRATIONS = "python/moe_graph/integrations/README.md"
# Pages README points to; paths and names in them are checked the same way.
PAGES = [README, INTEGRATIONS, "benchmarks/README.md"] + sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
# Marked python examples outside README and the test that runs each.
EXAMPLES_ELSEWHERE = {
    (INTEGRATIONS, "megatron-example"): ("tests/test_megatron_client.py", "test_readme_example"),
    (INTEGRATIONS, "hf-example"): ("tests/test_hf_models.py", "test_readme_example"),
}
SECTIONS = [
    "The two commands",
    "How data flows through one training iteration",
    "Quick start",
    "The API by layer (lowest first)",
    "CUDA-graph rules: what a captured step may and may not contain",
    "Failure behaviour",
    "Layout",
    "Training equivalence",
]
MAX_LINES = 230
PATH_RE = re.compile(r"(?<![\w./-])((?:python/moe_graph|tests|benchmarks|scripts|docs|csrc|third_party|\.ci)"
                     r"/[\w./*{},<>:-]*)")
NAME_RE = re.compile(r"(?<![\w.])moe_graph(?:\.[A-Za-z_]\w*)+")
COMMAND_RE = re.compile(r"-m ((?:moe_graph|helpers)(?:\.\w+)*)((?:\s+--?[\w-]+(?: +[^\s`-][^\s`]*)?)*)")


def _text(page: str) -> str:
    with open(os.path.join(ROOT, page)) as f:
        return f.read()


def _blocks(page: str) -> List[Tuple[str, str, int, str]]:
    """(language, marker or '', first line number of the code, code) for every fenced block of ``page``."""
    out, lines, i = [], _text(page).split("\n"), 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m or not m.group(1):
            i += 1
            continue
        prev = lines[i - 1] if i else ""
        marker = re.match(r"^<!-- (?:example: )?([\w-]+).*-->$", prev)
        j = lines.index("```", i + 1)
        out.append((m.group(1), marker.group(1) if marker else "", i + 2, "\n".join(lines[i + 1:j]) + "\n"))
        i = j + 1
    return out


# ------------------------------------------------------------------------------------------------ shape --
def test_readme_is_short_and_in_order():
    text = _text(README)
    n = text.count("\n")
    assert n < MAX_LINES, f"README.md has {n} lines; keep it under {MAX_LINES} (details go to docs/ or the pages)"
    headings = re.findall(r"^## (.+)$", text, re.M)
    assert headings == SECTIONS, f"README's sections changed: {headings}"
    for cmd in ("bash scripts/main.sh", "bash scripts/test.sh"):
        assert cmd in text, f"README lost the command {cmd!r} (CI and the tests rely on it)"


def test_every_python_block_is_a_marked_example():
    for page in PAGES:
        for lang, marker, line, _ in _blocks(page):
            if lang != "python":
                continue
            assert marker, f"{page}:{line}: a python block without an example marker on the line before it"
            if page != README:
                test_file, test_name = EXAMPLES_ELSEWHERE.get((page, marker), (None, None))
                assert test_file, f"{page}:{line}: example {marker!r} is run by no test (add it to EXAMPLES_ELSEWHERE)"
                assert re.search(rf"^def {test_name}\(", _text(test_file), re.M), f"{test_file}::{test_name} is gone"


# --------------------------------------------------------------------------------------------- examples --
@pytest.fixture(scope="module")
def examples():
    """Run README's examples as written, in order, in one namespace; returns {marker: namespace after it}."""
    ns: Dict[str, object] = {"__name__": "readme_examples"}
    after = {}
    for lang, marker, line, code in _blocks(README):
        if lang == "python":
            # Blank lines before the code keep the README's line numbers in tracebacks.
            exec(compile("\n" * (line - 1) + code, f"README.md (example {marker})", "exec"), ns)  # noqa: S102
            after[marker] = dict(ns)
    return after


def test_example_names_are_the_documented_ones(examples):
    assert list(examples) == ["grouped-linear", "train-step", "cuda-graph"]


def test_grouped_linear_example_matches_a_float64_reference(examples):
    ns = examples["grouped-linear"]
    layer, x, m_splits, y = ns["layer"], ns["x"], ns["m_splits"], ns["y"]
    splits = [int(s) for s in m_splits.cpu()]
    xd = x.detach().double().cpu().requires_grad_(True)
    rows, start = [], 0
    for e, n in enumerate(splits):
        w, b = getattr(layer, f"weight{e}").detach().double().cpu(), getattr(layer, f"bias{e}").detach().double().cpu()
        rows.append((xd[start:start + n] @ w.T, b))
        start += n
    ref = torch.zeros(x.shape[0], y.shape[1], dtype=torch.float64)
    start = 0
    for (r, b), n in zip(rows, splits):
        ref[start:start + n] = r + b
        start += n
    tol = dict(rtol=2e-2, atol=2e-2) if y.dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.detach().double().cpu(), ref, **tol)
    assert torch.count_nonzero(y[sum(splits):]) == 0  # capacity rows past sum(m_splits)
    ref.square().mean().backward()
    torch.testing.assert_close(x.grad.double().cpu(), xd.grad, **tol)


def test_train_step_example_trains(examples):
    res = examples["train-step"]["res"]
    assert torch.isfinite(res.loss) and torch.isfinite(res.grad_norm) and not bool(res.skipped)


def test_cuda_graph_example_replays_the_step(examples):
    ns = examples["cuda-graph"]
    graph, res, stats = ns["graph"], ns["res"], ns["stats"]
    assert graph.iteration() == 3
    assert torch.isfinite(res.loss) and not bool(res.skipped)
    assert stats and all(len(v) == 1 for v in stats.values())  # one MoE layer in the example's model


# ------------------------------------------------------------------------------------- paths and names --
def _expand(path: str) -> List[str]:
    m = re.search(r"\{([^}]*)\}", path)
    return [path[:m.start()] + alt + path[m.end():] for alt in m.group(1).split(",")] if m else [path]


def test_every_path_the_pages_name_exists():
    missing = []
    for page in PAGES:
        for m in PATH_RE.finditer(_text(page)):
            path = m.group(1).rstrip(".,:;)")
            path, _, test_name = path.partition("::")
            for p in _expand(path):
                hits = glob.glob(os.path.join(ROOT, p))
                if not hits:
                    missing.append(f"{page}: {p}")
                elif test_name and not re.search(rf"^def {test_name}\(", _text(p), re.M):
                    missing.append(f"{page}: {p}::{test_name}")
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)


def _resolve(name: str) -> bool:
    """``name`` is a module, or attributes of one. A module whose own dependencies are missing here (megatron-core)
    is read instead: its attribute must be defined at its top level."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:
            spec = importlib.util.find_spec(module)
        except ImportError:
            continue
        if spec is None:
            continue
        rest = parts[cut:]
        try:
            obj = importlib.import_module(module)
        except ImportError:
            src = open(spec.origin).read()
            return not rest or bool(re.search(rf"^(?:def|class) {rest[0]}\b|^{rest[0]} *=", src, re.M))
        for attr in rest:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_moe_graph_name_the_pages_use_exists():
    names = {n for page in PAGES for n in NAME_RE.findall(_text(page))} - {"moe_graph._C"}
    # The data-flow picture names modules relative to the package.
    flow = next(code for lang, _, _, code in _blocks(README) if lang == "text")
    names |= {"moe_graph." + n for n in re.findall(r"\b((?:ops|moe|train|distributed|cuda_graph)(?:\.\w+)+)", flow)}
    missing = sorted(n for n in names if not _resolve(n))
    assert not missing, f"names the pages use that do not exist: {missing}"


def _help(module: str) -> str:
    """``python -m module --help``, run in this process (no second interpreter to start)."""
    out, argv = io.StringIO(), sys.argv
    sys.argv = [module, "--help"]
    try:
        with contextlib.redirect_stdout(out), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module was imported before, as here
            runpy.run_module(module, run_name="__main__", alter_sys=False)
    except SystemExit as e:
        assert e.code in (0, None), f"python -m {module} --help exited with {e.code}"
    finally:
        sys.argv = argv
    return out.getvalue()


def test_every_command_names_a_module_and_flags_that_exist():
    flags: Dict[str, set] = {}
    for page in PAGES:
        text = _text(page).replace("\\\n", " ")
        for module, args in COMMAND_RE.findall(text):
            flags.setdefault(module, set()).update(re.findall(r"(--[\w-]+)", args))
    assert {"moe_graph.demo", "moe_graph.selfcheck", "helpers.equivalence"} <= set(flags)
    for module, used in sorted(flags.items()):
        assert importlib.util.find_spec(module) is not None, f"python -m {module}: no such module"
        if used:
            listed = _help(module)
            unknown = sorted(f for f in used if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", listed))
            assert not unknown, f"python -m {module}: flags the pages use that --help does not list: {unknown}"


def test_benchmarks_readme_lists_every_benchmark():
    text = _text("benchmarks/README.md")
    scripts = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "benchmarks", "*.py")))
    unlisted = [s for s in scripts if f"`{s}`" not in text]
    assert not unlisted, f"benchmarks/README.md does not list {unlisted}"


# --------------------------------------------------------------------------------------------- layout --
def _layout_tree() -> List[Tuple[str, str]]:
    """(path, floor or '') for every entry of README's Layout block."""
    code = next(code for lang, marker, _, code in _blocks(README) if marker == "layout")
    entries, stack = [], []
    for line in code.rstrip("\n").split("\n"):
        m = re.match(r"^( *)(\S+)(?: +(\d)(?= ))?", line)
        if not m or not re.fullmatch(r"[\w/-]+/|[\w-]+\.\w+", m.group(2)):
            continue  # a continuation line
        depth = len(m.group(1)) // 2
        del stack[depth:]
        path = "/".join(stack + [m.group(2).rstrip("/")])
        if m.group(2).endswith("/"):
            stack.append(m.group(2).rstrip("/"))
        entries.append((path, m.group(3) or ""))
    return entries


def test_layout_lists_every_module_at_its_floor():
    entries = _layout_tree()
    listed = {p for p, _ in entries}
    missing_files = sorted(p for p in listed if not os.path.exists(os.path.join(ROOT, p)))
    assert not missing_files, f"README's Layout lists entries that do not exist: {missing_files}"
    pkg = "python/moe_graph"
    modules = set()
    for dirpath, dirs, files in os.walk(os.path.join(ROOT, pkg)):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        rel = os.path.relpath(dirpath, ROOT)
        for f in files:
            if f.endswith(".py") and not (f == "__init__.py" and rel != pkg):  # a folder's line is its __init__
                modules.add(f"{rel}/{f}")
    unlisted = sorted(modules - listed)
    assert not unlisted, f"README's Layout does not list {unlisted}"
    floors = {p[len(pkg) + 1:].removesuffix(".py"): int(f) for p, f in entries
              if f and p.startswith(pkg + "/") and "/" not in p[len(pkg) + 1:]}
    assert floors == test_layout.FLOORS, (f"README's floors {floors} differ from tests/test_layout.py's FLOORS "
                                          f"{test_layout.FLOORS}")
