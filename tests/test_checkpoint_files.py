"""The checkpoint files of moe_graph.train.checkpoint as a user meets them (issue 40): a broken file is named
(one reader for every file: meta.json, latest, the .pt shards), the offline tool's convert / reshard leave nothing
behind when the disk fills up mid-way, and its --help is plain text."""

import errno
import os
import re
import shutil

import pytest
import torch

from helpers.checkpoint_workers import tiny_checkpoint_worker
from moe_graph.distributed.launch import run_distributed
from moe_graph.train import checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A one-rank checkpoint root of a tiny model (step 1), saved by save_checkpoint in its own process."""
    root = tmp_path_factory.mktemp("tiny") / "ck"
    run_distributed(tiny_checkpoint_worker, 1, str(root), timeout=120.0)
    return root


def _copy(tiny, dst):
    shutil.copytree(tiny, dst)
    return dst, dst / "step_00000001"


def _leftovers(root):
    return sorted(os.path.join(d, n) for d, dirs, files in os.walk(root) for n in dirs + files
                  if n.endswith((".tmp", ".partial")))


def test_a_truncated_file_is_named(tiny, tmp_path, capsys):
    ck, folder = _copy(tiny, tmp_path / "a")
    meta = folder / "meta.json"
    text = meta.read_text()
    meta.write_text(text[:len(text) // 2])  # cut inside a string: "Unterminated string starting at ..."
    with pytest.raises(ValueError, match=re.escape(str(meta)) + r": not readable as .*JSONDecodeError"):
        checkpoint.read_meta(str(folder))
    assert checkpoint.main(["inspect", str(ck)]) == 2  # the offline tool: one line naming the file
    err = capsys.readouterr().err
    assert err.startswith(f"error: {meta}: not readable") and "truncated or corrupted" in err, err
    _, folder = _copy(tiny, tmp_path / "b")
    shard = folder / "state_rank00000.pt"
    shard.write_bytes(shard.read_bytes()[:200])
    with pytest.raises(ValueError, match=re.escape(str(shard)) + r": not readable as a torch.save file"):
        checkpoint.read_model_state(str(folder), checkpoint.read_meta(str(folder)))
    (tmp_path / "b" / "latest").write_bytes(b"\xff\xfe\x00")  # not text
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "b" / "latest")) + ": not readable"):
        checkpoint.resolve_checkpoint(str(tmp_path / "b"))


def _full_disk_after(n_ok):
    """A writer (``torch.save`` / safetensors' ``save_file``) that writes ``n_ok`` files, then part of one and
    fails with ENOSPC."""
    calls = []
    real_save = torch.save

    def write(obj, f):
        calls.append(f)
        if len(calls) <= n_ok:
            return real_save(obj, f)
        if isinstance(f, str):
            with open(f, "wb") as fh:
                fh.write(b"\0" * 64)
        else:
            f.write(b"\0" * 64)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    return write


@pytest.mark.parametrize("cmd", ["convert_pt", "convert_safetensors", "reshard"])
def test_convert_and_reshard_leave_nothing_on_a_full_disk(tiny, tmp_path, monkeypatch, capsys, cmd):
    pytest.importorskip("safetensors")
    ck, _ = _copy(tiny, tmp_path / "ck")
    out = tmp_path / "out" / ("m.pt" if cmd == "convert_pt" else "m.safetensors" if cmd == "convert_safetensors"
                              else "r")
    argv = ["reshard", str(ck), str(out), "--dp", "2"] if cmd == "reshard" else ["convert", str(ck), str(out)]
    with monkeypatch.context() as m:
        if cmd == "convert_safetensors":
            fail = _full_disk_after(0)
            m.setattr(checkpoint, "save_file", lambda sd, path, **kw: fail(sd, path))
        else:  # reshard: two files written, the third cut short
            m.setattr(torch, "save", _full_disk_after(2 if cmd == "reshard" else 0))
        assert checkpoint.main(argv) == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err and str(out) in err, err
    assert not _leftovers(tmp_path), _leftovers(tmp_path)
    # OUT (made by the failed run) removed with it: nothing a load could accept
    assert not out.exists() and not any((tmp_path / "out").glob("**/*")), list((tmp_path / "out").glob("**/*"))
    # the same command with room on the disk writes what a load accepts
    assert checkpoint.main(argv) == 0 and not _leftovers(tmp_path)
    if cmd == "reshard":
        assert checkpoint.read_meta(checkpoint.resolve_checkpoint(str(out)))["layout"]["dp"] == 2
    else:
        assert out.is_file()


def test_cli_help_is_plain_text(capsys):
    for argv in (["--help"], ["inspect", "--help"], ["convert", "--help"], ["reshard", "--help"]):
        with pytest.raises(SystemExit) as e:
            checkpoint.main(argv)
        assert e.value.code == 0
        text = capsys.readouterr().out
        assert "usage: python -m moe_graph.train.checkpoint" in text
        markup = re.findall(r"``|:(?:func|mod|data|class|meth|attr):`|::$", text, re.M)
        assert not markup, (argv, markup, text)
