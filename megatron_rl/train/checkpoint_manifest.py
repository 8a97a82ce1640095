"""Checkpoint manifests: every file of a checkpoint with its size and CRC32, written last.

`iter_<N>/manifest.json` lists every other file under the checkpoint directory (relative path, size in
bytes, CRC32 of the content) and a CRC32 of that list itself. `commit_save` writes it after every
rank finished writing and before the directory is renamed into place, so a committed checkpoint
always carries one; `verify_manifest` checks the files against it before anything reads them and
raises one CheckpointError naming the checkpoint and the first bad file.

Both are collective over the default torch.distributed group when it is up: each rank reads a share
of the files (a torch_dist shard `__<rank>_<i>.distcp` goes to the rank that wrote it, so a save
re-reads it from that node's page cache), and the results meet in one all_gather. Checksums cost
one read of the checkpoint (CRC32 streams at ~1.2-1.6 GB/s on one core here; sha256 0.9,
blake2b 0.4); `mode="size"` checks only presence and sizes (a stat per file) for checkpoints whose
re-read would cost too much at load time (docs/train.md).
"""
from __future__ import annotations

import json
import os
import re
import uuid
import zlib
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatron_rl.errors import InputError

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
VERIFY_MODES = ("checksum", "size")
_CHUNK = 4 << 20
_SHARD_RE = re.compile(r"^__(\d+)_\d+\.distcp$")


class CheckpointError(InputError, RuntimeError):
    """A checkpoint that cannot be used: damaged, incomplete, or not what the caller needs."""


def describe(e: BaseException) -> str:
    """`Type: first line of the message`: library errors (torch's unpickler) span many lines."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def file_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _all_gather(value: Any) -> list[Any]:
    if not dist.is_initialized():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _reader(rel: str, index: int, world: int) -> int:
    """The rank that reads file `rel`: the writer of a torch_dist shard when it is in this world."""
    m = _SHARD_RE.match(rel)
    if m and int(m.group(1)) < world:
        return int(m.group(1))
    return index % world


def _files_crc(files: dict[str, Any]) -> str:
    return f"{zlib.crc32(json.dumps(files, sort_keys=True).encode()):08x}"


def _list_files(ckpt: Path) -> list[str]:
    return sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(ckpt: Path) -> None:
    """Collective, after every rank finished writing `ckpt`: rank 0 writes `ckpt/manifest.json`
    (temporary file, fsync, os.replace)."""
    rank, world = _rank_world()
    names = _all_gather(_list_files(ckpt) if rank == 0 else None)[0]  # one listing for everyone
    mine = {rel: {"size": (ckpt / rel).stat().st_size, "crc32": f"{file_crc32(ckpt / rel):08x}"}
            for i, rel in enumerate(names) if _reader(rel, i, world) == rank}
    parts = _all_gather(mine)
    if rank != 0:
        return
    files = {rel: entry for part in parts for rel, entry in part.items()}
    body = {"manifest_version": MANIFEST_VERSION, "checksum": "crc32", "files": dict(sorted(files.items())),
            "files_crc32": _files_crc(files)}
    tmp = ckpt / f"{MANIFEST}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "w") as f:
        json.dump(body, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, ckpt / MANIFEST)


def read_manifest(ckpt: Path) -> dict[str, dict[str, Any]] | None:
    """The manifest's file table, None when `ckpt` has no manifest; CheckpointError when it is damaged."""
    path = ckpt / MANIFEST
    if not path.exists():
        return None
    try:
        body = json.loads(path.read_bytes())
        files = body["files"]
        ok = (body.get("manifest_version") == MANIFEST_VERSION and body.get("checksum") == "crc32"
              and isinstance(files, dict) and body.get("files_crc32") == _files_crc(files)
              and all(isinstance(e, dict) and isinstance(e.get("size"), int) and isinstance(e.get("crc32"), str)
                      for e in files.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"damaged checkpoint {ckpt}: {MANIFEST} cannot be read ({describe(e)})")
    if not ok:
        raise CheckpointError(f"damaged checkpoint {ckpt}: {MANIFEST} is damaged (its own CRC32 or version "
                              f"field does not match; manifest version {MANIFEST_VERSION} expected)")
    return files


def _file_problem(ckpt: Path, rel: str, entry: dict[str, Any], checksums: bool) -> str | None:
    path = ckpt / rel
    if not path.is_file():
        return f"{rel} is missing (the manifest lists {entry['size']} bytes)"
    size = path.stat().st_size
    if size != entry["size"]:
        what = "empty" if size == 0 else f"{size} bytes long"
        return f"{rel} is {what}, the manifest says {entry['size']} bytes (truncated or overwritten)"
    if checksums and f"{file_crc32(path):08x}" != entry["crc32"]:
        return f"{rel} is damaged: its CRC32 differs from the manifest's (same size, other content)"
    return None


def verify_manifest(ckpt: Path, mode: str = "checksum") -> bool:
    """Collective: check every file of `ckpt` against its manifest (sizes always, CRC32 for mode
    "checksum"). Returns False for a checkpoint without a manifest; raises CheckpointError naming
    the checkpoint and the first bad file (in the manifest's order), the same on every rank."""
    if mode not in VERIFY_MODES:
        raise CheckpointError(f"checkpoint verification {mode!r}: expected one of {VERIFY_MODES}")
    files = read_manifest(ckpt)
    if files is None:
        return False
    rank, world = _rank_world()
    problems = [(i, msg) for i, (rel, entry) in enumerate(files.items()) if _reader(rel, i, world) == rank
                and (msg := _file_problem(ckpt, rel, entry, mode == "checksum"))]
    found = sorted(p for part in _all_gather(problems) for p in part)
    if found:
        more = f" (and {len(found) - 1} more damaged file(s))" if len(found) > 1 else ""
        raise CheckpointError(f"damaged checkpoint {ckpt}: {found[0][1]}{more}")
    return True
