"""Checkpoints that move (issue 34): a checkpoint written at one (pp, vpp, ep, dp) layout resumes at another and
continues the same training. Oracle: the uninterrupted run at the saving layout; both runs see the same global
batch with the same microbatch split (``dp x microbatches`` fixed), so after the next steps every parameter must
equal the uninterrupted run's within fp32 rounding (the difference is compared with how far those steps moved the
parameters).

By default one chain covers every axis (about a minute on 2 CPU cores): the reference at pp 2 x vpp 2 x dp 2 x ep 2;
its step-2 checkpoint, rewritten as a v1 checkpoint with the pre-layout-change expert names, resumed on one rank
(pp 2 -> 1, vpp 2 -> 1, ep 2 -> 1, dp 2 -> 1 with ep) for two steps; that checkpoint resumed at pp 2 x dp 2 x ep 2
(pp 1 -> 2, ep 1 -> 2, dp 1 -> 2). ``MOE_GRAPH_CHECKPOINT_MATRIX=1`` adds one resume per single-axis change."""

import json
import os
import shutil
import sys
from argparse import Namespace

import pytest
import torch
from safetensors.torch import load_file

from conftest import run_cmd
from moe_graph.demo.data import CharData, build_corpus
from moe_graph.demo.model import MoETransformerLM, moe_options
from moe_graph.distributed.optimizer import state_checksum
from moe_graph.train import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the DeepSeek router: its expert bias (a buffer updated after each step) must carry over as well
SMALL = ["--device", "cpu", "--layers", "4", "--hidden", "32", "--heads", "2", "--ffn", "48", "--seq", "32",
         "--batch", "4", "--log-every", "1", "--no-graph", "--router", "deepseek"]
REF = ["--pp", "2", "--vpp", "2", "--dp", "2", "--ep", "2", "--microbatches", "2"]  # global batch 16 sequences
MATRIX = os.environ.get("MOE_GRAPH_CHECKPOINT_MATRIX") == "1"


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(ROOT, "python") + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def _demo(out, *flags):
    proc = run_cmd([sys.executable, "-m", "moe_graph.demo", *SMALL, "--out", str(out), *flags], 300,
                   f"the demo {' '.join(flags)}", env=_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f)}


def _model(path):
    folder = checkpoint.resolve_checkpoint(str(path))
    return checkpoint.read_model_state(folder, checkpoint.read_meta(folder))


def _assert_same_training(got, ref, start):
    """``got``'s parameters equal ``ref``'s within fp32 rounding: at most 1e-6 of how far the steps since ``start``
    moved them (a lost Adam moment or a wrong expert moves a tensor by a good part of that)."""
    a, b, s = _model(got), _model(ref), _model(start)
    assert sorted(a) == sorted(b) and any(k.endswith("router.expert_bias") for k in a)
    moved = max((b[k] - s[k]).abs().max().item() for k in b)
    worst = max(((a[k] - b[k]).abs().max().item(), k) for k in b)
    print(f"{got} vs {ref}: max |diff| {worst[0]:.3g} ({worst[1]}), the steps moved parameters by up to {moved:.3g}")
    assert moved > 1e-3 and worst[0] <= 1e-6 * max(1.0, moved * 1e3), worst


