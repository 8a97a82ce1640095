"""The frozen reference policy of the KL term, on the trainer ranks.

Same architecture, parallel layout and dtype as the policy (its own GPTModel chunks, no DDP, no
optimizer, no gradients), so its logprobs run through the very packed micro-batches and pipeline
schedule of the step (`train.step.collect_logprobs`). It starts as a copy of the policy's initial
weights and, with `algo.kl_ref_refresh_every: N`, takes a copy of the current weights every N
updates. It is saved in trainer checkpoints only when it can differ from the initial weights
(refreshing), since otherwise a resumed run rebuilds it from the model it starts from.
"""
from __future__ import annotations

import torch


class ReferencePolicy:
    def __init__(self, policy_chunks: list, hf_config, layout, dtype: torch.dtype):
        from megatron_rl.train.model import build_model

        # the policy's LoRA adapters too (lora.attach): its state dict, copied below, holds them. They
        # start at B = 0, so the initial reference is the base model
        self.chunks = build_model(hf_config, layout, dtype, lora=getattr(policy_chunks[0], "mrl_lora", None))
        for chunk in self.chunks:
            chunk.requires_grad_(False)
            chunk.eval()
        self.copy_from(policy_chunks, version=0)

    @torch.no_grad()
    def copy_from(self, policy_chunks: list, version: int) -> None:
        """Take the current weights of the (bare) policy chunks; `version` is the policy version."""
        if len(policy_chunks) != len(self.chunks):
            raise ValueError(f"{len(policy_chunks)} policy chunks for {len(self.chunks)} reference chunks")
        for ref, policy in zip(self.chunks, policy_chunks):
            ref.load_state_dict(policy.state_dict(), strict=True)
        self.version = version

    def maybe_refresh(self, policy_chunks: list, version: int, every: int) -> bool:
        """Copy the policy when `every` > 0 and `version` is a multiple of it; True if it did."""
        if every > 0 and version % every == 0 and version != self.version:
            self.copy_from(policy_chunks, version)
            return True
        return False
