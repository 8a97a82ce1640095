"""Which device the trainer's tensors live on: the model's.

Every tensor a step creates (packed micro-batches, loss statistics, metric and count reductions, the
KL-in-reward sums) is put on `model_device(model)`. Collectives then need no backend check: the
process group init_parallel starts matches the model's device (NCCL with CUDA parameters, gloo with
CPU ones), so a tensor on the model's device is the tensor that group can send.
"""
from __future__ import annotations

import torch


def model_device(model) -> torch.device:
    """Device of the first parameter of `model` (a module, e.g. a DDP-wrapped chunk, or a list of
    chunks). A chunk with no parameters of its own (possible on a pipeline stage) is skipped."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    for chunk in chunks:
        for p in chunk.parameters():
            return p.device
    raise ValueError("the model has no parameters: its device is undefined")
