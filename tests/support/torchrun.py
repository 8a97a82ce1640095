"""Launch a 2-rank (or N-rank) gloo job with torchrun on loopback, as the multi-process tests do."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from support.net import free_port

REPO = Path(__file__).resolve().parents[2]


def run_two_ranks(script: str | Path, *args: str, timeout: float = 600, expect: str = "WORKER OK",
                  env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `script args` on 2 ranks (OMP_NUM_THREADS=1, the repository root on PYTHONPATH); assert it
    exited 0 and that each rank printed `expect` once."""
    return run_ranks(2, script, *args, timeout=timeout, expect=expect, env=env)


def run_ranks(nproc: int, script: str | Path, *args: str, timeout: float = 600, expect: str = "WORKER OK",
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`run_two_ranks` on `nproc` ranks."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **(env or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", str(script), *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.stdout.count(expect) == nproc, proc.stdout[-3000:]
    return proc
