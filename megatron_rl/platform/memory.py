"""Peak host memory of this process on Linux, for measuring what a CPU training step allocates.

torch has no allocator statistics for CPU tensors (torch.cuda.max_memory_allocated is CUDA only) and
tracemalloc does not see them, so the step's memory is read from the kernel: the resident set (VmRSS)
and its high-water mark (VmHWM) in /proc/self/status; writing "5" to /proc/self/clear_refs resets the
mark to the current RSS (Linux >= 4.0), so one process can measure one step after warm-up.

glibc keeps freed small blocks and, after a large free, raises its mmap threshold so that later large
blocks come from the heap and stay resident. `exact_malloc_env()` is the environment for a fresh
process that returns every block of 64 KiB or more to the kernel when freed (the RSS then follows
the live tensors); set it before the process starts (glibc reads it once).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.M)
    if match is None:
        raise RuntimeError(f"{_STATUS} has no {field} (not Linux?)")
    return int(match.group(1))


def rss_bytes() -> int:
    """Resident set size now."""
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """Highest resident set size since the process started or since `reset_peak_rss`."""
    return _status_kib("VmHWM") * 1024


def reset_peak_rss() -> None:
    """Set the high-water mark to the current RSS (RuntimeError where the kernel does not allow it)."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError as err:
        raise RuntimeError(f"cannot reset the peak RSS through {_CLEAR_REFS}: {err}") from None


def start_peak_window() -> int:
    """Bytes in use now, with the peak counter reset to them: the CUDA allocator's on a GPU (synchronised
    first), else this process's RSS. `window_peak()` then reads the peak since this call."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    reset_peak_rss()
    return rss_bytes()


def window_peak() -> int:
    """The peak bytes since `start_peak_window` (the same counter it reset)."""
    import torch

    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else peak_rss_bytes()


def exact_malloc_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for a child process whose large frees go back to the kernel at once."""
    env = dict(os.environ if base is None else base)
    env["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)  # a fixed threshold also disables its dynamic growth
    env["MALLOC_TRIM_THRESHOLD_"] = str(128 * 1024)
    return env
