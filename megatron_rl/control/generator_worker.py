"""Body of a generator rank: one SGLang server, samples streamed back to the controller.

The rank never blocks on generation: requests run in the Generator's threads while this loop
forwards finished rollouts (and the turn boundaries episodes reached, for the controller's checkpoints), answers update commands (pause in place / finish with a version: the
generator side of sync/, sync/generator_side.py) and reports a server restart so the controller
re-sends the current weights.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from megatron_rl.config import Config
from megatron_rl.control.episodes import episode_setup
from megatron_rl.control.mailbox import CONTROLLER, Mailbox
from megatron_rl.control.protocol import (FinishUpdate, GenerateRequest, PauseForUpdate, RolloutsReport, Stop,
                                          WorkerFailure)
from megatron_rl.platform import move_processes
from megatron_rl.rollout.generator import Generator, GeneratorDied
from megatron_rl.rollout.routing import SERVER_FLAG, RoutingShape
from megatron_rl.rollout.adapters import lora_server_args
from megatron_rl.rollout.server import ServerSpec, SGLangServer
from megatron_rl.sync.generator_side import answer, status_of
from megatron_rl.train.hf_source import resolve_model


# The generator computes in the trainer's precision, so that lag-0 mismatch measures kernels, not dtypes.
SERVING_DTYPE = {"fp32": "float32", "bf16": "bfloat16"}


def server_spec(cfg: Config, index: int, model_dir: str, run_dir: Path, port: int, host: str,
                gpus: tuple[int, ...] = (), shared_cores: tuple[int, ...] = (),
                cpu_cores: tuple[int, ...] = ()) -> ServerSpec:
    g = cfg.generator
    added = [SERVER_FLAG] if cfg.algo.routing_replay else []  # the server keeps every position's routes
    lora = cfg.trainer.lora
    if lora.push == "adapter":  # the base stays, pushed adapters are loaded beside it (rollout/adapters.py)
        added += lora_server_args(lora.rank, lora.target_modules, g.extra_args)
    return ServerSpec(model_path=model_dir, port=port, max_total_tokens=g.max_total_tokens,
                      log_path=str(run_dir / f"sglang-{index}.log"), mem_fraction_static=g.mem_fraction_static,
                      startup_timeout_s=g.startup_timeout_s, request_idle_timeout_s=g.request_idle_timeout_s,
                      extra_args=list(g.extra_args) + added, tp_size=g.tp_size, host=host, gpu_ids=gpus,
                      dtype=SERVING_DTYPE[cfg.trainer.precision], shared_cores=shared_cores,
                      cpu_cores=cpu_cores)


def generator_loop(mailbox: Mailbox, cfg: Config, index: int, model_dir: str, run_dir: Path, port: int, host: str,
                   gpus: tuple[int, ...] = (), poll_s: float = 0.01, shared_cores: tuple[int, ...] = ()) -> None:
    """`host`: this rank's node address; the server listens there and the controller and trainers
    reach it there (its URL travels in GeneratorStatus). `gpus`: its node-local GPU ids (node.assign_gpus).
    `shared_cores` (run.cpu_placement split): this rank is placed on its share of the cores, where its
    server's schedulers compute; the server starts on `shared_cores`, and this rank (HTTP streams,
    mostly waiting) moves back there once the server runs (ServerSpec)."""
    share = tuple(sorted(os.sched_getaffinity(0))) if shared_cores else ()
    spec = server_spec(cfg, index, model_dir, run_dir, port, host, gpus, shared_cores, share)
    rank = mailbox.rank
    try:
        gen = Generator(SGLangServer(spec), cfg.rollout, cfg.generator, generator_id=index,
                        max_concurrency=cfg.rollout.n_async + cfg.env.extra_in_flight,
                        episodes=episode_setup(cfg, resolve_model(model_dir).tokenizer()),
                        record_boundaries=cfg.env.multi_turn,
                        routing=RoutingShape.of_model(model_dir) if cfg.algo.routing_replay else None,
                        adapter_push=cfg.trainer.lora.push == "adapter")
        _check_gpus(gpus, rank)
        gen.start()
        if shared_cores:
            move_processes([os.getpid()], shared_cores)
    except Exception as e:
        mailbox.fail(WorkerFailure.of("generator", rank, "SGLang server failed to start", e))
        mailbox.wait_for_stop()
        return
    mailbox.send(CONTROLLER, status_of(gen))
    incarnation = gen.incarnation
    idle_s = busy_s = 0.0
    last = time.perf_counter()
    report_waits = cfg.env.extra_in_flight > 0  # else nobody reads it: no message per tool call
    waiting = 0  # env_waiting as last reported: a change is reported (the controller's admission)
    try:
        while True:
            for _, msg in mailbox.poll(source=CONTROLLER):
                if isinstance(msg, Stop):
                    return
                _obey(mailbox, gen, msg)
            finished = []
            item = gen.get(timeout=poll_s)
            while item is not None:
                finished.append(item)
                item = gen.get(timeout=0)
            boundaries = gen.boundaries()  # after the rollouts: a boundary never arrives after its rollout
            now = time.perf_counter()
            if gen.in_flight == 0 and not finished:
                idle_s += now - last
            else:
                busy_s += now - last
            last = now
            env_waiting = gen.env_waiting if report_waits else 0
            if finished or boundaries or env_waiting != waiting:
                mailbox.send(CONTROLLER, RolloutsReport(finished, idle_s, busy_s, boundaries, env_waiting))
                idle_s = busy_s = 0.0
                waiting = env_waiting
            if gen.incarnation != incarnation:  # the server died and was restarted with disk weights
                incarnation = gen.incarnation
                mailbox.send(CONTROLLER, status_of(gen))
    except GeneratorDied as e:  # its samples are the controller's to re-issue elsewhere
        mailbox.fail(WorkerFailure.of("generator", rank, "server died", e, fatal=False))
        mailbox.wait_for_stop()
    except Exception as e:
        mailbox.fail(WorkerFailure.of("generator", rank, "generation failed", e))
        mailbox.wait_for_stop()
    finally:
        gen.close()


def _obey(mailbox: Mailbox, gen: Generator, msg: object) -> None:
    if isinstance(msg, GenerateRequest):
        _submit(gen, msg)
    elif isinstance(msg, (PauseForUpdate, FinishUpdate)):  # the weight update's (sync/generator_side.py)
        mailbox.send(CONTROLLER, answer(gen, msg))
    else:
        raise RuntimeError(f"generator: unexpected {type(msg).__name__}")


def _check_gpus(gpus: tuple[int, ...], rank: int) -> None:
    from megatron_rl.control.node import check_gpus_exist
    from megatron_rl.platform import has_cuda

    if gpus and has_cuda():
        import torch

        check_gpus_exist(gpus, torch.cuda.device_count(), rank, "generator")


def _submit(gen: Generator, request: GenerateRequest) -> None:
    for group in request.groups:  # each as it came: prompt ids once, its stage and sampling
        gen.submit_group(group)
