"""LoRA adapters in HF PEFT's layout <-> this rank's Megatron shards (train/lora.py), and PEFT adapter folders.

- `load_adapter_tensors(chunks, tensors)`: copy PEFT-named adapters (`base_model.model.model.layers.{i}.
  self_attn.q_proj.lora_A.weight`, ... as `adapter_model.safetensors` stores them) into the chunks.
- `export_adapter_tensors(chunks, grads=False)`: yield (PEFT name, full tensor) of this stage's adapters,
  TP-gathered and padding removed (or their gradients); collective over TP like `hf_weights.export_hf_tensors`.
- `peft_config(spec, base_model)`: the adapter_config.json PEFT reads; `gather_peft_tensors(chunks)`: collective,
  the whole model's adapters on rank 0 (the adapter push sends them); `write_peft_adapter(chunks, out_dir,
  base_model)`: collective, rank 0 writes adapter_config.json + adapter_model.safetensors.

PEFT keeps one A [r, in] and one B [out, r] per projection; the fused Megatron adapters hold the same
numbers (lora.py): column layers A = [A_q; A_k; A_v] (or [A_gate; A_up]) and B in the fused weight's row
order, which is the order `hf_weights` maps a fused weight in, so the weight mapping is reused for B
(its rows are the weight's rows, only the width differs).
"""
from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from . import hf_weights
from .lora import COLUMN_PARALLEL, TARGETS, LoraSpec, padded_row_parallel_a, projection_shapes, spec_of
from .model import layer_offset

PEFT_PREFIX = "base_model.model."
_FUSED_KIND = {"linear_qkv": "qkv", "linear_fc1": "fc1"}  # hf_weights' kinds of the fused weights


def hf_module(layer: int, proj: str) -> str:
    """HF module name of projection `proj` of layer `layer` (model.layers.3.self_attn.q_proj)."""
    block = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return f"model.layers.{layer}.{block}.{proj}"


def peft_name(layer: int, proj: str, which: str) -> str:
    """The key PEFT saves for `which` ("A" or "B") of `proj` in adapter_model.safetensors."""
    return f"{PEFT_PREFIX}{hf_module(layer, proj)}.lora_{which}.weight"


def _adapted_layers(chunk) -> Iterator[tuple[int, str, torch.nn.Module]]:
    """(global layer index, target, linear module) of every adapter in the chunk."""
    spec: LoraSpec = chunk.mrl_lora
    offset = layer_offset(chunk)
    for local, layer in enumerate(chunk.decoder.layers):
        for target in spec.targets:
            yield offset + local, target, layer.get_submodule(TARGETS[target][0])


def _tp() -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()


@torch.no_grad()
def load_adapter_tensors(chunks: list, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy PEFT-named adapters into this rank's adapters (every adapter is written; shapes checked)."""
    tp, rank = _tp()
    for chunk in chunks:
        dims = chunk.mrl_dims
        for layer, target, linear in _adapted_layers(chunk):
            projs = [p for p, _, _ in projection_shapes(target, dims)]
            if target in COLUMN_PARALLEL:
                a = torch.cat([tensors[peft_name(layer, p, "A")] for p in projs])

                def get(hf_name: str) -> torch.Tensor:  # the fused weight's HF parts, B in their place
                    return tensors[f"{PEFT_PREFIX}{hf_name.removesuffix('.weight')}.lora_B.weight"]

                kind = _FUSED_KIND[target]
                b = hf_weights._shard(kind, 0, hf_weights._full_megatron(kind, layer, get, dims), tp, rank)
            else:
                a = padded_row_parallel_a(target, tensors[peft_name(layer, projs[0], "A")], dims)
                a = a.chunk(tp, dim=1)[rank]
                b = tensors[peft_name(layer, projs[0], "B")]
            for param, value, which in ((linear.lora_A, a, "A"), (linear.lora_B, b, "B")):
                if value.shape != param.shape:
                    raise ValueError(f"layer {layer} {target} lora_{which}: PEFT shape {tuple(value.shape)} != "
                                     f"Megatron {tuple(param.shape)} (another rank or model?)")
                param.copy_(value.to(dtype=param.dtype, device=param.device))


def _value(param: torch.Tensor, grads: bool) -> torch.Tensor:
    if not grads:
        return param.detach()
    g = getattr(param, "main_grad", None)
    g = param.grad if g is None else g
    return torch.zeros_like(param) if g is None else g.detach()


def _all_gather(local: torch.Tensor, dim: int, tp: int) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    if tp == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=dim)


