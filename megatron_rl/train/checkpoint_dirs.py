"""Atomic checkpoint directories in Megatron-LM's layout: a save is written aside and committed by one rename.

Layout under a checkpoint root (Megatron-LM's `--ckpt-format torch_dist` layout, so its tools and
`--load` find the checkpoints: megatron/training/checkpointing.py `get_checkpoint_name`,
`get_checkpoint_tracker_filename`):

    root/iter_0000012/                      one complete checkpoint: a dist_checkpointing directory
    root/latest_checkpointed_iteration.txt  the newest complete checkpoint's iteration ("12")
    root/iter_0000013.tmp-ab12cd/           a save in progress (or the debris of a crashed one)

A save writes everything into `<name>.tmp-<id>` (`begin_save`); once every rank is done the ranks
write its `manifest.json` (sizes and CRC32 of every file, `checkpoint_manifest`), then rank 0 renames
it to `<name>` (atomic on POSIX within one file system) and replaces the tracker file through a
temporary file + `os.replace` (`commit_save`). A writer killed at any moment leaves either the old
tracker -> old complete checkpoint, or the new one: never a half-written checkpoint behind the tracker.
Debris is removed by the next save. Collective over the default process group when torch.distributed
is up. A tracker naming no checkpoint directory is damage (the protocol never writes one):
CheckpointError. Roots in the layout before (`step_00000012/` + `latest`) are refused with a
CheckpointError saying how to rename them; one such step directory passed itself still loads.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import uuid
from pathlib import Path

import torch.distributed as dist

from megatron_rl.train.checkpoint_manifest import MANIFEST, CheckpointError, describe, write_manifest

log = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
_ITER_RE = re.compile(r"^iter_(\d{7,})$")
_TMP_MARK = ".tmp-"
# The layout before Megatron-LM's: refused at the root with the renaming to do (old_layout_error).
_OLD_POINTER = "latest"
_OLD_STEP_RE = re.compile(r"^step_(\d+)$")


def iter_dirname(step: int) -> str:
    """Megatron-LM's checkpoint directory name of an iteration: `iter_` and 7 digits (more past 9999999)."""
    return f"iter_{step:07d}"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _broadcast_str(value: str | None) -> str:
    if not dist.is_initialized():
        assert value is not None
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for dirpath, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def write_tracker(root: Path, step: int | str) -> None:
    """Atomically make `root/latest_checkpointed_iteration.txt` hold `step` (as Megatron-LM writes it:
    the number, no newline) through a temporary file, fsync, os.replace, fsync of the directory."""
    tmp = root / f"{TRACKER}{_TMP_MARK}{uuid.uuid4().hex[:8]}"
    with open(tmp, "w") as f:
        f.write(str(step))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / TRACKER)
    _fsync_dir(root)


def complete_checkpoints(root: Path) -> list[Path]:
    """Committed checkpoint directories under `root`, oldest step first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _ITER_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def holds_checkpoints(root: str | Path) -> bool:
    """Whether `root` is a checkpoint root a run wrote into: a tracker file (or the old `latest`)."""
    root = Path(root)
    return (root / TRACKER).is_file() or (root / _OLD_POINTER).is_file()


def tracked_step(root: str | Path) -> int | None:
    """The iteration the tracker file of `root` names, None without one (or an unreadable one)."""
    try:
        return int((Path(root) / TRACKER).read_text().strip())
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def old_layout_error(root: Path) -> CheckpointError | None:
    """The error for a root holding only checkpoints of the layout before (`step_N/` + `latest`)."""
    old = sorted(p.name for p in root.iterdir() if p.is_dir() and _OLD_STEP_RE.match(p.name))
    if not old and not (root / _OLD_POINTER).is_file():
        return None
    example = old[-1] if old else "step_00000012"
    new = iter_dirname(int(example.split("_")[1]))
    return CheckpointError(
        f"{root} holds checkpoints in the old layout (step_NNNNNNNN/ + latest): rename each directory to "
        f"Megatron-LM's (e.g. mv {example} {new}) and replace `latest` by {TRACKER} holding the step "
        f"number (e.g. echo {int(new[5:])} > {TRACKER}), or pass one step directory itself")


def is_checkpoint_dir(path: Path) -> bool:
    """A dist_checkpointing directory itself (complete or damaged), rather than a root of them."""
    return any((path / name).is_file() for name in ("metadata.json", MANIFEST, "common.pt"))


def resolve_checkpoint(path: str | Path) -> Path | None:
    """The checkpoint directory `path` designates: a root (follows its tracker file) or one checkpoint.

    Returns None for a root holding no complete checkpoint; CheckpointError when the tracker names no
    checkpoint directory (the newest one is not necessarily the one the run was at) and for a root in
    the old layout (`old_layout_error`).
    """
    path = Path(path)
    if is_checkpoint_dir(path):
        return path
    tracker = path / TRACKER
    if tracker.exists():
        try:
            text = tracker.read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{tracker} cannot be read ({describe(e)})") from None
        if text.isascii() and text.isdigit() and is_checkpoint_dir(path / iter_dirname(int(text))):
            return path / iter_dirname(int(text))
        found = ", ".join(p.name for p in complete_checkpoints(path)) or "none"
        raise CheckpointError(f"{tracker} holds {text[:80]!r}, which names no checkpoint directory in {path} "
                              f"(iteration directories there: {found}); write the wanted iteration into it, "
                              f"or pass that iter_ directory itself")
    done = [p for p in complete_checkpoints(path) if (p / "metadata.json").is_file()]
    if done:
        return done[-1]
    error = old_layout_error(path) if path.is_dir() else None
    if error is not None:
        raise error
    return None


def remove_debris(root: Path) -> list[Path]:
    """Delete leftovers of interrupted saves (`*.tmp-*`); call only while no save runs."""
    removed = []
    for p in root.iterdir() if root.is_dir() else []:
        if _TMP_MARK in p.name:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
            removed.append(p)
    return removed


def begin_save(root: Path, name: str) -> Path:
    """Rank 0 clears debris and creates a fresh temporary directory; every rank gets its path."""
    tmp_name = None
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        for p in remove_debris(root):
            log.info("removed debris of an interrupted save: %s", p)
        tmp_name = f"{name}{_TMP_MARK}{uuid.uuid4().hex[:8]}"
        (root / tmp_name).mkdir()
    return root / _broadcast_str(tmp_name)


def commit_save(root: Path, tmp: Path, step: int, keep_last: int | None = 0) -> Path:
    """After every rank finished writing `tmp`: rename it to `root/iter_<step>`, move the tracker to
    `step`, then delete all but the newest `keep_last` checkpoints (0: keep all)."""
    name = iter_dirname(step)
    final = root / name
    barrier()
    write_manifest(tmp)  # collective; last file written, before the directory becomes visible
    if _rank() == 0:
        _fsync_tree(tmp)
        if final.exists():  # re-saving the same step: move the old one aside first
            old = root / f"{name}{_TMP_MARK}old-{uuid.uuid4().hex[:8]}"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old)
        else:
            os.rename(tmp, final)
        _fsync_dir(root)
        write_tracker(root, step)
        if keep_last:
            for p in complete_checkpoints(root)[:-keep_last]:
                if p != final:
                    shutil.rmtree(p)
    barrier()
    return final
