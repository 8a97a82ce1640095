"""Where every MPI rank runs: one pure function from (config, hosts, GPUs per node) to a rank map.

The rank order is RankLayout's (controller, trainers, generators, verifiers; see layout.py), so the
map printed by `megatron-rl plan` is the one the launch follows. Placement rules:

- rank 0, the controller, runs on node 0 and owns no GPU;
- trainer ranks own one GPU each, filled in rank order from node 0, GPU 0: consecutive trainer ranks
  share a node, which keeps Megatron's TP groups (consecutive ranks) on one NVLink domain;
- each generator (one SGLang server) owns `generator.tp_size` GPUs on one node, packed after the
  trainers' GPUs; a generator never spans nodes, so when the rest of a node is too small for one it
  starts on the next node (the GPUs skipped stay idle);
- verifier ranks run on node 0 beside the controller and own no GPU (grading is CPU work).

Because node 0 carries 1 + verifiers + its trainers, tasks per node are uneven: launchers take one
host per rank in rank order (`plan --print-hostfile`, srun `--distribution=arbitrary`, an mpiexec
machinefile) rather than a fixed `--ntasks-per-node`.

`check_run` lists every reason the placed run cannot work (model shapes vs TP/PP, the packing bin vs
the longest sequence, per-GPU memory from megatron_rl.plan.estimate). Both functions are pure: no
MPI, no files; the `plan` command does the reading.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from megatron_rl.config import Config, length_stages
from megatron_rl.plan.layout import RankLayout, Role
from megatron_rl.plan.lora_memory import LoraShape, problems as lora_problems
from megatron_rl.train.moe import moe_layout_problems


class PlacementError(ValueError):
    """The ranks of the config do not fit on the given nodes (the message names the cause)."""


@dataclass(frozen=True)
class RankSlot:
    rank: int
    role: Role
    node: int  # index into Placement.hosts
    host: str  # the node's hostname or address, as given
    local_rank: int  # position among the ranks of its node, in rank order (what SLURM_LOCALID will be)
    gpus: tuple[int, ...]  # local GPU ids on the node (empty for controller and verifiers)


@dataclass(frozen=True)
class Placement:
    hosts: tuple[str, ...]
    gpus_per_node: int
    ranks: tuple[RankSlot, ...]

    @property
    def world_size(self) -> int:
        """The task count for srun --ntasks / mpiexec -n."""
        return len(self.ranks)

    def of_role(self, role: Role) -> list[RankSlot]:
        return [r for r in self.ranks if r.role == role]

    @property
    def nodes_used(self) -> int:
        return 1 + max(r.node for r in self.ranks)

    def gpus_used(self, node: int) -> int:
        return sum(len(r.gpus) for r in self.ranks if r.node == node)

    def hostfile(self) -> str:
        """One host per rank, in rank order (SLURM_HOSTFILE for --distribution=arbitrary, or a
        machinefile for mpiexec)."""
        return "".join(f"{r.host}\n" for r in self.ranks)


def default_hosts(nodes: int) -> list[str]:
    """Placeholder names when the real hosts are not known yet (planning before allocation)."""
    return [f"node{i}" for i in range(nodes)]


def generator_nodes_needed(trainers: int, generators: int, tp: int, gpus_per_node: int) -> int:
    """Nodes the packing rule uses for `trainers` single-GPU ranks then `generators` x `tp` GPUs."""
    node, gpu = divmod(trainers, gpus_per_node)
    for _ in range(generators):
        if gpu + tp > gpus_per_node:
            node, gpu = node + 1, 0
        gpu += tp
    return node + (1 if gpu else 0) if (trainers or generators) else 1


def place(cfg: Config, hosts: Sequence[str], gpus_per_node: int) -> Placement:
    """Every rank's role, node, host, local rank and local GPU ids. Raises PlacementError naming the
    cause when the ranks do not fit (too few nodes or GPUs, a generator wider than a node)."""
    hosts = tuple(hosts)
    if not hosts:
        raise PlacementError("no nodes: give --nodes >= 1")
    if len(set(hosts)) != len(hosts):
        raise PlacementError(f"hosts repeat a name: {list(hosts)} (one entry per node)")
    if gpus_per_node < 1:
        raise PlacementError(f"gpus per node must be >= 1, got {gpus_per_node}")
    layout = RankLayout.from_config(cfg)
    tp = cfg.generator.tp_size
    if tp < 1:
        raise PlacementError(f"generator.tp_size must be >= 1, got {tp}")
    if tp > gpus_per_node:
        raise PlacementError(f"generator.tp_size={tp} is more than the {gpus_per_node} GPUs of a node "
                             "(a generator never spans nodes)")
    need = generator_nodes_needed(layout.trainers, layout.generators, tp, gpus_per_node)
    if need > len(hosts):
        raise PlacementError(
            f"the ranks do not fit: {layout.trainers} trainer GPUs + {layout.generators} generators x "
            f"tp_size {tp} need {need} nodes of {gpus_per_node} GPUs, but {len(hosts)} were given")

    slots: list[tuple[Role, int, tuple[int, ...]]] = [("controller", 0, ())]
    for i in range(layout.trainers):
        node, gpu = divmod(i, gpus_per_node)
        slots.append(("trainer", node, (gpu,)))
    node, gpu = divmod(layout.trainers, gpus_per_node)
    for _ in range(layout.generators):
        if gpu + tp > gpus_per_node:
            node, gpu = node + 1, 0
        slots.append(("generator", node, tuple(range(gpu, gpu + tp))))
        gpu += tp
    slots += [("verifier", 0, ())] * layout.verifiers

    seen: dict[int, int] = {}
    ranks = []
    for rank, (role, node, gpus) in enumerate(slots):
        # The order above must be RankLayout's: the launch takes roles from it, not from this map.
        assert role == layout.role(rank), (rank, role, layout.role(rank))
        ranks.append(RankSlot(rank, role, node, hosts[node], seen.get(node, 0), gpus))
        seen[node] = seen.get(node, 0) + 1
    return Placement(hosts, gpus_per_node, tuple(ranks))


def longest_generation(cfg: Config) -> int:
    """The largest max_new_tokens any stage of the run requests (rollout.length_schedule included)."""
    return max(s.max_new_tokens for s in length_stages(cfg.rollout.length_schedule, cfg.rollout.max_new_tokens,
                                                        cfg.reward))


def check_run(cfg: Config, shapes, memory, *, gpu_memory_gb: float,
              max_prompt_tokens: int) -> list[str]:
    """Every reason the run cannot work, one line each naming its config key (empty: it can run).

    `shapes` is megatron_rl.plan.estimate.Shapes of trainer.model; `memory` its Estimate (or None
    when the estimator could not run, e.g. layers not divisible by PP, which is reported here).
    """
    t, g = cfg.trainer, cfg.generator
    causes = []
    # Megatron shards attention heads and KV groups over TP; uneven shards are refused at model build.
    if shapes.heads % t.tensor_parallel:
        causes.append(f"trainer.tensor_parallel={t.tensor_parallel} does not divide the model's "
                      f"{shapes.heads} attention heads")
    if shapes.kv_heads % t.tensor_parallel:
        causes.append(f"trainer.tensor_parallel={t.tensor_parallel} does not divide the model's "
                      f"{shapes.kv_heads} KV heads (query groups)")
    chunks = t.pipeline_parallel * (t.virtual_pipeline or 1)
    if shapes.layers % chunks:
        causes.append(f"trainer.pipeline_parallel={t.pipeline_parallel} x virtual_pipeline="
                      f"{t.virtual_pipeline or 1} does not divide the model's {shapes.layers} layers")
    # SGLang splits query heads over its TP and splits KV heads too, or replicates them when TP exceeds them.
    if shapes.heads % g.tp_size:
        causes.append(f"generator.tp_size={g.tp_size} does not divide the model's {shapes.heads} attention heads")
    elif shapes.kv_heads % g.tp_size and g.tp_size % shapes.kv_heads:
        causes.append(f"generator.tp_size={g.tp_size} neither divides nor is a multiple of the model's "
                      f"{shapes.kv_heads} KV heads")
    causes += lora_problems(shapes, LoraShape.from_config(t.lora), t.recompute)
    if shapes.experts:
        causes += moe_layout_problems(shapes.experts, shapes.shared_ffn, tp=t.tensor_parallel, ep=t.expert_parallel,
                                      sequence_parallel=t.sequence_parallel)
    # A sequence longer than the bin cannot be packed: the trainer would stop at its first such rollout.
    longest = max_prompt_tokens + longest_generation(cfg)
    if t.micro_batch_tokens < longest:
        causes.append(f"trainer.micro_batch_tokens={t.micro_batch_tokens} is smaller than the longest sequence "
                      f"the run can produce: {max_prompt_tokens} prompt tokens (--max-prompt-tokens) + "
                      f"{longest_generation(cfg)} generated (rollout.max_new_tokens / length_schedule) = {longest}")
    if memory is not None:
        if memory.trainer_gb["total"] > gpu_memory_gb:
            causes.append(f"a trainer GPU needs {memory.trainer_gb['total']:.1f} GB, more than the "
                          f"{gpu_memory_gb:g} GB of a GPU (trainer.tensor_parallel / pipeline_parallel / "
                          "micro_batch_tokens)")
        if memory.generator_gb["total"] > gpu_memory_gb:
            causes.append(f"a generator GPU needs {memory.generator_gb['total']:.1f} GB, more than the "
                          f"{gpu_memory_gb:g} GB of a GPU (generator.tp_size / max_total_tokens)")
    return causes


def notes(placement: Placement) -> list[str]:
    """Waste that does not stop the run (printed, exit status unchanged)."""
    out = []
    if placement.nodes_used < len(placement.hosts):
        out.append(f"the ranks use {placement.nodes_used} of the {len(placement.hosts)} nodes given")
    idle = len(placement.hosts) * placement.gpus_per_node - sum(len(r.gpus) for r in placement.ranks)
    if idle:
        out.append(f"{idle} GPU(s) stay idle")
    return out


def _span(values: Sequence[int]) -> str:
    return str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}"


def table(placement: Placement, gb_per_gpu: dict[str, float] | None = None) -> str:
    """The rank map, consecutive ranks of one role on one node on one line."""
    gb_per_gpu = gb_per_gpu or {}
    groups: list[list[RankSlot]] = []
    for r in placement.ranks:
        if groups and groups[-1][-1].role == r.role and groups[-1][-1].node == r.node and \
                groups[-1][-1].rank + 1 == r.rank:
            groups[-1].append(r)
        else:
            groups.append([r])
    rows = [("ranks", "role", "node", "host", "local ranks", "GPUs", "GB/GPU")]
    for grp in groups:
        gpus = [g for r in grp for g in r.gpus]
        per = len(grp[0].gpus)
        gpu_col = "-" if not gpus else f"{_span(gpus)} ({per} per rank)"
        gb = gb_per_gpu.get(grp[0].role)
        rows.append((_span([r.rank for r in grp]), f"{grp[0].role} x{len(grp)}", str(grp[0].node), grp[0].host,
                     _span([r.local_rank for r in grp]), gpu_col, "-" if gb is None or not gpus else f"{gb:.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)
