"""Body of a generator rank: one SGLang server, samples streamed back to the controller.

The rank never blocks on generation: requests run in the Generator's threads while this loop
forwards finished rollouts, answers update commands (pause in place / finish with a version) and
reports a server restart so the controller re-sends the current weights.
"""
from __future__ import annotations

import time
from pathlib import Path

from megatron_rl.config import Config
from megatron_rl.control.protocol import GenerateRequest, GeneratorStatus, RolloutsReport, SampleSpec, Tag, WorkerFailure
from megatron_rl.rollout.client import ServerUnreachable
from megatron_rl.rollout.generator import Generator, GeneratorDied
from megatron_rl.rollout.server import ServerSpec, SGLangServer


def _status(gen: Generator) -> GeneratorStatus:
    return GeneratorStatus(gen.generator_id, gen.server.url, gen.incarnation, gen.version, gen.needs_weight_sync)


def generator_loop(comm, cfg: Config, index: int, model_dir: str, run_dir: Path, port: int, host: str,
                   gpus: tuple[int, ...] = (), poll_s: float = 0.01) -> None:
    """`host`: this rank's node address; the server listens there and the controller and trainers
    reach it there (its URL travels in GeneratorStatus). `gpus`: its node-local GPU ids (node.assign_gpus)."""
    from mpi4py import MPI

    g = cfg.generator
    spec = ServerSpec(model_path=model_dir, port=port, max_total_tokens=g.max_total_tokens,
                      log_path=str(run_dir / f"sglang-{index}.log"), mem_fraction_static=g.mem_fraction_static,
                      startup_timeout_s=g.startup_timeout_s, extra_args=list(g.extra_args), tp_size=g.tp_size,
                      host=host, gpu_ids=gpus)
    gen = Generator(SGLangServer(spec), cfg.rollout, g, generator_id=index)
    rank = comm.Get_rank()
    try:
        _check_gpus(gpus, rank)
        gen.start()
    except Exception as e:
        comm.send(WorkerFailure("generator", rank, f"SGLang server failed to start: {e}"), dest=0, tag=Tag.FAILED)
        _wait_for_stop(comm)
        return
    comm.send(_status(gen), dest=0, tag=Tag.GEN_STATUS)
    incarnation = gen.incarnation
    status = MPI.Status()
    idle_s = busy_s = 0.0
    last = time.perf_counter()
    try:
        while True:
            while comm.Iprobe(source=0, tag=MPI.ANY_TAG, status=status):
                tag = status.Get_tag()
                msg = comm.recv(source=0, tag=tag)
                if tag == Tag.STOP:
                    return
                if tag == Tag.GENERATE:
                    _submit(gen, msg)
                elif tag == Tag.UPDATE_BEGIN:
                    _with_live_server(gen, gen.begin_update)
                    comm.send(_status(gen), dest=0, tag=Tag.UPDATE_READY)
                elif tag == Tag.UPDATE_FINISH:
                    _with_live_server(gen, lambda: gen.finish_update(int(msg)), retry=False)
                    comm.send(_status(gen), dest=0, tag=Tag.UPDATE_DONE)
            finished = []
            item = gen.get(timeout=poll_s)
            while item is not None:
                finished.append(item)
                item = gen.get(timeout=0)
            now = time.perf_counter()
            if gen.in_flight == 0 and not finished:
                idle_s += now - last
            else:
                busy_s += now - last
            last = now
            if finished:
                comm.send(RolloutsReport(finished, idle_s, busy_s), dest=0, tag=Tag.ROLLOUTS)
                idle_s = busy_s = 0.0
            if gen.incarnation != incarnation:  # the server died and was restarted with disk weights
                incarnation = gen.incarnation
                comm.send(_status(gen), dest=0, tag=Tag.GEN_STATUS)
    except GeneratorDied as e:
        unfinished = [SampleSpec(s.problem_id, s.sample_index, s.prompt_ids) for s in e.unfinished]
        comm.send(WorkerFailure("generator", rank, str(e), unfinished, fatal=False), dest=0, tag=Tag.FAILED)
        _wait_for_stop(comm)
    except Exception as e:
        comm.send(WorkerFailure("generator", rank, f"{type(e).__name__}: {e}"), dest=0, tag=Tag.FAILED)
        _wait_for_stop(comm)
    finally:
        gen.close()


def _check_gpus(gpus: tuple[int, ...], rank: int) -> None:
    from megatron_rl.control.node import check_gpus_exist
    from megatron_rl.platform import has_cuda

    if gpus and has_cuda():
        import torch

        check_gpus_exist(gpus, torch.cuda.device_count(), rank, "generator")


def _with_live_server(gen: Generator, action, retry: bool = True) -> None:
    """Run an update step; if the server died meanwhile, relaunch it (its unfinished samples are
    re-issued by the Generator) and, with `retry`, run the step on the new incarnation. The status
    sent next tells the controller the server serves disk weights: it pushes the current ones."""
    try:
        action()
    except ServerUnreachable:
        if gen.server.healthy():
            raise
        gen.restart()
        if retry:
            action()


def _submit(gen: Generator, request: GenerateRequest) -> None:
    by_group: dict[str, list[SampleSpec]] = {}
    for s in request.samples:
        by_group.setdefault(s.group_id, []).append(s)
    for group_id, specs in by_group.items():
        gen.submit(group_id, specs[0].prompt_ids, sampling=request.sampling,
                   sample_indices=[s.sample_index for s in specs])


def _wait_for_stop(comm, poll_s: float = 0.05) -> None:
    from mpi4py import MPI

    status = MPI.Status()
    while True:
        if comm.Iprobe(source=0, tag=MPI.ANY_TAG, status=status):
            comm.recv(source=0, tag=status.Get_tag())
            if status.Get_tag() == Tag.STOP:
                return
        time.sleep(poll_s)
