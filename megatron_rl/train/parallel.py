"""torch.distributed + Megatron-Core parallel state for the trainer (TP x CP x PP x DP, optional VPP).

API:
- `ParallelLayout(tp=1, pp=1, dp=1, vpp=None, sequence_parallel=False, cp=1)`: the layout;
  `world_size = tp * cp * pp * dp`. Context parallel (cp > 1) splits every packed sequence over the
  CP ranks (Megatron's 2*CP load-balanced chunks, see `packing.PackedMicroBatch.cp_slice`); gradients
  and token counts are reduced over DP x CP. Sequence parallel (tp > 1) splits the tokens of the norms, dropouts
  and residual stream over the TP ranks; it changes no group, only the model's TransformerConfig.
- `init_parallel(layout, backend=None, seed=1234) -> ParallelLayout`: starts torch.distributed if
  it is not running (env:// when launched by torchrun/srun-style env vars, else a 1-rank group on a
  free loopback port), applies the Megatron shims this machine needs (platform/), initialises Megatron's
  `parallel_state` and seeds the model-parallel RNG tracker. Backend: "nccl" on GPU, "gloo" on CPU.
  `dp=None`-style inference: pass `dp=0` to let it be `world_size // (tp * pp)`.
- `destroy_parallel(destroy_process_group=False)`: tears Megatron's groups down (and optionally the
  process group) so a test can re-initialise with another layout.
- `tp_group()`, `tp_rank()`, `pp_rank()`, `is_first_stage()`, `is_last_stage()`: small accessors.
"""
from __future__ import annotations

import dataclasses
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int | None = None  # virtual pipeline stages per PP rank (interleaved 1F1B); None = plain
    sequence_parallel: bool = False  # Megatron sequence parallel over the TP group (needs tp > 1)
    cp: int = 1  # context parallel: each sequence's tokens split over cp ranks
    ep: int = 1  # expert parallel (MoE): the experts split over ep ranks taken from tp x cp x dp

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"ParallelLayout.{name} must be >= 1, got {getattr(self, name)}")
        if self.dp < 0:
            raise ValueError(f"ParallelLayout.dp must be >= 1 (or 0 = infer), got {self.dp}")
        if self.vpp is not None:
            if self.vpp < 1:
                raise ValueError(f"ParallelLayout.vpp must be >= 1 or None, got {self.vpp}")
            if self.pp < 2 and self.vpp > 1:
                raise ValueError("ParallelLayout.vpp > 1 needs pp >= 2 (interleaved pipeline)")
        if self.sequence_parallel and self.tp < 2:
            raise ValueError("ParallelLayout.sequence_parallel needs tp > 1")
        if self.dp > 0 and (self.tp * self.cp * self.dp) % self.ep:
            raise ValueError(f"ParallelLayout.ep={self.ep} must divide tp*cp*dp={self.tp * self.cp * self.dp} "
                             "(expert parallel ranks are carved from them, expert TP = 1)")

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def interleaved(self) -> bool:
        return self.vpp is not None and self.vpp > 1

    @property
    def n_chunks(self) -> int:
        """Model chunks per rank (virtual stages)."""
        return self.vpp if self.interleaved else 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_parallel(layout: ParallelLayout, backend: str | None = None, seed: int = 1234) -> ParallelLayout:
    """Initialise torch.distributed (if needed) and Megatron parallel state; returns the resolved layout."""
    from megatron_rl.platform import ensure_megatron_shims

    backend = backend or default_backend()
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("backend 'nccl' needs a CUDA device; use 'gloo' on CPU")
    ensure_megatron_shims()  # the CPU ones without CUDA, the TE-less ones on a GPU without TE
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, init_method="env://")
        else:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}",
                                    rank=0, world_size=1)
    world = dist.get_world_size()
    model_ranks = layout.tp * layout.cp * layout.pp
    if layout.dp == 0:
        if world % model_ranks:
            raise ValueError(f"world size {world} is not divisible by tp*cp*pp={model_ranks}")
        layout = dataclasses.replace(layout, dp=world // model_ranks)
    if layout.world_size != world:
        raise ValueError(f"layout tp={layout.tp} x cp={layout.cp} x pp={layout.pp} x dp={layout.dp} = "
                         f"{layout.world_size} does not match the world size {world}")

    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.interleaved else None,
        expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=1,  # experts whole (moe.py)
    )
    model_parallel_cuda_manual_seed(seed)
    return layout


def destroy_parallel(destroy_process_group: bool = False) -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if destroy_process_group and dist.is_initialized():
        dist.destroy_process_group()


def tp_group():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group()


def tp_rank() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank()


def cp_size_rank() -> tuple[int, int]:
    """(size, rank) of this rank's context-parallel group; (1, 0) before init_parallel."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 1, 0
    return ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()


def dp_cp_group():
    """The group gradients and token counts are reduced over: DP x CP (DP alone when cp = 1)."""
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group(with_context_parallel=True)


def dp_sum_ints(values: list[int], device: torch.device) -> list[int]:
    """Integer counts summed over the data-parallel group (float64 on the wire: exact below 2**53)."""
    from megatron.core import parallel_state as ps

    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, group=ps.get_data_parallel_group())
    return [int(v) for v in t.tolist()]


def pp_rank() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_rank()


def is_first_stage() -> bool:
    from megatron.core import parallel_state as ps

    return ps.is_pipeline_first_stage(ignore_virtual=True)


def is_last_stage() -> bool:
    from megatron.core import parallel_state as ps

    return ps.is_pipeline_last_stage(ignore_virtual=True)
