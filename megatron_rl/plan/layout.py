"""Which MPI rank plays which role, derived from the config.

    rank 0                      controller (budget, batching, grading dispatch, metrics, checkpoints)
    ranks 1 .. T                trainers (T = tp x cp x pp x dp; their own torch.distributed world)
    next G ranks                generators (one SGLang server each)
    last V ranks                verifiers (optional; V = 0 grades inside the controller's process pool)

The same layout works under `mpiexec -n N` on one machine and `srun` on a cluster.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_rl.config import Config

Role = Literal["controller", "trainer", "generator", "verifier"]


@dataclass(frozen=True)
class RankLayout:
    trainers: int
    generators: int
    verifiers: int

    @classmethod
    def from_config(cls, cfg: Config) -> "RankLayout":
        t = cfg.trainer
        trainers = t.tensor_parallel * t.context_parallel * t.pipeline_parallel * t.data_parallel
        return cls(trainers, cfg.generator.num_generators, cfg.reward.verifier_ranks)

    @property
    def world_size(self) -> int:
        return 1 + self.trainers + self.generators + self.verifiers

    @property
    def trainer_ranks(self) -> list[int]:
        return list(range(1, 1 + self.trainers))

    @property
    def generator_ranks(self) -> list[int]:
        start = 1 + self.trainers
        return list(range(start, start + self.generators))

    @property
    def verifier_ranks(self) -> list[int]:
        start = 1 + self.trainers + self.generators
        return list(range(start, start + self.verifiers))

    @property
    def first_trainer(self) -> int:
        """The trainer the controller talks to: it shares each command with the other trainers and
        answers for them all; the trainers' rendezvous is on its node."""
        return 1

    def role(self, rank: int) -> Role:
        if rank == 0:
            return "controller"
        if rank in self.trainer_ranks:
            return "trainer"
        if rank in self.generator_ranks:
            return "generator"
        if rank in self.verifier_ranks:
            return "verifier"
        raise ValueError(f"rank {rank} is outside the layout of {self.world_size} ranks")

    def check_world(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise RuntimeError(
                f"the config needs {self.world_size} MPI ranks (1 controller + {self.trainers} trainers + "
                f"{self.generators} generators + {self.verifiers} verifiers), but the job has {world_size}")
