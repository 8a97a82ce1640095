"""Length stages: parsing and validation of rollout.length_schedule with penalty windows, the stage
lookup, and the per-response penalty window of reward.score / the verifier pool."""
from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest

from megatron_rl.config import (ConfigError, LengthStage, RewardConfig, config_from_dict, dump_config, length_stages,
                                load_config, stage_at)
from megatron_rl.config.length_stages import parse_length_entry
from megatron_rl.reward import TaskError, score
from megatron_rl.reward.pool import _normalise

TASK = {"kind": "math", "answer": "4"}
GOOD = "<think>Two and two make four.</think>\nThe answer is $\\boxed{4}$."


def closed_form(n: int, l_max: int, l_cache: int, p: Fraction = Fraction(1, 10)) -> Fraction:
    """DAPO's soft overlong penalty, written from the paper's formula."""
    if n <= l_max - l_cache:
        return Fraction(0)
    if n <= l_max:
        return -p * Fraction(n - l_max + l_cache, l_cache)
    return -p


# ---------------------------------------------------------------- parsing

@pytest.mark.parametrize("entry, want", [
    ("0:256", (0, 256, None, None)),
    ("50:512:512:128", (50, 512, 512, 128)),
    (" 7 : 9 ", (7, 9, None, None)),
    ("3:100:80:0", (3, 100, 80, 0)),
])
def test_parse_entry(entry, want):
    assert parse_length_entry(entry) == want


@pytest.mark.parametrize("entry, match", [
    ("abc", "UPDATE:TOKENS"), ("1:2:3", "UPDATE:TOKENS"), ("-1:5", "UPDATE:TOKENS"), ("1:5:6:7:8", "UPDATE:TOKENS"),
    ("1:0", "TOKENS must be >= 1"), ("1:5:0:0", "L_MAX must be >= 1"), ("0:100:50:60", "L_CACHE .60. must not exceed"),
])
def test_parse_entry_errors(entry, match):
    with pytest.raises(ValueError, match=match):
        parse_length_entry(entry)


def _cfg(rollout: dict, reward: dict | None = None, overrides=()):
    return config_from_dict({"rollout": rollout, "reward": reward or {}}, overrides)


@pytest.mark.parametrize("rollout, reward, key, match", [
    ({"length_schedule": ["0:100:50:60"]}, None, "rollout.length_schedule[0]", "L_CACHE"),
    ({"length_schedule": ["0:100", "x"]}, None, "rollout.length_schedule[1]", "UPDATE:TOKENS"),
    ({"length_schedule": ["0:4096", "0:2048"]}, None, "rollout.length_schedule[1]", "already starts at update 0"),
    # fixed l_max, stage cap below the ramp: the penalty could never fire
    ({"length_schedule": ["0:2048", "10:4096"]}, {"l_max": 4096, "l_cache": 512}, "rollout.length_schedule[0]",
     "never applies"),
    # fixed l_max, stage cap past l_max: every longer answer fully penalised
    ({"length_schedule": ["0:4096", "10:8192"]}, {"l_max": 4096, "l_cache": 512}, "rollout.length_schedule[1]",
     "full penalty"),
    # the implicit first stage (before update 10) uses rollout.max_new_tokens
    ({"max_new_tokens": 100, "length_schedule": ["10:200"]}, {"l_max": 200, "l_cache": 50},
     "rollout.max_new_tokens", "never applies"),
    # an explicit window that disagrees with its own cap
    ({"length_schedule": ["0:1000:2000:500"]}, None, "rollout.length_schedule[0]", "never applies"),
    ({"length_schedule": ["0:1000:800:100"]}, None, "rollout.length_schedule[0]", "full penalty"),
    # l_max null and no ramp: completions never exceed the cap, so no penalty ever
    ({"length_schedule": ["0:1000"]}, {"l_max": None, "l_cache": 0}, "reward.l_cache", "never applies"),
    ({}, {"l_max": 0}, "reward.l_max", "> 0 or null"),
    ({}, {"l_max": 100, "l_cache": 101}, "reward.l_cache", "[0, l_max]"),
    ({}, {"l_max": None, "l_cache": -1}, "reward.l_cache", ">= 0"),
])
def test_config_errors_name_the_key(rollout, reward, key, match):
    with pytest.raises(ConfigError) as err:
        _cfg(rollout, reward)
    assert str(err.value).startswith(key + ":"), str(err.value)
    assert match in str(err.value)


def test_valid_configs():
    # A plain run with a fixed l_max is the user's choice, checked as before (the CPU demo's window
    # lies beyond its cap).
    _cfg({"max_new_tokens": 48}, {"l_max": 96, "l_cache": 32})
    # No penalty at all: nothing to agree with.
    _cfg({"length_schedule": ["0:2048", "10:8192"]}, {"l_max": 4096, "overlong_penalty": 0.0})
    # A fixed l_max a schedule can live with: every cap inside (l_max - l_cache, l_max].
    _cfg({"length_schedule": ["0:3700", "10:4096"]}, {"l_max": 4096, "l_cache": 512})
    # l_max null from the command line; l_cache larger than an early cap is clamped, not an error.
    cfg = _cfg({"length_schedule": ["0:256", "10:4096"]}, None, ["reward.l_max=null"])
    assert cfg.reward.l_max is None


