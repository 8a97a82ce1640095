"""What LoRA (`trainer.lora`, train/lora.py) changes in the trainer's memory estimate (plan/estimate.py).

    LoraShape.from_config(trainer.lora) -> LoraShape | None (None: full-parameter training)
    adapter_params_per_layer(shapes, lora, tp) -> int      # lora_A + lora_B numel of one layer on one TP rank
    activation_terms(shapes, lora, tp, sequence_parallel) -> ActivationTerms
    problems(shapes, lora, recompute) -> list[str]         # what `plan` refuses, one line naming the key

Parameters (train/lora.py `attach`: per adapted layer an A and a B; r = rank, h = hidden, t = TP,
q = padded KV heads x heads per group x head_dim, kv = padded KV heads x head_dim, f = the MLP width
rounded up to t, padding as the model pads its weights):
    linear_qkv  column: A [3r, h] whole on every TP rank, B [(q + 2kv)/t, r]
    linear_proj row:    A [r, q/t],                       B [h, r] whole
    linear_fc1  column: A [2r, h] whole,                  B [2f/t, r]
    linear_fc2  row:    A [r, f/t],                       B [h, r] whole
At TP = 1 this is exactly what PEFT creates for q/k/v/o/gate/up/down with rank r each.

Activations (per token and layer, in elements; d = t under sequence parallel else 1). LoRA runs on the
local layer spec (Transformer Engine is refused), so these are changes to `activation_memory`'s
`kernels="local"` count, checked tensor by tensor against autograd's saved tensors
(tests/unit/test_plan_estimate_lora.py). The frozen base keeps less: Megatron's linear layers switch to
`linear_with_frozen_weight`, which keeps no input, and a norm whose weight is frozen keeps no
normalised input.
    - each norm's normalised input goes: -2h/d;
    - a norm's output (the next projection's input) stays only when that projection has an adapter
      (the adapter keeps it for A's gradient): -h/d without linear_qkv, -h/d without linear_fc1;
    - the row-parallel inputs likewise: -q/t without linear_proj, -f/t without linear_fc2;
    - the adapters' rank-r products, kept for B's gradient: +3r (qkv) +2r (fc1) whole on every TP
      rank and over all tokens (gathered under sequence parallel), +r/d (proj) +r/d (fc2);
    - dropout > 0: the dropped copy replaces the input the adapter keeps, plus the mask (1 byte per
      element on GPU, where dropout is one kernel returning a bool mask; the compute dtype on CPU):
      mask elements h/d (qkv), h/d (fc1), q/t (proj), f/t (fc2) per adapted layer;
    - per micro-batch, not per token: the fused qkv layer's B is split per projection, and when a TP
      rank holds several KV groups those per-projection views are copied: (q + 2kv)/t x r elements.
The final norm keeps only its input (h/d; the frozen output layer keeps nothing). Not counted (the
estimate stays on the safe side): the first layer's input norm keeps nothing either (the embedding is
frozen), and on MoE models the frozen experts' and router's terms stay as in full training.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.train.lora_rules import MLP, lora_problems

# Megatron's layer names as config/trainer.py LORA_TARGETS lists them (this module reads no config module)
COLUMN = ("linear_qkv", "linear_fc1")
ROW = ("linear_proj", "linear_fc2")


@dataclass(frozen=True)
class LoraShape:
    rank: int
    targets: tuple[str, ...]
    dropout: float = 0.0

    @classmethod
    def from_config(cls, lora) -> "LoraShape | None":
        """`trainer.lora` -> LoraShape, None when LoRA is off (rank 0)."""
        if not lora.rank:
            return None
        return cls(int(lora.rank), tuple(lora.target_modules), float(lora.dropout))


@dataclass(frozen=True)
class ActivationTerms:
    per_token: float  # elements per token and layer, in the compute dtype (added to the local count)
    mask_per_token: float  # dropout mask elements per token and layer (bytes: the mask's element size)
    per_layer: float  # elements per layer and micro-batch, independent of the token count
    head_per_token: float  # elements per token the final norm keeps (replaces the local 3h/d)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _widths(shapes, tp: int) -> tuple[int, int, int]:
    """(q, kv, f) on all TP ranks together, padded as train/model.py pads them."""
    kv_heads = _round_up(shapes.kv_heads, tp)
    q = kv_heads * (shapes.heads // shapes.kv_heads) * shapes.head_dim
    return q, kv_heads * shapes.head_dim, _round_up(shapes.ffn, tp)


def _check_moe(shapes, lora: LoraShape) -> None:
    experts = [t for t in lora.targets if t in MLP]
    if shapes.experts and experts:
        raise ValueError(f"trainer.lora.target_modules: {', '.join(experts)} on an MoE model would adapt the "
                         "experts, which LoRA does not support yet; target linear_qkv / linear_proj")


def adapter_params_per_layer(shapes, lora: LoraShape, tp: int = 1) -> int:
    """lora_A + lora_B elements of one transformer layer on one TP rank (see the module docstring)."""
    _check_moe(shapes, lora)
    r, h = lora.rank, shapes.hidden
    q, kv, f = _widths(shapes, tp)
    per_target = {"linear_qkv": 3 * r * h + r * (q + 2 * kv) // tp,
                  "linear_proj": r * q // tp + h * r,
                  "linear_fc1": 2 * r * h + r * 2 * f // tp,
                  "linear_fc2": r * f // tp + h * r}
    return sum(per_target[t] for t in lora.targets)


def adapter_params(shapes, lora: LoraShape) -> int:
    """Adapter parameters of the whole model (TP = 1: PEFT's count)."""
    return shapes.layers * adapter_params_per_layer(shapes, lora)


def activation_terms(shapes, lora: LoraShape, tp: int = 1, sequence_parallel: bool = False) -> ActivationTerms:
    """What LoRA adds to (negative: removes from) the local spec's activation count (module docstring)."""
    _check_moe(shapes, lora)
    t, d = tp, (tp if sequence_parallel else 1)
    h, r = shapes.hidden, lora.rank
    q, kv, f = _widths(shapes, tp)
    has = set(lora.targets)
    per_token = -2 * h / d  # both norms' normalised inputs
    per_token -= (("linear_qkv" not in has) + (not shapes.experts and "linear_fc1" not in has)) * h / d
    per_token -= ("linear_proj" not in has) * q / t + (not shapes.experts and "linear_fc2" not in has) * f / t
    products = {"linear_qkv": 3 * r, "linear_fc1": 2 * r, "linear_proj": r / d, "linear_fc2": r / d}
    inputs = {"linear_qkv": h / d, "linear_fc1": h / d, "linear_proj": q / t, "linear_fc2": f / t}
    per_token += sum(products[x] for x in has)
    mask = sum(inputs[x] for x in has) if lora.dropout > 0 else 0.0
    groups = _round_up(shapes.kv_heads, tp) // tp
    per_layer = (q + 2 * kv) / t * r if "linear_qkv" in has and groups > 1 else 0.0
    return ActivationTerms(per_token, mask, per_layer, h / d)


def problems(shapes, lora: LoraShape | None, recompute: str) -> list[str]:
    """What the trainer would refuse (train/lora.check_model), found from the model's shapes alone."""
    if lora is None:
        return []
    return lora_problems(lora.rank, lora.targets, lora.dropout, recompute, "" if shapes.experts else None,
                         shapes.hidden, shapes.heads * shapes.head_dim, shapes.kv_heads * shapes.head_dim, shapes.ffn)
