"""The `generator` section: SGLang servers and the weight update (megatron_rl.rollout, megatron_rl.sync)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_rl.config.tree import check


@dataclass
class GeneratorConfig:
    """SGLang generator workers and weight sync (megatron_rl.rollout, megatron_rl.sync)."""

    num_generators: int = 1
    tp_size: int = 1  # GPUs per SGLang server (its --tp-size), all on one node; `megatron-rl plan` places them
    port_base: int = 30000
    max_total_tokens: int = 65536  # SGLang KV-cache size; always set (the default is huge on CPU)
    mem_fraction_static: float | None = None
    # in_place: running sequences keep their KV and continue (Magistral); retract: re-prefill.
    update_mode: Literal["in_place", "retract"] = "in_place"
    # A request never reuses a cached prefix computed by weights more than this many versions older (cache salts).
    prefix_cache_max_staleness: int = 0
    bucket_mb: int = 256
    # Time allowed for a server to become healthy. null: 600 s + the model's weights read at 100 MB/s (a
    # cold first start from shared storage: CUDA graphs, kernel compilation); the error names this key.
    startup_timeout_s: float | None = None
    # Longest a request's stream may stay silent (queued, paused for an update, or a hung server) before
    # the run stops with an error naming the server; a completion's length is not limited by it. null: no limit.
    request_idle_timeout_s: float | None = 3600.0
    extra_args: list[str] = field(default_factory=list)

    def validate(self, key: str) -> None:
        check(self.num_generators >= 1, f"{key}.num_generators", "must be >= 1")
        check(1024 <= self.port_base <= 65000, f"{key}.port_base", "must lie in [1024, 65000]")
        check(self.max_total_tokens >= 256, f"{key}.max_total_tokens", "must be >= 256")
        check(self.bucket_mb >= 1, f"{key}.bucket_mb", "must be >= 1")
        check(self.prefix_cache_max_staleness >= 0, f"{key}.prefix_cache_max_staleness", "must be >= 0")
        check(self.mem_fraction_static is None or 0 < self.mem_fraction_static < 1,
               f"{key}.mem_fraction_static", "must lie in (0, 1) or be null")
        check(self.startup_timeout_s is None or self.startup_timeout_s > 0,
              f"{key}.startup_timeout_s", "must be > 0 or null (derived from the model's size)")
        check(self.request_idle_timeout_s is None or self.request_idle_timeout_s > 0,
              f"{key}.request_idle_timeout_s", "must be > 0 or null (no limit)")
