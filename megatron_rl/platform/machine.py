"""The facts about this machine that the shims and the rest of the package decide on (re-exported by
the package): its own module so that `megatron_cpu` can ask them without importing the package."""
from __future__ import annotations

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
