"""What a CPU-only machine needs to run the real Megatron-Core and SGLang — and nothing else.

- `megatron_cpu.apply()`: monkeypatches for Megatron-Core on a CPU torch build (see that module).
- `sglang_cpu_env()`: environment for an SGLang server process on CPU: the CPU engine switch and the
  import-only `sgl_kernel` stub on its PYTHONPATH (the stub never enters this process).

Both do nothing when a CUDA device exists, so GPU runs use the libraries untouched.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

SGL_KERNEL_STUB_DIR = Path(__file__).resolve().parent / "sgl_kernel_stub"


def has_cuda() -> bool:
    return torch.cuda.is_available()


def ensure_megatron_cpu() -> list[str]:
    """Apply the Megatron-Core CPU shims if there is no GPU; returns the names applied."""
    from . import megatron_cpu

    return megatron_cpu.apply()


def sglang_cpu_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for launching an SGLang server; CPU additions only when there is no GPU."""
    env = dict(os.environ if base is None else base)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    if has_cuda():
        return env
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    paths = [str(SGL_KERNEL_STUB_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env
