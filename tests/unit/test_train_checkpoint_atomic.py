"""Atomic checkpoint directory mechanics (no model): temp dir, rename, tracker file, debris, pruning,
in Megatron-LM's layout (`iter_NNNNNNN/` + `latest_checkpointed_iteration.txt` holding the number),
and the one-line refusal of the layout before (`step_NNNNNNNN/` + `latest`)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_rl.train import checkpoint_dirs as ck

TRACKER = "latest_checkpointed_iteration.txt"  # megatron/training/checkpointing.py: get_checkpoint_tracker_filename


def _fake_save(root: Path, step: int, keep_last: int | None = 0, payload: str = "x") -> Path:
    tmp = ck.begin_save(root, ck.iter_dirname(step))
    assert tmp.parent == root and ".tmp-" in tmp.name and tmp.is_dir()
    (tmp / "metadata.json").write_text("{}")
    (tmp / "payload").write_text(payload)
    return ck.commit_save(root, tmp, step, keep_last=keep_last)


def test_names_are_megatron_lms():
    # Megatron-LM: 'iter_{:07d}'.format(iteration); wider numbers keep all their digits
    assert [ck.iter_dirname(s) for s in (0, 12, 1234567, 12345678)] == [
        "iter_0000000", "iter_0000012", "iter_1234567", "iter_12345678"]
    assert ck.TRACKER == TRACKER


def test_commit_renames_and_moves_the_tracker(tmp_path):
    assert ck.resolve_checkpoint(tmp_path) is None and not ck.holds_checkpoints(tmp_path)
    first = _fake_save(tmp_path, 1)
    assert first == tmp_path / "iter_0000001"
    assert (tmp_path / TRACKER).read_text() == "1"  # what Megatron-LM writes: str(iteration)
    second = _fake_save(tmp_path, 12)
    assert (tmp_path / TRACKER).read_text() == "12" and ck.tracked_step(tmp_path) == 12
    assert ck.resolve_checkpoint(tmp_path) == second and ck.holds_checkpoints(tmp_path)
    assert ck.resolve_checkpoint(first) == first  # a checkpoint directory designates itself
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_interrupted_save_leaves_previous_checkpoint_and_is_cleaned(tmp_path):
    done = _fake_save(tmp_path, 1)
    # a writer that died mid-save: a partial temp dir, the tracker untouched
    partial = ck.begin_save(tmp_path, ck.iter_dirname(2))
    (partial / "half_written").write_text("...")
    assert ck.resolve_checkpoint(tmp_path) == done
    # a tracker write that died before os.replace leaves only a temp file behind
    (tmp_path / f"{TRACKER}.tmp-deadbeef").write_text("2")
    assert ck.resolve_checkpoint(tmp_path) == done
    # the next save removes the debris
    third = _fake_save(tmp_path, 3)
    assert ck.resolve_checkpoint(tmp_path) == third
    assert not partial.exists() and not (tmp_path / f"{TRACKER}.tmp-deadbeef").exists()


def test_dangling_tracker_is_refused_naming_it(tmp_path):
    """The protocol never makes the tracker name nothing: such a tracker is damage, and the newest
    checkpoint is not necessarily the run's, so nothing is guessed."""
    _fake_save(tmp_path, 1)
    _fake_save(tmp_path, 2)
    for text in ("9", "", "../elsewhere", "release", "iter_0000001"):  # no such dir / empty / not a number
        ck.write_tracker(tmp_path, text)
        with pytest.raises(ck.CheckpointError, match=rf"{TRACKER} holds .*iter_0000001, iter_0000002"):
            ck.resolve_checkpoint(tmp_path)
    (tmp_path / TRACKER).unlink()  # no tracker at all (a crash before the first one): the newest
    assert ck.resolve_checkpoint(tmp_path) == tmp_path / "iter_0000002"


def test_commit_writes_the_manifest_last(tmp_path):
    import json
    import zlib

    done = _fake_save(tmp_path, 1, payload="abc")
    files = json.loads((done / "manifest.json").read_text())["files"]
    assert files == {name: {"size": len(text), "crc32": f"{zlib.crc32(text.encode()):08x}"}
                     for name, text in (("metadata.json", "{}"), ("payload", "abc"))}


@pytest.mark.parametrize("keep", [None, 0])
def test_keep_none_or_zero_keeps_all(tmp_path, keep):
    for step in (1, 2, 3, 4):
        _fake_save(tmp_path, step, keep_last=keep)
    assert len(ck.complete_checkpoints(tmp_path)) == 4


def test_resave_same_step_and_keep_last(tmp_path):
    _fake_save(tmp_path, 1)
    _fake_save(tmp_path, 2)
    again = _fake_save(tmp_path, 2, payload="new")
    assert (again / "payload").read_text() == "new"
    _fake_save(tmp_path, 10, keep_last=2)  # ordered by number, not by name
    assert [p.name for p in ck.complete_checkpoints(tmp_path)] == ["iter_0000002", "iter_0000010"]


def _old_layout(root: Path) -> Path:
    """A root as the layout before wrote it: `step_NNNNNNNN/` and `latest` naming the newest."""
    for step in (4, 12):
        (root / f"step_{step:08d}").mkdir(parents=True)
        (root / f"step_{step:08d}" / "metadata.json").write_text("{}")
    (root / "latest").write_text("step_00000012\n")
    return root / "step_00000012"


def test_old_layout_is_refused_in_one_line_saying_how_to_rename(tmp_path):
    old = _old_layout(tmp_path)
    assert ck.holds_checkpoints(tmp_path)  # a run is there: `run.resume=fresh` protects it
    with pytest.raises(ck.CheckpointError) as caught:
        ck.resolve_checkpoint(tmp_path)
    message = str(caught.value)
    assert "\n" not in message and str(tmp_path) in message and "old layout" in message
    assert ck.resolve_checkpoint(old) == old  # one step directory passed itself still designates itself
    # doing what the message says makes the root resolvable
    mv = re.search(r"mv (\S+) (\S+)\)", message)
    echo = re.search(rf"echo (\d+) > {re.escape(TRACKER)}", message)
    assert mv and echo, message
    (tmp_path / mv.group(1)).rename(tmp_path / mv.group(2))
    (tmp_path / TRACKER).write_text(echo.group(1))
    (tmp_path / "latest").unlink()
    assert ck.resolve_checkpoint(tmp_path) == tmp_path / "iter_0000012"
