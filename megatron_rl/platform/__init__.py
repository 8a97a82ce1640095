"""What a CPU-only machine needs to run the real Megatron-Core and SGLang — and nothing else.

- `megatron_cpu.apply()`: monkeypatches for Megatron-Core where the machine lacks what its code
  assumes: each shim is gated on the missing piece it works around (CUDA, Transformer Engine, a fused
  Adam, triton), so a GPU without TE takes the TE-less ones and a GPU with TE none (see that module).
- `sglang_cpu_env()`: environment for an SGLang server process on CPU: the CPU engine switch and the
  import-only `sgl_kernel` stub on its PYTHONPATH (the stub never enters this process); it adds
  nothing when a CUDA device exists.
- `te_available()`: Transformer Engine's layer spec can be used (CUDA and an importable TE);
  `cpu_has_fast_bf16()`: the CPU has bf16 arithmetic (else bf16 runs tens of times slower than fp32).
- `run_on_cores(cores, sglang_tp)`: this process (every thread) and what it starts on those cores, with
  one torch/OpenMP thread per core (control/node.py's `assign_cpus` decides which).
- `pin_nccl_cumem(env)`: the one NCCL_CUMEM_ENABLE of every member of a weight-update group.
- `megatron_kernel_options(use_te, interleaved)`: the Megatron fusion / p2p / init switches this
  machine supports (everything off on CPU-gloo, Megatron's training defaults on CUDA where the kernel
  behind a switch is installed).
"""
from __future__ import annotations

import importlib.util
import os
import warnings
from pathlib import Path
from typing import MutableMapping

import torch

from .machine import cpu_flags, cpu_has_fast_bf16, has_cuda, te_available  # the machine facts, re-exported

SGL_KERNEL_STUB_DIR = Path(__file__).resolve().parent / "sgl_kernel_stub"


# Megatron-Core warns at import and model build, once per module, that Transformer Engine and Apex are
# missing and it falls back to torch; without CUDA neither can be installed: on CPU the fallback is the plan.
_CPU_EXPECTED_WARNINGS = (r"Transformer Engine and Apex are not installed", r"Apex is not installed\. Falling back")


def silence_expected_cpu_warnings() -> None:
    """Ignore Megatron-Core's import warnings that only say this machine has no CUDA (nothing else; on a
    CUDA machine they stay, since there a missing Transformer Engine is worth a warning)."""
    if has_cuda():
        return
    for message in _CPU_EXPECTED_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning, module=r"megatron")


def ensure_megatron_shims() -> list[str]:
    """Apply the Megatron-Core shims this machine needs (megatron_cpu.apply); returns the names applied."""
    from . import megatron_cpu

    silence_expected_cpu_warnings()  # before the shims import Megatron-Core's optimizer modules
    return megatron_cpu.apply()


# SGLang's server sets NCCL_CUMEM_ENABLE=0 for itself when it is unset (entrypoints/engine.py,
# _set_envs_and_config) while NCCL's own default is 1, and NCCL reads it once per process: a trainer
# left at the default would set up its update-group communicator with the server under the other
# memory scheme (what broke NCCL weight sync against vLLM's same default: SkyRL PR 143). One value for
# every member: the job's, when its environment sets one, else SGLang's.
NCCL_CUMEM_DEFAULT = "0"


def pin_nccl_cumem(env: MutableMapping[str, str]) -> str:
    """Set NCCL_CUMEM_ENABLE in `env` (a server's environment, or a trainer's os.environ before its
    first NCCL communicator) to the value every member of a weight-update group uses; returns it."""
    return env.setdefault("NCCL_CUMEM_ENABLE", NCCL_CUMEM_DEFAULT)


