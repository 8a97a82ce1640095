"""SGLang's LoRA layers and torch_native LoRA backend on a CPU-only torch: they allocate their host-side
index tensors pinned (`pin_memory=True`, `.pin_memory()`), which raises on a torch without an
accelerator. Pinning only speeds up copies to a GPU; on the CPU engine there is none. Every module of
`sglang.srt.lora` gets, after it is executed, a `torch` whose tensor factories ignore `pin_memory`, and
`Tensor.pin_memory` returns the tensor itself (it can only raise on this torch)."""
from __future__ import annotations

import types

import torch

from ._on_import import patch_on_import

PACKAGE = "sglang.srt.lora"
_FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange", "empty_like", "zeros_like", "ones_like")


class _UnpinnedTorch(types.ModuleType):
    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        value = getattr(torch, name)
        if name in _FACTORIES:
            def factory(*args, _f=value, **kwargs):
                kwargs.pop("pin_memory", None)
                return _f(*args, **kwargs)
            return factory
        return value


_TORCH = _UnpinnedTorch()


def _patch(module) -> None:
    if getattr(module, "torch", None) is torch:
        module.torch = _TORCH


def _unpinned_pin_memory(self, *args, **kwargs):
    return self


def install() -> None:
    if torch.accelerator.is_available():
        return
    torch.Tensor.pin_memory = _unpinned_pin_memory
    patch_on_import(lambda name: name == PACKAGE or name.startswith(PACKAGE + "."), _patch)