@torch.no_grad()
def export_adapter_tensors(chunks: list, grads: bool = False,
                           dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (PEFT name, full tensor) for this stage's adapters (their gradients with `grads`);
    collective over TP: every TP rank iterates to the end and gets the same tensors."""
    tp, _ = _tp()
    for chunk in chunks:
        dims = chunk.mrl_dims
        for layer, target, linear in _adapted_layers(chunk):
            projs = [p for p, _, _ in projection_shapes(target, dims)]
            a, b = _value(linear.lora_A, grads), _value(linear.lora_B, grads)
            if target in COLUMN_PARALLEL:
                kind = _FUSED_KIND[target]
                out = list(zip(projs, a.split(a.shape[0] // len(projs)), strict=True))
                full_b = hf_weights._gather(kind, 0, b, tp)
                bs = [t for _, t in hf_weights._to_hf(kind, layer, full_b, dims)]
                pairs = [(p, a_p, b_p) for (p, a_p), b_p in zip(out, bs, strict=True)]
            else:
                full_a = _all_gather(a, 1, tp)
                if target == "linear_proj":
                    width = dims.heads_per_group * dims.head_dim
                    full_a = full_a.reshape(a.shape[0], dims.padded_num_kv_heads, width)[:, :dims.num_kv_heads]
                    full_a = full_a.reshape(a.shape[0], dims.num_kv_heads * width)
                else:
                    full_a = full_a[:, :dims.ffn_size]
                pairs = [(projs[0], full_a, b)]
            for proj, a_p, b_p in pairs:
                for which, t in (("A", a_p), ("B", b_p)):
                    t = t.contiguous()
                    yield peft_name(layer, proj, which), t if dtype is None else t.to(dtype)


def peft_config(spec: LoraSpec, base_model: str) -> dict:
    """adapter_config.json for PEFT's LoraConfig (the keys it needs; it fills the rest with defaults)."""
    modules = sorted({p for t in spec.targets for p in TARGETS[t][1]})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": spec.dropout, "target_modules": modules,
            "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "init_lora_weights": True, "inference_mode": True}


def gather_peft_tensors(chunks: list, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor] | None:
    """Collective over the trainer world: every stage's adapters (PEFT names, whole: TP gathered, padding
    removed) on global rank 0 as CPU tensors; None on the other ranks. Adapters are small: they travel as
    one object per stage. Used by `write_peft_adapter` and the adapter push (sync/adapter_push.py)."""
    from megatron.core import parallel_state as ps

    if spec_of(chunks) is None:
        raise ValueError("these model chunks carry no LoRA adapters (trainer.lora.rank is 0)")
    mine = {n: t.cpu() for n, t in export_adapter_tensors(chunks, dtype=dtype)}
    if ps.get_tensor_model_parallel_rank() != 0 or ps.get_data_parallel_rank(with_context_parallel=True) != 0:
        mine = {}
    gathered = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
    if dist.is_initialized():
        dist.all_gather_object(gathered, mine)
    else:
        gathered = [mine]
    if (dist.get_rank() if dist.is_initialized() else 0) != 0:
        return None
    return {n: t for part in gathered for n, t in part.items()}


def write_peft_adapter(chunks: list, out_dir: str | Path, base_model: str,
                       dtype: torch.dtype | None = None) -> Path | None:
    """Collective over the trainer world: every stage's adapters reach global rank 0, which writes
    `out_dir/adapter_config.json` and `out_dir/adapter_model.safetensors` (returns the folder there,
    None on the other ranks)."""
    from safetensors.torch import save_file

    tensors = gather_peft_tensors(chunks, dtype)
    if tensors is None:
        return None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(peft_config(spec_of(chunks), base_model), indent=2) + "\n")
    return out
