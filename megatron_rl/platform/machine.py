"""The facts about this machine that the shims and the rest of the package decide on (re-exported by
the package): its own module so that `megatron_cpu` can ask them without importing the package."""
from __future__ import annotations

from pathlib import Path

import torch


def has_cuda() -> bool:
    return torch.cuda.is_available()


def te_available() -> bool:
    """Transformer Engine's layer spec can be used here: a CUDA device and an importable TE."""
    if not has_cuda():
        return False
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # a broken TE install must not take the local path down
        return False
    return True


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str] | None:
    """The CPU's feature flags (None: not readable here, e.g. not Linux)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return None


def cpu_has_fast_bf16(flags: set[str] | None = None) -> bool | None:
    """The CPU multiplies bf16 natively (AVX512-BF16 or AMX-BF16); None: its flags are unknown. Without
    them torch converts every bf16 matmul: 33x slower than fp32 (512x512, one thread, an AVX2 EPYC)."""
    flags = cpu_flags() if flags is None else flags
    if flags is None:
        return None
    return bool({"avx512_bf16", "amx_bf16"} & flags)
