"""reward.custom: plug-ins loaded from a module, a file or an entry point, graded in the verifier
pool under its time limit and fault handling, their results checked."""
from __future__ import annotations

import os
import re
import textwrap

import pytest

from megatron_rl.config import ConfigError, RewardConfig, load_config
from megatron_rl.control.preflight import check_config
from megatron_rl.reward import VerifierPool, score
from megatron_rl.reward.compose import builtin_score
from megatron_rl.reward.custom import ENTRY_POINT_GROUP, RewardPluginError, load_reward_fn

os.environ.setdefault("OMP_NUM_THREADS", "1")

FAULTY = "support.reward_plugins:faulty"
MATH = {"kind": "math", "answer": "55", "problem": "What is the sum of 1 to 10?"}
THINK = "<think>Five pairs of eleven make fifty-five.</think>\n"


def test_pool_grades_with_the_plugin_and_handles_its_faults():
    task_bonus = {**MATH, "meta": {"bonus": 0.25}}
    task_compose = {**MATH, "meta": {"compose": True}}
    short_right = THINK + "The sum is $\\boxed{55}$."
    long_wrong = THINK + "word " * 60 + "So $\\boxed{54}$."
    items = [(MATH, "work\n55", 7), (task_bonus, "work\n54", 7), (task_bonus, "55", 3),
             (task_compose, short_right, 20), (task_compose, long_wrong, 80),
             (MATH, "HANG"), (MATH, "DIE"), (MATH, "RAISE"), (MATH, "FLOAT"), (MATH, "NAN")]
    cfg = RewardConfig(custom=FAULTY)
    with VerifierPool(cfg, workers=2, item_timeout_s=3.0) as pool:
        out = pool.map(items)
    # last_line_match: 1 when the last line is the answer, plus the task's meta.bonus
    assert [(r.status, r.correct, r.total) for r in out[:3]] == [
        ("ok", True, 1.0), ("ok", False, 0.25), ("ok", True, 1.25)]
    assert out[0].num_tokens == 7 and out[0].details["tokens_seen"] == 7
    assert out[0].details["reward"] == f"custom:{FAULTY}"
    # composed: the built-in reward of the same response (graded here, in-process), + 0.05 when < 40 tokens
    for r, (task, response, n) in zip(out[3:5], items[3:5]):
        ref = builtin_score(task, response, RewardConfig(), n)
        assert (r.status, r.correct, r.format_ok) == ("ok", ref.correct, ref.format_ok)
        assert r.total == pytest.approx(ref.total + (0.05 if n < 40 else 0.0))
    assert out[3].correct and not out[4].correct
    statuses = [r.status for r in out[5:]]
    assert statuses == ["timeout", "crash", "error", "error", "error"]
    assert "plug-in bug" in out[7].error
    for r in out[8:]:  # a return that is no breakdown is an error naming the key, never a reward
        assert "reward.custom" in r.error and r.total == 0.0
    assert "float" in out[8].error and "total=nan" in out[9].error


def test_file_plugin_and_its_load_errors(tmp_path, monkeypatch):
    plugin = tmp_path / "my_reward.py"
    plugin.write_text(textwrap.dedent('''
        from megatron_rl.reward import RewardBreakdown

        def length_reward(task, response, ctx):
            return RewardBreakdown(format_ok=True, correct=True, total=min(1.0, len(response) / 10))
    '''))
    monkeypatch.chdir(tmp_path)  # a relative path starts at the working directory
    cfg = load_config(None, ["reward.custom=my_reward.py:length_reward"])
    assert score(MATH, "abcd", cfg.reward).total == pytest.approx(0.4)
    assert score(MATH, "x" * 30, cfg.reward).total == 1.0
    cases = {"my_reward.py:nope": "has no function 'nope'",
             "missing.py:f": "file 'missing.py' not found",
             "no_such_module_xyz:f": "cannot load it: ModuleNotFoundError",
             "support.reward_plugins:NOT_A_FUNCTION": "int is not callable",
             "support.reward_plugins:two_args": "must take (task, response, ctx)",
             "no_such_entry_point": f"no entry point 'no_such_entry_point' in group {ENTRY_POINT_GROUP}"}
    for spec, why in cases.items():
        with pytest.raises(ConfigError, match=f"reward.custom: .*{re.escape(why)}"):  # pre-flight loads it
            check_config(load_config(None, [f"reward.custom={spec}"]))
    with pytest.raises(RewardPluginError, match="reward.custom 'missing.py:f'"):  # the pool refuses it too
        VerifierPool(_unchecked(custom="missing.py:f"))


def _unchecked(**kw) -> RewardConfig:
    return RewardConfig(**kw)  # dataclass construction does not validate


def test_entry_point_plugin(tmp_path, monkeypatch):
    dist = tmp_path / "my_rewards-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-rewards\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nlast_line = support.reward_plugins:last_line_match\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    load_reward_fn.cache_clear()
    cfg = load_config(None, ["reward.custom=last_line"])
    assert score(MATH, "so\n55", cfg.reward).total == 1.0
    assert score(MATH, "so\n56", cfg.reward).total == 0.0
    with pytest.raises(ConfigError, match="installed: last_line"):
        check_config(load_config(None, ["reward.custom=first_line"]))


def test_a_plugin_may_leave_the_language_unchecked(tmp_path):
    """ctx.builtin() under reward.language_check false says language_ok=None (not checked), and the
    check of what a plug-in returns lets it through; any other non-bool is still an error."""
    cfg = RewardConfig(custom="support.reward_plugins:builtin_plus_brevity", language_check=False)
    out = score(MATH, THINK + "The sum is $\\boxed{55}$.", cfg, 20)
    assert (out.correct, out.language_ok, out.total) == (True, None, pytest.approx(1.05))
    plugin = tmp_path / "yes_reward.py"
    plugin.write_text("from megatron_rl.reward import RewardBreakdown\n\n"
                      "def yes(task, response, ctx):\n    return RewardBreakdown(format_ok=True, language_ok='yes')\n")
    with pytest.raises(RewardPluginError, match=r"language_ok='yes' \(not a bool or None\)"):
        score(MATH, "55", RewardConfig(custom=f"{plugin}:yes"), 5)
