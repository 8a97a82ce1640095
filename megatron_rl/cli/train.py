"""`megatron-rl train CONFIG [key=value ...] [--resume]`: the asynchronous RL loop.

Outside an MPI job this starts the ranks (`python -m megatron_rl.cli.rank`, cli/rank.py) under
`mpiexec -n N` (N from the config's rank layout: one controller, tp x pp x dp trainers, the generators
and the verifier ranks); under mpiexec or srun it runs directly as one rank of the job.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

from megatron_rl.cli.common import add_config_argument, venv_tool
from megatron_rl.log import get_logger

log = get_logger(__name__)

_MPI_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")
RANK_ENTRY = "megatron_rl.cli.rank"  # `python -m` module of every rank (cli/rank.py)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_argument(parser, required=True)
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in run.output_dir from its checkpoint (= run.resume=require)")


def _inside_mpi_job() -> bool:
    return any(v in os.environ for v in _MPI_RANK_VARS)


def _mpiexec() -> str:
    found = venv_tool("mpiexec")
    if not found:
        raise FileNotFoundError("mpiexec not found (./dev setup installs the mpich wheel)")
    return found


def main(args: argparse.Namespace) -> int:
    from megatron_rl.config import ConfigError, load_config
    from megatron_rl.control.failure_report import clear_records
    from megatron_rl.control.preflight import check_code_sandbox
    from megatron_rl.data.sources import DataError
    from megatron_rl.plan.layout import RankLayout
    from megatron_rl.reward.sandbox import SandboxUnavailable
    from megatron_rl.train.hf_cache import ModelUnavailable

    if _inside_mpi_job():
        from megatron_rl.control.main import run_rank

        return run_rank(args.config, args.overrides, args.resume)
    try:
        cfg = load_config(args.config, args.overrides)
        layout = RankLayout.from_config(cfg)
    except ConfigError as e:
        log.error("config error: %s", e)
        return 1
    try:  # before any rank starts: a model not here, a problem set that cannot load, ungradable code tasks
        check_code_sandbox(cfg)
    except ConfigError as e:  # keys checked by running code (reward.custom, data.system_prompt)
        log.error("config error: %s", e)
        return 1
    except (DataError, SandboxUnavailable, ModelUnavailable) as e:
        log.error("%s", e)
        return 1
    clear_records(Path(cfg.run.output_dir))  # read when the job ends: none may be an earlier start's
    rank_args = [args.config, *args.overrides] + (["--resume"] if args.resume else [])
    cmd = [_mpiexec(), "-n", str(layout.world_size), sys.executable, "-m", RANK_ENTRY, *rank_args]
    log.info("launching %d ranks: %s", layout.world_size, " ".join(cmd))
    # mpiexec runs in its own session and gets each SIGINT/SIGTERM exactly once, from us: it forwards
    # it to the ranks, the controller checkpoints and stops them, and we return its exit status.
    proc = subprocess.Popen(cmd, start_new_session=True)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda sig, frame: proc.send_signal(sig))
    status = proc.wait()
    if status != 0:
        log.error("%s", ended_message(Path(cfg.run.output_dir), args.config, status))
    return status


def ended_message(run_dir: Path, config: str, status: int) -> str:
    """The launcher's last line after a job that ended badly: the failing rank and its error from rank 0's
    report (starting again is advised only where it can help), else a rank that died (mpiexec ends every
    rank when one dies and names its pid above)."""
    from megatron_rl.control.failure_report import rank_pids, read_report
    from megatron_rl.control.protocol import Cause

    head = f"megatron-rl train: the job ended with status {status}"
    report = read_report(run_dir)
    if report is not None and report["cause"] != Cause.LOST:  # bad input or a crash: a new start meets it again
        return f"{head}: {report['line']}"
    if report is not None:
        return f"{head}: {report['line']}; {_restart_advice(run_dir, config)}"
    pids = rank_pids(run_dir)
    if not pids:
        return f"{head} before its ranks started (the messages above say why)"
    return (f"{head}: a rank died (killed, out of memory, a node lost); mpiexec's message above names its pid "
            f"({pids}); {_restart_advice(run_dir, config)}")


def _restart_advice(run_dir: Path, config: str) -> str:
    from megatron_rl.train.checkpoint_dirs import tracked_step

    step = tracked_step(run_dir / "checkpoints")
    if step is None:
        return "it wrote no checkpoint yet: start it again with the same command"
    return f"continue from its last checkpoint (iteration {step}) with: megatron-rl train {config} --resume"
