"""`megatron-rl evaluate` as a user runs it (a subprocess, a real SGLang server, the tiny random Llama).

getting_started's step 5 printed nothing for 10 minutes and then died with requests' ReadTimeout
traceback. Here: a small run shows its progress and prints the summary; a run whose server stays
silent past `generator.request_idle_timeout_s` ends with one line naming the server and the key to
raise, exit status 1, no traceback.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from support.net import free_port

pytestmark = pytest.mark.timeout(1200)


def _evaluate(tmp_path, model_dir, *extra: str) -> subprocess.CompletedProcess:
    problems = tmp_path / "problems.jsonl"
    problems.write_text("".join(json.dumps({"id": f"p{i}", "problem": f"What is {i} plus {i}?", "answer": str(2 * i)})
                                + "\n" for i in range(2)))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "megatron_rl.cli", "evaluate", "--source", "jsonl", "--path",
                           str(problems), "--model", str(model_dir), "--template", "short", "--n", "2", "--k", "1,2",
                           "--max-new-tokens", "8", "--port", str(free_port()), "generator.max_total_tokens=4096",
                           *extra], capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path)


def test_a_small_evaluation_shows_progress_and_prints_the_summary(tmp_path, tiny_llama_dir):
    p = _evaluate(tmp_path, tiny_llama_dir)
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads(p.stdout)
    assert (summary["problems"], summary["samples"], summary["pass@1"]) == (2, 4, 0.0), summary
    (last,) = [line for line in p.stderr.splitlines() if "sampling: 4/4 completion" in line]
    assert " tokens, " in last and " tok/s, at most " in last, p.stderr[-3000:]


@pytest.mark.long
def test_a_silent_server_ends_the_evaluation_with_one_line_naming_the_setting(tmp_path, tiny_llama_dir):
    p = _evaluate(tmp_path, tiny_llama_dir, "generator.request_idle_timeout_s=0.001")
    assert p.returncode == 1, p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    (error,) = [line for line in p.stderr.splitlines() if " ERROR " in line]
    assert "sent nothing on request" in error and "raise generator.request_idle_timeout_s" in error, error
