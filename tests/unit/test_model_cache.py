"""trainer.model as a hub id resolved from the local HF cache (never the network), and the error that
lists the families the trainer builds."""
from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest

from megatron_rl.config import load_config
from megatron_rl.control.preflight import check_model
from megatron_rl.train.hf_cache import ModelUnavailable
from megatron_rl.train.hf_source import resolve_model
from megatron_rl.train.model import SUPPORTED_MODEL_TYPES

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _cache_model(hf_home, repo_id, model_dir, model_type=None):
    """The layout `huggingface-cli download` leaves: blobs by hash, a snapshot of links, refs/main."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in model_dir.iterdir():
        data = f.read_bytes()
        if f.name == "config.json" and model_type:
            data = json.dumps({**json.loads(data), "model_type": model_type}).encode()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


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
