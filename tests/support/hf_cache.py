"""A model laid out in a local HF cache as `huggingface-cli download` leaves it (tests have no hub)."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_model(hf_home: Path, repo_id: str, model_dir: Path, model_type: str | None = None) -> Path:
    """blobs by hash, a snapshot of relative links, refs/main; `model_type` rewrites config.json's."""
    repo = Path(hf_home) / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in Path(model_dir).iterdir():
        data = f.read_bytes()
        if f.name == "config.json" and model_type:
            data = json.dumps({**json.loads(data), "model_type": model_type}).encode()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot
