"""Atomic checkpoint directory mechanics (no model): temp dir, rename, `latest` pointer, debris."""
from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.train import checkpoint_dirs as ck


def _fake_save(root: Path, step: int, keep_last: int = 0, payload: str = "x") -> Path:
    tmp = ck.begin_save(root, ck.step_dirname(step))
    assert tmp.parent == root and ".tmp-" in tmp.name and tmp.is_dir()
    (tmp / "metadata.json").write_text("{}")
    (tmp / "payload").write_text(payload)
    return ck.commit_save(root, tmp, ck.step_dirname(step), keep_last=keep_last)


def test_commit_renames_and_moves_latest(tmp_path):
    assert ck.resolve_checkpoint(tmp_path) is None
    first = _fake_save(tmp_path, 1)
    assert first == tmp_path / "step_00000001"
    assert (tmp_path / "latest").read_text().strip() == "step_00000001"
    second = _fake_save(tmp_path, 2)
    assert ck.resolve_checkpoint(tmp_path) == second
    assert ck.resolve_checkpoint(first) == first  # a checkpoint directory designates itself
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_interrupted_save_leaves_previous_checkpoint_and_is_cleaned(tmp_path):
    done = _fake_save(tmp_path, 1)
    # a writer that died mid-save: a partial temp dir, `latest` untouched
    partial = ck.begin_save(tmp_path, ck.step_dirname(2))
    (partial / "half_written").write_text("...")
    assert ck.resolve_checkpoint(tmp_path) == done
    # a pointer write that died before os.replace leaves only a temp file behind
    (tmp_path / "latest.tmp-deadbeef").write_text("step_00000002\n")
    assert ck.resolve_checkpoint(tmp_path) == done
    # the next save removes the debris
    third = _fake_save(tmp_path, 3)
    assert ck.resolve_checkpoint(tmp_path) == third
    assert not partial.exists() and not (tmp_path / "latest.tmp-deadbeef").exists()


def test_dangling_pointer_is_refused_naming_it(tmp_path):
    """The protocol never points `latest` at nothing: such a pointer is damage, and the newest
    checkpoint is not necessarily the run's, so nothing is guessed."""
    _fake_save(tmp_path, 1)
    _fake_save(tmp_path, 2)
    for target in ("step_00000009", "", "../elsewhere"):  # names nothing / empty / not a step name
        ck.write_pointer(tmp_path, target)
        with pytest.raises(ck.CheckpointError, match=r"latest names .*step_00000001, step_00000002"):
            ck.resolve_checkpoint(tmp_path)
    (tmp_path / "latest").unlink()  # no pointer at all (a crash before the first one): the newest
    assert ck.resolve_checkpoint(tmp_path) == tmp_path / "step_00000002"


def test_commit_writes_the_manifest_last(tmp_path):
    import json
    import zlib

    done = _fake_save(tmp_path, 1, payload="abc")
    files = json.loads((done / "manifest.json").read_text())["files"]
    assert files == {name: {"size": len(text), "crc32": f"{zlib.crc32(text.encode()):08x}"}
                     for name, text in (("metadata.json", "{}"), ("payload", "abc"))}


def test_resave_same_step_and_keep_last(tmp_path):
    _fake_save(tmp_path, 1)
    _fake_save(tmp_path, 2)
    again = _fake_save(tmp_path, 2, payload="new")
    assert (again / "payload").read_text() == "new"
    _fake_save(tmp_path, 3, keep_last=2)
    assert [p.name for p in ck.complete_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
