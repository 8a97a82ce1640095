"""Body of the trainer ranks: train on batches, push weights to the generators, save/load.

The controller sends each command once, to the first trainer; `CommandFanout` shares it with the
other trainers over torch.distributed, all run it collectively, and the first trainer answers.
A weight push is the trainer side of sync/, `sync.trainer_push.TrainerPush` (the first TP/DP rank of
each pipeline stage sends); its `PushReport` and the update's `TrainReport` go back typed.
"""
from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from megatron_rl.config import Config
from megatron_rl.control.mailbox import CONTROLLER, Mailbox
from megatron_rl.control.protocol import (LoadRequest, Loaded, PushRequest, Pushed, SaveRequest, Saved, Stop,
                                          Trained, TrainReport, TrainRequest, WorkerFailure)


@dataclass(frozen=True)
class TrainerPlace:
    """Where a trainer rank runs and where its world meets (control/node.py decides both)."""

    rank: int  # among the trainers
    world: int
    gpu: int  # local id of the CUDA device it takes (node.assign_gpus); LOCAL_RANK for libraries that read it
    node_addr: str  # its node's address: weight-update groups it sends on rendezvous here
    master_addr: str  # the first trainer's node address
    master_port: int


def _setup_dist_env(place: TrainerPlace) -> None:
    from megatron_rl.platform import pin_nccl_cumem

    pin_nccl_cumem(os.environ)  # before this process's first NCCL communicator: NCCL reads it once
    os.environ.update(RANK=str(place.rank), WORLD_SIZE=str(place.world), LOCAL_RANK=str(place.gpu),
                      MASTER_ADDR=place.master_addr, MASTER_PORT=str(place.master_port))


def _init_default_group(place: TrainerPlace, listener) -> None:
    """The trainers' world, rendezvousing on the first trainer's store. The store serves on the
    socket the first trainer bound to its node's address (torch's env:// rendezvous would listen on
    every interface); init_parallel then finds the group made and only builds Megatron's groups."""
    import torch

    from megatron_rl.control.node import check_gpus_exist
    from megatron_rl.sync.group import listening_store
    from megatron_rl.train.parallel import default_backend

    if torch.cuda.is_available():
        check_gpus_exist([place.gpu], torch.cuda.device_count(), place.rank, "trainer")
        torch.cuda.set_device(place.gpu)
    timeout = timedelta(minutes=10)
    if listener is not None:
        store = listening_store(listener, place.world, timeout)
    else:
        store = dist.TCPStore(place.master_addr, place.master_port, place.world, False, timeout=timeout)
    dist.init_process_group(default_backend(), store=store, rank=place.rank, world_size=place.world)


class CommandFanout:
    """The first trainer's commands, shared with every trainer. Idle trainers wait between commands
    (for as long as generation takes) in a broadcast on a CPU group with a long timeout; the command
    itself then travels on the trainers' default group (NCCL on the model's device with CUDA)."""

    IDLE_TIMEOUT = timedelta(days=30)

    def __init__(self, mailbox: Mailbox, is_first: bool):
        import torch

        self.mailbox, self.is_first = mailbox, is_first
        self._wait_group = dist.new_group(backend="gloo", timeout=self.IDLE_TIMEOUT)
        self._flag = torch.zeros(1, dtype=torch.int64)
        self._queued: deque[object] = deque()  # on the first trainer: received, not yet shared

    def next(self) -> object:
        """The next command, on every trainer rank."""
        box = [None]
        if self.is_first:
            while not self._queued:
                self._queued.extend(m for _, m in self.mailbox.poll(timeout_s=60.0, source=CONTROLLER))
            box = [self._queued.popleft()]
        dist.broadcast(self._flag, src=0, group=self._wait_group)  # all wait here while the first waits on MPI
        dist.broadcast_object_list(box, src=0)
        return box[0]


def trainer_loop(mailbox: Mailbox, cfg: Config, place: TrainerPlace, listener=None) -> None:
    """`listener`: on the first trainer, the socket its rendezvous store serves on."""
    from megatron_rl.sync.trainer_push import TrainerPush
    from megatron_rl.train.trainer import Trainer

    _setup_dist_env(place)
    first = place.rank == 0
    rank = mailbox.rank
    try:
        _init_default_group(place, listener)
        trainer = Trainer(cfg)
        pusher = TrainerPush(trainer.model_chunks, cfg.generator.bucket_mb, place.node_addr,
                             adapters=cfg.trainer.lora.push == "adapter", base_model=cfg.trainer.model)
        fanout = CommandFanout(mailbox, first)
    except Exception as e:
        mailbox.fail(WorkerFailure.of("trainer", rank, "trainer set-up failed", e))
        return
    while True:
        command = fanout.next()
        if isinstance(command, Stop):
            pusher.close()
            return
        try:
            reply = _run(trainer, pusher, command)
        except Exception as e:
            mailbox.fail(WorkerFailure.of("trainer", rank, f"{type(command).__name__} failed", e))
            continue
        if first:
            mailbox.send(CONTROLLER, reply)


_NOT_METRICS = ("steps", "version", "step")  # of train_on's answer: per-step metrics, the counters


def _run(trainer, pusher, command: object) -> object:
    if isinstance(command, TrainRequest):
        out = trainer.train_on(command.batch)
        return Trained(TrainReport(trainer.version, {k: v for k, v in out.items() if k not in _NOT_METRICS}))
    if isinstance(command, PushRequest):
        return Pushed(pusher.push(command.version, command.targets))
    if isinstance(command, SaveRequest):
        return Saved(str(trainer.save(command.root, command.extra)))
    if isinstance(command, LoadRequest):
        return Loaded(trainer.load(command.root))
    raise RuntimeError(f"trainer: unexpected {type(command).__name__}")
