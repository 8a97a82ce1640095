"""SGLang's routed-experts capture (routing replay) on a CPU-only torch: its host buffer is allocated
pinned and registered with cudaHostRegister (`pool_host.common.ALLOC_MEMORY_FUNCS`, the default for
every device without its own entry, "cpu" included), which raises without CUDA. Pinning only speeds up
copies from a GPU, and on the CPU engine there is none: "cpu" gets a plain allocation. Installed when
the stub is imported (SGLang's CPU engine imports `sgl_kernel` at start-up, in every server process),
as a patch applied right after SGLang's module is executed (or at once if it already was)."""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

POOL_MODULE = "sglang.srt.mem_cache.pool_host.common"


def _unpinned(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
    return allocator.allocate(dims, dtype=dtype, device=device)


def _patch(module) -> None:
    module.ALLOC_MEMORY_FUNCS["cpu"] = _unpinned


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != POOL_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    if POOL_MODULE in sys.modules:
        _patch(sys.modules[POOL_MODULE])
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
