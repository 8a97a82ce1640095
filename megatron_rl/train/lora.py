"""LoRA adapters inside Megatron-Core's tensor-parallel linear layers (`trainer.lora`, docs/train.md "LoRA").

API:
- `LoraSpec.from_config(trainer.lora)`: rank r, alpha, dropout, targets; `scale = alpha / r` (PEFT's).
- `check_model(spec, dims, use_te, recompute)`: ConfigError (one line naming the key) for a rank larger
  than a projection, LoRA on MoE experts, on the Transformer Engine spec, or dropout under full recompute.
- `attach(chunk, spec, seed)`: freezes every base parameter of a built GPTModel chunk and gives each
  targeted linear layer two trainable parameters, `lora_A` and `lora_B`, plus a forward hook adding
  `scale * B A x` to its output. Call before DDP/Float16Module wrap the chunk (they see the flags).
- `is_adapter_param(name)`, `merged_weight(layer, weight)`: what `hf_weights` needs to skip the adapters
  when loading HF weights and to export `W + scale * B A` (the weight push and the merged HF model).
- `record(chunks)`: the spec as plain values (checkpoints store it and refuse a mismatch).

Fused layouts. Megatron fuses PEFT's separate projections: linear_qkv holds, per KV group g on this TP
rank, [q heads of g; k_g; v_g] rows; linear_fc1 holds [gate_r; up_r] (this rank's halves). An adapter
equal to PEFT's separate q/k/v (gate/up) adapters therefore has one A block per projection,
`lora_A = [A_q; A_k; A_v]` ([P*r, in], P projections), and a block-structured B: `lora_B` has the base
weight's rows in the base weight's fused order ([out_local, r]), and row i of it only ever multiplies
the A block of the projection row i belongs to. Storing B in the weight's own row order means it is
sharded, padded (TP padding of KV groups / MLP width: zero rows that get zero gradients) and resharded
exactly like the weight.

Tensor parallel (Megatron's layouts of the base weight, and which reduction makes each term whole):
- column-parallel (linear_qkv, linear_fc1): A replicated, B split on the output dim like W. h = A x is
  the same on every TP rank; `copy_to_tensor_model_parallel_region(h)` all-reduces dL/dh in the backward,
  since each rank's B_local sees only its output rows (this completes A's and x's gradients). Under
  sequence parallel x holds 1/TP of the tokens: h is all-gathered over the sequence (backward: reduce-
  scatter), and A's gradient, a sum over this rank's tokens only, is tagged `sequence_parallel` so
  finalize_model_grads sums it over TP as it does for the norms.
- row-parallel (linear_proj, linear_fc2): A split on the input dim like W, B replicated. h_partial =
  A_local x_local is a partial sum over the input shards and is reduced the way the base output is:
  all-reduce, or reduce-scatter over the sequence under sequence parallel. The reduction runs on the
  rank-r h rather than on the [.., hidden] B h (r << hidden: less traffic, and B's gradient then needs
  no extra all-reduce); under sequence parallel B sees 1/TP of the tokens and is tagged like A above.
Pipeline, data and context parallel need nothing: adapters live in each stage's layers, DDP reduces
their gradients over DP x CP like any parameter, and a LoRA product is per token.

Initialisation (PEFT's): A ~ U(-1/sqrt(in), 1/sqrt(in)) per projection (kaiming_uniform, a=sqrt(5)),
B = 0, so the adapted model starts as the base. A is drawn in the HF shape of each projection from a
generator seeded by (seed, layer, projection) and then padded and sharded: every layout starts from
the same adapters.

Dropout (PEFT's lora_dropout) applies to the adapter's input in passes that build a graph (the
training step), not in logprob passes under no_grad (proximal, reference); masks come from Megatron's
RNG tracker so that TP ranks holding the same tokens draw the same mask. Full recompute re-runs a
layer's first no_grad forward with gradients, which would draw a mask only the second time: refused.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megatron_rl.config import ConfigError
from megatron_rl.config.trainer import LORA_PEFT_MODULES, LORA_TARGETS
from megatron_rl.train import lora_rules

ADAPTER_PARAMS = ("lora_A", "lora_B")
# Megatron layer -> (its module path inside a transformer layer, PEFT's projections in fused order)
_PATHS = {"linear_qkv": "self_attention.linear_qkv", "linear_proj": "self_attention.linear_proj",
          "linear_fc1": "mlp.linear_fc1", "linear_fc2": "mlp.linear_fc2"}
TARGETS = {t: (_PATHS[t], projections) for t, projections in LORA_PEFT_MODULES.items()}
COLUMN_PARALLEL = ("linear_qkv", "linear_fc1")


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = LORA_TARGETS

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_config(cls, lora_config) -> "LoraSpec | None":
        """None when LoRA is off (rank 0)."""
        if lora_config.rank == 0:
            return None
        return cls(lora_config.rank, float(lora_config.alpha), float(lora_config.dropout),
                   tuple(lora_config.target_modules))

    def record(self) -> dict[str, Any]:
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout, "targets": list(self.targets)}


@dataclass(frozen=True)
class _Geometry:
    """How one adapted layer's local shard is laid out (see the module docstring)."""

    target: str
    column: bool
    groups: int  # column: row blocks repeating [part 0; part 1; ...] (KV groups of this rank; fc1: 1)
    sizes: tuple[int, ...]  # column: rows of each projection inside one block
    rank: int
    scale: float
    dropout: float
    sequence_parallel: bool


