"""Reward plug-ins for tests (reward.custom = "support.reward_plugins:<name>"); importable in the
verifier pool's spawned workers because they inherit the test process's sys.path."""
from __future__ import annotations

import os
import signal
import time

from megatron_rl.reward import RewardBreakdown


def last_line_match(task, response, ctx):
    """1 when the response's last line is the reference answer, plus meta.bonus; a made-up rule the
    built-in reward does not follow (no <think>, no \\boxed{})."""
    lines = response.strip().splitlines()
    correct = bool(lines) and lines[-1].strip() == task["answer"]
    bonus = float(task.get("meta", {}).get("bonus", 0.0))
    return RewardBreakdown(format_ok=True, correct=correct, total=float(correct) + bonus,
                           details={"bonus": bonus, "tokens_seen": ctx.num_tokens})


def builtin_plus_brevity(task, response, ctx):
    """The built-in reward plus 0.05 when the response is under 40 tokens (composes, not replaces)."""
    out = ctx.builtin(response)
    if not out.grading_failed and ctx.num_tokens < 40:
        out.total += 0.05
    return out


def faulty(task, response, ctx):
    """Faults chosen by the response: hang, die, raise, or return something that is no breakdown;
    else builtin_plus_brevity when meta.compose is set, last_line_match otherwise."""
    if response == "HANG":
        time.sleep(300)
    if response == "DIE":
        os.kill(os.getpid(), signal.SIGKILL)
    if response == "RAISE":
        raise RuntimeError("plug-in bug")
    if response == "FLOAT":
        return 1.0
    if response == "NAN":
        return RewardBreakdown(format_ok=True, total=float("nan"))
    if task.get("meta", {}).get("compose"):
        return builtin_plus_brevity(task, response, ctx)
    return last_line_match(task, response, ctx)


NOT_A_FUNCTION = 3


def two_args(task, response):
    return RewardBreakdown()


def digit_share(task, response, ctx):
    """1 for the answer in the response, else a tenth of the share of digits among its characters:
    a random model's samples differ, so its groups are diverse and train (e2e runs)."""
    text = "".join(response.split())
    share = sum(c.isdigit() for c in text) / len(text) if text else 0.0
    correct = task["answer"] in response
    return RewardBreakdown(format_ok=bool(text), correct=correct, total=1.0 if correct else 0.1 * share,
                           details={"digit_share": share, "meta": task.get("meta", {})})
