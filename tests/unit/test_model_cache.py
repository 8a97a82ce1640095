"""trainer.model as a hub id resolved from the local HF cache (never the network), and the error that
lists the families the trainer builds."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.config import load_config
from megatron_rl.control.preflight import check_model
from megatron_rl.train.hf_cache import ModelUnavailable
from megatron_rl.train.hf_source import resolve_model
from megatron_rl.train.model import SUPPORTED_MODEL_TYPES
from support.hf_cache import COMMIT
from support.hf_cache import cache_model as _cache_model


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    return home


def test_hub_id_resolves_from_the_cache(hf_home, tiny_llama_dir):
    snapshot = _cache_model(hf_home, "tiny-org/tiny-llama", tiny_llama_dir)
    source = resolve_model("tiny-org/tiny-llama")
    assert source.path == snapshot and source.name == "tiny-llama"
    assert resolve_model(f"tiny-org/tiny-llama@{COMMIT}").path == snapshot
    assert source.config().model_type == "llama"
    assert source.tokenizer()("1 + 1").input_ids == resolve_model(tiny_llama_dir).tokenizer()("1 + 1").input_ids
    assert set(source.tensors()) == set(resolve_model(tiny_llama_dir).tensors())
    check_model(load_config(None, ["trainer.model=tiny-org/tiny-llama"]))  # a trainable family: no error


def test_missing_or_unsupported_models_list_the_families(hf_home, tiny_llama_dir, tmp_path):
    families = ", ".join(SUPPORTED_MODEL_TYPES)
    with pytest.raises(ModelUnavailable) as e:
        resolve_model("tiny-org/not-downloaded")
    assert str(hf_home / "hub") in str(e.value) and f"trainable families: {families}" in str(e.value)
    assert "huggingface-cli download tiny-org/not-downloaded" in str(e.value)
    _cache_model(hf_home, "tiny-org/tiny-gpt", tiny_llama_dir, model_type="gpt2")
    with pytest.raises(ModelUnavailable, match=f"model_type 'gpt2' is not a family the trainer builds "
                                                f"\\(supported: {families}\\)"):
        check_model(load_config(None, ["trainer.model=tiny-org/tiny-gpt"]))
    local = shutil.copytree(tiny_llama_dir, tmp_path / "local")
    (local / "config.json").write_text(json.dumps({**json.loads((local / "config.json").read_text()),
                                                   "model_type": "gemma"}))
    with pytest.raises(ModelUnavailable, match="model_type 'gemma'"):
        check_model(load_config(None, [f"trainer.model={local}"]))


def test_a_missing_local_path_is_answered_as_a_path_not_a_hub_id(hf_home, tmp_path, monkeypatch):
    """`megatron-rl train ... trainer.model=./tiny-lama` (a typo of a local folder) as a user runs it."""
    (tmp_path / "problems.jsonl").write_text('{"prompt": "What is 1+1?", "answer": "2"}\n')
    config = Path(__file__).resolve().parents[2] / "examples" / "cpu_demo.yaml"
    p = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "train", str(config), "trainer.model=./tiny-lama",
                        "data.path=problems.jsonl", "data.eval_path=problems.jsonl", f"run.output_dir={tmp_path / 'run'}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert f"model './tiny-lama': {tmp_path / 'tiny-lama'}: no such directory" in p.stderr, p.stderr
    assert "huggingface-cli" not in p.stderr

    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    cases = {"empty": "a directory without config.json", "problems.jsonl": "a file, neither an HF model directory",
             "models/org/name": "no such directory", "~/no-such-model": "no such directory"}
    for name, why in cases.items():
        with pytest.raises(ModelUnavailable, match=f"^model '{name}': /.*: {why}"):
            resolve_model(name)