def is_adapter_param(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in ADAPTER_PARAMS


def projection_shapes(target: str, dims) -> list[tuple[str, int, int]]:
    """(PEFT projection, in_features, out_features) of the HF layers a Megatron target stands for."""
    return lora_rules.projection_shapes(target, dims.hidden_size, dims.num_heads * dims.head_dim,
                                        dims.num_kv_heads * dims.head_dim, dims.ffn_size)


def check_model(spec: LoraSpec, dims, use_te: bool = False, recompute: str = "none") -> None:
    """ConfigError naming the key when this model / layer spec cannot take these adapters."""
    if use_te:
        raise ConfigError("trainer.lora: LoRA on the Transformer Engine layer spec (its fused norm+linear "
                          "layers) is not supported yet; on GPU run without TE (MEGATRON_RL_GPU_TE=0)")
    problems = lora_rules.lora_problems(spec.rank, spec.targets, spec.dropout, recompute,
                                        None if dims.moe is None else dims.model_type, dims.hidden_size,
                                        dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim,
                                        dims.ffn_size)
    if problems:
        raise ConfigError(problems[0])


def _tp_size_rank() -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()


def _kaiming_a(rank: int, fan_in: int, seed: int, layer: int, proj_index: int, target_index: int) -> torch.Tensor:
    """PEFT's A init, U(-1/sqrt(fan_in), 1/sqrt(fan_in)), from a generator the layout does not change."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + layer * 101 + target_index * 7 + proj_index)
    bound = 1.0 / math.sqrt(fan_in)
    return (torch.rand(rank, fan_in, generator=g, dtype=torch.float64) * 2 - 1).mul_(bound).float()


def padded_row_parallel_a(target: str, a: torch.Tensor, dims) -> torch.Tensor:
    """A of linear_proj / linear_fc2 in PEFT's shape -> Megatron's TP=1 padded input layout (zero
    columns for padded heads / MLP width, whose inputs are zero)."""
    r = a.shape[0]
    if target == "linear_proj":
        kv, kvp, width = dims.num_kv_heads, dims.padded_num_kv_heads, dims.heads_per_group * dims.head_dim
        grouped = a.reshape(r, kv, width)
        return torch.cat([grouped, grouped.new_zeros(r, kvp - kv, width)], 1).reshape(r, kvp * width)
    return torch.cat([a, a.new_zeros(r, dims.padded_ffn_size - dims.ffn_size)], 1)


def _geometry(target: str, dims, spec: LoraSpec, tp: int, sequence_parallel: bool) -> _Geometry:
    if target == "linear_qkv":
        hd = dims.head_dim
        groups, sizes = dims.padded_num_kv_heads // tp, (dims.heads_per_group * hd, hd, hd)
    elif target == "linear_fc1":
        groups, sizes = 1, (dims.padded_ffn_size // tp,) * 2
    else:
        groups, sizes = 0, ()
    return _Geometry(target, target in COLUMN_PARALLEL, groups, sizes, spec.rank, spec.scale, spec.dropout,
                     sequence_parallel)


def attach(chunk, spec: LoraSpec, seed: int) -> None:
    """Freeze `chunk` and add the adapters of `spec` to its transformer layers (see the module docstring)."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    dims = chunk.mrl_dims
    tp, tp_rank = _tp_size_rank()
    sp = bool(chunk.config.sequence_parallel)
    chunk.requires_grad_(False)
    first = chunk.decoder.layers[0].layer_number - 1 if len(chunk.decoder.layers) else 0
    for local, layer in enumerate(chunk.decoder.layers):
        for target in spec.targets:
            path, _ = TARGETS[target]
            linear = layer.get_submodule(path)
            weight = linear.weight
            geo = _geometry(target, dims, spec, tp, sp)
            a_parts = [_kaiming_a(spec.rank, fan_in, seed, first + local, p, LORA_TARGETS.index(target))
                       for p, (_, fan_in, _) in enumerate(projection_shapes(target, dims))]
            if geo.column:  # A whole on every TP rank, B: the weight's local rows
                a = torch.cat(a_parts)
                b = torch.zeros(weight.shape[0], spec.rank)
            else:  # A: this rank's input columns, B whole
                a = padded_row_parallel_a(target, a_parts[0], dims).chunk(tp, dim=1)[tp_rank]
                b = torch.zeros(weight.shape[0], spec.rank)
            kw = dict(device=weight.device, dtype=weight.dtype)
            linear.lora_A = torch.nn.Parameter(a.to(**kw).contiguous())
            linear.lora_B = torch.nn.Parameter(b.to(**kw))
            sharded = linear.lora_B if geo.column else linear.lora_A
            set_tensor_model_parallel_attributes(sharded, True, 0 if geo.column else 1, 1)
            if sp:  # the whole parameter sees only this rank's tokens: summed over TP by finalize_model_grads
                (linear.lora_A if geo.column else linear.lora_B).sequence_parallel = True
            linear.mrl_lora = geo
            linear.register_forward_hook(_add_adapter_output)
            _shard_adapters_in_checkpoints(linear, geo)
    chunk.mrl_lora = spec


def _dropout(x: torch.Tensor, geo: _Geometry, tp_distinct: bool) -> torch.Tensor:
    if geo.dropout == 0 or not torch.is_grad_enabled():
        return x
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_data_parallel_rng_tracker_name

    tracker = get_cuda_rng_tracker()
    # the model-parallel stream differs per TP rank (their tokens or features differ); the data-parallel
    # one is the same on every TP rank, as the mask of a replicated input must be
    with tracker.fork() if tp_distinct else tracker.fork(get_data_parallel_rng_tracker_name()):
        return F.dropout(x, geo.dropout, training=True)


def _delta(linear, x: torch.Tensor) -> torch.Tensor:
    """scale * B A x for this rank's part of the layer's output (see the module docstring)."""
    from megatron.core.tensor_parallel import mappings

    geo: _Geometry = linear.mrl_lora
    if geo.column:
        h = F.linear(_dropout(x, geo, tp_distinct=geo.sequence_parallel), linear.lora_A)
        if geo.sequence_parallel:
            h = mappings.gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True)
        else:
            h = mappings.copy_to_tensor_model_parallel_region(h)
        blocks = linear.lora_B.view(geo.groups, sum(geo.sizes), geo.rank).split(geo.sizes, dim=1)
        outs = [F.linear(h_p, b_p.reshape(-1, geo.rank)).unflatten(-1, (geo.groups, size))
                for h_p, b_p, size in zip(h.split(geo.rank, dim=-1), blocks, geo.sizes)]
        y = torch.cat(outs, dim=-1).flatten(-2)  # back to the fused row order
    else:
        h = F.linear(_dropout(x, geo, tp_distinct=True), linear.lora_A)
        if geo.sequence_parallel:
            h = mappings.reduce_scatter_to_sequence_parallel_region(h)
        else:
            h = mappings.reduce_from_tensor_model_parallel_region(h)
        y = F.linear(h, linear.lora_B)
    return y * geo.scale


