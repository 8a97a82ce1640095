"""`megatron-rl train CONFIG [key=value ...] [--resume]`: the asynchronous RL loop.

Outside an MPI job this starts itself under `mpiexec -n N` (N from the config's rank layout: one
controller, tp x pp x dp trainers, the generators and the verifier ranks); under mpiexec or srun
it runs directly as one rank of the job.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

_MPI_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config (e.g. examples/cpu_demo.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. run.updates=10")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in run.output_dir from its checkpoint (= run.resume=require)")


def _inside_mpi_job() -> bool:
    return any(v in os.environ for v in _MPI_RANK_VARS)


def _mpiexec() -> str:
    local = Path(sys.executable).parent / "mpiexec"
    found = str(local) if local.exists() else shutil.which("mpiexec")
    if not found:
        raise FileNotFoundError("mpiexec not found (./dev setup installs the mpich wheel)")
    return found


def main(args: argparse.Namespace) -> int:
    from megatron_rl.config import ConfigError, load_config
    from megatron_rl.control.layout import RankLayout
    from megatron_rl.control.preflight import check_code_sandbox
    from megatron_rl.data.sources import DataError
    from megatron_rl.reward.sandbox import SandboxUnavailable
    from megatron_rl.train.hf_cache import ModelUnavailable

    rank_args = [args.config, *args.overrides] + (["--resume"] if args.resume else [])
    if _inside_mpi_job():
        from megatron_rl.control.main import main as rank_main

        return rank_main(rank_args)
    try:
        cfg = load_config(args.config, args.overrides)
        layout = RankLayout.from_config(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 1
    try:  # before any rank starts: a model not here, a problem set that cannot load, ungradable code tasks
        check_code_sandbox(cfg)
    except (DataError, SandboxUnavailable, ModelUnavailable) as e:
        print(f"megatron-rl train: {e}", file=sys.stderr)
        return 1
    cmd = [_mpiexec(), "-n", str(layout.world_size), sys.executable, "-m", "megatron_rl.control.main", *rank_args]
    print(f"launching {layout.world_size} ranks: {' '.join(cmd)}", file=sys.stderr, flush=True)
    # mpiexec runs in its own session and gets each SIGINT/SIGTERM exactly once, from us: it forwards
    # it to the ranks, the controller checkpoints and stops them, and we return its exit status.
    proc = subprocess.Popen(cmd, start_new_session=True)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda sig, frame: proc.send_signal(sig))
    status = proc.wait()
    if status != 0:
        print(ended_message(Path(cfg.run.output_dir), args.config, status), file=sys.stderr, flush=True)
    return status


def ended_message(run_dir: Path, config: str, status: int) -> str:
    """What to do after a job that ended badly: mpiexec ends every rank when one dies (kill -9, out of
    memory, a node lost) and names its pid above; RUN_DIR/ranks/ says which rank and role had it."""
    from megatron_rl.train.checkpoint_dirs import tracked_step

    step = tracked_step(run_dir / "checkpoints")
    where = (f"continue from its last checkpoint (iteration {step}) with: megatron-rl train {config} "
             f"--resume" if step is not None else "it wrote no checkpoint yet: start it again")
    return (f"megatron-rl train: the job ended with status {status} (a rank failed or died: the messages above "
            f"name it, {run_dir / 'ranks'} maps pids to ranks and roles); {where}")
