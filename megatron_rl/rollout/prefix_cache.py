"""Prefix-cache policy across in-flight weight updates.

What SGLang 0.5.23 allows: `/flush_cache` (and `flush_cache=True` on a weight update, which then
reports HTTP 400 / success False) is refused while any request is *running*; while the engine is
paused, queued requests do not block it. So after a `retract` pause (nothing running) the radix
cache can always be flushed, after an `in_place` pause only if no sequence was mid-decode.

Policy (`GeneratorConfig.prefix_cache_max_staleness = s`):
1. After every update the generator tries `/flush_cache` while still paused. Success: the cache is
   empty, nothing old can be reused. (Always the case in `retract` mode; a refusal there is an error.)
2. If refused (in_place with running sequences — the normal async case), requests sent from now on
   carry a `cache_salt` naming the *cache epoch* `version // (s + 1)`. SGLang's radix cache only
   matches prefixes inserted under the same salt, and every entry under a salt was computed by
   weights of that epoch (or newer), so a new request never reuses a prefix computed more than `s`
   versions before its own. s = 0 (default): a prefix is only reused by requests of the same version.
   The running sequences keep their own KV (that is the point of in_place, as in Magistral).
3. Once the generator has no request left on the server, it flushes (frees the memory held by
   unreachable old-epoch entries); a refusal then is harmless and retried at the next idle moment.

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
    dirty: bool = False  # old-epoch entries may remain in the radix cache

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")

    def epoch(self, version: int | None = None) -> int:
        return (self.version if version is None else version) // (self.max_staleness + 1)

    def salt(self) -> str:
        """cache_salt for a request sent now."""
        return f"i{self.incarnation}-e{self.epoch()}"

    def on_update(self, new_version: int, flushed: bool) -> None:
        old_epoch = self.epoch()
        self.version = new_version
        if flushed:
            self.dirty = False
        elif self.epoch() != old_epoch:
            self.dirty = True

    def on_restart(self, incarnation: int, version: int) -> None:
        self.incarnation, self.version, self.dirty = incarnation, version, False

    def on_idle_flush(self, flushed: bool) -> None:
        if flushed:
            self.dirty = False