def _add_adapter_output(linear, args, output):
    out, bias = output
    return out + _delta(linear, args[0]).to(out.dtype), bias


@torch.no_grad()
def merged_weight(linear, weight: torch.Tensor) -> torch.Tensor:
    """This rank's shard of W + scale * B A (in float32 arithmetic, returned in W's dtype); `weight`
    unchanged for a layer without adapters."""
    geo: _Geometry | None = getattr(linear, "mrl_lora", None)
    if geo is None:
        return weight
    a, b = linear.lora_A.float(), linear.lora_B.float()
    if geo.column:
        blocks = b.view(geo.groups, sum(geo.sizes), geo.rank).split(geo.sizes, dim=1)
        parts = [b_p @ a_p for b_p, a_p in zip(blocks, a.split(geo.rank, dim=0))]  # [groups, size, in]
        delta = torch.cat(parts, dim=1).reshape(weight.shape)
    else:
        delta = b @ a
    return (weight.float() + geo.scale * delta).to(weight.dtype)


def _shard_adapters_in_checkpoints(linear, geo: _Geometry) -> None:
    """The layer's sharded_state_dict marks lora_B (column) / lora_A (row) as split over TP like the
    weight (Megatron's own would store them as replicated), fc1's B with the SwiGLU gate/up split."""
    from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint

    base = linear.sharded_state_dict
    name, axis = ("lora_B", 0) if geo.column else ("lora_A", 1)

    def sharded_state_dict(prefix="", sharded_offsets=(), metadata=None):
        sd = base(prefix, sharded_offsets, metadata)
        key = f"{prefix}{name}"
        sd[key] = make_tp_sharded_tensor_for_checkpoint(getattr(linear, name), key, axis,
                                                        prepend_offsets=sharded_offsets)
        if geo.target == "linear_fc1":  # [gate_r; up_r] rows: stored as gate and up, like fc1's weight
            from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

            sd[key] = apply_swiglu_sharded_factory(sd[key], sharded_offsets,
                                                   (metadata or {}).get("singleton_local_shards", False))
        return sd

    linear.sharded_state_dict = sharded_state_dict


def record(chunks: list) -> dict[str, Any] | None:
    spec = getattr(chunks[0], "mrl_lora", None) if chunks else None
    return spec.record() if spec is not None else None


def spec_of(chunks: list) -> LoraSpec | None:
    return getattr(chunks[0], "mrl_lora", None) if chunks else None
