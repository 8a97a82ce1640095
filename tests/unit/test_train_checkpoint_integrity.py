"""Damaged checkpoints: each kind of damage gives one CheckpointError naming the checkpoint and the file.

One trainer checkpoint of the tiny Llama is saved once; every test damages a copy of it the way a
disk, a copy or a person would, and resumes from it with `Trainer.load` (the resume path: resolve,
verify against the manifest, read). The manifest is checked against zlib's CRC32 of the bytes on
disk, computed here independently.
"""
from __future__ import annotations

import json
import logging
import shutil
import zlib
from pathlib import Path

import pytest
import torch

from megatron_rl.train.checkpoint import CheckpointError, verify_checkpoint
from megatron_rl.train.checkpoint_dirs import TRACKER, iter_dirname

from test_train_step import make_config  # noqa: E402  (tests/unit on sys.path)


@pytest.fixture(scope="module")
def saved(tiny_llama_dir, tmp_path_factory):
    from megatron_rl.train.trainer import Trainer

    trainer = Trainer(make_config(tiny_llama_dir))
    root = tmp_path_factory.mktemp("integrity") / "ckpt"
    trainer.save(root)
    return trainer, root


@pytest.fixture
def damaged(saved, tmp_path):
    """(trainer, root, step dir, largest shard) with a fresh copy of the saved checkpoint to damage."""
    trainer, root = saved
    copy = tmp_path / "ckpt"
    shutil.copytree(root, copy)
    step = copy / iter_dirname(0)
    shard = max(step.glob("*.distcp"), key=lambda p: p.stat().st_size)
    return trainer, copy, step, shard


def _flip_byte(path: Path, at: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    i = len(data) // 2 if at is None else at
    data[i] ^= 0x01
    path.write_bytes(bytes(data))


def _refused(trainer, root: Path, step: Path, names: str) -> str:
    with pytest.raises(CheckpointError) as caught:
        trainer.load(root)
    message = str(caught.value)
    assert "\n" not in message and str(step) in message and names in message, message
    return message


def test_manifest_lists_every_file_with_size_and_crc32(damaged):
    trainer, root, step, _ = damaged
    manifest = json.loads((step / "manifest.json").read_text())
    on_disk = {str(p.relative_to(step)): p.read_bytes() for p in step.rglob("*") if p.name != "manifest.json"}
    assert manifest["files"] == {name: {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
                                 for name, data in on_disk.items()}
    assert {"common.pt", "metadata.json", ".metadata"} <= set(on_disk)
    before = {n: p.detach().clone() for n, p in trainer.model_chunks[0].named_parameters()}
    assert trainer.load(root) == {} and trainer.last_load.path == step  # intact: verifies and loads
    assert all(torch.equal(p, before[n]) for n, p in trainer.model_chunks[0].named_parameters())


@pytest.mark.parametrize("name", ["common.pt", "metadata.json", ".metadata", "shard"])
def test_missing_file(damaged, name):
    trainer, root, step, shard = damaged
    path = shard if name == "shard" else step / name
    path.unlink()
    assert "is missing" in _refused(trainer, root, step, path.name)


def test_truncated_shard(damaged):
    trainer, root, step, shard = damaged
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    assert f"{size // 2} bytes long, the manifest says {size}" in _refused(trainer, root, step, shard.name)


def test_zero_byte_shard(damaged):
    trainer, root, step, shard = damaged
    shard.write_bytes(b"")
    assert "is empty" in _refused(trainer, root, step, shard.name)


@pytest.mark.parametrize("name", ["shard", "common.pt"])
def test_byte_flip(damaged, name):
    trainer, root, step, shard = damaged
    path = shard if name == "shard" else step / name
    _flip_byte(path)
    assert "CRC32 differs" in _refused(trainer, root, step, path.name)


def test_size_mode_checks_sizes_only(damaged):
    """`size` trades the flip detection for no extra read: it still catches truncation."""
    _, _, step, shard = damaged
    _flip_byte(shard)
    assert verify_checkpoint(step, "size") == step
    with pytest.raises(CheckpointError, match="CRC32 differs"):
        verify_checkpoint(step, "checksum")
    with open(shard, "ab") as f:
        f.write(b"\0")
    with pytest.raises(CheckpointError, match=f"{shard.name} is .* bytes long"):
        verify_checkpoint(step, "size")


@pytest.mark.parametrize("damage", ["missing", "cut", "edited", "not a table"])
def test_damaged_manifest(damaged, damage):
    trainer, root, step, shard = damaged
    manifest = step / "manifest.json"
    if damage == "missing":
        manifest.unlink()  # common.pt records that the save wrote one
    elif damage == "cut":
        manifest.write_bytes(manifest.read_bytes()[:-20])
    elif damage == "not a table":
        manifest.write_text("[1, 2]")
    else:  # still valid JSON, but a size no longer matches the manifest's own CRC32
        body = json.loads(manifest.read_text())
        body["files"][shard.name]["size"] += 1
        manifest.write_text(json.dumps(body))
    _refused(trainer, root, step, "manifest.json")


def test_tracker_pointing_nowhere(damaged):
    trainer, root, step, _ = damaged
    (root / TRACKER).write_text("7")
    with pytest.raises(CheckpointError, match=r"holds '7'.*iter_0000000") as caught:
        trainer.load(root)
    assert str(root / TRACKER) in str(caught.value)


def _as_old_checkpoint(step: Path) -> None:
    """What a save before manifests left: no manifest.json, no `has_manifest` in common.pt."""
    (step / "manifest.json").unlink()
    common = torch.load(step / "common.pt", weights_only=False)
    del common["has_manifest"]
    torch.save(common, step / "common.pt")


def test_old_checkpoint_without_manifest_loads_with_a_warning(damaged, caplog):
    trainer, root, step, _ = damaged
    _as_old_checkpoint(step)
    with caplog.at_level(logging.WARNING, logger="megatron_rl.train.checkpoint"):
        trainer.load(root)
    assert trainer.last_load.path == step
    assert any("no manifest.json" in r.getMessage() and str(step) in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("name", ["common.pt", "metadata.json"])
def test_old_checkpoint_with_damaged_metadata(damaged, name):
    """Without a manifest nothing is verified, but unreadable metadata still names its file."""
    trainer, root, step, _ = damaged
    _as_old_checkpoint(step)
    (step / name).write_bytes((step / name).read_bytes()[:7])
    _refused(trainer, root, step, name)
