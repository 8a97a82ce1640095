"""Magistral's reward composition for one response: format gate -> 0.1 -> +0.9 correct ->
overlong penalty -> +0.1 language consistency. Every number comes from RewardConfig, except the
penalty window a caller may override per response (`stage`: the length stage it was generated under).
A code answer whose program could not be run (no sandbox) gets status "sandbox_unavailable" and no
verdict, never ``correct=False``: an environment fault must not read as a wrong answer.

math and code verifiers are imported lazily (inside the functions) so this module, and the
language/format/length parts, import and work on their own. `score` (reward.grade) picks this or the
plug-in of reward.custom.
"""
from __future__ import annotations

import time
from typing import Any

from megatron_rl.config import LengthStage, RewardConfig
from megatron_rl.reward.format import FormatResult, check_format
from megatron_rl.reward.language import check_consistency, policy_for
from megatron_rl.reward.length import estimate_tokens, overlong_penalty
from megatron_rl.reward.types import CodeTask, GradeStatus, MathTask, RewardBreakdown, Task, parse_task


def _grade_math(task: MathTask, fmt: FormatResult, cfg: RewardConfig) -> tuple[bool, dict[str, Any]]:
    from megatron_rl.reward.math import check_response

    # the scan for the final answer runs in the math worker too, inside the same time limit
    res = check_response(fmt.answer, task.answer, timeout=cfg.math_timeout_s, backend=cfg.math_backend)
    return res.equal, {"prediction": res.prediction, "math_status": res.status}


def _grade_code(task: CodeTask, fmt: FormatResult, cfg: RewardConfig) -> tuple[bool, dict[str, Any]]:
    from megatron_rl.reward.code_task import run_task_tests

    result = run_task_tests(task, fmt.code, cfg)  # Magistral: at most 20 tests, all must pass
    details = {"code_status": str(result.status), "n_passed": int(result.n_passed), "n_tests": int(result.n_tests)}
    if not result.graded:  # the program never ran: score() reports a grading failure, not a wrong answer
        details["sandbox_error"] = result.message
    return bool(result.passed), details


def penalty_window(cfg: RewardConfig, l_max: int | None = None, l_cache: int | None = None, *,
                   stage: LengthStage | None = None) -> tuple[int, int]:
    """The (l_max, l_cache) of the overlong penalty: the length stage's window when a `stage` is given
    (the stage the response was generated under, resolved by the config: used as is), else the
    overrides where given, else the config's. A null config l_max means "the generation cap", which
    only the caller knows: it must pass l_max (or the stage). An l_cache taken from the config is
    clamped to l_max."""
    if stage is not None:
        if l_max is not None or l_cache is not None:
            raise ValueError("give the penalty window as a length stage or as l_max / l_cache, not both")
        l_max, l_cache = stage.l_max, stage.l_cache
    if l_max is None:
        l_max = cfg.l_max
        if l_max is None:
            raise ValueError("reward.l_max is null (the penalty follows the generation cap): pass l_max, the "
                             "max_new_tokens this response was generated with")
    if l_cache is None:
        l_cache = min(cfg.l_cache, l_max)
    for name, v in (("l_max", l_max), ("l_cache", l_cache)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{name} must be an int, got {v!r}")
    if l_max < 1 or not 0 <= l_cache <= l_max:
        raise ValueError(f"need l_max >= 1 and 0 <= l_cache <= l_max, got l_max={l_max}, l_cache={l_cache}")
    return l_max, l_cache


def check_response_args(response: Any, num_tokens: Any) -> None:
    if not isinstance(response, str):
        raise TypeError(f"response must be a string, got {type(response).__name__}")
    if num_tokens is not None and (isinstance(num_tokens, bool) or not isinstance(num_tokens, int)
                                   or num_tokens < 0):
        raise ValueError(f"num_tokens must be a non-negative int or None, got {num_tokens!r}")


def builtin_score(task: dict | Task, response: str, config: RewardConfig | None = None,
                  num_tokens: int | None = None, *, l_max: int | None = None,
                  l_cache: int | None = None, stage: LengthStage | None = None) -> RewardBreakdown:
    """The built-in reward (Magistral's composition), whatever reward.custom says."""
    start = time.perf_counter()
    cfg = config if config is not None else RewardConfig()
    window = penalty_window(cfg, l_max, l_cache, stage=stage)
    parsed = parse_task(task)
    check_response_args(response, num_tokens)
    estimated = num_tokens is None
    n_tok = estimate_tokens(response) if estimated else num_tokens
    language_ok: bool | None = False if cfg.language_check else None  # None: not checked, not a failure

    fmt = check_format(parsed, response)
    if not fmt.ok:  # the gate: nothing else is graded
        return RewardBreakdown(language_ok=language_ok, num_tokens=n_tok, num_tokens_estimated=estimated,
                               details={"format": fmt.reason}, elapsed_s=time.perf_counter() - start)

    grade = _grade_code if isinstance(parsed, CodeTask) else _grade_math
    correct, details = grade(parsed, fmt, cfg)
    if "sandbox_error" in details:  # no verdict: total 0 here is not a reward (RewardBreakdown.status)
        return RewardBreakdown(format_ok=True, status=GradeStatus.SANDBOX_UNAVAILABLE, error=details.pop("sandbox_error"),
                               num_tokens=n_tok, num_tokens_estimated=estimated, details=details,
                               elapsed_s=time.perf_counter() - start)
    penalty = overlong_penalty(n_tok, *window, cfg.overlong_penalty)
    details["length_window"] = list(window)
    if cfg.language_check:
        language_ok, details["language"] = check_consistency(parsed.problem, fmt.thoughts, fmt.answer,
                                                             policy_for(cfg.language_window_letters))
    else:
        details["language"] = "disabled"
    total = (cfg.format_reward + (cfg.correct_reward if correct else 0.0) + penalty
             + (cfg.language_reward if language_ok else 0.0))
    return RewardBreakdown(format_ok=True, correct=correct, length_penalty=penalty, language_ok=language_ok,
                           total=total, num_tokens=n_tok, num_tokens_estimated=estimated, details=details,
                           elapsed_s=time.perf_counter() - start)
