"""The experts SGLang's MoE router chose (routing replay, docs/train.md "Routing replay").

A server launched with `--enable-return-routed-experts` answers a request that sets
`return_routed_experts` with `meta_info.routed_experts`: base64 of an int32 array [rows, layers, topk],
one row per position of `[routed_experts_start_len, len(input) + len(output) - 1)` (every token the
server ran through the model: the input, prefix-cached or not, and the output but its last token), the
top-k ids as the router ranked them. Rows of cached prefix tokens are those stored with their KV, so
they are the routes the attention of the new tokens actually read.
Here they become `uint8` (at most 256 experts) or `uint16` ids: 1 or 2 bytes per id instead of 4.
"""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_rl.records import RoutedExperts

SERVER_FLAG = "--enable-return-routed-experts"


class MissingRoutes(ValueError):
    """An answer lacks the routed experts it was asked for (or they do not fit its tokens)."""


@dataclass(frozen=True)
class RoutingShape:
    """What one position's routes hold: `layers` MoE layers of `topk` ids among `experts`."""

    layers: int
    topk: int
    experts: int

    @classmethod
    def of_model(cls, model_path: str | Path) -> "RoutingShape":
        """From the HF config.json of the model the server serves (every layer an MoE layer: the MoE
        families the trainer builds refuse dense layers)."""
        cfg = json.loads((Path(model_path) / "config.json").read_text())
        experts = cfg.get("num_experts") or cfg.get("num_local_experts")
        if not experts or not cfg.get("num_experts_per_tok"):
            raise ValueError(f"{model_path}: not an MoE model (no num_experts / num_experts_per_tok in config.json)")
        return cls(int(cfg["num_hidden_layers"]), int(cfg["num_experts_per_tok"]), int(experts))

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint8 if self.experts <= 256 else "<u2")

    def decode(self, meta: dict, rows: int) -> np.ndarray:
        """`meta_info.routed_experts` as [rows, layers, topk] ids of `dtype`; MissingRoutes when absent or
        of another row count."""
        raw = meta.get("routed_experts")
        if raw is None:
            raise MissingRoutes(f"no routed_experts in the answer: launch the server with {SERVER_FLAG}")
        ids = np.frombuffer(base64.b64decode(raw), dtype=np.int32)
        if ids.size != rows * self.layers * self.topk:
            raise MissingRoutes(f"{ids.size} routed expert ids for {rows} positions x {self.layers} layers x "
                                f"top-{self.topk}")
        return ids.reshape(rows, self.layers, self.topk).astype(self.dtype)

    def record(self, routes: np.ndarray) -> RoutedExperts:
        return RoutedExperts(routes.astype(self.dtype).tobytes(), self.layers, self.topk, self.dtype.itemsize)
