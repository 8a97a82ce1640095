"""The `algo` section: loss, advantages, KL and off-policy corrections (megatron_rl.algo)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_rl.config.tree import check


@dataclass
class AlgoConfig:
    """Loss and advantage settings (megatron_rl.algo)."""

    eps_low: float = 0.2
    eps_high: float = 0.28  # clip-higher (Magistral uses 0.26-0.28)
    # Advantage normalisation after group centring: `minibatch` (Magistral: (A - mean) / std over each
    # optimizer minibatch), `group` (GRPO: divided by the std of the sample's own group), `none`.
    adv_norm: Literal["minibatch", "group", "none"] = "minibatch"
    # Weighting of the minibatch mean/std: each token counts (`token`) or each sequence (`sequence`).
    adv_norm_weighting: Literal["token", "sequence"] = "token"
    drop_non_diverse_groups: bool = True
    # Optional KL(policy || reference) with a true gradient; off by default as in Magistral. The reference
    # is a frozen copy of the initial weights on the trainer ranks. k2: sequence-level k2 loss added to the
    # surrogate; reward: kl_coef * sum_t (log pi - log ref) subtracted from each sample's reward (score function).
    kl_mode: Literal["none", "k2", "reward"] = "none"
    kl_coef: float = 0.0  # KL weight; 0 with a kl_mode only measures the KL (metric `kl`), without a penalty
    # Copy the current weights into the reference every N updates (0: the reference stays the initial weights).
    kl_ref_refresh_every: int = 0
    # Anchor of the importance ratio. behaviour: the generator's logprobs (Magistral). trainer: the decoupled
    # objective: the trainer's logprobs of the weights at the start of the update (one extra forward pass),
    # with the behaviour mismatch as a per-token weight exp(proximal - behaviour), truncated at tis_cap.
    proximal: Literal["behaviour", "trainer"] = "behaviour"
    # Truncation of importance weights (None = off): of exp(proximal - behaviour) with proximal: trainer,
    # else of each token's ratio pi / pi_behaviour in its gradient. The cap of token_tis and sequence_tis.
    tis_cap: float | None = None
    # Importance-sampling correction of the trainer/generator mismatch (docs/algo.md "Corrections"):
    # token_tis: each token's weight truncated at tis_cap (null: no correction); token_mask: tokens whose
    # ratio leaves [mask_ratio_low, mask_ratio_high] are masked out of the loss; sequence_tis: every token
    # weighted by its sequence's geometric-mean ratio, truncated at tis_cap (needs proximal: trainer).
    is_correction: Literal["token_tis", "token_mask", "sequence_tis"] = "token_tis"
    mask_ratio_low: float = 0.5  # token_mask band on exp(trainer - generator logprob)
    mask_ratio_high: float = 2.0  # its upper end (tokens above it are masked too)
    # Advantage estimator for pass@k training (None = plain pass@1 / GRPO).
    pass_at_k: int | None = None
    # Entropy bonus: entropy_coef x the token-mean policy entropy is subtracted from the loss (maximised).
    # 0 = off (Magistral found it unstable and uses clip-higher instead; docs/experiments.md).
    entropy_coef: float = 0.0
    # MoE routing replay (R3, docs/train.md "Routing replay"): the generators return the experts their
    # routers chose for every position, and the trainer's routers use those experts in every pass (gates
    # recomputed by the current router over them). MoE models only (refused for a dense one).
    routing_replay: bool = False
    # On-policy distillation (docs/algo.md "Distillation"): a frozen teacher on the trainer ranks, an HF
    # model named like trainer.model with the student's tokenizer; null = none. Each sampled token's
    # advantage gains distill_coef * (log teacher - log student at the update start).
    teacher: str | None = None
    distill_coef: float = 0.0  # weight of the teacher term; 0 with a teacher only measures distill/teacher_kl
    # Train on the teacher term alone: the verifier reward's advantage is dropped (rewards are still graded and
    # logged). Needs drop_non_diverse_groups: false, since equal-reward groups carry a teacher signal too.
    distill_only: bool = False

    def validate(self, key: str) -> None:
        check(0.0 <= self.eps_low < 1.0, f"{key}.eps_low", "must lie in [0, 1)")
        check(self.eps_high >= 0.0, f"{key}.eps_high", "must be >= 0")
        check(self.kl_coef >= 0.0, f"{key}.kl_coef", "must be >= 0")
        check(self.kl_mode != "none" or self.kl_coef == 0, f"{key}.kl_coef",
               "has no effect with kl_mode: none (choose k2 or reward)")
        check(self.kl_ref_refresh_every >= 0, f"{key}.kl_ref_refresh_every", "must be >= 0 (0 = never)")
        check(self.tis_cap is None or self.tis_cap >= 1.0, f"{key}.tis_cap", "must be >= 1 or null")
        check(0.0 < self.mask_ratio_low <= 1.0, f"{key}.mask_ratio_low", "must lie in (0, 1]")
        check(self.mask_ratio_high >= 1.0, f"{key}.mask_ratio_high", "must be >= 1")
        check(self.is_correction != "token_mask" or self.tis_cap is None, f"{key}.tis_cap",
               "has no effect with is_correction: token_mask (the band bounds the weights): set it to null")
        check(self.is_correction != "sequence_tis" or self.proximal == "trainer", f"{key}.is_correction",
               "sequence_tis weighs sequences by the trainer/generator ratio at the update start: it needs "
               "algo.proximal: trainer")
        check(self.pass_at_k is None or self.pass_at_k >= 1, f"{key}.pass_at_k", "must be >= 1 or null")
        check(self.entropy_coef >= 0.0, f"{key}.entropy_coef", "must be >= 0 (0 = no entropy bonus)")
        self._validate_distillation(key)

    def _validate_distillation(self, key: str) -> None:
        check(self.teacher is None or bool(str(self.teacher).strip()), f"{key}.teacher",
              "must name a model (an HF directory, a cached hub id or smollm2-135m) or be null")
        check(self.distill_coef >= 0.0, f"{key}.distill_coef", "must be >= 0 (0 = measure the teacher KL only)")
        check(self.teacher is not None or self.distill_coef == 0, f"{key}.distill_coef",
              "has no effect without algo.teacher (the model to distil from)")
        if not self.distill_only:
            return
        check(self.distill_coef > 0, f"{key}.distill_only",
              "drops the verifier reward's advantage: it needs algo.teacher and algo.distill_coef > 0")
        check(not self.drop_non_diverse_groups, f"{key}.distill_only",
              "trains on the teacher term alone, which equal-reward groups carry too: set "
              "algo.drop_non_diverse_groups: false")
        check(self.kl_mode != "reward", f"{key}.distill_only",
              "drops the reward-side advantage that kl_mode: reward adjusts: use kl_mode: k2 or none")
