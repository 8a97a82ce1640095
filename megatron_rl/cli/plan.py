"""`megatron-rl plan CONFIG [key=value ...] --nodes N --gpus-per-node G`: the rank map of a run
(megatron_rl.plan.placement) with per-GPU memory per role (megatron_rl.plan.estimate) and the
task count for srun / mpiexec. Exit status: 0 the run can work, 1 bad input (file, key, option),
3 the layout cannot work (every cause is printed, one per line, on stderr).

`--print-tasks` prints only the task count and `--print-hostfile` only the hostfile (one host per
rank, in rank order), so launch scripts take both from here and cannot disagree with the config;
`--print-srun-mpi` only srun's PMI plugin for the MPI library this environment loads (plan/srun.py).
"""
from __future__ import annotations

import argparse
import sys

from megatron_rl.cli.common import add_config_argument
from megatron_rl.log import get_logger

log = get_logger(__name__)

DEFAULT_MAX_PROMPT_TOKENS = 1024  # Magistral-style system prompt + a competition problem


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_argument(parser, required=True)
    parser.add_argument("--nodes", type=int, default=None, help="nodes of the job (default: as many as --hosts)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node")
    parser.add_argument("--hosts", default=None,
                        help="comma-separated hostnames or addresses of the nodes, in node order (default: "
                             "node0, node1, ...; in an allocation: scontrol show hostnames | paste -sd,)")
    parser.add_argument("--gpu-memory-gb", type=float, default=80.0, help="memory of one GPU")
    parser.add_argument("--max-prompt-tokens", type=int, default=DEFAULT_MAX_PROMPT_TOKENS,
                        help="upper bound on prompt length (chat template included) of the data set; "
                             "prompt + longest generation must fit in trainer.micro_batch_tokens")
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--print-tasks", action="store_true", help="print only the task count (for srun --ntasks)")
    out.add_argument("--print-hostfile", action="store_true",
                     help="print only the hostfile: one host per rank in rank order (SLURM_HOSTFILE)")
    out.add_argument("--print-srun-mpi", action="store_true",
                     help="print only srun's --mpi plugin for the MPI library mpi4py loads here")


def main(args: argparse.Namespace) -> int:
    from megatron_rl.config import ConfigError, load_config
    from megatron_rl.plan.placement import PlacementError, check_run, default_hosts, notes, place, table
    from megatron_rl.plan.srun import mpi_library, pmi_plugin
    from megatron_rl.plan.estimate import Cluster, estimate, shapes_of

    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()] if args.hosts else None
    nodes = args.nodes if args.nodes is not None else (len(hosts) if hosts else None)
    if nodes is None or nodes < 1:
        log.error("give --nodes N (>= 1) or --hosts")
        return 1
    if hosts is not None and len(hosts) != nodes:
        log.error("--hosts names %d nodes but --nodes is %d", len(hosts), nodes)
        return 1
    if args.max_prompt_tokens < 1 or args.gpu_memory_gb <= 0:
        log.error("--max-prompt-tokens and --gpu-memory-gb must be > 0")
        return 1
    try:
        cfg = load_config(args.config, args.overrides)
        shapes = shapes_of(cfg)
    except (ConfigError, ValueError, OSError, TypeError) as err:
        named = str(err).startswith(str(args.config))  # load_config names the file (and line) itself
        log.error("%s", err if named else f"{args.config}: {err}")
        return 1

    causes: list[str] = []
    try:
        placement = place(cfg, hosts or default_hosts(nodes), args.gpus_per_node)
    except PlacementError as err:
        placement = None
        causes.append(str(err))
    cluster = Cluster(gpu_memory_gb=args.gpu_memory_gb, gpus_per_node=args.gpus_per_node,
                      generator_tp=max(1, cfg.generator.tp_size), prompt_tokens=args.max_prompt_tokens)
    try:
        memory = estimate(cfg, cluster, shapes)
    except ValueError:  # layers not divisible by PP: check_run names it
        memory = None
    causes += check_run(cfg, shapes, memory, gpu_memory_gb=args.gpu_memory_gb,
                        max_prompt_tokens=args.max_prompt_tokens)

    if placement is not None and not causes and args.print_tasks:
        print(placement.world_size)
        return 0
    if placement is not None and not causes and args.print_hostfile:
        sys.stdout.write(placement.hostfile())
        return 0
    if not causes and args.print_srun_mpi:
        print(pmi_plugin(mpi_library())[0])
        return 0
    if not (args.print_tasks or args.print_hostfile or args.print_srun_mpi):
        t, g = cfg.trainer, cfg.generator
        print(f"config: {args.config}; {nodes} nodes x {args.gpus_per_node} GPUs ({args.gpu_memory_gb:g} GB)")
        print(f"trainer: TP={t.tensor_parallel} PP={t.pipeline_parallel} DP={t.data_parallel}; generators: "
              f"{g.num_generators} x tp_size {g.tp_size}; verifier ranks: {cfg.reward.verifier_ranks}")
        if memory is not None:
            print("trainer GPU: " + ", ".join(f"{k} {v:.1f} GB" for k, v in memory.trainer_gb.items()))
            print("generator GPU: " + ", ".join(f"{k} {v:.1f} GB" for k, v in memory.generator_gb.items()))
        if placement is not None:
            gb = {} if memory is None else {"trainer": memory.trainer_gb["total"],
                                            "generator": memory.generator_gb["total"]}
            print(table(placement, gb))
            for note in notes(placement):
                print(f"note: {note}")
            library = mpi_library()
            plugin, why = pmi_plugin(library)
            print(f"tasks: {placement.world_size} (srun --mpi={plugin} --ntasks={placement.world_size} "
                  f"--distribution=arbitrary with SLURM_HOSTFILE from --print-hostfile; "
                  f"mpiexec -n {placement.world_size})")
            print(f"mpi: {library or 'none'}; srun --mpi={plugin}: {why}")
    for cause in causes:
        log.error("cannot run: %s", cause)
    return 3 if causes else 0
