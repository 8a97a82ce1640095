"""Shims that let the real Megatron-Core run where a piece its code assumes is missing.

Megatron-Core assumes CUDA in a handful of places (device queries, RNG tracker, hard-coded
`device="cuda"` tensors, `.type() == "torch.cuda.FloatTensor"` asserts, streams), and a few more
assume Transformer Engine or a fused Adam (the local torch norm refuses sequence parallel, the MoE
router reads a TE-only name, DistributedOptimizer checkpoints expect apex/TE Adam's state). Each
shim below works around exactly one of those and is gated (`when`) on the missing piece itself, not
on "no CUDA": a GPU without TE (MEGATRON_RL_GPU_TE=0) takes the TE-less shims and none of the CUDA
ones. Every shim also carries a `needed` probe that inspects the upstream code it works around;
`tests/unit/test_platform.py` asserts each probe still holds, so an upstream change that makes a
shim obsolete (or moves the problem) fails loudly instead of silently.

Nothing else in the package patches third-party code. Call `apply()` (idempotent) before building
Megatron models.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import sys
import types
from dataclasses import dataclass
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode


@dataclass(frozen=True)
class Shim:
    name: str
    why: str
    when: Callable[[], bool]  # this machine lacks the piece the upstream code assumes (CUDA, TE, ...)
    needed: Callable[[], bool]  # True while the upstream behaviour it works around is present
    apply: Callable[[], None]


def _no_cuda() -> bool:
    return not torch.cuda.is_available()


def _no_triton() -> bool:
    return importlib.util.find_spec("triton") is None


def _te_not_installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is None


def _local_spec() -> bool:
    # the local (torch) layer spec is what build_model takes whenever TE's spec cannot be used
    from .machine import te_available

    return not te_available()


def _source_contains(module: str, text: str) -> bool:
    try:
        return text in inspect.getsource(importlib.import_module(module))
    except (ImportError, OSError, TypeError):
        return False


# ---------------------------------------------------------------- (0) triton-only module

_PAGED_STASH = "megatron.core.transformer.moe.ops.paged_stash"


def _paged_stash_needs_stub() -> bool:
    # Decided from metadata: importing any megatron.core module here would already hit triton.
    try:
        version = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return False
    major, minor = (int(x) for x in version.split(".")[:2])
    return (major, minor) >= (0, 19)


def _stub_paged_stash() -> None:
    # megatron-core 0.19 imports triton unconditionally through this MoE module, pulled in by the
    # pipeline schedules. Register a stub for just that module (a global fake `triton` would
    # mislead torch._inductor, which probes for it).
    if _PAGED_STASH in sys.modules:
        return
    mod = types.ModuleType(_PAGED_STASH)
    mod.GLOBAL_BLOCK_SIZE = 1024

    def _needs_triton(*args, **kwargs):
        raise RuntimeError("MoE paged stash needs triton, which is absent on this CPU machine")

    mod.paged_stash_copy_kernel = mod.paged_stash_pop_kernel = _needs_triton
    sys.modules[_PAGED_STASH] = mod


# ---------------------------------------------------------------- (1) current_device

def _patch_current_device() -> None:
    # RoPE, DDP buffers and p2p shape tensors call torch.cuda.current_device(); "cpu" makes the
    # `device=torch.cuda.current_device()` they build land on the CPU.
    torch.cuda.current_device = lambda: "cpu"


# ---------------------------------------------------------------- (2) RNG tracker

def _patch_rng() -> None:
    # The model-parallel RNG tracker forks the CUDA generator (DotProductAttention always forks it).
    import megatron.core.tensor_parallel.random as mrandom

    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.random.get_rng_state = torch.cuda.get_rng_state
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)


# ---------------------------------------------------------------- (3) device="cuda", (4) .type()

def _is_cuda(device) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites `device="cuda"` to CPU and reports CPU float tensors as `torch.cuda.*` types.

    The pipeline schedules and grad clipping create tensors with a hard-coded `device="cuda"`;
    optimizer code asserts `param.type() == "torch.cuda.FloatTensor"`.
    """

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu") + tuple(args[2:])
        return func(*args, **kwargs)


_MODE: _CudaToCpuMode | None = None


def _enter_cuda_to_cpu_mode() -> None:
    # The mode stack is thread-local: this covers the thread that applies the shims (the trainer's).
    global _MODE
    if _MODE is None:
        _MODE = _CudaToCpuMode()
        _MODE.__enter__()


# ---------------------------------------------------------------- (5) synchronize, streams

class _NoOpStream:
    def __getattr__(self, name):  # wait_event / wait_stream / record_event / synchronize ...
        return lambda *args, **kwargs: None


def _patch_sync_and_streams() -> None:
    # p2p communication synchronises after batched sends; 0.19 DDP grad sync asks for the stream.
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_stream = lambda *args, **kwargs: _NoOpStream()
    torch.cuda.default_stream = lambda *args, **kwargs: _NoOpStream()


# ---------------------------------------------------------------- (6) DistributedOptimizer + torch Adam

