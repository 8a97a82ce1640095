"""`megatron-rl reward`: the response length comes from the model's tokenizer (as the run counts it),
the exit status tells graded (0), bad input (1) and grading failed (3) apart, and a reward plug-in
that fails, named in any of the three forms of docs/reward.md, is graded as a run grades it."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
RESPONSE = "<think>Three pencils per dollar, four dollars.</think>\nSo it is $\\boxed{12}$ pencils."
MATH_TASK = {"kind": "math", "answer": "12", "problem": "How many pencils for four dollars at three a dollar?"}
CODE_TASK = {"kind": "code", "language": "python", "problem": "Print the sum of two integers.",
             "tests": [{"input": "1 2\n", "output": "3\n"}]}
CODE = "<think>Read two ints and add them.</think>\n```python\na, b = map(int, input().split())\nprint(a + b)\n```"


def _reward(tmp_path: Path, task: dict, response: str, *extra: str, env=None) -> subprocess.CompletedProcess:
    (tmp_path / "task.json").write_text(json.dumps(task))
    (tmp_path / "response.txt").write_text(response)
    cmd = [sys.executable, "-m", "megatron_rl.cli", "reward", "--task", str(tmp_path / "task.json"),
           "--response", str(tmp_path / "response.txt"), *extra]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_tokens_are_counted_with_the_models_tokenizer(tmp_path, tiny_llama_dir):
    p = _reward(tmp_path, MATH_TASK, RESPONSE, f"trainer.model={tiny_llama_dir}")
    assert p.returncode == 0, p.stderr
    result = json.loads(p.stdout)
    expected = len(Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json")).encode(
        RESPONSE, add_special_tokens=False).ids)
    assert result["num_tokens"] == expected and not result["num_tokens_estimated"]
    assert expected != round(len(RESPONSE) / 4)  # the old guess would not have passed


def test_grading_that_fails_exits_non_zero(tmp_path, tiny_llama_dir):
    no_bwrap = tmp_path / "bin"
    no_bwrap.mkdir()
    env = dict(os.environ, PATH=str(no_bwrap))  # the code sandbox cannot start: no verdict
    p = _reward(tmp_path, CODE_TASK, CODE, "--num-tokens", "40", env=env)
    assert p.returncode == 3, (p.returncode, p.stderr)
    assert json.loads(p.stdout)["status"] == "sandbox_unavailable"
    assert "[reward] ERROR grading failed" in p.stderr
    bad = _reward(tmp_path, {"kind": "math"}, RESPONSE, "--num-tokens", "40")
    assert bad.returncode == 1 and "answer" in bad.stderr


FAILING_PLUGINS = """
def raises(task, response, ctx):
    raise RuntimeError("plug-in bug")

def returns_float(task, response, ctx):
    return 1.0

def hangs(task, response, ctx):
    import time
    time.sleep(300)
"""


def _docs_plugin() -> str:
    """The python block of docs/reward.md that defines `exact_match` (the docs' my_reward.py)."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "reward.md").read_text(), re.S)
    return next(b for b in blocks if "def exact_match(" in b)


def _plugin_reward(tmp_path: Path, form: str, fn: str, *extra: str) -> subprocess.CompletedProcess:
    """`megatron-rl reward` in tmp_path with reward.custom naming `fn` of my_reward.py in `form`:
    "module" (my_reward on PYTHONPATH), "file" (my_reward.py from the working directory) or
    "entry_point" (an installed package's megatron_rl.rewards entry point)."""
    (tmp_path / "my_reward.py").write_text(_docs_plugin() + FAILING_PLUGINS)
    (tmp_path / "task.json").write_text(json.dumps(MATH_TASK))
    (tmp_path / "response.txt").write_text("work\n12")
    dist = tmp_path / "my_rewards-1.0.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-rewards\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[megatron_rl.rewards]\n{fn} = my_reward:{fn}\n")
    spec = {"module": f"my_reward:{fn}", "file": f"my_reward.py:{fn}", "entry_point": fn}[form]
    env = dict(os.environ, PYTHONPATH=str(tmp_path) if form != "file" else "")
    cmd = [sys.executable, "-m", "megatron_rl.cli", "reward", "--task", "task.json", "--response", "response.txt",
           "--num-tokens", "7", f"reward.custom={spec}", *extra]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def _failed(p: subprocess.CompletedProcess, status: str) -> str:
    """Exit 3 with the breakdown printed and no traceback; the breakdown's error."""
    assert p.returncode == 3, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr, p.stderr
    result = json.loads(p.stdout)
    assert (result["status"], result["total"]) == (status, 0.0)
    assert f"grading failed (status {status})" in p.stderr
    return result["error"]


@pytest.mark.parametrize("form", ["module", "file", "entry_point"])
def test_a_failing_plugin_is_graded_error_with_its_breakdown(tmp_path, form):
    error = _failed(_plugin_reward(tmp_path, form, "raises"), "error")
    assert re.search(r"reward.custom '.*raises' raised RuntimeError: plug-in bug \(my_reward.py:\d+ in raises\)",
                     error), error
    error = _failed(_plugin_reward(tmp_path, form, "returns_float"), "error")
    assert "returns_float' returned a float; expected a megatron_rl.reward.RewardBreakdown" in error


def test_the_docs_plugin_grades_and_a_hung_one_times_out(tmp_path):
    p = _plugin_reward(tmp_path, "file", "exact_match")
    assert p.returncode == 0, p.stderr
    result = json.loads(p.stdout)
    assert (result["status"], result["correct"], result["total"]) == ("ok", True, 1.0)
    error = _failed(_plugin_reward(tmp_path, "file", "hangs", "reward.verifier_item_timeout_s=2"), "timeout")
    assert "per-item limit of 2 s" in error
