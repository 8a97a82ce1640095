"""Streaming writer of an HF safetensors checkpoint: shards are written as tensors arrive.

`ShardWriter(folder, prefix, max_shard_bytes)` buffers tensors until the next one would push the
buffer past `max_shard_bytes`, then writes the buffer as one `.safetensors` file and drops it: the
writer never holds more than one shard (or one tensor, when a single tensor is larger). Several
writers (one per pipeline stage) can write into the same folder with distinct prefixes;
`finalize_index` then renames their files to HF's `model-0000k-of-0000n.safetensors` names (or
`model.safetensors` when there is one file) and writes `model.safetensors.index.json`.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch


class ShardWriter:
    def __init__(self, folder: str | Path, prefix: str, max_shard_bytes: int = 2 << 30):
        if max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.prefix = prefix
        self.max_shard_bytes = max_shard_bytes
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self.weight_map: dict[str, str] = {}  # tensor name -> file name (in this folder)
        self.files: list[str] = []
        self.total_bytes = 0
        self.peak_buffer_bytes = 0  # the most this writer ever held at once (memory bound check)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.weight_map or name in self._buffer:
            raise ValueError(f"tensor {name!r} written twice")
        nbytes = tensor.numel() * tensor.element_size()
        if self._buffer and self._buffer_bytes + nbytes > self.max_shard_bytes:
            self.flush()
        # clone only when the tensor is a view into something larger (safetensors wants contiguous
        # storage, and a view would keep its whole base alive in the buffer)
        t = tensor.detach().cpu()
        if not t.is_contiguous() or t.untyped_storage().nbytes() != nbytes:
            t = t.contiguous().clone()
        self._buffer[name] = t
        self._buffer_bytes += nbytes
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, self._buffer_bytes)

    def flush(self) -> None:
        if not self._buffer:
            return
        from safetensors.torch import save_file

        fname = f"{self.prefix}-{len(self.files):05d}.safetensors"
        save_file(self._buffer, str(self.folder / fname), metadata={"format": "pt"})
        for name in self._buffer:
            self.weight_map[name] = fname
        self.files.append(fname)
        self.total_bytes += self._buffer_bytes
        self._buffer, self._buffer_bytes = {}, 0

    def close(self) -> dict[str, str]:
        self.flush()
        return dict(self.weight_map)


def finalize_index(folder: str | Path, weight_maps: list[dict[str, str]], total_bytes: int) -> list[str]:
    """Rename the writers' files (in `weight_maps` order) to HF shard names; write the index.

    Returns the final file names."""
    folder = Path(folder)
    seen: dict[str, str] = {}
    order: list[str] = []
    for wm in weight_maps:
        for name, fname in wm.items():
            if name in seen:
                raise ValueError(f"tensor {name!r} exported by two writers")
            seen[name] = fname
            if fname not in order:
                order.append(fname)
    if not order:
        raise ValueError("no tensors were written")
    n = len(order)
    final = {f: ("model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors")
             for i, f in enumerate(order)}
    for old, new in final.items():
        os.replace(folder / old, folder / new)
    index = folder / "model.safetensors.index.json"
    if n > 1:
        index.write_text(json.dumps({"metadata": {"total_size": total_bytes},
                                     "weight_map": {k: final[v] for k, v in sorted(seen.items())}}, indent=2))
    elif index.exists():
        index.unlink()
    return list(final.values())
