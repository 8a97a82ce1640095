"""What every MPI rank of a training run does: `run_rank(config, overrides, resume)`. Its command line
(`mpiexec -n N python -m megatron_rl.cli.rank CONFIG [key=value ...] [--resume]`) is parsed in cli/rank.py.

Every rank tells the others its node address and local rank (control/node.py); rank 0 prepares the
run (directory, model files for the generators) and broadcasts it; the first trainer binds the
trainers' rendezvous on its node and broadcasts the port; every rank then takes its role from
`RankLayout`. `megatron-rl train` starts this under mpiexec by itself when it is not already
running inside an MPI job.
"""
from __future__ import annotations

import json
import signal
from pathlib import Path

from megatron_rl import log as logs
from megatron_rl.config import Config, ConfigError, dump_config, load_config
from megatron_rl.control.failure_report import clear_records, write_pid_file, write_report
from megatron_rl.control.node import assign_cpus, assign_gpus, gather_cores, gather_nodes
from megatron_rl.control.protocol import WorkerFailure
from megatron_rl.plan.layout import RankLayout
from megatron_rl.sync.group import bind_listener
from megatron_rl.train.checkpoint_dirs import holds_checkpoints

log = logs.get_logger(__name__)


def run_config(config: str | None, overrides: list[str], resume: bool = False) -> Config:
    """The config of the command line; `resume` (`--resume`) is `run.resume=require`, over the file and
    overrides."""
    return load_config(config, list(overrides) + (["run.resume=require"] if resume else []))


def resume_root(cfg: Config) -> Path | None:
    """The checkpoint root to continue from under `run.resume`, or None to start afresh; ConfigError when
    the run directory's state and the mode disagree."""
    run_dir = Path(cfg.run.output_dir)
    ckpt_root = run_dir / "checkpoints"
    has_ckpt = holds_checkpoints(ckpt_root)  # a tracker file (or the old layout's `latest`: refused on load)
    if cfg.run.resume == "require" and not has_ckpt:
        raise ConfigError(f"run.resume: require (--resume) but there is no checkpoint under {ckpt_root}")
    if cfg.run.resume == "fresh" and has_ckpt:
        raise ConfigError(f"run.resume: fresh, but {run_dir} already holds a run; pass --resume (or "
                          f"run.resume=auto) to continue it, or choose another run.output_dir")
    return ckpt_root if has_ckpt else None