def test_null_l_max_round_trips_through_yaml(tmp_path):
    cfg = _cfg({"length_schedule": ["0:256", "5:512:512:64"]}, {"l_max": None})
    path = tmp_path / "c.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg


# ---------------------------------------------------------------- resolution and lookup

def test_stage_windows_resolve():
    entries = ["5:256", "10:512:600:100", "20:1024"]
    fixed = length_stages(entries, 128, RewardConfig(l_max=700, l_cache=50))
    assert fixed == [LengthStage(0, 128, 700, 50), LengthStage(5, 256, 700, 50), LengthStage(10, 512, 600, 100),
                     LengthStage(20, 1024, 700, 50)]
    tracking = length_stages(entries, 128, RewardConfig(l_max=None, l_cache=200))
    assert tracking == [LengthStage(0, 128, 128, 128), LengthStage(5, 256, 256, 200), LengthStage(10, 512, 600, 100),
                        LengthStage(20, 1024, 1024, 200)]


def test_stage_lookup_against_a_table():
    stages = length_stages(["30:512:512:64", "10:256"], 128, RewardConfig(l_max=None, l_cache=32))
    # expected stage per update, written out by hand from the schedule (entries given out of order)
    want = {0: (128, 128, 32), 9: (128, 128, 32), 10: (256, 256, 32), 29: (256, 256, 32), 30: (512, 512, 64),
            10**6: (512, 512, 64)}
    for update, (cap, l_max, l_cache) in want.items():
        s = stage_at(stages, update)
        assert (s.max_new_tokens, s.l_max, s.l_cache) == (cap, l_max, l_cache), update
    with pytest.raises(ValueError, match="update 0"):
        stage_at(stages[1:], 0)


def test_length_schedule_caps_by_update():
    stages = length_stages(["10:256", "30:512"], 128, RewardConfig())
    assert [stage_at(stages, u).max_new_tokens for u in (0, 9, 10, 29, 30, 99)] == [128, 128, 256, 256, 512, 512]
    with pytest.raises(ValueError, match="UPDATE:TOKENS"):
        length_stages(["abc"], 1, RewardConfig())


def test_examples_stage_windows_end_at_their_caps():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "examples"
    for name in ("magistral_small.yaml", "magistral_medium.yaml"):
        cfg = load_config(root / name)
        stages = length_stages(cfg.rollout.length_schedule, cfg.rollout.max_new_tokens, cfg.reward)
        assert len(stages) == 3 and all(s.l_max == s.max_new_tokens for s in stages), name


# ---------------------------------------------------------------- the penalty window per response

@pytest.mark.parametrize("l_max, l_cache", [(40, 16), (80, 20), (30, 30)])
def test_score_window_override_matches_closed_form(l_max, l_cache):
    cfg = RewardConfig(l_max=4096, l_cache=512, language_check=False)
    before = dataclasses.replace(cfg)
    for n in range(0, l_max + 5):
        r = score(TASK, GOOD, cfg, num_tokens=n, l_max=l_max, l_cache=l_cache)
        assert r.length_penalty == pytest.approx(float(closed_form(n, l_max, l_cache)), abs=1e-12), n
        assert r.total == pytest.approx(1.0 + float(closed_form(n, l_max, l_cache)), abs=1e-12)
        assert r.details["length_window"] == [l_max, l_cache]
    assert cfg == before  # the shared config is never modified


def test_score_window_defaults_and_errors():
    cfg = RewardConfig(l_max=None, l_cache=16, language_check=False)
    with pytest.raises(ValueError, match="reward.l_max is null"):
        score(TASK, GOOD, cfg, num_tokens=10)
    # l_cache from the config is clamped to the override's l_max: a full ramp over [0, 10]
    r = score(TASK, GOOD, cfg, num_tokens=5, l_max=10)
    assert r.details["length_window"] == [10, 10] and r.length_penalty == pytest.approx(-0.05)
    with pytest.raises(ValueError, match="l_cache <= l_max"):
        score(TASK, GOOD, cfg, num_tokens=5, l_max=10, l_cache=11)
    fixed = RewardConfig(l_max=100, l_cache=20, language_check=False)
    assert score(TASK, GOOD, fixed, num_tokens=90).details["length_window"] == [100, 20]


def test_pool_items_carry_the_window_and_fail_early_without_one():
    cfg = RewardConfig(l_max=None)
    _, _, n, window = _normalise({"task": TASK, "response": GOOD, "num_tokens": 3, "l_max": 40, "l_cache": 8}, 0, cfg)
    assert (n, window) == (3, {"l_max": 40, "l_cache": 8})
    with pytest.raises(TaskError, match="item 1: reward.l_max is null"):
        _normalise((TASK, GOOD, 3), 1, cfg)
    assert _normalise((TASK, GOOD, 3), 0, RewardConfig())[3] == {}
