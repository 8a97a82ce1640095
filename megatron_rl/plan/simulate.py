"""Discrete-event simulator of the asynchronous RL pipeline and of its synchronous baseline.

Model (the rules of `control/controller.py` + `control/budget.py`, with measured rates plugged in):
- generators decode by processor sharing: with c sequences on a generator each advances at
  `tok_s(c) / c` tokens/s (`DecodeModel`: `peak * c / (c + c_half)` or a measured table); admitting
  a sequence stalls its generator's decoding for `prefill_s`;
- async: groups of G samples are issued to the least-loaded generator whenever G slots of the
  `n_async` budget are free and the staleness admission of `control/budget.py` lets them in
  (committed samples + G <= (max_staleness + 1 - batches behind) * n_batch); a finished group is
  dropped as non-diverse with `drop_prob`, else its samples become ready; when the trainer is idle the
  groups whose token-mean staleness exceeds `max_staleness` are dropped (each token carries the
  version it was decoded under: a push mid-sequence makes the rest of it fresh), and once `n_batch`
  are ready it trains on the groups with the oldest tokens first
  (`train_a_s + n_mini * train_step_s + train_b_s * tokens`), then pushes the weights: every
  generator pauses `push_s` (in-flight sequences keep going afterwards, on the new version);
- sync: issue enough groups for a batch, wait for all of them (the longest dominates), train, push;
- episodes (`turns` > 1): a sequence's tokens are decoded in `turns` turns of equal share; between two
  turns it leaves its generator for `tool_s` seconds (the environment's step: a tool run), still in
  flight for the budget (beyond `n_async` up to `extra_in_flight` more are admitted while sequences
  are in tools: env.extra_in_flight), and its next turn is a new request (another `prefill_s`); a push
  while it waits makes its next turn's tokens the new version's.
Figures are taken over a steady-state window: from the end of update `warmup_updates` to the end of
the last update (cycle boundaries, so deterministic cases reproduce closed forms exactly).
"""
from __future__ import annotations

import heapq
import math
import random
from dataclasses import asdict, dataclass, field
from typing import Literal

from megatron_rl.plan.simulate_models import DecodeModel, LengthDist, parse_lengths

__all__ = ["DecodeModel", "LengthDist", "SimParams", "SimResult", "compare", "parse_lengths", "simulate"]

Mode = Literal["async", "sync"]
MAX_SEQUENCES = 2_000_000  # memory guard (~0.5 GB of records)


@dataclass
class SimParams:
    generators: int = 1
    decode: DecodeModel = field(default_factory=DecodeModel)
    prefill_s: float = 0.0  # per request (a sequence's first turn, each later turn), stalls its generator
    train_a_s: float = 0.0  # trainer time per update = a + n_mini * step + b * tokens
    train_b_s: float = 0.0  # seconds per trained token (prompt + completion)
    train_step_s: float = 0.0  # per optimizer step
    push_s: float = 0.0  # weight push: every generator paused this long
    n_async: int = 64
    n_batch: int = 32
    n_mini: int = 4
    group: int = 16
    lengths: LengthDist = field(default_factory=LengthDist)  # model-sampled tokens of a sequence (all its turns)
    turns: int = 1  # model turns per sequence (episode)
    tool_s: float = 0.0  # seconds between two turns, off the generator (an environment step)
    extra_in_flight: int = 0  # env.extra_in_flight: sequences admitted beyond n_async while others are in tools
    prompt_len: int = 0  # tokens per prompt (trainer cost only)
    drop_prob: float = 0.0  # probability that a finished group is non-diverse
    max_staleness: int | None = 4  # None: unbounded
    updates: int = 50
    warmup_updates: int = 5
    seed: int = 0
    keep_trace: bool = False  # return every sequence's record (tests)

    def validate(self) -> None:
        checks = [(self.generators >= 1, "generators must be >= 1"), (self.group >= 1, "group must be >= 1"),
                  (self.n_batch >= 1 and self.n_mini >= 1 and self.n_batch % self.n_mini == 0,
                   f"n_mini ({self.n_mini}) must divide n_batch ({self.n_batch})"),
                  (self.n_async >= self.group, f"n_async ({self.n_async}) must be >= group ({self.group})"),
                  (0.0 <= self.drop_prob < 1.0, "drop_prob must lie in [0, 1)"),
                  (min(self.prefill_s, self.train_a_s, self.train_b_s, self.train_step_s, self.push_s,
                       self.tool_s) >= 0, "times must be >= 0"),
                  (self.turns >= 1, "turns must be >= 1"),
                  (self.extra_in_flight >= 0, "extra_in_flight must be >= 0"),
                  (self.max_staleness is None or self.max_staleness >= 0, "max_staleness must be >= 0 or None"),
                  (0 <= self.warmup_updates < self.updates, "need 0 <= warmup_updates < updates"),
                  (self.prompt_len >= 0, "prompt_len must be >= 0")]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"simulation parameters: {msg}")


