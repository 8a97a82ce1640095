"""`megatron-rl train` refuses to start when its code tasks could not be graded here, with the
sandbox probe's own error on one line; `megatron-rl doctor` reports the same real probe.

The sandbox finds bwrap on PATH: each case runs the real probe against a missing bwrap or one that
exits like bwrap on a host that refuses user namespaces."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from megatron_rl.cli import doctor
from megatron_rl.config import config_from_dict
from megatron_rl.control.preflight import check_code_sandbox, code_languages
from megatron_rl.data import DataError
from megatron_rl.reward.code import Toolchain
from megatron_rl.reward.sandbox import SandboxUnavailable, available

pytestmark = pytest.mark.skipif(not available(Toolchain().jail())[0],
                                reason=f"no sandbox: {available(Toolchain().jail())[1]}")

REFUSED = "bwrap: No permissions to creating new namespace, likely because the kernel does not allow " \
          "non-privileged user namespaces."
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def problem_files(tmp_path):
    code = {"prompt": "Print the sum of two integers.", "tests": [{"input": "1 2\n", "output": "3\n"}]}
    math = {"prompt": "What is 2 + 2?", "answer": 4}
    files = {"code": [math, code, dict(code, language="cpp")], "math": [math]}
    out = {}
    for name, rows in files.items():
        out[name] = tmp_path / f"{name}.jsonl"
        out[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


@pytest.fixture
def bwrap_dir():
    path = tempfile.mkdtemp(prefix="mrl-fakebwrap-")
    os.chmod(path, 0o755)  # reachable by the sandbox's unprivileged uid
    yield path
    shutil.rmtree(path, ignore_errors=True)


def refuse(bwrap_dir: str) -> None:
    with open(os.path.join(bwrap_dir, "bwrap"), "w") as f:
        f.write(f"#!/bin/sh\necho \"{REFUSED}\" >&2\nexit 1\n")
    os.chmod(os.path.join(bwrap_dir, "bwrap"), 0o755)


def cfg_for(path) -> object:
    return config_from_dict({"data": {"source": "jsonl", "path": str(path)}})


def test_code_tasks_and_their_languages_are_found(problem_files):
    assert code_languages(cfg_for(problem_files["code"])) == ["cpp", "python"]
    assert code_languages(cfg_for(problem_files["math"])) == []
    assert code_languages(config_from_dict({"data": {"source": "reasoning_gym"}})) == []  # math by construction
    with pytest.raises(DataError, match="evaluation-only"):  # refused before any rank starts
        code_languages(config_from_dict({"data": {"source": "humaneval"}}))


def test_real_sandbox_passes_both_languages(problem_files):
    check_code_sandbox(cfg_for(problem_files["code"]))  # python and cpp programs really ran


@pytest.mark.parametrize("case", ["missing", "namespaces_refused"])
def test_code_tasks_without_a_sandbox_refuse_to_start(monkeypatch, problem_files, bwrap_dir, case):
    if case == "namespaces_refused":
        refuse(bwrap_dir)
    monkeypatch.setenv("PATH", bwrap_dir)
    with pytest.raises(SandboxUnavailable) as e:
        check_code_sandbox(cfg_for(problem_files["code"]))
    why = str(e.value)
    assert "\n" not in why and f"{problem_files['code']} has cpp code tasks" in why
    assert ("not installed" if case == "missing" else "No permissions to creating new namespace") in why
    check_code_sandbox(cfg_for(problem_files["math"]))  # math needs no sandbox: no refusal


def test_train_command_refuses_before_launching_any_rank(problem_files, bwrap_dir, tmp_path):
    refuse(bwrap_dir)
    config = tmp_path / "run.yaml"
    config.write_text(f"data:\n  source: jsonl\n  path: {problem_files['code']}\nrun:\n  output_dir: {tmp_path / 'run'}\n")
    env = dict(os.environ, PATH=bwrap_dir, PYTHONPATH=str(ROOT))
    env = {k: v for k, v in env.items() if k not in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")}
    p = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "train", str(config)], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1, p.stderr
    assert "[train] ERROR " in lines[0] and "No permissions to creating new namespace" in lines[0]
    assert not (tmp_path / "run").exists()  # nothing started


def test_doctor_runs_the_real_probe(monkeypatch, bwrap_dir):
    assert doctor.sandbox() == {"ok": True, "why": ""}
    refuse(bwrap_dir)
    monkeypatch.setenv("PATH", bwrap_dir)
    report = doctor.sandbox()
    assert report["ok"] is False and "No permissions to creating new namespace" in report["why"]