def _as_v1_before_rename(src, dst):
    """``src`` (a v2 checkpoint folder) as the same checkpoint written before the package-layout change: format v1
    (no index), expert weights named ``blocks.N.moe.fc1.weight[e]`` in the state and optimizer files."""
    old = {"moe.experts.fc1.": "moe.fc1.", "moe.experts.fc2.": "moe.fc2."}

    def rename(n):
        for a, b in old.items():
            n = n.replace(a, b)
        return n

    os.makedirs(dst)
    meta = json.loads((src / "meta.json").read_text())
    meta["format"] = checkpoint.FORMAT_V1
    del meta["index"]
    (dst / "meta.json").write_text(json.dumps(meta))
    for r in range(meta["world"]):
        state_f, optim_f = checkpoint.rank_files(meta, r)
        st = torch.load(src / state_f, weights_only=True)
        st["format"] = checkpoint.FORMAT_V1
        st["model"] = {rename(k): v for k, v in st["model"].items()}
        st["crc32"] = {rename(k): v for k, v in st["crc32"].items()}
        torch.save(st, dst / state_f)
        sd = torch.load(src / optim_f, weights_only=True)
        sd["shard"] = {rename(k): v for k, v in sd["shard"].items()}
        sd["metadata"]["params"] = {rename(k): v for k, v in sd["metadata"]["params"].items()}
        sd["checksum"] = state_checksum(sd)
        torch.save(sd, dst / optim_f)
    assert any(".moe.fc1.weight[" in k for k in torch.load(dst / "state_rank00000.pt", weights_only=True)["model"])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run at pp 2 x vpp 2 x dp 2 x ep 2 (4 ranks), 6 steps, checkpoints at 2, 4 and 6."""
    d = tmp_path_factory.mktemp("ref")
    _demo(d / "out", *REF, "--steps", "6", "--save", str(d / "ck"), "--save-every", "2")
    return d


def test_resume_at_other_layouts_continues_the_same_training(reference, tmp_path):
    ck = reference / "ck"
    ref_metrics = _metrics(reference / "out")
    v1 = tmp_path / "v1" / "step_00000002"
    _as_v1_before_rename(ck / "step_00000002", v1)
    # pp 2 -> 1, vpp 2 -> 1, ep 2 -> 1, dp 2 -> 1 (microbatches 2 -> 4: the same global batch and split), from v1
    out = _demo(tmp_path / "a", "--dp", "1", "--ep", "1", "--microbatches", "4", "--steps", "4", "--load", str(v1),
                "--save", str(tmp_path / "a_ck"))
    assert "at step 2" in out and "RNG fresh" in out, out
    _assert_same_training(tmp_path / "a_ck", ck / "step_00000004", ck / "step_00000002")
    # pp 1 -> 2, ep 1 -> 2, dp 1 -> 2 (a v2 checkpoint: each rank opens only the files holding its tensors)
    out = _demo(tmp_path / "b", "--pp", "2", "--dp", "2", "--ep", "2", "--microbatches", "2", "--steps", "6",
                "--load", str(tmp_path / "a_ck"), "--save", str(tmp_path / "b_ck"))
    _assert_same_training(tmp_path / "b_ck", ck / "step_00000006", ck / "step_00000004")
    got = {**_metrics(tmp_path / "a"), **_metrics(tmp_path / "b")}
    assert sorted(got) == [3, 4, 5, 6]
    for s in got:
        assert abs(got[s]["loss"] - ref_metrics[s]["loss"]) <= 1e-5 * ref_metrics[s]["loss"], (s, got[s])


SINGLE_AXIS = [  # (what changes, resume flags); each resumes the reference's step 2 and runs to step 4
    ("ep 2 -> 1", ["--pp", "2", "--vpp", "2", "--dp", "2", "--ep", "1", "--microbatches", "2"]),
    ("vpp 2 -> 1", ["--pp", "2", "--dp", "2", "--ep", "2", "--microbatches", "2"]),
    ("pp 2 -> 1", ["--dp", "2", "--ep", "2", "--microbatches", "2"]),
    ("dp 2 -> 1 with ep 2 -> 1", ["--pp", "2", "--vpp", "2", "--dp", "1", "--ep", "1", "--microbatches", "4"]),
    ("pp 2 -> 4, vpp 2 -> 1", ["--pp", "4", "--dp", "1", "--ep", "1", "--microbatches", "4"]),
    ("dp 2 -> 4, ep 2 -> 4", ["--pp", "1", "--dp", "4", "--ep", "4", "--microbatches", "1"]),
    ("dp 2 -> 4, ep 2 (expert-dp 2)", ["--pp", "1", "--dp", "4", "--ep", "2", "--microbatches", "1"]),
]


@pytest.mark.skipif(not MATRIX, reason="the whole layout matrix: MOE_GRAPH_CHECKPOINT_MATRIX=1")
@pytest.mark.parametrize("what,flags", SINGLE_AXIS, ids=[w for w, _ in SINGLE_AXIS])
def test_resume_layout_matrix(reference, tmp_path, what, flags):
    ck = reference / "ck"
    _demo(tmp_path / "o", *flags, "--steps", "4", "--load", str(ck / "step_00000002"), "--save", str(tmp_path / "c"))
    _assert_same_training(tmp_path / "c", ck / "step_00000004", ck / "step_00000002")


def test_each_rank_reads_only_the_files_holding_its_tensors(reference):
    folder = str(reference / "ck" / "step_00000002")
    meta = checkpoint.read_meta(folder)
    assert meta["format"] == checkpoint.FORMAT and len(meta["index"]) == 4
    coords = meta["coords"]
    # layer 0 is on pipeline rank 0 (chunk 0): its dense weights from dp rank 0 of that stage only
    assert [coords[r]["pp_rank"] for r in checkpoint.files_holding(meta, "model", ["blocks.0.qkv.weight"])] == [0]
    # expert 5 of layer 2 (pipeline rank 0's second chunk; 8 experts, ep 2: rank 1 holds 4..7), optimizer state on
    # that expert rank only
    name = "blocks.2.moe.experts.fc1.weight[5]"
    ranks = checkpoint.files_holding(meta, "optim", [name])
    assert ranks and all(coords[r]["pp_rank"] == 0 and coords[r]["ep_rank"] == 1 for r in ranks), ranks
    assert set(checkpoint.read_model_state(folder, meta, wanted=[name])) == {name}
    # a v1 checkpoint has no index: every file
    meta_v1 = dict(meta, format=checkpoint.FORMAT_V1)
    meta_v1["index"] = checkpoint.index_v1(meta_v1)
    assert checkpoint.files_holding(meta_v1, "optim", [name]) == [0, 1, 2, 3]
    assert [i["naming"] for i in meta_v1["index"]] == [i["naming"] for i in meta["index"]]


def test_a_checkpoint_that_cannot_serve_the_layout_is_refused_naming_why(reference, tmp_path):
    folder = str(reference / "ck" / "step_00000002")
    meta = checkpoint.read_meta(folder)
    ranks = list(range(meta["world"]))
    saved = checkpoint.read_optimizer_shards(folder, ranks)
    namings = [meta["index"][r]["naming"] for r in ranks]
    target, naming = saved[0]["metadata"], meta["index"][0]["naming"]
    assert len(checkpoint.reshard_optimizer(saved, namings, target, naming)) >= 1
    # missing files (those of pipeline rank 0's expert rank 0, which is also its data-parallel rank 0)
    keep = [r for r in ranks if meta["coords"][r]["ep_rank"] != 0 or meta["coords"][r]["pp_rank"] != 0]
    with pytest.raises((KeyError, ValueError), match=r"(do not cover elements|has no tensor).*'blocks\.[02]\."):
        checkpoint.reshard_optimizer([saved[r] for r in keep], [namings[r] for r in keep], target, naming)
    # another model: a wider expert
    wide = json.loads(json.dumps(target))
    for n, m in wide["params"].items():
        if m["expert"]:
            m["shape"] = [m["shape"][0], m["shape"][1] + 1] + m["shape"][2:]
    with pytest.raises(ValueError, match="this run expects"):
        checkpoint.reshard_optimizer(saved, namings, wide, naming)
    # an unknown format names the formats this version reads
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    m = json.loads((bad / "meta.json").read_text())
    (bad / "meta.json").write_text(json.dumps(dict(m, format="moe_graph.train.checkpoint.v9")))
    with pytest.raises(ValueError, match="v9.*not one this moe_graph reads.*v1.*v2"):
        checkpoint.read_meta(str(bad))


def test_migrate_name():
    assert checkpoint.migrate_name("blocks.3.moe.fc1.weight[5]") == "blocks.3.moe.experts.fc1.weight[5]"
    assert checkpoint.migrate_name("chunk1.blocks.0.moe.fc2.weight") == "chunk1.blocks.0.moe.experts.fc2.weight"
    for same in ("blocks.3.moe.experts.fc1.weight[5]", "blocks.0.moe.shared_expert.fc1.weight",
                 "blocks.0.moe.router.weight", "blocks.0.qkv.weight"):
        assert checkpoint.migrate_name(same) == same


def test_checkpoint_command_inspect_convert_reshard(reference, tmp_path, capsys):
    """The offline tool on the reference's step 2 (pp 2 x vpp 2 x dp 2 x ep 2): inspect; convert to one state dict
    that a one-process model loads strictly; reshard (model and optimizer state unchanged by whole-model name, the
    new layout's index) and resume the resharded checkpoint: the same training as the uninterrupted run."""
    src = reference / "ck" / "step_00000002"
    assert checkpoint.main(["inspect", str(src), "--json", "--tensors"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["step"], info["layout"]["pp"], info["layout"]["vpp"], info["layout"]["world"]) == (2, 2, 2, 4)
    assert info["tensors"]["blocks.3.moe.experts.fc2.weight[7]"]["shape"] == [32, 48]
    # convert: the state dict of the model on one rank (experts stacked), .pt with optimizer state and .safetensors
    assert checkpoint.main(["convert", str(src), str(tmp_path / "m.pt"), "--optimizer"]) == 0
    assert checkpoint.main(["convert", str(src), str(tmp_path / "m.safetensors")]) == 0
    full = torch.load(tmp_path / "m.pt", weights_only=True)
    st = load_file(str(tmp_path / "m.safetensors"))
    assert sorted(st) == sorted(full["model"]) and all(torch.equal(st[k], full["model"][k]) for k in st)
    assert full["step"] == 2 and full["optimizer"]["blocks.1.moe.experts.fc1.weight"]["exp_avg"].shape == (8, 96, 32)
    cfg = Namespace(layers=4, hidden=32, heads=2, ffn=48, experts=8, topk=2, seq=32, aux=0.01, spare=1,
                    capacity=1.25, overflow="rerun", exchange="auto", assignment="auto", router="deepseek")
    model = MoETransformerLM(cfg, CharData(build_corpus(seed=0)).vocab_size, moe_options(cfg, None, 1), "cpu",
                             torch.float32)
    model.load_state_dict(st, strict=True)
    saved = _model(src)
    assert torch.equal(model.blocks[2].moe.experts.fc1.weight[5], saved["blocks.2.moe.experts.fc1.weight[5]"])
    # reshard offline: everything equal by whole-model name at pp 4 x dp 2 x ep 2
    assert checkpoint.main(["reshard", str(src), str(tmp_path / "r4"), "--pp", "4", "--dp", "2", "--ep",
                                 "2"]) == 0
    a, b = (checkpoint.whole_model_state_dict(str(p), optimizer=True) for p in (src, tmp_path / "r4"))
    assert a["model"].keys() == b["model"].keys() and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["optimizer"].keys() == b["optimizer"].keys()
    assert all(torch.equal(v, b["optimizer"][k][f]) for k, d in a["optimizer"].items() for f, v in d.items())
    meta = checkpoint.read_meta(checkpoint.resolve_checkpoint(str(tmp_path / "r4")))
    assert meta["layout"]["pp"] == 4 and meta["world"] == 8 and meta["resharded_from"]["layout"]["pp"] == 2
    # an impossible layout is refused before anything is written
    assert checkpoint.main(["reshard", str(src), str(tmp_path / "bad"), "--ep", "3", "--dp", "3"]) == 2
    assert "--ep 3 must divide the model's 8 experts" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
    # the resharded checkpoint resumes (one rank) and continues the same training
    assert checkpoint.main(["reshard", str(src), str(tmp_path / "r1")]) == 0
    out = _demo(tmp_path / "o", "--dp", "1", "--ep", "1", "--microbatches", "4", "--steps", "4", "--load",
                str(tmp_path / "r1"), "--save", str(tmp_path / "c"))
    assert "RNG fresh (none saved)" in out, out
    _assert_same_training(tmp_path / "c", reference / "ck" / "step_00000004", src)


@pytest.mark.skipif(not MATRIX, reason="with the layout matrix: MOE_GRAPH_CHECKPOINT_MATRIX=1")
def test_a_missing_file_fails_the_resume_on_every_rank(reference, tmp_path):
    """One optimizer file gone: the rank that needs it names it, no rank waits, nothing is trained."""
    broken = tmp_path / "broken"
    shutil.copytree(reference / "ck" / "step_00000002", broken)
    os.remove(broken / "optim_rank00001.pt")
    proc = run_cmd([sys.executable, "-m", "moe_graph.demo", *SMALL, "--out", str(tmp_path / "o"), "--dp", "2",
                    "--ep", "2", "--microbatches", "2", "--steps", "4", "--load", str(broken)], 300,
                   "the demo resuming a broken checkpoint", env=_env())
    assert proc.returncode != 0 and "optim_rank00001.pt is missing" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "o" / "metrics.jsonl").exists()


def test_a_truncated_file_fails_the_resume_on_every_rank_naming_it(reference, tmp_path):
    """One optimizer file cut short (issue 40): the rank that reads it names the file, every rank fails at once
    (none waits in a collective), nothing is trained."""
    broken = tmp_path / "broken"
    shutil.copytree(reference / "ck" / "step_00000002", broken)
    shard = broken / "optim_rank00001.pt"
    shard.write_bytes(shard.read_bytes()[:300])
    proc = run_cmd([sys.executable, "-m", "moe_graph.demo", *SMALL, "--out", str(tmp_path / "o"), "--dp", "2",
                    "--ep", "2", "--microbatches", "2", "--steps", "4", "--load", str(broken)], 300,
                   "the demo resuming a truncated checkpoint", env=_env())
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert f"{shard}: not readable as a torch.save file" in proc.stderr, proc.stderr[-3000:]
    assert f"--load {broken}: rank " in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "o" / "metrics.jsonl").exists()