@dataclass
class SimResult:
    mode: str
    window_s: float
    updates: int  # updates inside the window
    generator_util: float  # fraction of generator time decoding or prefilling
    trainer_util: float  # fraction of time computing updates
    push_frac: float  # fraction of time spent pushing weights
    sequences_per_s: float  # trained
    tokens_per_s: float  # trained completion tokens
    generated_tokens_per_s: float
    # staleness of a trained sequence: trainer version when batched - version of its oldest token
    staleness_mean: float
    staleness_p50: float
    staleness_p95: float
    staleness_max: int
    token_staleness_mean: float  # the same per token, as the loss sees it (the admission/drop rule)
    length_ratio: float  # mean completion length: trained / all finished in the window (1: no length bias)
    versions_per_seq_mean: float
    versions_per_seq_max: int
    dropped_frac: float  # of finished sequences: non-diverse + stale
    dropped_stale_frac: float
    mean_in_flight: float  # time average of sequences on the generators
    completions_per_s: float
    mean_latency_s: float  # admission -> finish, sequences finished in the window
    trace: list[dict] | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("trace")
        return d


@dataclass
class _Seq:
    gen: int
    group: int
    length: int
    admit_t: float
    start_version: int
    finish_t: float = -1.0
    finish_version: int = -1
    trained_version: int | None = None  # trainer version when it was put in a batch
    v_start: float = 0.0  # its generator's virtual time at admission (tokens decoded = v - v_start)
    version: int = 0  # the version decoding its next tokens
    marked: float = 0.0  # tokens decoded before the last push it saw
    version_sum: float = 0.0  # sum over its tokens decoded up to `marked` of their version
    turn_ends: list[int] = field(default_factory=list)  # tokens decoded at the end of each turn left

    def mark(self, v_now: float, version: int) -> None:
        """A push: the tokens decoded since the last mark were decoded by `self.version`."""
        done = min(float(self.length), max(self.marked, v_now - self.v_start))
        self.version_sum += (done - self.marked) * self.version
        self.marked, self.version = done, version


class _Gen:
    def __init__(self) -> None:
        self.v = 0.0  # virtual time: tokens decoded by every active sequence so far
        self.last = 0.0
        self.blocked_until = 0.0  # prefill or weight-push pause
        self.heap: list[tuple[float, int]] = []  # (virtual finish, seq id)
        self.epoch = 0
        self.busy = 0.0
        self.seq_time = 0.0  # integral of active sequences over time (Little's law)


