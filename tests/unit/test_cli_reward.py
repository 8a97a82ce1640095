"""`megatron-rl reward`: the response length comes from the model's tokenizer (as the run counts it),
and the exit status tells graded (0), bad input (1) and grading failed (3) apart."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
