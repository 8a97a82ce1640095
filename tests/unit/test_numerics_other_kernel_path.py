"""The numerics-sensitive unit tests once more on another CPU kernel path, in every suite run.

CI runs on whichever CPU the machine has (AVX2, AVX-512, AMX), and ATen and oneDNN pick their kernels
by it, so float results differ in the last bits from one machine to the next. A tolerance that holds
on one kernel path only would land or fail by the machine. Both libraries document a switch to a
lower path: `ATEN_CPU_CAPABILITY=default` (ATen's unvectorised kernels) and `ONEDNN_MAX_CPU_ISA`
(oneDNN's ISA cap, x86 names). The files below are run under both in a child pytest: their tolerances
(tests/support/tolerances.py) must hold there as well as on this machine's own path.

To run any selection that way by hand:
    ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41 ./dev test tests/multiproc -k train
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
FILES = [  # fused loss and logprob ops, the trainer step against HF, KL/proximal passes, MoE layers
    "unit/test_ops_fused_loss.py", "unit/test_ops_fused_linear.py", "unit/test_ops_sequence_kl.py",
    "unit/test_train_model_logprobs.py", "unit/test_train_step.py", "unit/test_train_kl_proximal.py",
    "unit/test_train_moe.py",
]


def lower_kernel_env() -> dict[str, str]:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    if platform.machine() in ("x86_64", "AMD64"):
        env["ONEDNN_MAX_CPU_ISA"] = "SSE41"
    return env


def test_aten_takes_the_lower_path_when_asked():
    probe = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    out = subprocess.run([sys.executable, "-c", probe], env=lower_kernel_env(), capture_output=True,
                         text=True, check=True).stdout.strip()
    assert out == "DEFAULT"


def test_numerics_tests_pass_on_the_lower_kernel_path():
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--no-header", "-rfE",
           *(str(TESTS / f) for f in FILES)]
    proc = subprocess.run(cmd, env=lower_kernel_env(), cwd=TESTS.parent, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