def _patch_distopt_torch_adam() -> None:
    # Without apex/TE, DistributedOptimizer wraps torch Adam, whose per-parameter `step` tensors
    # its checkpoint code does not expect: (a) an empty fresh state asserts; (b) `step` is treated as
    # a state tensor and overwritten; (c) one loaded `step` tensor is shared by every param, so Adam
    # would increment it once per parameter.
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if getattr(DistributedOptimizer, "_megatron_rl_patched", False):
        return
    original_ssd = DistributedOptimizer.sharded_state_dict
    original_set = DistributedOptimizer._set_main_param_and_optimizer_states

    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading=False, *args, **kwargs):
        if is_loading and len(self.optimizer.state) == 0:
            self._init_optimizer_states_with_dummy_values()
        if model_sharded_state_dict is None:
            model_sharded_state_dict = {}
        return original_ssd(self, model_sharded_state_dict, is_loading, *args, **kwargs)

    def set_states(self, model_param, tensors):
        group_index, order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][order]
        state = self.optimizer.state.get(main_param, {})
        step = state.pop("step", None)
        try:
            with torch.no_grad():
                original_set(self, model_param, {k: v for k, v in tensors.items() if k != "step"})
        finally:
            if step is not None:
                state["step"] = step.detach().clone()

    DistributedOptimizer.sharded_state_dict = sharded_state_dict
    DistributedOptimizer._set_main_param_and_optimizer_states = set_states
    DistributedOptimizer._megatron_rl_patched = True


def _fused_adam_absent() -> bool:
    return (importlib.util.find_spec("apex") is None
            and importlib.util.find_spec("transformer_engine") is None)


# ---------------------------------------------------------------- (7) sequence-parallel torch norm

def _patch_torch_norm_sequence_parallel() -> None:
    # The local (torch) norm refuses sequence_parallel=True; build it anyway and tag its params
    # `sequence_parallel`, which finalize_model_grads uses to all-reduce their grads over TP.
    from megatron.core.transformer import torch_norm

    if getattr(torch_norm.WrappedTorchNorm, "_megatron_rl_patched", False):
        return
    original_new = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
        sequence_parallel = config.sequence_parallel
        config.sequence_parallel = False
        try:
            module = original_new(cls, config, hidden_size, eps, *args, **kwargs)
        finally:
            config.sequence_parallel = sequence_parallel
        if sequence_parallel:
            for param in module.parameters():
                param.sequence_parallel = True
        return module

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(new)
    torch_norm.WrappedTorchNorm._megatron_rl_patched = True


_MOE_UTILS = "megatron.core.transformer.moe.moe_utils"


def _moe_router_gemm_unbound() -> bool:
    # moe_utils binds te_general_gemm only when Transformer Engine imports, yet the router's
    # gating linear tests `te_general_gemm is not None` unconditionally (NameError without TE).
    try:
        mod = importlib.import_module(_MOE_UTILS)
    except ImportError:
        return False
    return not hasattr(mod, "te_general_gemm") and _source_contains(_MOE_UTILS, "te_general_gemm is not None")


def _bind_moe_router_gemm() -> None:
    importlib.import_module(_MOE_UTILS).te_general_gemm = None  # -> the plain torch.mm branch


SHIMS: tuple[Shim, ...] = (
    Shim("paged_stash_stub", "megatron-core 0.19 imports triton via the MoE paged stash",
         _no_triton, _paged_stash_needs_stub, _stub_paged_stash),
    Shim("current_device", "torch.cuda.current_device() used for tensor placement", _no_cuda,
         lambda: _source_contains("megatron.core.models.common.embeddings.rotary_pos_embedding",
                                  "torch.cuda.current_device()"),
         _patch_current_device),
    Shim("rng_tracker", "model-parallel RNG tracker forks the CUDA generator", _no_cuda,
         lambda: _source_contains("megatron.core.tensor_parallel.random", "torch.cuda.get_rng_state"),
         _patch_rng),
    Shim("cuda_to_cpu_mode", 'hard-coded device="cuda" tensors and torch.cuda.FloatTensor asserts', _no_cuda,
         lambda: _source_contains("megatron.core.pipeline_parallel.schedules", 'device="cuda"')
         and _source_contains("megatron.core.optimizer.clip_grads", "torch.cuda.FloatTensor"),
         _enter_cuda_to_cpu_mode),
    Shim("sync_and_streams", "torch.cuda.synchronize after batched p2p, streams in DDP", _no_cuda,
         lambda: _source_contains("megatron.core.pipeline_parallel.p2p_communication",
                                  "torch.cuda.synchronize()"),
         _patch_sync_and_streams),
    Shim("distopt_torch_adam", "DistributedOptimizer checkpoints with torch Adam (no apex/TE)", _fused_adam_absent,
         lambda: _source_contains("megatron.core.optimizer.distrib_optimizer",
                                  "_init_optimizer_states_with_dummy_values"),
         _patch_distopt_torch_adam),
    Shim("torch_norm_sequence_parallel", "local torch norm rejects sequence_parallel", _local_spec,
         lambda: _source_contains("megatron.core.transformer.torch_norm", "sequence parallel"),
         _patch_torch_norm_sequence_parallel),
    Shim("moe_router_gemm", "MoE router gating reads te_general_gemm, unbound without Transformer Engine",
         _te_not_installed, _moe_router_gemm_unbound, _bind_moe_router_gemm),
)

_APPLIED: list[str] = []


def wanted() -> list[Shim]:
    """The shims this machine needs: its gate holds (the piece is missing) and the upstream code still
    has the behaviour (`needed`); the gate is asked first, so a GPU with TE imports nothing extra."""
    return [shim for shim in SHIMS if shim.when() and shim.needed()]


def apply() -> list[str]:
    """Apply every shim this machine needs (`wanted`); returns the names applied (idempotent)."""
    if _APPLIED:
        return list(_APPLIED)
    for shim in wanted():
        shim.apply()
        _APPLIED.append(shim.name)
    return list(_APPLIED)


def applied() -> list[str]:
    return list(_APPLIED)
