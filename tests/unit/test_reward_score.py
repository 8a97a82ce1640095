"""Magistral's composition through reward.score, with the real math and code verifiers."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from megatron_rl.config import RewardConfig
from megatron_rl.reward import RewardBreakdown, TaskError, score
from megatron_rl.reward.length import overlong_penalty

PROBLEM_EN = "A shop sells pencils at three for a dollar. How many pencils can you buy with four dollars?"
THOUGHTS_EN = ("Each dollar buys three pencils, so four dollars buy four times as many pencils. "
               "That is $4 \\cdot 3 = 12$ pencils in total, and there is no change left over.")
MATH_TASK = {"kind": "math", "answer": "12", "problem": PROBLEM_EN}
GOOD = f"<think>{THOUGHTS_EN}</think>\nThe answer is $\\boxed{{12}}$."
ADD_TASK = {"kind": "code", "language": "python", "problem": "Read two integers and print their sum.",
            "tests": [{"input": "1 2\n", "output": "3\n"}, {"input": "10 -4\n", "output": "6\n"}]}
ADD_THOUGHTS = ("I read both integers from one line of standard input and print their sum. "
                "Negative numbers need no special handling in Python.")


def code_response(body: str, tag: str = "python") -> str:
    return f"<think>{ADD_THOUGHTS}</think>\nHere is the program:\n```{tag}\n{body}\n```\n"


def expected_total(cfg: RewardConfig, correct: bool, n_tokens: int, language_ok: bool) -> float:
    return (cfg.format_reward + cfg.correct_reward * correct
            + overlong_penalty(n_tokens, cfg.l_max, cfg.l_cache, cfg.overlong_penalty)
            + cfg.language_reward * language_ok)


def test_correct_math_in_one_language_gets_full_reward():
    r = score(MATH_TASK, GOOD, num_tokens=100)
    assert (r.format_ok, r.correct, r.language_ok, r.length_penalty) == (True, True, True, 0.0)
    assert r.total == pytest.approx(0.1 + 0.9 + 0.1)
    assert r.details["prediction"] == "12" and not r.num_tokens_estimated


def test_equivalent_forms_are_graded_by_the_math_verifier():
    task = dict(MATH_TASK, answer="\\frac{1}{2}")
    assert score(task, GOOD.replace("\\boxed{12}", "\\boxed{0.5}"), num_tokens=10).correct
    assert not score(task, GOOD.replace("\\boxed{12}", "\\boxed{0.51}"), num_tokens=10).correct


def test_wrong_answer_keeps_format_and_language_reward():
    r = score(MATH_TASK, GOOD.replace("\\boxed{12}", "\\boxed{13}"), num_tokens=100)
    assert r.format_ok and not r.correct and r.language_ok
    assert r.total == pytest.approx(0.2)


def test_format_failure_is_zero_and_nothing_else_is_graded():
    for bad in (GOOD.replace("<think>", ""), "Sure. " + GOOD, GOOD.replace("\\boxed{12}", "12"),
                GOOD + "<think>again</think>"):
        r = score(MATH_TASK, bad, num_tokens=10**6)  # would be correct and overlong
        assert (r.format_ok, r.correct, r.language_ok, r.length_penalty, r.total) == (False, False, False, 0.0, 0.0)
        assert r.details["format"]


def test_every_number_comes_from_the_config():
    cfg = RewardConfig(format_reward=0.2, correct_reward=0.5, language_reward=0.05, l_max=100, l_cache=40,
                       overlong_penalty=0.3)
    for n_tokens in (10, 60, 61, 80, 100, 500):
        for resp, correct in ((GOOD, True), (GOOD.replace("\\boxed{12}", "\\boxed{7}"), False)):
            r = score(MATH_TASK, resp, cfg, num_tokens=n_tokens)
            assert r.correct is correct and r.language_ok
            assert r.total == pytest.approx(expected_total(cfg, correct, n_tokens, True))
    r = score(MATH_TASK, GOOD, dataclasses.replace(cfg, language_check=False), num_tokens=10)
    assert not r.language_ok and r.total == pytest.approx(0.7)


def test_language_bonus_needs_the_problem_language():
    french = ("Chaque dollar permet d'acheter trois crayons, donc quatre dollars en achètent quatre fois plus. "
              "Cela fait $4 \\cdot 3 = 12$ crayons au total.")
    r = score(MATH_TASK, f"<think>{french}</think>\nLa réponse est $\\boxed{{12}}$.", num_tokens=50)
    assert r.correct and not r.language_ok and r.total == pytest.approx(1.0)
    assert r.details["language"]["thoughts"] == "fr" and r.details["language"]["problem"] == "en"


def test_num_tokens_fallback_is_estimated_and_flagged():
    cfg = RewardConfig(l_max=40, l_cache=10)
    r = score(MATH_TASK, GOOD, cfg)
    assert r.num_tokens_estimated and r.num_tokens == pytest.approx(len(GOOD) / 4, abs=1)
    assert r.length_penalty == pytest.approx(-0.1)  # ~60 estimated tokens > l_max


def test_python_code_all_tests_must_pass():
    ok = score(ADD_TASK, code_response("a, b = map(int, input().split())\nprint(a + b)"), num_tokens=80)
    assert ok.correct and ok.language_ok and ok.total == pytest.approx(1.1)
    assert ok.details["n_passed"] == 2 and ok.details["code_status"] == "ok"
    wrong = score(ADD_TASK, code_response("a, b = map(int, input().split())\nprint(a + abs(b))"), num_tokens=80)
    assert wrong.format_ok and not wrong.correct and wrong.details["n_passed"] == 1


def test_cpp_code_is_compiled_and_run():
    task = dict(ADD_TASK, language="cpp")
    body = "#include <cstdio>\nint main(){long long a,b;scanf(\"%lld %lld\",&a,&b);printf(\"%lld\\n\",a+b);}"
    assert score(task, code_response(body, "cpp"), num_tokens=80).correct
    assert not score(task, code_response(body, "python"), num_tokens=80).format_ok


def test_only_the_first_code_max_tests_are_run():
    task = dict(ADD_TASK, tests=ADD_TASK["tests"] + [{"input": "1 1\n", "output": "3\n"}])  # 3rd is wrong
    resp = code_response("a, b = map(int, input().split())\nprint(a + b)")
    assert not score(task, resp, num_tokens=10).correct
    assert score(task, resp, RewardConfig(code_max_tests=2), num_tokens=10).correct


@pytest.mark.parametrize("task, msg", [
    ({"kind": "math"}, "missing 'answer'"),
    ({"kind": "math", "answer": ""}, "empty"),
    ({"kind": "math", "answer": [1]}, "string or number"),
    ({"kind": "proof", "answer": "1"}, "'math' or 'code'"),
    ({"kind": "math", "answer": "1", "answers": "1"}, "unknown key"),
    ({"kind": "code", "tests": []}, "non-empty"),
    ({"kind": "code", "tests": [{"input": "1"}]}, "exactly 'input' and 'output'"),
    ({"kind": "code", "tests": [{"input": 1, "output": "1"}]}, "must be a string"),
    ({"kind": "code", "language": "rust", "tests": [{"input": "", "output": ""}]}, "'language'"),
    ({"kind": "code", "langauge": "cpp", "tests": [{"input": "", "output": ""}]}, "unknown key"),
    ("math", "must be a dict"),
])
def test_schema_errors_are_clear(task, msg):
    with pytest.raises(TaskError, match=msg):
        score(task, GOOD)


def test_meta_and_numbers_are_accepted():
    r = score({"kind": "math", "answer": 12, "id": "p1", "meta": {"source": "x"}}, GOOD, num_tokens=5)
    assert isinstance(r, RewardBreakdown) and r.correct


def test_bad_num_tokens_and_response_type():
    with pytest.raises(ValueError):
        score(MATH_TASK, GOOD, num_tokens=-1)
    with pytest.raises(TypeError):
        score(MATH_TASK, None)


def test_cli_prints_breakdown_json(tmp_path):
    (tmp_path / "task.json").write_text(json.dumps(MATH_TASK))
    (tmp_path / "response.txt").write_text(GOOD)
    cmd = [sys.executable, "-m", "megatron_rl.cli", "reward", "--task", str(tmp_path / "task.json"),
           "--response", str(tmp_path / "response.txt"), "--num-tokens", "3700", "reward.language_reward=0.2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["correct"] and data["language_ok"]
    assert data["total"] == pytest.approx(0.1 + 0.9 + overlong_penalty(3700, 4096, 512) + 0.2)
    (tmp_path / "task.json").write_text(json.dumps({"kind": "math"}))
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "answer" in bad.stderr
