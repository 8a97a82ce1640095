"""`./dev gpu-check` (env/gpu_check.py) cannot run here: it must stop at once, naming why, without CUDA;
what it reads out of each check's output is checked on the outputs' own formats."""
from __future__ import annotations

import importlib.util
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "env" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_cuda_it_fails_fast_and_says_where_to_run_it():
    t0 = time.monotonic()
    done = subprocess.run([str(ROOT / "dev"), "gpu-check"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and time.monotonic() - t0 < 60
    assert "no CUDA device here" in done.stderr and "run ./dev gpu-check on a machine lent a GPU" in done.stderr
    assert "PASS" not in done.stdout  # no check ran


def test_it_runs_every_gpu_test_and_its_own_checks_apart(gpu_check):
    files = gpu_check.gpu_test_files()
    assert "tests/unit/test_train_step_cuda.py" in files and "tests/unit/test_ops_cuda.py" in files
    assert gpu_check.SELF_TESTS not in files  # run as the kl-reference and te-less checks
    assert (ROOT / gpu_check.SELF_TESTS).is_file()
    assert [c[0] for c in gpu_check.CHECKS] == ["megatron-core", "csrc", "kl-reference", "te-less", "pytest-gpu",
                                                "bench-fused-loss", "bench-trainer"]


def test_summaries_read_from_each_output(gpu_check):
    assert gpu_check.pytest_detail("...\n===== 5 passed, 1 skipped in 12.30s =====\n") == "5 passed, 1 skipped in 12.30s"
    fused = ("device=cuda T=16384 ...\n"
             "eager          time      12.5 ms  speedup vs eager  1.00x  peak extra ...\n"
             "fused          time       4.1 ms  speedup vs eager  3.05x  peak extra ...\n"
             "linear_fused   FAILED: RuntimeError: boom\n")
    note = gpu_check.fused_loss_detail(fused)
    assert note == "eager 12.5 ms (1.00x); fused 4.1 ms (3.05x); linear_fused FAILED"
    assert not gpu_check.passed(True, note, skips_allowed=True)  # the benchmark exits 0 all the same
    trainer = "megatron_rl trainer :  51234.5 tok/s  (step times ...)\nratio megatron_rl / HF: 1.84x  (median ...)\n"
    assert gpu_check.trainer_detail(trainer) == "megatron_rl trainer : 51234.5 tok/s; ratio megatron_rl / HF: 1.84x"
    assert not gpu_check.passed(True, "2 passed, 1 skipped in 3s", skips_allowed=False)
    assert gpu_check.passed(True, "2 passed, 1 skipped in 3s", skips_allowed=True)
