"""Import-only stand-in for the CPU build of `sgl_kernel` (that build is not on PyPI).

SGLang's CPU engine imports `sgl_kernel` at start-up. On CPUs without AMX, the only function the
torch_native attention path calls is `assign_req_to_token_pool_cpu`, implemented below in torch.
Any other function raises immediately with its name, so an unexpected call is never silent.
Put this folder's parent on PYTHONPATH of the SGLang server process only
(`megatron_rl.platform.sglang_cpu_env()` does that).
Importing it also lets SGLang's routed-experts capture allocate its host buffer without CUDA
(`_unpinned_host`) and SGLang's LoRA layers and torch_native LoRA backend (`--enable-lora
--lora-backend torch_native`) allocate their host index tensors unpinned (`_unpinned_lora`), and makes
the torch_native attention backend decode a batch in one SDPA call instead of one per request
(`_batched_decode`).
"""
import torch

from ._batched_decode import install as _install_batched_decode
from ._unpinned_host import install as _install_unpinned_host
from ._unpinned_lora import install as _install_unpinned_lora

_install_unpinned_host()
_install_unpinned_lora()
_install_batched_decode()

__version__ = "0.0.0+megatron_rl_stub"


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset,
                                 out_cache_loc, pool_len):
    offset = 0
    for i in range(req_pool_indices.shape[0]):
        start, end = int(start_offset[i]), int(end_offset[i])
        row = int(req_pool_indices[i])
        req_to_token[row, start:end] = out_cache_loc[offset:offset + end - start].to(req_to_token.dtype)
        offset += end - start


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def _missing(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not available on CPU (megatron_rl stub); "
            "this SGLang code path needs the real sgl-kernel build")

    _missing.__name__ = name
    return _missing
