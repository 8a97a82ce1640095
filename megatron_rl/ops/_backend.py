"""The two row kernels behind the fused loss, from the csrc/ extension or, failing that, PyTorch.

`lse_stats(logits[N, V], targets[N], vocab_start) -> (row_max, row_sumexp, target_logit)` and
`logits_grad(logits, targets, lse, coef, vocab_start, inplace) -> grad` (see csrc/cpu/fused_loss_cpu.cpp).

Backend choice: MEGATRON_RL_OPS_BACKEND = auto (default: prebuilt library, else JIT compile, else the
PyTorch path with a one-time warning) | ext (the extension or an error) | strict (ext, and CUDA tensors
need the CUDA kernels: a CPU-only build next to a CUDA torch is an error too; set by the Dockerfile)
| torch (PyTorch path only). float64 (gradient checks) always takes the PyTorch path.
The PyTorch path processes rows in chunks, so it never holds a float32 [N, V] tensor either.
"""
from __future__ import annotations

import os
import threading
import warnings

import torch

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CHUNK_ELEMENTS = 1 << 24  # PyTorch path: rows per chunk * V stays below this (64 MiB of float32)

_MODES = ("auto", "ext", "strict", "torch")
_lock = threading.Lock()
_state: dict[str, object] = {"loaded": None, "error": None, "warned": False}


def _mode() -> str:
    mode = os.environ.get("MEGATRON_RL_OPS_BACKEND", "auto").strip().lower()
    if mode not in _MODES:
        raise ValueError(f"MEGATRON_RL_OPS_BACKEND must be one of {', '.join(_MODES)}, got {mode!r}")
    return mode


def _load() -> bool:
    """Load the extension once per process: prebuilt library first, then a cached JIT build."""
    with _lock:
        if _state["loaded"] is not None:
            return bool(_state["loaded"])
        from . import build

        try:
            lib = build.prebuilt_library()
            if lib is not None:
                torch.ops.load_library(str(lib))
            else:
                build.jit_load()
            _state["loaded"] = True
        except Exception as exc:  # no compiler, no sources, failed build: remember why
            _state["loaded"] = False
            _state["error"] = f"{type(exc).__name__}: {exc}"
        return bool(_state["loaded"])


def extension_available() -> bool:
    """True when the csrc/ kernels are loaded (building them just in time if needed)."""
    return _mode() != "torch" and _load()


def extension_error() -> str | None:
    """Why the extension could not be loaded (None if it loaded or was never tried)."""
    return _state["error"]  # type: ignore[return-value]


def _has_cuda_kernels() -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key("megatron_rl_ops::lse_stats", "CUDA")


def require_extension(cuda: bool = False) -> None:
    """Load the extension or raise RuntimeError saying why (with cuda=True its CUDA kernels too):
    what strict mode checks at first use, callable up front (the GPU install runs it)."""
    if not _load():
        raise RuntimeError(
            f"megatron_rl.ops strict: the csrc extension failed to build or load: {_state['error']}"
        )
    if cuda and not _has_cuda_kernels():
        raise RuntimeError(
            "megatron_rl.ops strict: the loaded csrc extension has no CUDA kernels (built without a CUDA "
            "torch or nvcc); rebuild it with MEGATRON_RL_BUILD_EXT=cuda (./dev setup --gpu)"
        )


def _use_extension(logits: torch.Tensor) -> bool:
    mode = _mode()
    if mode == "torch":
        return False
    if mode == "strict":
        require_extension(cuda=logits.is_cuda)
    ok = _load()
    if mode == "ext" and not ok:
        raise RuntimeError(f"MEGATRON_RL_OPS_BACKEND=ext but the csrc extension failed: {_state['error']}")
    if not ok:
        if not _state["warned"]:
            _state["warned"] = True
            warnings.warn(
                "megatron_rl.ops: csrc extension unavailable, using the PyTorch implementation of the "
                f"fused loss (slower, same values). Reason: {_state['error']}",
                RuntimeWarning,
                stacklevel=3,
            )
        return False
    if logits.dtype not in _KERNEL_DTYPES:
        return False  # float64 (used by gradient checks) goes through PyTorch
    if logits.is_cuda and not _has_cuda_kernels():
        return False  # a CPU-only build loaded next to a CUDA torch
    return True


def backend_name(logits: torch.Tensor) -> str:
    return "ext" if _use_extension(logits) else "torch"


def _row_chunks(n_rows: int, n_cols: int):
    step = max(1, _CHUNK_ELEMENTS // max(n_cols, 1))
    for start in range(0, n_rows, step):
        yield start, min(n_rows, start + step)


def _local_targets(targets: torch.Tensor, vocab_start: int, vocab: int):
    local = targets - vocab_start
    owned = (local >= 0) & (local < vocab)
    return local.clamp(0, vocab - 1), owned


def _torch_lse_stats(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int):
    n, v = logits.shape
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    row_max = torch.empty(n, dtype=acc, device=logits.device)
    row_sum = torch.empty_like(row_max)
    local, owned = _local_targets(targets, vocab_start, v)
    for a, b in _row_chunks(n, v):
        z = logits[a:b].to(acc)
        m = z.amax(dim=1)
        row_max[a:b] = m
        row_sum[a:b] = torch.exp(z - m.unsqueeze(1)).sum(dim=1)
    target = logits.gather(1, local.unsqueeze(1)).squeeze(1).to(acc)
    return row_max, row_sum, torch.where(owned, target, torch.zeros_like(target))


def _torch_logits_grad(logits, targets, lse, coef, vocab_start: int, inplace: bool):
    n, v = logits.shape
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    out = logits if inplace else torch.empty_like(logits)
    local, owned = _local_targets(targets, vocab_start, v)
    for a, b in _row_chunks(n, v):
        p = torch.exp(logits[a:b].to(acc) - lse[a:b].to(acc).unsqueeze(1))
        g = -coef[a:b].to(acc).unsqueeze(1) * p
        rows = torch.arange(b - a, device=logits.device)
        g[rows, local[a:b]] += torch.where(owned[a:b], coef[a:b].to(acc), torch.zeros_like(g[:, 0]))
        out[a:b] = g.to(logits.dtype)
    return out


def lse_stats(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int):
    """Per row: max, sum of exp(logit - max), and the target logit if this shard owns it (else 0)."""
    if _use_extension(logits):
        return torch.ops.megatron_rl_ops.lse_stats(logits, targets, vocab_start)
    return _torch_lse_stats(logits, targets, vocab_start)


def logits_grad(logits, targets, lse, coef, vocab_start: int, inplace: bool = False) -> torch.Tensor:
    """coef[t] * (onehot(target_t) - softmax(logits[t])), in the logits dtype; in place if asked."""
    if _use_extension(logits):
        lse32, coef32 = lse.float().contiguous(), coef.float().contiguous()
        if inplace:
            return torch.ops.megatron_rl_ops.logits_grad_(logits, targets, lse32, coef32, vocab_start)
        return torch.ops.megatron_rl_ops.logits_grad(logits, targets, lse32, coef32, vocab_start)
    return _torch_logits_grad(logits, targets, lse, coef, vocab_start, inplace)
