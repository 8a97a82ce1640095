"""Model files the SGLang generators load: an HF safetensors directory for the configured model.

SGLang reads HF directories; the SmolLM2 model of the demo ships as GGUF, so it is converted once
(dequantised by transformers, written by `ModelSource.save_hf`) into a cache directory, written to a
temporary name and renamed, so a crash never leaves a half-written model behind.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

CACHE = Path(os.environ.get("MEGATRON_RL_CACHE", Path.home() / ".cache" / "megatron_rl"))


def generator_model_dir(model: str, precision: str = "bf16", cache: Path = CACHE) -> Path:
    """`model` itself when it is an HF directory, else its HF copy under `cache` (made on the first call)."""
    from megatron_rl.train.hf_source import resolve_model

    source = resolve_model(model)
    if not source.gguf_file:
        return source.path
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    target = Path(cache) / "hf" / f"{source.name}-{'bf16' if dtype == torch.bfloat16 else 'fp32'}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        source.save_hf(tmp, dtype)
        os.rename(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").is_file():
            raise
        # another process won the race (rename onto its non-empty dir fails): its copy is complete
    except BaseException:  # cleanup, then re-raise (Ctrl-C included): no half-written copy stays behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
