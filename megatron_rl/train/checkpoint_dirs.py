"""Atomic checkpoint directories: a save is written aside and committed by one rename.

Layout under a checkpoint root:

    root/step_00000012/        one complete checkpoint directory
    root/latest                text file naming the newest complete checkpoint ("step_00000012")
    root/step_00000013.tmp-ab12cd/   a save in progress (or the debris of a crashed one)

A save writes everything into `<name>.tmp-<id>` (`begin_save`); once every rank is done the ranks
write its `manifest.json` (sizes and CRC32 of every file, `checkpoint_manifest`), then rank 0 renames
it to `<name>` (atomic on POSIX within one file system) and replaces `latest` through a temporary
file + `os.replace` (`commit_save`). A writer killed at any moment leaves either the old `latest` -> old
complete checkpoint, or the new one: never a half-written checkpoint behind `latest`. Debris is
removed by the next save. Collective over the default process group when torch.distributed is up.
`latest` naming no checkpoint directory is damage (the protocol never writes one): CheckpointError.
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

LATEST = "latest"
_STEP_RE = re.compile(r"^step_(\d+)$")
_TMP_MARK = ".tmp-"


def step_dirname(step: int) -> str:
    return f"step_{step:08d}"


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


def write_pointer(root: Path, name: str) -> None:
    """Atomically make `root/latest` name `name` (temporary file, fsync, os.replace, fsync dir)."""
    tmp = root / f"{LATEST}{_TMP_MARK}{uuid.uuid4().hex[:8]}"
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    _fsync_dir(root)


def complete_checkpoints(root: Path) -> list[Path]:
    """Committed checkpoint directories under `root`, oldest step first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def is_checkpoint_dir(path: Path) -> bool:
    """A dist_checkpointing directory itself (complete or damaged), rather than a root of them."""
    return any((path / name).is_file() for name in ("metadata.json", MANIFEST, "common.pt"))


def resolve_checkpoint(path: str | Path) -> Path | None:
    """The checkpoint directory `path` designates: a root (follows `latest`) or one checkpoint.

    Returns None for a root holding no complete checkpoint; CheckpointError when `latest` names no
    checkpoint directory (the newest one is not necessarily the one the run was at).
    """
    path = Path(path)
    if is_checkpoint_dir(path):
        return path
    pointer = path / LATEST
    if pointer.exists():
        try:
            name = pointer.read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{pointer} cannot be read ({describe(e)})") from None
        if _STEP_RE.match(name) and is_checkpoint_dir(path / name):
            return path / name
        found = ", ".join(p.name for p in complete_checkpoints(path)) or "none"
        raise CheckpointError(f"{pointer} names {name[:80]!r}, which is not a checkpoint directory in {path} "
                              f"(step directories there: {found}); write the wanted one's name into it, "
                              f"or pass that step directory itself")
    done = [p for p in complete_checkpoints(path) if (p / "metadata.json").is_file()]
    return done[-1] if done else None


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


def commit_save(root: Path, tmp: Path, name: str, keep_last: int = 0) -> Path:
    """After every rank finished writing `tmp`: rename it to `root/name`, move `latest`, prune."""
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
        write_pointer(root, name)
        if keep_last > 0:
            for p in complete_checkpoints(root)[:-keep_last]:
                if p != final:
                    shutil.rmtree(p)
    barrier()
    return final
