"""Generator worker: owns one SGLang server, samples G completions per prompt, streams `Rollout`s.

- `submit_group(records.GroupRequest)` queues the group's samples (one SGLang request each, so each
  completion is streamed as soon as it finishes; the requests share the prompt's prefix in the radix
  cache), capped by the group's length stage, which each of its rollouts carries back
  (`Rollout.stage`); `submit(group_id, prompt_ids, ...)` is the same for a group built on the spot.
- `get(timeout)` / `completions()` yield finished `Rollout`s with token ids, per-token behaviour
  logprobs (log_softmax(logits / T), as SGLang reports them) and per-token weight versions, and with
  `routing` (routing replay) the experts the server routed every position to (`Rollout.routed_experts`:
  each turn asks for the positions from the first one its episode holds no routes of).
- `begin_update()` / `finish_update(version)` bracket an in-flight weight update: pause
  (`in_place` keeps running sequences and their KV, `retract` re-prefills them), open SGLang's
  weight-update session, ... senders push buckets ..., set + verify the version, close the session,
  apply the prefix-cache policy (see prefix_cache.py), continue.

Death of the server (connection refused/reset, process gone) is recovered here when
`on_death="restart"` (default): the server is relaunched from `model_path` and every turn in flight
runs again from its start there (an episode resumes at its last turn boundary, with its environment
and the turns before kept). The relaunched server serves the weights on disk, i.e. version
`initial_version`, and `needs_weight_sync` becomes True: tokens are honestly tagged with that
version, and the controller is expected to push the current weights (senders re-create their
update groups because `incarnation` changed). With `on_death="raise"`, or once `max_restarts` is
exhausted, `get()` raises `GeneratorDied` and the unfinished samples are listed in it.
A request whose stream stays silent past the server's `request_idle_timeout_s` is no death (the
server may still answer /health while hung): `get()` raises the client's `GenerationTimeout`.
`tokens_streamed` counts the output tokens received so far (progress while completions run).
Episodes: at every turn boundary of a multi-turn episode its `PartialEpisode` is queued for
`boundaries()`; a group's `resume` entries continue episodes from such a record instead of starting
them (rollout/episode.py: the environment replays the recorded turns; one that answers differently
starts over, `EpisodeReport.replay_diverged`).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import queue
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterator, Literal

from megatron_rl.config import GeneratorConfig, RolloutConfig
from megatron_rl.records import GroupRequest, PartialEpisode, Rollout
from megatron_rl.rollout.adapters import AdapterVersions, adapter_name
from megatron_rl.rollout.client import PauseMode, SGLangHTTPError, ServerUnreachable
from megatron_rl.rollout.episode import Episode, EpisodeSetup, ReplayDiverged, run_episode
from megatron_rl.rollout.outputs import Turn, parse_version, scoring_temperature
from megatron_rl.rollout.prefix_cache import PrefixCachePolicy
from megatron_rl.rollout.routing import RoutingShape
from megatron_rl.rollout.server import SGLangServer


class GeneratorDied(RuntimeError):
    """The server died and was not (or could not be) restarted. `unfinished` (the samples not
    delivered, by group) can be re-submitted."""

    def __init__(self, msg: str, unfinished: list[GroupRequest]):
        super().__init__(msg)
        self.unfinished = unfinished


class _ServerGone(Exception):
    """The generator died while a turn waited for its server (the sample stays pending: unfinished)."""


class WeightUpdateError(RuntimeError):
    """A weight update did not complete; the generator stays paused with its session open."""


@dataclass
class Sample:
    """One pending completion: sample `index` of `group` (the request it came in), its sampling
    parameters and its attempts on the server."""

    group: GroupRequest
    index: int
    sampling: dict[str, Any]
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    attempts: int = 0
    streamed: int = 0  # output tokens received by its current request
    request_id: str = ""  # of the request now on the server (one per turn and attempt)
    routes_from: int = 0  # first position its episode holds no routed experts of (routing replay)
    between_turns: bool = False  # a turn ended and the next has not begun: its environment's step runs
    on_server: bool = False  # its current request was sent and has not come back
    resend: bool = False  # aborted as not started when an update began: its turn is sampled again after it


class Generator:
    def __init__(self, server: SGLangServer, rollout: RolloutConfig | None = None,
                 config: GeneratorConfig | None = None, generator_id: int = 0,
                 max_concurrency: int | None = None, on_death: Literal["restart", "raise"] = "restart",
                 max_restarts: int = 3, episodes: EpisodeSetup | None = None, record_boundaries: bool = False,
                 routing: RoutingShape | None = None, adapter_push: bool = False):
        self.server = server
        # trainer.lora.push: adapter: the server serves the base plus pushed adapters (rollout/adapters.py);
        # updates load an adapter without pausing, each turn names the newest and keeps it to its end
        self.adapters = AdapterVersions(server.spec.initial_version) if adapter_push else None
        self.routing = routing  # ask for the routed experts of every position (the server runs with routing.SERVER_FLAG)
        self.episodes = episodes or EpisodeSetup()
        self.rollout = rollout or RolloutConfig()
        self.config = config or GeneratorConfig()
        self.generator_id = generator_id
        self.on_death = on_death
        self.max_restarts = max_restarts
        self.cache = PrefixCachePolicy(self.config.prefix_cache_max_staleness,
                                       version=server.spec.initial_version)
        self.needs_weight_sync = False
        self.tokens_streamed = 0  # output tokens received so far, over every request (progress)
        self._out: queue.Queue[Rollout | BaseException] = queue.Queue()
        self.record_boundaries = record_boundaries  # queue each turn boundary for boundaries()
        self._boundaries: queue.Queue[PartialEpisode] = queue.Queue()
        self._pending: dict[str, Sample] = {}
        self._lock = threading.Lock()
        self._recover_lock = threading.Lock()
        self._send_gate = threading.Event()  # cleared during an update: hold new requests back
        self._send_gate.set()
        self._update_mode: PauseMode | None = None
        self._in_place_updates = 0  # finished in_place updates (a request sent before one may prefill after it)
        self._dead: GeneratorDied | None = None
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency or self.rollout.n_async,
                                        thread_name_prefix=f"gen{generator_id}")
        self._closed = False

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> "Generator":
        self.server.start()
        self.cache.on_restart(self.server.incarnation, self.server.spec.initial_version)
        return self

    def close(self) -> None:
        """Abort what runs, stop the server (whole process group) and the worker threads."""
        if self._closed:
            return
        self._closed = True
        if self.server.alive():
            try:
                self.server.client.abort(abort_all=True)
            except (SGLangHTTPError, OSError):  # best effort: the server is stopped next either way
                pass
        self.server.stop()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "Generator":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def version(self) -> int:
        return self.cache.version

    @property
    def incarnation(self) -> int:
        return self.server.incarnation

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._pending)

    # ---------------------------------------------------------------- sampling
    def sampling_params(self, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        sp = {"temperature": self.rollout.temperature, "top_p": self.rollout.top_p,
              "max_new_tokens": self.rollout.max_new_tokens}
        sp.update(overrides or {})
        if sp.get("max_new_tokens", 0) < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {sp.get('max_new_tokens')}")
        return sp

    def submit(self, group_id: str, prompt_ids: list[int], group_size: int | None = None,
               sampling: dict[str, Any] | None = None, sample_indices: list[int] | None = None) -> list[str]:
        """Queue G samples of one prompt (or exactly `sample_indices`, e.g. to re-issue part of a
        group), with no length stage; returns their request ids."""
        g = self.rollout.group_size if group_size is None else group_size
        if g < 1:
            raise ValueError(f"group_size must be >= 1, got {g}")
        indices = list(range(g)) if sample_indices is None else list(sample_indices)
        return self.submit_group(GroupRequest(group_id, list(prompt_ids or []), indices, sampling=dict(sampling or {})))

    def submit_group(self, group: GroupRequest) -> list[str]:
        """Queue the samples of `group` as it came (its stage's cap, then its sampling overrides, over
        the configured sampling); returns their request ids."""
        if self._closed:
            raise RuntimeError("generator is closed")
        if self._dead is not None:
            raise self._dead
        prompt_ids = group.prompt_ids
        if not prompt_ids or not all(isinstance(t, int) and t >= 0 for t in prompt_ids):
            raise ValueError(f"prompt_ids must be a non-empty list of token ids (group {group.group_id})")
        sp = self.sampling_params(group.sampling_overrides())
        samples = [Sample(group, i, sp) for i in group.sample_indices]
        for s in samples:
            self._issue(s)
        return [s.rid for s in samples]

    def _issue(self, s: Sample) -> None:
        with self._lock:
            self._pending[s.rid] = s
        self._pool.submit(self._run, s)

    def _run(self, s: Sample) -> None:
        try:
            s.attempts += 1
            try:
                ep = self._episode(s)
            except _ServerGone:  # the generator died: the sample is listed in GeneratorDied.unfinished
                return
            finally:
                s.between_turns = False
            r = Rollout(group_id=s.group.group_id, sample_index=s.index, prompt_ids=ep.prompt_ids,
                        completion_ids=ep.ids, behaviour_logprobs=ep.logprobs, weight_versions=ep.versions,
                        finish_reason=ep.finish_reason, text=ep.text, generator_id=self.generator_id,
                        stage=s.group.stage, temperature=scoring_temperature(s.sampling), loss_mask=ep.loss_mask,
                        episode=ep.report,
                        routed_experts=None if ep.routes is None else self.routing.record(ep.routes))
            # queued before it leaves _pending: in_flight == 0 with an empty queue means all delivered
            self._out.put(r)
            with self._lock:
                self._pending.pop(s.rid, None)
        except BaseException as e:  # never lose a sample silently: surface the error to get()
            self._out.put(e)
            with self._lock:
                self._pending.pop(s.rid, None)

    def _episode(self, s: Sample) -> Episode:
        """Play sample `s`'s episode: from its start, or on from the group's record of it."""
        e, start = self.episodes, s.group.resume.get(s.index)

        def play(start: PartialEpisode | None) -> Episode:
            return run_episode(e.make_env(), s.group.task, s.group.prompt_ids, lambda ids, n: self._turn(s, ids, n),
                               s.sampling["max_new_tokens"], e.limits, e.turns, start,
                               functools.partial(self._record, s) if self.record_boundaries else None)

        if start is None:
            return play(None)
        try:
            return play(start)
        except ReplayDiverged:  # its context no longer matches a new environment: start it over
            ep = play(None)
            ep.report.replay_diverged = True
            return ep

    def _record(self, s: Sample, ep: Episode) -> None:
        self._boundaries.put(ep.partial(s.group.group_id, s.index))

    def boundaries(self) -> list[PartialEpisode]:
        """The turn boundaries episodes reached since the last call (the latest per episode comes last)."""
        out = []
        while True:
            try:
                out.append(self._boundaries.get_nowait())
            except queue.Empty:
                return out

    @property
    def env_waiting(self) -> int:
        """Samples between two turns: their environment steps (a tool run), the server has nothing of
        theirs to decode (the controller's admission: env.extra_in_flight)."""
        with self._lock:
            return sum(s.between_turns for s in self._pending.values())

    def _turn(self, s: Sample, context: list[int], max_new_tokens: int) -> Turn:
        """One model turn of sample `s` from `context`: a new request (after an update it carries the new
        cache salt, so its prefill runs under the new weights). If the server dies meanwhile, the turn
        runs again from its start on the relaunched server: the episode resumes at its last turn boundary."""
        s.between_turns = False
        try:
            return self._request_turn(s, context, max_new_tokens)
        finally:
            s.between_turns = True  # until its next turn, or its end (_run)

    def _request_turn(self, s: Sample, context: list[int], max_new_tokens: int) -> Turn:
        while True:
            self._send_gate.wait()
            if self._dead is not None or self._closed:
                raise _ServerGone
            incarnation, in_place_updates, epoch = self.server.incarnation, self._in_place_updates, self.cache.epoch()
            with self._lock:
                s.request_id = f"{s.rid}-{s.attempts}-{uuid.uuid4().hex[:8]}"
                s.streamed = 0  # each request (a turn, a turn again) streams from its first token
                s.on_server, s.resend = True, False
            body = {"input_ids": context, "sampling_params": dict(s.sampling, max_new_tokens=max_new_tokens),
                    "return_logprob": True, "rid": s.request_id, "cache_salt": self.cache.salt()}
            if self.routing is not None:
                body |= {"return_routed_experts": True, "routed_experts_start_len": s.routes_from}
            adapter = None
            if self.adapters is not None:
                adapter, version = self.adapters.acquire()
                if adapter is not None:
                    body["lora_path"] = adapter
            try:
                out = self.server.client.generate(body, on_tokens=lambda n: self._count_tokens(s, n))
                turn = Turn.of(out, self.routing, s.routes_from)
                if self.adapters is not None:  # the adapter it named sampled every token (adapters.py)
                    turn.versions = [version] * len(turn.ids)
                elif s.resend or self._prefilled_after_update(turn, in_place_updates, epoch):
                    continue  # nothing of it is kept: sampled again from the same context, under the new salt
                s.routes_from = len(context) + len(turn.ids) - 1
                return turn
            except ServerUnreachable as err:
                if not self._recover(incarnation, err):
                    raise _ServerGone from err
            finally:
                s.on_server = False
                if self.adapters is not None:
                    self._unload(self.adapters.release(adapter))

    def _prefilled_after_update(self, turn: Turn, in_place_updates: int, epoch: int) -> bool:
        """The request was sent before an in_place update and prefilled after it (its first token has a
        later version): its old cache salt let it reuse prompt KV the old weights computed, which its
        new-version tokens would wrongly pass for theirs. begin_update aborts such requests; this catches
        one that reached the server's queue only after those aborts."""
        return (self._in_place_updates != in_place_updates and bool(turn.versions)
                and self.cache.epoch(turn.versions[0]) != epoch)

    def _abort_unstarted(self) -> None:
        """Abort every request on the server that has streamed nothing yet (queued, or not far into its
        first tokens): it is sent again after the update, under the new cache salt (_request_turn)."""
        with self._lock:
            unstarted = [s for s in self._pending.values() if s.on_server and s.streamed == 0]
            for s in unstarted:
                s.resend = True
        for s in unstarted:
            self.server.client.abort(s.request_id)

    def _count_tokens(self, s: Sample, n: int) -> None:
        with self._lock:
            self.tokens_streamed += n - s.streamed
            s.streamed = n

    def get(self, timeout: float | None = None) -> Rollout | None:
        """Next finished rollout, or None after `timeout`; raises what a worker hit."""
        try:
            item = self._out.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def completions(self, n: int | None = None, timeout: float | None = None) -> Iterator[Rollout]:
        """Yield finished rollouts as they come (all pending ones when n is None)."""
        count = itertools.count()
        while n is None or next(count) < n:
            if n is None and self.in_flight == 0 and self._out.empty():
                return
            r = self.get(timeout=timeout)
            if r is None:
                raise TimeoutError(f"no completion within {timeout} s ({self.in_flight} in flight)")
            yield r

    def abort(self, rid: str) -> None:
        """Abort one sample; it still comes back (finish_reason 'abort') with its partial tokens."""
        with self._lock:
            s = self._pending.get(rid)
        if s is not None:
            self.server.client.abort(s.request_id)

    # ---------------------------------------------------------------- death and recovery
    def _recover(self, incarnation: int, err: Exception) -> bool:
        """After a request found the server unreachable: relaunch it (once, whichever request notices
        first) unless it was already; False when the generator is dead or closing."""
        if self._closed:  # shutting down: the server was stopped on purpose, never relaunch it
            return False
        with self._recover_lock:
            if self._dead is None and self.server.incarnation == incarnation and not self.server.healthy():
                if self.on_death == "restart" and self.server.restarts < self.max_restarts:
                    self._send_gate.clear()
                    try:
                        self.server.restart()
                    except Exception as e:
                        self._die(f"restart of the SGLang server failed: {e}")
                    else:
                        self.cache.on_restart(self.server.incarnation, self.server.spec.initial_version)
                        if self.adapters is not None:
                            self.adapters.reset()
                        self.needs_weight_sync = True
                        self._update_mode = None
                    finally:
                        self._send_gate.set()
                else:
                    why = "on_death='raise'" if self.on_death == "raise" else f"{self.max_restarts} restarts used"
                    self._die(f"SGLang server on port {self.server.spec.port} died ({err}); {why}")
        return self._dead is None

    def _die(self, msg: str) -> None:
        with self._lock:
            pending = list(self._pending.values())
            self._pending.clear()
        by_group: dict[str, list[Sample]] = {}
        for s in pending:
            by_group.setdefault(s.group.group_id, []).append(s)
        unfinished = [dataclasses.replace(ss[0].group, sample_indices=[s.index for s in ss]) for ss in by_group.values()]
        self._dead = GeneratorDied(msg, unfinished)
        self._out.put(self._dead)

    # ---------------------------------------------------------------- weight updates
    def begin_update(self, mode: PauseMode | None = None) -> None:
        """Pause generation and open SGLang's weight-update session; senders may push buckets next."""
        if self.adapters is not None:  # an adapter is loaded beside the running ones: nothing pauses
            return
        mode = mode or self.config.update_mode
        if mode not in ("in_place", "retract"):
            raise ValueError(f"update mode must be in_place or retract, got {mode!r}")
        if self._update_mode is not None:  # retry after a failed send: the session is still open
            return
        self._send_gate.clear()
        if mode == "in_place":  # retract flushes the radix cache after the update instead (finish_update)
            self._abort_unstarted()
        self.server.client.pause(mode)
        self.server.client.begin_weight_update()
        self._update_mode = mode

    def finish_update(self, version: int) -> None:
        """Stamp `version`, verify the server reports it, close the session, apply the prefix
        policy and continue. Call only after every sender reported success. With adapter push: new
        turns name adapter `version` (which the sender loaded; checked here), and adapters no turn uses
        any more are unloaded."""
        if self.adapters is not None:
            loaded = self.server.client.loaded_adapters()
            if adapter_name(version) not in loaded:
                raise WeightUpdateError(f"generator {self.generator_id} lacks adapter {adapter_name(version)} after "
                                        f"the push of version {version} (loaded: {sorted(loaded)})")
            self.cache.on_update(version)
            self.needs_weight_sync = False
            self._unload(self.adapters.switch(version))
            return
        if self._update_mode is None:
            raise WeightUpdateError("finish_update without begin_update")
        c = self.server.client
        c.set_weight_version(str(version))
        got = c.weight_version()
        if parse_version(got) != version:
            raise WeightUpdateError(f"generator {self.generator_id} reports version {got} after update to {version}")
        c.end_weight_update()
        # retract re-prefills the paused sequences under their old cache salt: only a flush keeps them
        # from reusing KV of the old weights. in_place needs none (new requests carry a new salt; those sent
        # before it and not started were aborted and go again: begin_update) and a flush would stall the
        # paused generator (SGLang runs gc.collect on CPU, empty_cache on CUDA)
        if self._update_mode == "retract" and not c.flush_cache():
            raise WeightUpdateError("radix cache flush refused after a retract pause; KV would not be exact")
        self.cache.on_update(version)
        self.needs_weight_sync = False
        self._in_place_updates += self._update_mode == "in_place"
        self._update_mode = None
        c.resume()
        self._send_gate.set()

    def _unload(self, names: list[str]) -> None:
        """Free adapters no turn uses (SGLang keeps each loaded adapter in host memory)."""
        for name in names:
            try:
                self.server.client.unload_lora_adapter(name)
            except (ServerUnreachable, SGLangHTTPError):  # a restarted server holds none; a retry frees it next time
                pass

    def restart(self) -> None:
        """Relaunch the server (weights from disk). Samples that were on the old server see their
        connection drop and re-issue themselves (once each) on the new one."""
        with self._recover_lock:
            self._send_gate.clear()
            try:
                self.server.restart()
                self.cache.on_restart(self.server.incarnation, self.server.spec.initial_version)
                if self.adapters is not None:
                    self.adapters.reset()
                self.needs_weight_sync = True
                self._update_mode = None
            finally:
                self._send_gate.set()

