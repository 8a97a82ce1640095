"""`megatron-rl convert` (in process, one rank) around damaged checkpoints and occupied folders.

to-megatron into a folder that holds a run's checkpoints changes nothing and exits 1 with one line
(unless --force); to-hf of a byte-flipped checkpoint, which used to convert with exit 0 into a
model with garbage weights, exits 1 with one line naming the file and writes nothing.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from megatron_rl.cli import main as cli
from megatron_rl.train.checkpoint_dirs import TRACKER


@pytest.fixture(scope="module")
def converted(tiny_llama_dir, tmp_path_factory) -> Path:
    from megatron_rl.train.convert import hf_to_megatron

    root = tmp_path_factory.mktemp("convert_guard") / "ckpt"
    hf_to_megatron(tiny_llama_dir, root, backend="gloo")
    return root


def _run_folder(converted: Path, tmp_path: Path) -> Path:
    """A folder as a run leaves it: checkpoints of step 5 with the tracker file naming it."""
    run = tmp_path / "run"
    shutil.copytree(converted, run)
    (run / "iter_0000000").rename(run / "iter_0000005")
    (run / TRACKER).write_text("5")
    return run


def _contents(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "[convert] ERROR " in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("holds", ["tracker and iterations", "tracker only", "iterations only"])
def test_to_megatron_refuses_a_folder_holding_checkpoints(converted, tiny_llama_dir, tmp_path, capsys, holds):
    run = _run_folder(converted, tmp_path)
    if holds == "tracker only":
        shutil.rmtree(run / "iter_0000005")
    elif holds == "iterations only":
        (run / TRACKER).unlink()
    before = _contents(run)
    assert cli(["convert", "to-megatron", str(tiny_llama_dir), str(run)]) == 1
    line = _one_error_line(capsys)
    assert str(run) in line and "--force" in line, line
    assert _contents(run) == before


def test_to_megatron_force_writes_into_it(converted, tiny_llama_dir, tmp_path, capsys):
    from megatron_rl.train.checkpoint import verify_checkpoint

    run = _run_folder(converted, tmp_path)
    old = _contents(run / "iter_0000005")
    assert cli(["convert", "to-megatron", str(tiny_llama_dir), str(run), "--force", "--backend", "gloo"]) == 0
    assert (run / TRACKER).read_text() == "0"
    assert verify_checkpoint(run) == run / "iter_0000000"
    assert _contents(run / "iter_0000005") == old  # the run's own checkpoints are left alone


def test_to_hf_refuses_a_byte_flipped_shard(converted, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(converted, ckpt)
    shard = max((ckpt / "iter_0000000").glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    out = tmp_path / "hf"
    assert cli(["convert", "to-hf", str(ckpt), str(out), "--backend", "gloo"]) == 1
    line = _one_error_line(capsys)
    assert str(ckpt / "iter_0000000") in line and shard.name in line, line
    assert not out.exists()
