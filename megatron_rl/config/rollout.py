"""The `rollout` section: sampling, the asynchronous budget and the length schedule (megatron_rl.control)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_rl.config.length_stages import length_stages
from megatron_rl.config.reward import RewardConfig
from megatron_rl.config.tree import check


@dataclass
class RolloutConfig:
    """Sampling and the asynchronous rollout budget (megatron_rl.control)."""

    group_size: int = 16  # G completions per prompt
    n_async: int = 64  # sequences in flight on the generators
    n_batch: int = 32  # finished (filtered) sequences per trainer update
    n_mini: int = 4  # optimizer steps per update (minibatches of n_batch / n_mini)
    max_new_tokens: int = 4096
    temperature: float = 1.0
    top_p: float = 1.0
    # Bound on the staleness of a trained group: the mean over its tokens of (batch version - the version that
    # sampled the token). A group is only started while it can be consumed within it: samples committed
    # (started, not yet trained) + G <= (max_staleness + 1 - batches not yet served) * n_batch (docs/control.md).
    max_staleness: int = 4
    # What happens to a group that still exceeds the bound (overtaken by shorter ones): drop: dropped and its
    # problem re-queued. reweight: kept and trained with the decoupled objective (needs algo.proximal: trainer
    # and algo.tis_cap): each token's importance weight exp(proximal - behaviour), truncated at tis_cap.
    stale_policy: Literal["drop", "reweight"] = "drop"
    # Stages by update index, "UPDATE:TOKENS" or "UPDATE:TOKENS:L_MAX:L_CACHE" (e.g. ["0:2048", "100:4096"]):
    # from update UPDATE on, requests get max_new_tokens = TOKENS and their rollouts are graded with the
    # overlong penalty window L_MAX/L_CACHE, else reward.l_max/l_cache (l_max null: = TOKENS). A rollout
    # keeps the stage it was requested under, even if graded after the switch. Before the first stage
    # (or with no schedule): max_new_tokens. Checked whenever a schedule is set or reward.l_max is null:
    # each stage's cap must end its penalty ramp, l_max - l_cache < TOKENS <= l_max (else the penalty
    # never fires, or fully hits every answer longer than l_max), unless reward.overlong_penalty is 0.
    length_schedule: list[str] = field(default_factory=list)

    def validate(self, key: str) -> None:
        check(self.group_size >= 2, f"{key}.group_size", "must be >= 2 (advantages are group-centred)")
        check(self.n_batch >= 1, f"{key}.n_batch", "must be >= 1")
        check(1 <= self.n_mini <= self.n_batch, f"{key}.n_mini", "must lie in [1, n_batch]")
        check(self.n_batch % self.n_mini == 0, f"{key}.n_mini",
               f"must divide n_batch ({self.n_batch})")
        check(self.n_async >= self.group_size, f"{key}.n_async", "must be >= group_size")
        check(self.max_new_tokens >= 1, f"{key}.max_new_tokens", "must be >= 1")
        check(self.temperature > 0, f"{key}.temperature", "must be > 0")
        check(0 < self.top_p <= 1, f"{key}.top_p", "must lie in (0, 1]")
        check(self.max_staleness >= 0, f"{key}.max_staleness", "must be >= 0")
        # entry syntax and distinct starts (the windows are checked against reward by Config.validate)
        length_stages(self.length_schedule, self.max_new_tokens, RewardConfig(), key)
