"""What LoRA adapters (`trainer.lora`) cannot be put on, from the model's shapes alone: the one list of
refusals that the trainer raises (train/lora.check_model) and `plan` reports (plan/lora_memory.problems).
Plain ints and names only, no torch, so that `plan` and `estimate` import it cheaply (as train/moe.py's
layout checks)."""
from __future__ import annotations

MLP = ("linear_fc1", "linear_fc2")


def projection_shapes(target: str, hidden: int, q_out: int, kv_out: int, ffn: int) -> list[tuple[str, int, int]]:
    """(PEFT projection, in_features, out_features) of the HF layers a Megatron target stands for."""
    return {"linear_qkv": [("q_proj", hidden, q_out), ("k_proj", hidden, kv_out), ("v_proj", hidden, kv_out)],
            "linear_proj": [("o_proj", q_out, hidden)],
            "linear_fc1": [("gate_proj", hidden, ffn), ("up_proj", hidden, ffn)],
            "linear_fc2": [("down_proj", ffn, hidden)]}[target]


def lora_problems(rank: int, targets: tuple[str, ...], dropout: float, recompute: str, moe: str | None,
                  hidden: int, q_out: int, kv_out: int, ffn: int) -> list[str]:
    """One line per refusal, each naming its trainer.lora key: dropout under full recompute, MLP targets
    on an MoE model (`moe`: its model type, "" when unknown; None for a dense model), and the first
    projection smaller than the rank."""
    out = []
    if recompute == "full" and dropout > 0:
        out.append("trainer.lora.dropout: > 0 with trainer.recompute: full is not supported (the recomputed "
                   "forward would draw another dropout mask); use dropout 0 or selective")
    experts = [t for t in targets if t in MLP]
    if moe is not None and experts:
        model = f" ({moe})" if moe else ""
        out.append(f"trainer.lora.target_modules: {', '.join(experts)} on an MoE model{model} would adapt the "
                   "experts, which LoRA does not support yet; target linear_qkv / linear_proj")
    for target in targets:
        for proj, fan_in, fan_out in projection_shapes(target, hidden, q_out, kv_out, ffn):
            if rank > min(fan_in, fan_out):
                return out + [f"trainer.lora.rank: {rank} exceeds {target}'s {proj} ({fan_in} -> {fan_out}): "
                              f"the rank must be <= {min(fan_in, fan_out)}"]
    return out
