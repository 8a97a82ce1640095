"""The cold start as getting_started.md step 2 runs it: `megatron-rl sft`, then `megatron-rl convert
to-hf` of its checkpoint, as a user's subprocesses. On CPU neither prints Megatron-Core's "Transformer
Engine and Apex are not installed" import warnings (platform.silence_expected_cpu_warnings), and
to-hf without `--hf-config` on a trainer checkpoint names the flag."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
CPU_ONLY_WARNING = "Transformer Engine and Apex are not installed"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_rl.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the warnings stay on a CUDA machine")
def test_sft_then_convert_to_hf_print_no_cpu_warnings_and_name_the_hf_config_flag(tiny_llama_dir, tmp_path):
    data = tmp_path / "traces.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i} + {i}?", "completion": f"<think>{2 * i}</think> "
                                        f"\\boxed{{{2 * i}}}"}) + "\n" for i in range(1, 3)))
    run = tmp_path / "run"
    sft = _cli("sft", f"trainer.model={tiny_llama_dir}", "trainer.precision=fp32", "trainer.micro_batch_tokens=64",
               f"run.output_dir={run}", "--data", str(data), "--batch-size", "2", "--epochs", "1")
    assert sft.returncode == 0, sft.stderr[-3000:]

    bare = _cli("convert", "to-hf", str(run / "checkpoints"), str(tmp_path / "hf"))
    assert bare.returncode == 1 and "Traceback" not in bare.stderr, bare.stderr[-3000:]
    assert "no hf_config/ next to the checkpoint" in bare.stderr and "pass --hf-config MODEL" in bare.stderr

    to_hf = _cli("convert", "to-hf", str(run / "checkpoints"), str(tmp_path / "hf"), "--hf-config", str(tiny_llama_dir))
    assert to_hf.returncode == 0, to_hf.stderr[-3000:]
    assert (tmp_path / "hf" / "config.json").is_file()
    for step in (sft, bare, to_hf):
        assert CPU_ONLY_WARNING not in step.stderr, step.stderr[-3000:]
