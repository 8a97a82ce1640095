"""Adapter push (`trainer.lora.push: adapter`) on the generator side: the server serves the frozen base
plus one LoRA adapter per pushed weight version, and every request names the newest one.

The rule for versions (docs/train.md "What leaves the trainer"): SGLang binds a request to the adapter
it names when it arrives and keeps it to the end (its LoRA id is part of the request, and of its radix
cache key); a request cannot switch adapters. So an update never changes a sequence in flight: a turn
that named adapter `policy-v7` is sampled by version 7 from its first token to its last, and every token
is stamped 7. A turn that names none (before the first push, or after a restart) is sampled by the base
on disk: `initial_version`. Adapters are loaded under a new name per version (SGLang refuses to load a
name twice) and unloaded once no turn uses them (SGLang's unload waits for the requests that use the
adapter, holding its LoRA update lock, so it is sent only when the last turn on it has returned).
"""
from __future__ import annotations

import threading

from megatron_rl.config.trainer import LORA_PEFT_MODULES
from megatron_rl.platform import has_cuda
from megatron_rl.rollout.server import sets_flag

PREFIX = "policy-v"


def adapter_name(version: int) -> str:
    return f"{PREFIX}{version}"


def lora_server_args(rank: int, targets: list[str] | tuple[str, ...], extra_args: list[str] = ()) -> list[str]:
    """SGLang flags for a server that takes pushed adapters of rank `rank` on `targets` (Megatron names).
    The LoRA kernel backend is SGLang's default (csgmv, triton) on CUDA and torch_native on CPU (the only
    one without triton; the sgl_kernel stub lets it allocate unpinned), unless extra_args name one."""
    modules = [m for t in targets for m in LORA_PEFT_MODULES[t]]  # as --lora-target-modules takes them
    args = ["--enable-lora", "--max-lora-rank", str(rank), "--lora-target-modules", *modules]
    if not has_cuda() and not sets_flag(extra_args, "--lora-backend"):
        args += ["--lora-backend", "torch_native"]
    return args


class AdapterVersions:
    """Which adapter new turns name, and how many turns run on each (thread-safe)."""

    def __init__(self, initial_version: int):
        self._lock = threading.Lock()
        self.initial_version = initial_version
        self.current: int | None = None  # version of the newest loaded adapter; None: the base on disk
        self.loaded: set[int] = set()
        self._running: dict[int | None, int] = {}

    def acquire(self) -> tuple[str | None, int]:
        """(adapter name or None for the base, the version every token of the turn gets)."""
        with self._lock:
            v = self.current
            self._running[v] = self._running.get(v, 0) + 1
        return (None, self.initial_version) if v is None else (adapter_name(v), v)

    def release(self, name: str | None) -> list[str]:
        """A turn on `name` returned; the adapters that no turn uses and no new turn will name."""
        v = None if name is None else int(name.removeprefix(PREFIX))
        with self._lock:
            self._running[v] -= 1
            return self._idle()

    def switch(self, version: int) -> list[str]:
        """Adapter `version` is loaded: new turns name it; returns the adapters now idle."""
        with self._lock:
            self.loaded.add(version)
            self.current = version
            return self._idle()

    def reset(self) -> None:
        """The server restarted: it holds no adapter and serves the base."""
        with self._lock:
            self.current, self.loaded = None, set()

    def _idle(self) -> list[str]:
        idle = sorted(v for v in self.loaded if v != self.current and not self._running.get(v))
        self.loaded.difference_update(idle)
        return [adapter_name(v) for v in idle]
