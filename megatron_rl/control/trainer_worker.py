"""Body of the trainer ranks: train on batches, push weights to the generators, save/load.

All trainer ranks receive every command and run it collectively; rank `lead` (the first trainer)
answers the controller. For a weight push, the first TP/DP rank of every pipeline stage sends its
stage's layers to every generator (several senders in parallel); the other ranks take part in the
TP gathers only.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from megatron_rl.config import Config
from megatron_rl.control.protocol import PushRequest, SaveRequest, Tag, WorkerFailure


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


def trainer_loop(comm, cfg: Config, place: TrainerPlace, resume_root: str | None, listener=None,
                 poll_s: float = 0.01) -> None:
    """`listener`: on the first trainer, the socket its rendezvous store serves on."""
    from mpi4py import MPI

    from megatron_rl.train.trainer import Trainer

    _setup_dist_env(place)
    lead = place.rank == 0
    rank = comm.Get_rank()
    try:
        _init_default_group(place, listener)
        trainer = Trainer(cfg)
        pusher = _Pusher(trainer, cfg, place.node_addr)
    except Exception as e:
        comm.send(WorkerFailure("trainer", rank, f"trainer set-up failed: {type(e).__name__}: {e}"), dest=0,
                  tag=Tag.FAILED)
        return
    status = MPI.Status()
    while True:
        if not comm.Iprobe(source=0, tag=MPI.ANY_TAG, status=status):
            time.sleep(poll_s)
            continue
        tag = status.Get_tag()
        msg = comm.recv(source=0, tag=tag)
        if tag == Tag.STOP:
            pusher.close()
            return
        try:
            if tag == Tag.TRAIN:
                metrics = trainer.train_on(msg)
                reply, reply_tag = {k: v for k, v in metrics.items() if k != "steps"}, Tag.TRAINED
            elif tag == Tag.PUSH:
                reply, reply_tag = pusher.push(msg), Tag.PUSHED
            elif tag == Tag.SAVE:
                req: SaveRequest = msg
                reply, reply_tag = str(trainer.save(req.root, req.extra)), Tag.SAVED
            elif tag == Tag.LOAD:
                reply, reply_tag = trainer.load(msg), Tag.LOADED
            else:
                raise RuntimeError(f"trainer: unexpected message tag {tag}")
        except Exception as e:
            comm.send(WorkerFailure("trainer", rank, f"{Tag(tag).name} failed: {type(e).__name__}: {e}"), dest=0,
                      tag=Tag.FAILED)
            continue
        if lead:
            comm.send(reply, dest=0, tag=reply_tag)


class _Pusher:
    """Weight sync from this trainer rank: a WeightSender on the first TP/DP rank of each stage."""

    def __init__(self, trainer, cfg: Config, node_addr: str):
        from megatron.core import parallel_state as ps

        self.trainer, self.cfg, self.node_addr = trainer, cfg, node_addr
        self.is_sender = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
        self.stage = ps.get_pipeline_model_parallel_rank()
        self.sender = None

    def push(self, req: PushRequest) -> dict:
        from megatron_rl.sync.sender import SyncTarget, WeightSender
        from megatron_rl.train.hf_weights import export_hf_tensors, hf_names_of_stage

        targets = [SyncTarget(url, tp, inc) for url, tp, inc in req.targets]
        tensors = export_hf_tensors(self.trainer.model_chunks)  # collective over TP: every rank iterates
        report = None
        if self.is_sender:
            if self.sender is None:
                self.sender = WeightSender(self.stage, targets, bucket_mb=self.cfg.generator.bucket_mb,
                                           address=self.node_addr)
            else:
                self.sender.retarget(targets)
            report = self.sender.send(tensors)
        else:
            for _ in tensors:
                pass
        expected = set(hf_names_of_stage(self.trainer.model_chunks)) if self.is_sender else set()
        sent = set(report.names) if report else set()
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (sorted(expected), sorted(sent), report.bytes if report else 0,
                                          report.seconds if report else 0.0))
        want = set().union(*(set(g[0]) for g in gathered))
        got = set().union(*(set(g[1]) for g in gathered))
        if want - got:
            raise RuntimeError(f"partial weight push: {len(want - got)} tensors not sent, e.g. {sorted(want - got)[:3]}")
        return {"version": req.version, "tensors": len(got), "bytes": sum(g[2] for g in gathered),
                "send_s": max(g[3] for g in gathered)}

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