def test_reshard_optimizer_moves_every_element_including_16_bit_master_weights():
    """Pure bookkeeping against an oracle: whole-model fp32 state (exp_avg, exp_avg_sq and, for bf16 parameters,
    main_param) cut into the shards of ep 2 x dp 2 with cuts inside expert rows, resharded for ep 1 (two chunks,
    vpp-style names) and for ep 4: every element lands where the target's names and ranges say."""
    E, row = 8, (3, 4)
    gen = torch.Generator().manual_seed(0)
    truth = {f"blocks.{l}.moe.experts.fc1.weight[{e}]": {f: torch.randn(12, generator=gen) for f in
                                                          ("main_param", "exp_avg", "exp_avg_sq")}
             for l in (0, 1) for e in range(E)}
    truth.update({f"blocks.{l}.qkv.weight": {f: torch.randn(6, generator=gen) for f in
                                             ("main_param", "exp_avg", "exp_avg_sq")} for l in (0, 1)})
    head = {"format": "moe_graph.distributed_optimizer.sharded.v1", "step": torch.tensor(3.0),
            "lr": torch.tensor(0.1), "hyper": {"betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.0,
                                                "adamw": True, "clip_grad": 0.0}, "loss_scaler": None}

    def params(L, prefix_of):
        out = {}
        for l in (0, 1):
            out[f"{prefix_of(l)}blocks.{l if not prefix_of(l) else 0}.moe.experts.fc1.weight"] = {
                "shape": [L, *row], "dtype": "torch.bfloat16", "expert": True}
            out[f"{prefix_of(l)}blocks.{l if not prefix_of(l) else 0}.qkv.weight"] = {
                "shape": [2, 3], "dtype": "torch.bfloat16", "expert": False}
        return out

    # saved: ep 2 x dp 2, one chunk per rank holding both layers; rank (ep, dp) owns half of each flat parameter
    saved, namings = [], []
    for ep_rank in range(2):
        md = {"ep_size": 2, "ep_rank": ep_rank, "params": params(4, lambda l: "")}
        for dp_rank in range(2):
            shard = {}
            for l in (0, 1):
                flat = {f: torch.cat([truth[f"blocks.{l}.moe.experts.fc1.weight[{ep_rank * 4 + i}]"][f]
                                      for i in range(4)]) for f in ("main_param", "exp_avg", "exp_avg_sq")}
                a, b = (0, 29) if dp_rank == 0 else (29, 48)  # 29: inside expert row 2
                shard[f"blocks.{l}.moe.experts.fc1.weight"] = dict({"range": (a, b)},
                                                                   **{f: v[a:b] for f, v in flat.items()})
                d = (0, 6) if (ep_rank, dp_rank) == (0, 0) else (0, 0)
                dense = truth[f"blocks.{l}.qkv.weight"]
                shard[f"blocks.{l}.qkv.weight"] = dict({"range": d}, **{f: v[d[0]:d[1]] for f, v in dense.items()})
            saved.append(dict(head, metadata=md, shard=shard))
            namings.append({"layer_ids": [[0, 1]], "chunked": False, "ep_rank": ep_rank})
    for L, ep_rank, chunked in ((8, 0, True), (2, 3, False)):
        prefix = (lambda l: f"chunk{l}.") if chunked else (lambda l: "")
        target = {"ep_size": E // L, "ep_rank": ep_rank, "params": params(L, prefix)}
        naming = {"layer_ids": [[0], [1]] if chunked else [[0, 1]], "chunked": chunked, "ep_rank": ep_rank}
        shards = checkpoint.reshard_optimizer(saved, namings, target, naming)
        for name, m in target["params"].items():
            numel = 1
            for d in m["shape"]:
                numel *= d
            got = {f: torch.full((numel,), float("nan")) for f in ("main_param", "exp_avg", "exp_avg_sq")}
            for sh in shards:
                if name in sh["shard"]:
                    a, b = sh["shard"][name]["range"]
                    for f in got:
                        got[f][a:b] = sh["shard"][name][f]
            l = int(name.split("blocks.")[1].split(".")[0]) if not chunked else int(name[5])
            for f, v in got.items():
                if m["expert"]:
                    want = torch.cat([truth[f"blocks.{l}.moe.experts.fc1.weight[{ep_rank * L + i}]"][f]
                                      for i in range(L)])
                else:
                    want = truth[f"blocks.{l}.qkv.weight"][f]
                assert torch.equal(v, want), (L, name, f)
