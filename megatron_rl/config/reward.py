"""The `reward` section: Magistral's reward composition and the verifiers' limits (megatron_rl.reward)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_rl.config.tree import check


@dataclass
class RewardConfig:
    """Magistral's reward composition (megatron_rl.reward); every number is configurable."""

    format_reward: float = 0.1  # granted once the format gate passes
    correct_reward: float = 0.9
    # Soft overlong penalty (DAPO): 0 up to l_max - l_cache, linear to -overlong_penalty at l_max.
    # null: l_max is the generation cap the rollout was sampled with (rollout.max_new_tokens or its
    # length_schedule stage), so the penalty follows the cap; a stage may also set its own window.
    l_max: int | None = 4096
    # Width of the penalty ramp before l_max (clamped to l_max when l_max is null).
    l_cache: int = 512
    overlong_penalty: float = 0.1
    language_reward: float = 0.1
    language_check: bool = True
    language_window_letters: int = 60  # letters per window of the language check (CJK char = 4); longer clauses are judged in sliding windows, so a mid-sentence switch is caught
    math_timeout_s: float = 5.0
    math_backend: Literal["sympy", "math_verify"] = "sympy"  # math answer checker: sympy (exact rules of docs/reward.md) or math_verify (HF math-verify); same workers and math_timeout_s
    code_compile_timeout_s: float = 10.0
    code_test_timeout_s: float = 4.0
    code_max_tests: int = 20
    code_memory_mb: int = 1024
    code_max_output_bytes: int = 1 << 20
    verifier_workers: int = 2  # grading processes per verifier pool
    verifier_item_timeout_s: float = 60.0
    verifier_ranks: int = 0  # MPI ranks dedicated to grading (0: a pool inside the controller rank)
    regrade_attempts: int = 1  # times a sample whose grading failed is graded again before its group is dropped
    # A verifier rank that answers its oldest grading request not within this many seconds is hung: its items
    # go to the other verifier ranks (none left: the run stops). null: derived per request from the pool's
    # limits, 2 x verifier_item_timeout_s per round of verifier_workers items + 30 s (control/verifiers.py).
    verifier_reply_timeout_s: float | None = None
    # Reward plug-in grading in place of the built-in reward: "module:function", "path/file.py:function" or an entry point name of group megatron_rl.rewards (docs/reward.md "Add a verifier"); null: built-in
    custom: str | None = None

    def validate(self, key: str) -> None:
        check(self.l_max is None or self.l_max > 0, f"{key}.l_max", "must be > 0 or null (= the generation cap)")
        check(self.l_cache >= 0, f"{key}.l_cache", "must be >= 0")
        check(self.l_max is None or self.l_cache <= self.l_max, f"{key}.l_cache", "must lie in [0, l_max]")
        for name in ("format_reward", "correct_reward", "overlong_penalty", "language_reward"):
            check(getattr(self, name) >= 0, f"{key}.{name}", "must be >= 0")
        for name in ("math_timeout_s", "code_compile_timeout_s", "code_test_timeout_s",
                     "verifier_item_timeout_s"):
            check(getattr(self, name) > 0, f"{key}.{name}", "must be > 0")
        check(1 <= self.code_max_tests, f"{key}.code_max_tests", "must be >= 1")
        check(self.code_memory_mb >= 16, f"{key}.code_memory_mb", "must be >= 16")
        check(self.verifier_workers >= 1, f"{key}.verifier_workers", "must be >= 1")
        check(self.verifier_ranks >= 0, f"{key}.verifier_ranks", "must be >= 0")
        check(self.language_window_letters >= 10, f"{key}.language_window_letters",
               "must be >= 10 (shorter windows cannot be classified)")
        check(self.regrade_attempts >= 0, f"{key}.regrade_attempts", "must be >= 0 (0: drop the group at once)")
        check(self.verifier_reply_timeout_s is None or self.verifier_reply_timeout_s > 0,
              f"{key}.verifier_reply_timeout_s", "must be > 0 or null (derived from verifier_item_timeout_s)")
