"""Prefix-cache policy across in-flight weight updates.

What SGLang 0.5.23 allows: `/flush_cache` (and `flush_cache=True` on a weight update, which then
reports HTTP 400 / success False) is refused while any request is *running*; while the engine is
paused, queued requests do not block it. So after a `retract` pause (nothing running) the radix
cache can always be flushed.

Policy (`GeneratorConfig.prefix_cache_max_staleness = s`):
1. Requests carry a `cache_salt` naming the *cache epoch* `version // (s + 1)`. SGLang's radix cache
   only matches prefixes inserted under the same salt, and every entry under a salt was computed by
   weights of that epoch (or newer), so a new request never reuses a prefix computed more than `s`
   versions before its own. s = 0 (default): a prefix is only reused by requests of the same version.
   The running sequences keep their own KV (that is the point of in_place, as in Magistral).
2. An `in_place` update therefore does not flush: old-epoch entries are unreachable and SGLang evicts
   them (LRU) when the pool needs room. A flush would stall the paused generator for nothing: SGLang
   runs `gc.collect()` on CPU (~0.5 s on the benchmark's server, against ~0.1 s for the whole rest of
   the update) and `torch.cuda.empty_cache()` on CUDA.
3. A `retract` update flushes while still paused (nothing runs, so SGLang allows it; a refusal is an
   error): the retracted sequences are re-prefilled under their old salt and would otherwise reuse KV
   of the old weights.

Requests that already reached the server before a pause (running or queued) count as in flight:
a queued one may still reuse an older prefix when it starts after the update; its tokens are
tagged with the version that produced them, like every in-flight token.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefixCachePolicy:
    max_staleness: int = 0
    incarnation: int = 0  # server (re)start count: a restarted server starts with an empty cache
    version: int = 0

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")

    def epoch(self, version: int | None = None) -> int:
        return (self.version if version is None else version) // (self.max_staleness + 1)

    def salt(self) -> str:
        """cache_salt for a request sent now."""
        return f"i{self.incarnation}-e{self.epoch()}"

    def on_update(self, new_version: int) -> None:
        self.version = new_version

    def on_restart(self, incarnation: int, version: int) -> None:
        self.incarnation, self.version = incarnation, version
