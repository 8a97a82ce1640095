"""Real Megatron-Core on gloo: TP=2 forward/backward equals TP=1 (2 processes, torchrun)."""
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent / "scripts" / "megatron_tp_smoke.py"


def test_tp2_matches_tp1(free_port):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port}", str(SCRIPT)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert out.stdout.count("max|dlogits|") == 2
