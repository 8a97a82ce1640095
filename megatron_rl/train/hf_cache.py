"""Hub model ids resolved from the local Hugging Face cache only (HF_HUB_OFFLINE semantics: nothing is
ever downloaded), and the model families the trainer builds.

`hub_snapshot("Qwen/Qwen3-0.6B")` is the snapshot directory that `huggingface-cli download` (or any
`from_pretrained` with network) left in the cache: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
`$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`, read when called (not when
huggingface_hub was imported), so a job can point HF_HOME at a shared cache.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from megatron_rl.errors import InputError


class ModelUnavailable(InputError, FileNotFoundError):
    """trainer.model is neither a known name, a local HF directory nor a hub id in the local cache, or
    its family is not one the trainer builds."""


def hub_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def hub_snapshot(repo_id: str, revision: str | None = None) -> Path | None:
    """The cached snapshot of `repo_id` ("org/name", optionally "org/name@revision") holding a
    config.json; None when the cache has none (or the text is no hub id)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    if "@" in repo_id and revision is None:
        repo_id, revision = repo_id.split("@", 1)
    if repo_id.count("/") != 1:
        return None
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=hub_cache_dir(),
                                        local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError, OSError):
        return None
    return folder if (folder / "config.json").is_file() else None


def supported_families() -> tuple[str, ...]:
    """HF model_type values the trainer builds (megatron_rl.train.model)."""
    from megatron_rl.train.model import SUPPORTED_MODEL_TYPES

    return tuple(SUPPORTED_MODEL_TYPES)


def looks_local(name: str) -> bool:
    """Whether `name` reads as a path (absolute, ./ ../ ~, a trailing or second slash, or one that exists):
    a hub id is "org/name", and HF refuses names that start with a dot."""
    return name.startswith(("/", ".", "~")) or name.endswith("/") or name.count("/") > 1 or Path(name).exists()


def _local_message(name: str, known_names: tuple[str, ...]) -> str:
    path = Path(name).expanduser().absolute()  # where a relative path was looked for
    why = ("no such directory" if not path.exists() else
           "a directory without config.json (an HF model directory holds config.json and *.safetensors)"
           if path.is_dir() else "a file, neither an HF model directory nor a .gguf file")
    return (f"model {name!r}: {path}: {why}; a model is {' or '.join(repr(n) for n in known_names)}, a local HF "
            f"directory or a hub id in the local HF cache")


def not_found_message(name: str, known_names: tuple[str, ...]) -> str:
    """Why `name` resolves to no model: a path-like name as a missing path, anything else as a hub id."""
    if looks_local(name):
        return _local_message(name, known_names)
    return (f"model {name!r} is not {' or '.join(repr(n) for n in known_names)}, not a local HF directory with "
            f"config.json, and not a hub id in the local HF cache {hub_cache_dir()} (no downloads here: run "
            f"`huggingface-cli download {name if name.count('/') == 1 else 'ORG/NAME'}` where there is network, "
            f"or set HF_HOME); trainable families: {', '.join(supported_families())}")


def check_family(folder: Path) -> str:
    """The model_type of an HF directory; ModelUnavailable naming the supported ones when it is not."""
    try:
        model_type = json.loads((Path(folder) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError) as e:
        raise ModelUnavailable(f"{folder}/config.json: cannot read it ({e})") from None
    if model_type not in supported_families():
        raise ModelUnavailable(f"{folder}: model_type {model_type!r} is not a family the trainer builds "
                               f"(supported: {', '.join(supported_families())})")
    return model_type
