"""Adapter push (`trainer.lora.push: adapter`): after an update the generators receive only the LoRA
adapters, in HF PEFT's layout, loaded by SGLang beside the frozen base (never re-sent) under the name of
the new version (rollout/adapters.py: the version rule, the generator's bookkeeping).

Transport: SGLang 0.5.23 loads adapters from a folder (/load_lora_adapter) or from tensors
(/load_lora_adapter_from_tensors); it has no adapter path over a torch.distributed group. The tensors
travel inside the HTTP request: a plain pickle of {PEFT name: CPU tensor} (each storage's bytes inline,
which SGLang's restricted unpickler accepts; a torch.multiprocessing pickle would pass shared-memory
handles, usable on the same host only), base64 in the JSON body, one copy per server TP rank (SGLang
shards the adapter itself). Adapters are small (SmolLM2-135M, rank 16 on all targets: 18.6 MiB in
420 tensors; benchmarks/lora.py), so one request per generator, in parallel.

On the trainers (trainer_push.TrainerPush) `train/lora_weights.gather_peft_tensors` runs on every rank
(the TP gathers are collective) and leaves the whole model's adapters on global rank 0, which sends them
(`AdapterSender`) with their `peft_config`.
"""
from __future__ import annotations

import base64
import io
import pickle
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Mapping

import torch

from megatron_rl.rollout.adapters import adapter_name
from megatron_rl.rollout.client import SGLangClient
from megatron_rl.sync.messages import PushReport
from megatron_rl.sync.sender import SyncTarget, WeightSyncError


def serialize(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """A plain pickle of CPU tensors: their bytes inline (not torch.multiprocessing's shared memory).
    Each is cloned: pickle writes a tensor's whole storage, and on a CPU trainer the adapters are views of
    larger ones (the fused adapters' per-projection splits, Megatron's parameter buffer)."""
    buf = io.BytesIO()
    pickle.dump({n: t.detach().cpu().clone(memory_format=torch.contiguous_format) for n, t in tensors.items()},
                buf, protocol=pickle.HIGHEST_PROTOCOL)
    return buf.getvalue()


def load_body(name: str, payload: bytes, config: dict, tp_size: int = 1) -> dict:
    """The JSON body of /load_lora_adapter_from_tensors: one copy of the tensors per server TP rank.
    Never send an empty list: SGLang 0.5.23's scheduler indexes it by TP rank and dies (IndexError)."""
    if tp_size < 1 or not payload:
        raise ValueError("an adapter push needs tensors and a TP size >= 1")
    data = base64.b64encode(payload).decode("ascii")
    return {"lora_name": name, "config_dict": config, "serialized_named_tensors": [data] * tp_size}


class AdapterSender:
    """Loads one version's adapters into every target (in parallel, one request each)."""

    def __init__(self, timeout_s: float = 600.0):
        self.timeout_s = timeout_s

    def send(self, version: int, tensors: Mapping[str, torch.Tensor], config: dict,
             targets: list[SyncTarget]) -> PushReport:
        if not targets:
            raise WeightSyncError("adapter push with no generator to load it")
        start = time.perf_counter()
        payload = serialize(tensors)
        name = adapter_name(version)

        def load(target: SyncTarget) -> int:
            body = load_body(name, payload, config, target.tp_size)
            try:
                SGLangClient(target.url, timeout_s=self.timeout_s).load_lora_adapter_from_tensors(body)
            except Exception as e:
                raise WeightSyncError(f"adapter {name} not loaded by {target.url}: {e}") from e
            return len(payload) * target.tp_size

        with ThreadPoolExecutor(max_workers=len(targets)) as pool:
            sent = sum(pool.map(load, targets))
        return PushReport(version, tensors=len(tensors), bytes=sent, send_s=time.perf_counter() - start,
                          mode="adapter")
