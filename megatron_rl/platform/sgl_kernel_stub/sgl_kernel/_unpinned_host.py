"""SGLang's routed-experts capture (routing replay) on a CPU-only torch: its host buffer is allocated
pinned and registered with cudaHostRegister (`pool_host.common.ALLOC_MEMORY_FUNCS`, the default for
every device without its own entry, "cpu" included), which raises without CUDA. Pinning only speeds up
copies from a GPU, and on the CPU engine there is none: "cpu" gets a plain allocation. Installed when
the stub is imported (SGLang's CPU engine imports `sgl_kernel` at start-up, in every server process),
as a patch applied right after SGLang's module is executed (or at once if it already was)."""
from __future__ import annotations

from ._on_import import patch_on_import

POOL_MODULE = "sglang.srt.mem_cache.pool_host.common"


def _unpinned(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
    return allocator.allocate(dims, dtype=dtype, device=device)


def _patch(module) -> None:
    module.ALLOC_MEMORY_FUNCS["cpu"] = _unpinned


def install() -> None:
    patch_on_import(lambda name: name == POOL_MODULE, _patch)