def _percentile(xs: list[int], q: float) -> float:
    s = sorted(xs)
    if not s:
        return 0.0
    pos = (len(s) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


class _Sim:
    def __init__(self, p: SimParams, mode: Mode):
        p.validate()
        if mode not in ("async", "sync"):
            raise ValueError(f"mode must be async or sync, got {mode!r}")
        self.p, self.mode = p, mode
        self.rng = random.Random(p.seed)
        self.draw = p.lengths.sampler(random.Random(p.seed + 1))  # same lengths stream in both modes
        self.gens = [_Gen() for _ in range(p.generators)]
        self.seqs: list[_Seq] = []
        self.groups: dict[int, list[int]] = {}  # unfinished groups -> member ids
        self.ready: list[int] = []
        self.events: list[tuple[float, int, str, int, int]] = []
        self.serial = 0
        self.group_serial = 0
        self.now = 0.0
        self.version = 0  # trainer version (updates done)
        self.gen_version = 0  # version the generators serve
        self.in_flight = 0
        self.phase = "idle"  # idle | training | pushing
        self.pushing = False
        self.train_time = self.push_time = 0.0
        self.finished = self.finished_tokens = self.dropped = self.dropped_stale = 0
        self.snap: dict | None = None
        self.batches: list[tuple[int, list[int], float]] = []  # (update index, seq ids, train seconds)
        self.in_tool: set[int] = set()  # sequences between two turns, off their generator

    # ------------------------------------------------------------ events
    def _push_event(self, t: float, kind: str, who: int = -1, epoch: int = 0) -> None:
        self.serial += 1
        heapq.heappush(self.events, (t, self.serial, kind, who, epoch))

    def _advance(self, g: _Gen) -> None:
        c = len(g.heap)
        if c:
            eff = max(0.0, self.now - max(g.last, g.blocked_until))
            g.v += eff * self.p.decode.tok_s(c) / c
            g.busy += eff
            g.seq_time += c * (self.now - g.last)
        g.last = self.now

    def _reschedule(self, i: int) -> None:
        g = self.gens[i]
        g.epoch += 1
        if g.heap:
            c = len(g.heap)
            dt = max(0.0, g.heap[0][0] - g.v) * c / self.p.decode.tok_s(c)
            self._push_event(max(self.now, g.blocked_until) + dt, "finish", i, g.epoch)

    def _block(self, i: int, seconds: float) -> None:
        g = self.gens[i]
        self._advance(g)
        g.blocked_until = max(g.blocked_until, self.now) + seconds  # paused: idle, not busy
        self._reschedule(i)

    def _admit(self, i: int, sid: int) -> None:
        """Sequence `sid` starts its next turn on generator `i` (a request: its prefill stalls it)."""
        g, s = self.gens[i], self.seqs[sid]
        s.v_start = g.v - s.marked  # tokens decoded so far count from its admission's virtual time
        heapq.heappush(g.heap, (s.v_start + s.turn_ends[0], sid))
        if self.p.prefill_s:
            g.busy += self.p.prefill_s
            g.blocked_until = max(g.blocked_until, self.now) + self.p.prefill_s

    def _turn_ends(self, length: int) -> list[int]:
        """Tokens decoded at the end of each turn: `length` in `turns` near-equal shares."""
        t = min(self.p.turns, max(1, length))
        return [length * (k + 1) // t for k in range(t)]

    # ------------------------------------------------------------ controller rules
    def _start_group(self) -> None:
        p = self.p
        i = min(range(p.generators), key=lambda k: (len(self.gens[k].heap), k))
        g = self.gens[i]
        self._advance(g)
        self.group_serial += 1
        gid = self.group_serial
        version = self.gen_version + (1 if self.pushing else 0)  # first token comes after the push
        if len(self.seqs) > MAX_SEQUENCES:
            raise RuntimeError(f"more than {MAX_SEQUENCES} sequences simulated: generators outpace the trainer "
                               "without a staleness bound (set max_staleness) or too many updates were asked")
        ids = []
        for _ in range(p.group):
            length = self.draw()
            s = _Seq(i, gid, length, self.now, version, v_start=g.v, version=version, turn_ends=self._turn_ends(length))
            ids.append(len(self.seqs))
            self.seqs.append(s)
            self._admit(i, ids[-1])
        self.groups[gid] = ids
        self.in_flight += p.group
        self._reschedule(i)

    def _fill(self) -> None:
        p = self.p
        if self.mode == "async":
            while self._flight_room() >= p.group and self._admits():
                self._start_group()
        elif self.in_flight == 0 and self.phase == "idle" and len(self.ready) < p.n_batch:
            for _ in range(math.ceil((p.n_batch - len(self.ready)) / p.group)):
                self._start_group()

    def _flight_room(self) -> int:
        """control/budget.flight_room: n_async outside tools, n_async + extra_in_flight in all."""
        p = self.p
        return min(p.n_async + p.extra_in_flight - self.in_flight, p.n_async - (self.in_flight - len(self.in_tool)))

    def _admits(self) -> bool:
        """RolloutBudget.free_group_slots: one more group fits the committed-batches bound."""
        p = self.p
        if p.max_staleness is None:
            return True
        behind = self.version + (self.phase == "training") - self.gen_version
        committed = p.group * len(self.groups) + len(self.ready)
        if behind == 0 and committed < p.n_batch:
            return True
        return committed + p.group <= (p.max_staleness + 1 - behind) * p.n_batch

    def _on_finish(self, i: int) -> None:
        g = self.gens[i]
        self._advance(g)
        while g.heap and g.heap[0][0] <= g.v + 1e-9 * max(1.0, g.v):
            _, sid = heapq.heappop(g.heap)
            s = self.seqs[sid]
            s.mark(float(s.turn_ends.pop(0)) + s.v_start, s.version)
            if s.turn_ends:  # to its environment; the next turn is a new request
                self.in_tool.add(sid)
                self._push_event(self.now + self.p.tool_s, "tool", sid)
                continue
            s.finish_t, s.finish_version = self.now, self.gen_version
            self.in_flight -= 1
            self.finished += 1
            self.finished_tokens += s.length
            members = self.groups[s.group]
            if all(self.seqs[m].finish_t >= 0 for m in members):
                del self.groups[s.group]
                if self.p.drop_prob and self.rng.random() < self.p.drop_prob:
                    self.dropped += len(members)
                else:
                    self.ready.extend(members)
        self._reschedule(i)

    def _on_tool_done(self, sid: int) -> None:
        self.in_tool.discard(sid)
        i = self.seqs[sid].gen
        self._advance(self.gens[i])
        self._admit(i, sid)
        self._reschedule(i)

    def _drop_stale_and_order(self) -> None:
        """As RolloutBudget.take_batch: drop groups whose token-mean lag exceeds the bound, oldest first."""
        tokens: dict[int, list[float]] = {}  # group -> [tokens, sum of their versions]
        for sid in self.ready:
            t = tokens.setdefault(self.seqs[sid].group, [0.0, 0.0])
            t[0], t[1] = t[0] + self.seqs[sid].length, t[1] + self.seqs[sid].version_sum
        lag = {gid: self.version - vs / n for gid, (n, vs) in tokens.items()}
        if self.p.max_staleness is not None:
            keep = [sid for sid in self.ready if lag[self.seqs[sid].group] <= self.p.max_staleness]
            self.dropped_stale += len(self.ready) - len(keep)
            self.dropped += len(self.ready) - len(keep)
            self.ready = keep
        if self.mode == "async":
            self.ready.sort(key=lambda sid: -lag[self.seqs[sid].group])

    def _try_train(self) -> None:
        p = self.p
        if self.phase != "idle":
            return
        self._drop_stale_and_order()
        if len(self.ready) < p.n_batch:
            return
        batch, self.ready = self.ready[:p.n_batch], self.ready[p.n_batch:]
        for sid in batch:
            self.seqs[sid].trained_version = self.version
        tokens = sum(self.seqs[sid].length + p.prompt_len for sid in batch)
        dt = p.train_a_s + p.n_mini * p.train_step_s + p.train_b_s * tokens
        self.batches.append((self.version + 1, batch, dt))
        self.train_time += dt
        self.phase = "training"
        self._push_event(self.now + dt, "trained")

    def _on_trained(self) -> None:
        self.version += 1
        self.phase = "pushing"
        self.pushing = True
        if self.p.push_s:
            for i in range(self.p.generators):
                self._block(i, self.p.push_s)
        self.push_time += self.p.push_s
        self._push_event(self.now + self.p.push_s, "pushed")

    def _on_pushed(self) -> None:
        for g in self.gens:
            self._advance(g)  # tokens decoded so far belong to the old version
            for _, sid in g.heap:
                self.seqs[sid].mark(g.v, self.version)
        for sid in self.in_tool:  # its next turn decodes under the new weights
            s = self.seqs[sid]
            s.mark(s.v_start + s.marked, self.version)
        self.gen_version = self.version
        self.pushing = False
        self.phase = "idle"
        if self.version == self.p.warmup_updates:
            self.snap = self._counters()

    def _counters(self) -> dict:
        for g in self.gens:
            self._advance(g)
        return {"t": self.now, "busy": sum(g.busy for g in self.gens), "seq_time": sum(g.seq_time for g in self.gens),
                "train": self.train_time, "push": self.push_time, "finished": self.finished,
                "tokens": self.finished_tokens, "dropped": self.dropped, "stale": self.dropped_stale}

    # ------------------------------------------------------------ run
    def run(self) -> SimResult:
        p = self.p
        if p.warmup_updates == 0:
            self.snap = self._counters()
        self._fill()
        while self.version < p.updates or self.phase != "idle":
            if not self.events:
                raise RuntimeError("simulation stalled: no pending event (n_batch never reachable?)")
            t, _, kind, who, epoch = heapq.heappop(self.events)
            self.now = t
            if kind == "finish":
                if epoch != self.gens[who].epoch:
                    continue
                self._on_finish(who)
            elif kind == "tool":
                self._on_tool_done(who)
            elif kind == "trained":
                self._on_trained()
            else:
                self._on_pushed()
            if self.version < p.updates:
                self._try_train()
                self._fill()
        return self._result()

    def _result(self) -> SimResult:
        p, a, b = self.p, self.snap, self._counters()
        assert a is not None
        dur = b["t"] - a["t"]
        trained = [sid for u, ids, _ in self.batches if u > p.warmup_updates for sid in ids]
        stale = [self.seqs[sid].trained_version - self.seqs[sid].start_version for sid in trained]
        token_lag = sum(self.seqs[sid].trained_version * self.seqs[sid].length - self.seqs[sid].version_sum
                        for sid in trained)
        trained_len = sum(self.seqs[sid].length for sid in trained)
        versions = [self.seqs[sid].finish_version - self.seqs[sid].start_version + 1 for sid in trained]
        done = [s for s in self.seqs if s.finish_t > a["t"]]
        n_fin = b["finished"] - a["finished"]
        return SimResult(
            mode=self.mode, window_s=dur, updates=p.updates - p.warmup_updates,
            generator_util=(b["busy"] - a["busy"]) / (p.generators * dur),
            trainer_util=(b["train"] - a["train"]) / dur, push_frac=(b["push"] - a["push"]) / dur,
            sequences_per_s=len(trained) / dur,
            tokens_per_s=sum(self.seqs[sid].length for sid in trained) / dur,
            generated_tokens_per_s=(b["tokens"] - a["tokens"]) / dur,
            staleness_mean=sum(stale) / len(stale), staleness_p50=_percentile(stale, 0.5),
            staleness_p95=_percentile(stale, 0.95), staleness_max=max(stale),
            token_staleness_mean=token_lag / max(1, trained_len),
            length_ratio=(trained_len / len(trained)) / max(1e-9, sum(s.length for s in done) / max(1, len(done))),
            versions_per_seq_mean=sum(versions) / len(versions), versions_per_seq_max=max(versions),
            dropped_frac=(b["dropped"] - a["dropped"]) / max(1, n_fin),
            dropped_stale_frac=(b["stale"] - a["stale"]) / max(1, n_fin),
            mean_in_flight=(b["seq_time"] - a["seq_time"]) / dur, completions_per_s=n_fin / dur,
            mean_latency_s=sum(s.finish_t - s.admit_t for s in done) / max(1, len(done)),
            trace=[asdict(s) for s in self.seqs] if p.keep_trace else None)


def simulate(params: SimParams, mode: Mode = "async") -> SimResult:
    """Run one simulation (`mode` "async": the controller's rules; "sync": generate all, train, push)."""
    return _Sim(params, mode).run()


def compare(params: SimParams) -> dict[str, SimResult]:
    """Both modes on the same inputs (same length stream)."""
    return {"async": simulate(params, "async"), "sync": simulate(params, "sync")}