def sglang_cpu_env(base: dict[str, str] | None = None, tp_size: int = 1) -> dict[str, str]:
    """Environment for launching an SGLang server; CPU additions only when there is no GPU."""
    env = dict(os.environ if base is None else base)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    pin_nccl_cumem(env)
    if has_cuda():
        return env
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    paths = [str(SGL_KERNEL_STUB_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if tp_size > 1:  # SGLang's CPU engine allows one TP rank per NUMA node unless told which cores each takes
        env.setdefault("SGLANG_CPU_OMP_THREADS_BIND", cpu_threads_bind(tp_size))
    return env


def run_on_cores(cores: tuple[int, ...], sglang_tp: int | None = None) -> tuple[int, ...]:
    """Every thread of this process, and every process it starts, on `cores`, with one torch/OpenMP
    thread per core (OMP_NUM_THREADS for children). `sglang_tp`: this process launches an SGLang
    server of that many TP ranks, whose OpenMP threads SGLang binds itself on some CPUs (AMX, arm64):
    told to bind them within `cores` (SGLANG_CPU_OMP_THREADS_BIND), split between its ranks. Cores
    outside this process's affinity (a launcher's binding or per-task cpuset) are left out: with none
    left it stays where it is. Returns the cores it runs on."""
    cores = tuple(c for c in cores if c in os.sched_getaffinity(0)) or tuple(sorted(os.sched_getaffinity(0)))
    move_processes([os.getpid()], cores)
    os.environ["OMP_NUM_THREADS"] = str(threads_per_rank(sglang_tp or 1))
    torch.set_num_threads(len(cores))
    if sglang_tp is not None:
        os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = cpu_threads_bind(sglang_tp)
    return cores


def process_table() -> list[tuple[int, int, int]]:
    """(pid, parent pid, process group) of every process now living, from /proc/*/stat (read after
    the command name, which may hold spaces)."""
    table = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # gone meanwhile
        fields = stat[stat.rindex(")") + 2:].split()
        table.append((int(entry.name), int(fields[1]), int(fields[2])))
    return table


def process_group(pgid: int, title: str = "") -> list[int]:
    """Pids of process group `pgid` whose command line starts with `title` (every member with "")."""
    members = []
    for pid, _, group in process_table():
        if group != pgid:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone meanwhile
        if cmdline.startswith(title):
            members.append(pid)
    return members


def move_processes(pids: list[int], cores: tuple[int, ...] | set[int]) -> int:
    """Every thread of each of `pids` onto `cores` (sched_setaffinity of a pid moves its main thread
    only); returns the threads moved."""
    moved = 0
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue  # gone meanwhile
        for tid in tids:
            try:
                os.sched_setaffinity(int(tid), cores)
                moved += 1
            except OSError:  # a thread that ended meanwhile
                pass
    return moved


def threads_per_rank(ranks: int) -> int:
    """This process's cores split evenly between `ranks` processes (at least one thread each)."""
    return max(1, len(os.sched_getaffinity(0)) // ranks)


def cpu_threads_bind(ranks: int) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND value splitting this process's cores between `ranks` TP ranks
    ("0-3|4-7"); with fewer cores than ranks, ranks share cores round-robin."""
    cores = sorted(os.sched_getaffinity(0))
    per = threads_per_rank(ranks)
    spans = []
    for i in range(ranks):
        chunk = cores[(i * per) % len(cores):][:per]
        spans.append(f"{chunk[0]}-{chunk[-1]}" if len(chunk) > 1 else str(chunk[0]))
    return "|".join(spans)


def _module_available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _te_rope_fusion_available() -> bool:
    # what TransformerConfig itself checks for apply_rope_fusion (TE >= 1.4's fused RoPE)
    try:
        from megatron.core.models.common.embeddings import rope_utils
    except Exception:  # a broken TE install must not take the unfused path down
        return False
    return rope_utils.fused_apply_rotary_pos_emb is not None or rope_utils.fused_apply_rotary_pos_emb_thd is not None


def megatron_kernel_options(*, use_te: bool, interleaved: bool) -> dict[str, bool]:
    """TransformerConfig switches for this machine (`use_te`: the Transformer Engine layer spec is used;
    `interleaved`: virtual pipeline stages).

    CPU (gloo): every fusion off (they are CUDA kernels; the unfused paths are the numerical reference),
    parameters initialised on the CPU, and no batched p2p for interleaved PP: batch_isend_irecv on gloo
    with interleaved PP=2 gives silently wrong losses (ENVIRONMENT.md).
    CUDA: Megatron-LM's training defaults, each only where its kernel exists:
    - bias_dropout_fusion, bias_activation_fusion (SwiGLU): torch.compile/jit kernels, always there;
    - apply_rope_fusion: TE's fused RoPE;
    - gradient_accumulation_fusion: apex's `fused_weight_gradient_mlp_cuda` (Megatron's own
      ColumnParallelLinear, e.g. the output layer, raises without it even under the TE spec); it
      accumulates into `main_grad`, so only DDP-wrapped chunks can run a backward with it;
    - masked_softmax_fusion: the `scaled_masked_softmax_cuda` kernel (read by the local spec's
      DotProductAttention only);
    - persist_layer_norm stays off: it is apex's persistent *LayerNorm* kernel, these families use
      RMSNorm, and the local spec's torch norm asserts it off.
    """
    if not has_cuda():
        return {"bias_dropout_fusion": False, "bias_activation_fusion": False, "apply_rope_fusion": False,
                "gradient_accumulation_fusion": False, "masked_softmax_fusion": False,
                "persist_layer_norm": False, "batch_p2p_comm": not interleaved,
                "use_cpu_initialization": True}
    return {"bias_dropout_fusion": True, "bias_activation_fusion": True,
            "apply_rope_fusion": use_te and _te_rope_fusion_available(),
            "gradient_accumulation_fusion": _module_available("fused_weight_gradient_mlp_cuda"),
            "masked_softmax_fusion": _module_available("scaled_masked_softmax_cuda"),
            "persist_layer_norm": False, "batch_p2p_comm": True, "use_cpu_initialization": False}
