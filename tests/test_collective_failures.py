"""Every rank agrees on every failure of a collective load or save (issue 40): an exception of any kind on one
rank (a truncated safetensors file, a tensor one row short, a full disk, an exception class no moe_graph code
knows) raises on every rank within seconds, naming the file and the tensor, with the live state unchanged and no
rank left waiting in a collective. Each case runs on 2 gloo ranks under a run timeout far below the suite's: a
rank left waiting fails the test instead of hanging it."""

import os

import pytest

from helpers.checkpoint_workers import save_failure_worker
from moe_graph.distributed.launch import run_distributed
from moe_graph.train import checkpoint

RUN_TIMEOUT_S = 120.0  # a rank stuck in a collective would wait 30 min (the process group's default)
FAST_S = 20.0  # every rank gives up within this after the failure


def _leftovers(root):
    return sorted(os.path.join(d, n) for d, dirs, files in os.walk(root) for n in dirs + files
                  if n.endswith((".tmp", ".partial")))


def test_load_hf_checkpoint_fails_on_every_rank_naming_the_file_and_tensor(tmp_path):
    pytest.importorskip("transformers")
    from helpers.hf_checkpoint_workers import broken_folders, load_failure_worker

    folders = broken_folders(str(tmp_path))
    res = run_distributed(load_failure_worker, 2, folders, timeout=RUN_TIMEOUT_S)
    want = {
        # only rank 1 reads the second file (experts 4..7): rank 0 must not wait for it
        "truncated": ("model-00002-of-00002.safetensors", "not readable as a safetensors file"),
        # rank 1's expert 5: named with its file, before the conversion stacks the experts
        "short_row": ("experts.5.w1.weight", os.path.join(folders["short_row"], "model.safetensors")),
        # an exception class nobody catches by name, raised on rank 1 in the conversion
        "injected": ("Injected: injected on rank 1", "MoE block 'model.layers.0.mlp'",
                     os.path.join(folders["good"], "model.safetensors")),
    }
    for case, parts in want.items():
        for rank, r in enumerate(res):
            typ, msg, secs, unchanged = r[case]
            assert typ != "none" and unchanged and secs < FAST_S, (case, rank, r[case])
            assert all(p in msg for p in parts), (case, rank, msg)
            assert f"load_hf_checkpoint({folders['good' if case == 'injected' else case]})" in msg, msg
        assert res[0][case][0] == "CollectiveFailure" and "another rank could not" in res[0][case][1], res[0][case]
        assert "rank 1: " in res[0][case][1], res[0][case]
    assert res[1]["injected"][0] == "Injected"
    assert all(r["clean"] for r in res)  # the ranks are still in step: a good folder loads afterwards
    # save_hf_pretrained: rank 0's writer fails; rank 1 (waiting for the files) raises too, naming it
    saved = tmp_path / "saved"
    for rank, (typ, msg, secs) in enumerate(r["save"] for r in res):
        assert typ == ("Injected" if rank == 0 else "CollectiveFailure") and secs < FAST_S, (rank, typ, msg)
        assert f"save_hf_pretrained({saved})" in msg and "rank 0: writing" in msg and "injected in save_file" in msg
    assert not _leftovers(tmp_path)


def test_save_checkpoint_fails_on_every_rank_and_keeps_the_previous_one(tmp_path):
    root = str(tmp_path / "ck")
    res = run_distributed(save_failure_worker, 2, root, timeout=RUN_TIMEOUT_S)
    optim_file = os.path.join(root, ".step_00000002.partial", "optim_rank00001.pt")
    for case, part in (("full_disk", f"writing {optim_file}: OSError: [Errno {28}]"),
                       ("injected", "Injected: injected in state_dict")):
        for rank, r in enumerate(res):
            typ, msg, secs = r[case]
            assert typ != "none" and secs < FAST_S and part in msg, (case, rank, r[case])
            assert "save_checkpoint(" in msg and "'latest' still names the previous checkpoint" in msg, msg
        assert res[0][case][0] == "CollectiveFailure", res[0][case]
    assert res[0]["latest"] == "step_00000001" and not res[0]["step2"]
    assert res[0]["after"].endswith("step_00000003")
    assert not _leftovers(root), _leftovers(root)


@pytest.mark.parametrize("case", ["counts", "demand"])
def test_gathered_counts_that_disagree_between_ranks_are_flagged(case):
    """Rank 1's copy of rank 0's gathered counts rolled (every value in range): flagged for check_errors() on both
    ranks by the device-side checksum (no host sync), silent when nothing is corrupted."""
    from helpers.moe_workers import corrupted_counts_worker
    from moe_graph.ops.errors import EXCHANGE_COUNTS

    res = run_distributed(corrupted_counts_worker, 2, case, timeout=RUN_TIMEOUT_S)
    for rank, r in enumerate(res):
        assert r["clean_flag"] == 0, (rank, r)
        assert r["corrupted_flag"] == EXCHANGE_COUNTS, (rank, r)