def prepare_run(cfg: Config, layout: RankLayout) -> dict:
    """Rank 0: run directory, resolved config, model files for SGLang, ports. Raises on bad input.
    (The trainers' rendezvous port is the first trainer's to pick, on its own node: see main.)"""
    from megatron_rl.control.model_files import generator_model_dir
    from megatron_rl.control.preflight import check_code_sandbox

    check_code_sandbox(cfg)  # srun starts the ranks directly: this is the first check they all wait on
    run_dir = Path(cfg.run.output_dir)
    resume = resume_root(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    clear_records(run_dir)  # srun starts the ranks without `megatron-rl train`, which clears them too
    model_dir = generator_model_dir(cfg.trainer.model, cfg.trainer.precision)
    ports = [cfg.generator.port_base + i for i in range(layout.generators)]
    return {"run_dir": str(run_dir), "model_dir": str(model_dir), "generator_ports": ports,
            "resume_root": str(resume) if resume else None}


def report(run_dir: Path, failure: WorkerFailure) -> None:
    """Rank 0: the failure in one line on stderr, and in RUN_DIR for `megatron-rl train` to tell."""
    log.error("%s", write_report(run_dir, failure))


def run_rank(config: str | None, overrides: list[str], resume: bool = False) -> int:
    """This process's part of the job: its role from the config's rank layout, its loop until the end."""
    from megatron_rl.control.mailbox import Mailbox, world

    comm = world()
    rank = comm.Get_rank()
    logs.setup("rank", rank)  # the role is known once the config is read
    setup = cfg = None
    try:
        cfg = run_config(config, overrides, resume)
        layout = RankLayout.from_config(cfg)
        layout.check_world(comm.Get_size())
        nodes = gather_nodes(comm)  # collective; the same list (or the same error) on every rank
        if rank == 0:
            setup = prepare_run(cfg, layout)
    except Exception as e:  # the same on every rank (config, nodes), or rank 0's (prepare_run): rank 0 tells
        if rank == 0 and cfg is not None:
            report(Path(cfg.run.output_dir), WorkerFailure.of("controller", 0, "setting up the run failed", e))
        elif rank == 0:
            log.error("%s", e)  # a config the ranks cannot read: under `megatron-rl train` it checked it first
        setup = {"error": str(e)}
    setup = comm.bcast(setup, root=0)
    if "error" in setup:
        return 1
    first = layout.first_trainer
    # the trainers meet on the first trainer's node; it holds the bound socket until its store adopts it
    listener = bind_listener(nodes[first].addr) if rank == first else None
    master_port = comm.bcast(listener.getsockname()[1] if listener else None, root=first)
    role = layout.role(rank)
    logs.setup(role, rank)
    roles = [layout.role(r) for r in range(layout.world_size)]
    gpus = assign_gpus(roles, nodes, cfg.generator.tp_size)[rank]
    start_cores = _place_on_cores(cfg, role, assign_cpus(roles, *gather_cores(comm), cfg.generator.tp_size)[rank])
    if role != "controller":  # only the controller reacts to SIGINT/SIGTERM; it stops the others in order
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    run_dir = Path(setup["run_dir"])
    write_pid_file(run_dir, rank, role, nodes[rank].addr)
    if role == "controller":
        return _run_controller(comm, cfg, layout, run_dir, setup)
    mailbox = Mailbox(comm)
    if role == "trainer":
        from megatron_rl.control.trainer_worker import TrainerPlace, trainer_loop

        place = TrainerPlace(layout.trainer_ranks.index(rank), layout.trainers, gpus[0],
                             nodes[rank].addr, nodes[first].addr, master_port)
        trainer_loop(mailbox, cfg, place, listener)
    elif role == "generator":
        from megatron_rl.control.generator_worker import generator_loop

        index = layout.generator_ranks.index(rank)
        generator_loop(mailbox, cfg, index, setup["model_dir"], run_dir, setup["generator_ports"][index],
                       nodes[rank].addr, gpus, shared_cores=start_cores)
    else:
        from megatron_rl.control.grading import verifier_loop

        verifier_loop(mailbox, cfg.reward)
    return 0


def _place_on_cores(cfg: Config, role: str, cores: tuple[int, ...]) -> tuple[int, ...]:
    """`run.cpu_placement: split` without a GPU: this rank (a trainer, or a generator and its server) on
    its share of its host's cores (control/node.py). Returns the cores it had before, on which a
    generator's server starts and its waiting processes stay (rollout/server.py's shared_cores); ()
    otherwise."""
    import os

    from megatron_rl.platform import has_cuda, run_on_cores

    if cfg.run.cpu_placement != "split" or not cores or has_cuda():
        return ()
    before = tuple(sorted(os.sched_getaffinity(0)))
    cores = run_on_cores(cores, cfg.generator.tp_size if role == "generator" else None)
    log.info("%s computes on cores %s, %d thread(s)", role, ",".join(map(str, cores)), len(cores))
    return before if role == "generator" and set(before) != set(cores) else ()


def _run_controller(comm, cfg: Config, layout: RankLayout, run_dir: Path, setup: dict) -> int:
    from megatron_rl.control.controller import Controller, RunFailed, stop_workers, write_summary
    from megatron_rl.control.mailbox import Mailbox
    from megatron_rl.data import iter_problems, read_problems
    from megatron_rl.rollout.server import startup_timeout
    from megatron_rl.train.hf_source import resolve_model

    controller = None
    code = 0
    try:
        problems = list(iter_problems(cfg.data))
        tokenizer = resolve_model(cfg.trainer.model).tokenizer()
        eval_problems = read_problems(cfg.data.eval_path, cfg.data) if cfg.run.eval_every else None  # same checks
        controller = Controller(comm, cfg, layout, run_dir, problems, tokenizer, eval_problems)
        controller.install_signal_handlers()
        start_s, _ = startup_timeout(cfg.generator.startup_timeout_s, setup["model_dir"])
        controller.wait_for_generators(start_s + 60)
        if setup["resume_root"]:
            controller.resume(Path(setup["resume_root"]))
        summary = controller.run()
        write_summary(run_dir, summary)
        print(json.dumps(summary), flush=True)
        if summary["stopped_early"]:
            log.warning("stopped early and checkpointed; continue with --resume (run dir %s)", run_dir)
    except RunFailed as e:
        report(run_dir, e.failure)
        code = 1
    # bad input first met here (a problem source, a checkpoint to resume: an InputError, one line) or a bug
    # (its traceback in RUN_DIR); either way `finally` still stops the other ranks in order
    except Exception as e:
        report(run_dir, WorkerFailure.of("controller", 0, "the controller loop failed", e))
        code = 1
    finally:
        if controller is not None:
            controller.shutdown()
        else:
            stop_workers(Mailbox(comm), layout)
    return code
