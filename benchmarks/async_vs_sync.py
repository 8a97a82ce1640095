"""Async vs synchronous RL throughput, measured on the real generator + trainer, and simulated.

Same hardware, model, prompts and heavy-tailed completion lengths in both modes:
- generator: one real SGLang server (`megatron_rl.rollout.Generator`) on a tiny random Llama
  (`tests/support/models.py:make_tiny_llama`), pinned to core `--gen-core`; lengths are forced per
  request (`max_new_tokens` from a bounded Pareto on [low, ratio * low], `ignore_eos`);
- trainer: the real Megatron-Core `Trainer` on the same model in this process, pinned to core
  `--train-core` (so are this process's HTTP client threads); weights pushed in place after every
  update with `sync.update.push_in_process` (`WeightSender`, gloo) from the trainer's HF export;
- bookkeeping: the controller's own `RolloutBudget` (groups, staleness bound, batches).
Sync: issue the groups of one batch, wait for all of them, train, push. Async: keep up to `n_async`
sequences in flight, as the budget admits them (staleness admission, `RolloutBudget.free_group_slots`);
the trainer trains whenever `n_batch` are ready (groups with the oldest tokens first), then pushes
while generation continues. Throughput = trained sequences (tokens) / wall time over updates after
`--warmup`, pooled over `--pairs` alternating sync / async runs (the machine's speed drifts
between runs); per mode also the token staleness of the trained batches, the groups dropped as stale, the
mean length of trained / all completed samples (length bias), the generator's CPU use (its server's
processes) and the trainer's busy share (train + push). The simulator (`megatron_rl.plan.simulate`)
is then calibrated on this run's measured rates (decode tokens/s measured at several concurrencies and
fitted with peak * c / (c + c_half), the trainer's time per update against its tokens, the push
time), run for this layout and for a scaled-out one (--sim-generators generators, --sim-trainers
data-parallel trainers, lengths --sim-ratio x), and printed next to the measured figures.

    .venv/bin/python benchmarks/async_vs_sync.py            # ~4 minutes on 2 idle cores (3 pairs)
    .venv/bin/python benchmarks/async_vs_sync.py --pairs 1 --updates 3 --warmup 1   # a quick look
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


@dataclass
class ModeResult:
    seqs: int = 0
    tokens: int = 0
    seconds: float = 0.0
    train: list[tuple[int, float]] = field(default_factory=list)  # (tokens incl. prompt, seconds)
    push: list[float] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)  # per trained token: batch version - its version
    dropped_frac: float = 0.0  # groups dropped as stale / groups completed (whole phase)
    length_ratio: float = 1.0  # mean completion length: trained / all graded (RolloutBudget.length_stats)
    trainer_busy_s: float = 0.0  # training + pushing, measured updates
    gen_cpu_s: float = 0.0  # CPU seconds of the SGLang server's processes over the measured window

    def utilisation(self) -> str:
        return f"{self.gen_cpu_s / self.seconds:.0%} / {self.trainer_busy_s / self.seconds:.0%}"

    @property
    def seq_s(self) -> float:
        return self.seqs / self.seconds

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


class Bench:
    def __init__(self, args, gen, trainer, sender):
        from megatron_rl.config import AlgoConfig, RolloutConfig
        from megatron_rl.plan.simulate import LengthDist

        self.args, self.gen, self.trainer, self.sender = args, gen, trainer, sender
        self.rollout_cfg = RolloutConfig(group_size=args.group, n_async=args.n_async, n_batch=args.n_batch,
                                         n_mini=args.n_mini, max_staleness=args.max_staleness)
        self.algo = AlgoConfig()
        self.lengths = LengthDist("pareto", low=args.low, ratio=args.ratio, alpha=args.alpha)
        self.draw = self.lengths.sampler(random.Random(args.seed))
        self.rng = random.Random(args.seed + 1)
        self.vocab = trainer.dims.vocab_size
        self.serial = 0

    def _problem(self):
        from megatron_rl.records import Problem

        self.serial += 1
        return Problem(f"p{self.serial}", "", {})

    def _issue_group(self, budget) -> None:
        group = budget.start_group(self._problem())
        for i in range(budget.cfg.group_size):
            prompt = [self.rng.randrange(3, self.vocab) for _ in range(self.args.prompt_len)]
            sp = {"max_new_tokens": self.draw(), "ignore_eos": True, "temperature": 1.0}
            self.gen.submit(group.group_id, prompt, group_size=1, sampling=sp, sample_indices=[i])

    def _graded(self, budget, timeout: float) -> bool:
        r = self.gen.get(timeout=timeout)
        if r is None:
            return False
        self._add(budget, r)
        return True

    def _add(self, budget, r) -> None:
        r.reward = self.rng.gauss(0.0, 1.0)  # stand-in verifier: groups are always diverse
        budget.add_graded(r)

    def _update(self, batch, res: ModeResult, measured: bool) -> None:
        from megatron_rl.sync.update import push_in_process
        from megatron_rl.train.hf_weights import export_hf_tensors

        tokens = sum(len(s.token_ids) for s in batch.sequences)
        t0 = time.perf_counter()
        self.trainer.train_on(batch)
        t1 = time.perf_counter()
        push_in_process([self.gen], [(self.sender, export_hf_tensors(self.trainer.model_chunks))], self.trainer.version)
        t2 = time.perf_counter()
        if measured:  # the calibration too: a run's first update pays one-time costs
            res.train.append((tokens, t1 - t0))
            res.push.append(t2 - t1)
            res.trainer_busy_s += t2 - t0
            res.seqs += len(batch.sequences)
            res.tokens += sum(s.completion_len for s in batch.sequences)
            res.staleness += [batch.policy_version - v for s in batch.sequences for v in s.weight_versions]

    def run_sync(self, updates: int, warmup: int) -> ModeResult:
        from megatron_rl.control.budget import RolloutBudget

        budget = RolloutBudget(self.rollout_cfg, self.algo)
        res, t_start = ModeResult(), None
        for u in range(updates):
            batch = budget.take_batch(self.trainer.version)
            while batch is None:  # generate all (enough groups for a batch), then train
                for _ in range(-(-(self.args.n_batch - len(budget.ready)) // self.args.group)):
                    self._issue_group(budget)
                while budget.in_flight:
                    self._graded(budget, timeout=600)
                batch = budget.take_batch(self.trainer.version)
            self._update(batch, res, measured=u >= warmup)
            if u + 1 == warmup:
                t_start, res.gen_cpu_s = time.perf_counter(), -self._gen_cpu_s()
        res.seconds = time.perf_counter() - t_start
        res.gen_cpu_s += self._gen_cpu_s()
        _close_phase(res, budget)
        return res

    def run_async(self, updates: int, warmup: int) -> ModeResult:
        """The trainer stays in the main thread (Megatron's CPU shims are per thread); a rollout
        thread keeps n_async in flight and grades, sharing the budget under a lock."""
        from megatron_rl.control.budget import RolloutBudget

        budget = RolloutBudget(self.rollout_cfg, self.algo)
        lock, stop, errors = threading.Lock(), threading.Event(), []

        def rollouts():
            try:
                while not stop.is_set():
                    with lock:
                        for _ in range(budget.free_group_slots()):
                            self._issue_group(budget)
                    r = self.gen.get(timeout=0.01)
                    if r is not None:
                        with lock:
                            self._add(budget, r)
            except BaseException as e:  # surfaced in the main thread
                errors.append(e)

        worker = threading.Thread(target=rollouts, daemon=True)
        worker.start()
        res, t_start = ModeResult(), None
        try:
            for u in range(updates):
                batch = None
                while batch is None:
                    if errors:
                        raise errors[0]
                    with lock:
                        batch = budget.take_batch(self.trainer.version)
                    if batch is None:
                        time.sleep(0.005)
                self._update(batch, res, measured=u >= warmup)  # generation goes on meanwhile
                with lock:
                    budget.weights_served(self.trainer.version)  # admission: new samples start on them
                if u + 1 == warmup:
                    t_start, res.gen_cpu_s = time.perf_counter(), -self._gen_cpu_s()
            res.seconds = time.perf_counter() - t_start
            res.gen_cpu_s += self._gen_cpu_s()
        finally:
            stop.set()
            worker.join()
        _close_phase(res, budget)
        while budget.in_flight:  # drain so the next phase starts on an idle server
            self._graded(budget, timeout=600)
        return res

    def _gen_cpu_s(self) -> float:
        """CPU seconds used so far by the generator's server and its child processes (its core's busy time)."""
        import psutil

        root = psutil.Process(self.gen.server.proc.pid)
        total = 0.0
        for proc in [root] + root.children(recursive=True):
            try:
                t = proc.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total

    def _round(self, c: int, tokens: int) -> float:
        t0 = time.perf_counter()
        for i in range(c):
            prompt = [self.rng.randrange(3, self.vocab) for _ in range(self.args.prompt_len)]
            self.gen.submit(f"d{c}-{i}", prompt, group_size=1,
                            sampling={"max_new_tokens": tokens, "ignore_eos": True, "temperature": 1.0})
        for _ in self.gen.completions(timeout=600):
            pass
        return time.perf_counter() - t0

    def decode_model(self, levels: list[int], short: int, long: int) -> tuple[list[tuple[float, float]], float]:
        """Steady decode tokens/s at several concurrencies, from rounds of `short` and `long` tokens
        (the difference removes per-request costs), and the per-sequence start-up cost (prefill,
        request handling) from the intercept: what the simulator's DecodeModel and prefill_s need."""
        table, starts = [], []
        for c in levels:
            t_short, t_long = self._round(c, short), self._round(c, long)
            rate = c * (long - short) / max(1e-6, t_long - t_short)
            table.append((float(c), rate))
            starts.append(max(0.0, t_short - c * short / rate) / c)
        return table, statistics.median(starts)


def _pooled(runs: list[ModeResult]) -> ModeResult:
    """The runs of one mode as one: throughput over their summed time, every sample's figures."""
    out = ModeResult(dropped_frac=statistics.fmean(r.dropped_frac for r in runs),
                     length_ratio=statistics.fmean(r.length_ratio for r in runs))
    for r in runs:
        out.seqs, out.tokens, out.seconds = out.seqs + r.seqs, out.tokens + r.tokens, out.seconds + r.seconds
        out.train, out.push, out.staleness = out.train + r.train, out.push + r.push, out.staleness + r.staleness
        out.trainer_busy_s, out.gen_cpu_s = out.trainer_busy_s + r.trainer_busy_s, out.gen_cpu_s + r.gen_cpu_s
    return out


def _close_phase(res: ModeResult, budget) -> None:
    c = budget.counters
    res.dropped_frac = c.groups_dropped_stale / max(1, c.groups_completed)
    res.length_ratio = budget.length_stats().get("length/trained_vs_completed", 1.0)


def simulated(args, table, prefill_s: float, sync: ModeResult, asyn: ModeResult):
    """The simulator calibrated on this run: its 1-generator / 1-trainer layout, and the same rates
    scaled out to --sim-generators generators and --sim-trainers data-parallel trainers (each trainer
    takes n_batch sequences per update: n_batch x trainers in all; n_async keeps its ratio to n_batch;
    the per-update trainer overhead and the push time are kept as measured) with Pareto lengths whose
    longest is --sim-ratio x the shortest."""
    from dataclasses import replace

    from megatron_rl.plan.simulate import DecodeModel, LengthDist, SimParams, compare
    from megatron_rl.plan.simulate_calibration import fit_line

    pairs = sync.train + asyn.train
    a, b = fit_line([float(t) for t, _ in pairs], [s for _, s in pairs])
    # smooth the (noisy, shared-machine) table with tok_s(c) = peak c / (c + c_half), i.e. the line
    # 1/tok_s = 1/peak + (c_half/peak) (1/c)
    inv_peak, slope = fit_line([1 / c for c, _ in table], [1 / t for _, t in table], min_spread=0.0)
    decode = DecodeModel(1 / inv_peak, slope / inv_peak) if inv_peak > 0 else DecodeModel(table=table)
    p = SimParams(generators=1, decode=decode, prefill_s=prefill_s, train_a_s=a, train_b_s=b,
                  push_s=statistics.median(sync.push + asyn.push), n_async=args.n_async, n_batch=args.n_batch,
                  n_mini=args.n_mini, group=args.group, prompt_len=args.prompt_len,
                  lengths=LengthDist("pareto", low=args.low, ratio=args.ratio, alpha=args.alpha),
                  max_staleness=args.max_staleness, updates=200, warmup_updates=20, seed=args.seed)
    n_batch = args.n_batch * args.sim_trainers
    big = replace(p, generators=args.sim_generators, train_b_s=b / args.sim_trainers, n_batch=n_batch,
                  n_async=n_batch * args.n_async // args.n_batch, updates=60, warmup_updates=10,
                  lengths=replace(p.lengths, ratio=args.sim_ratio))
    return p, compare(p), big, compare(big)


def report(args, params, sim, big, big_sim, sync: ModeResult, asyn: ModeResult) -> None:
    print(f"\nworkload: G={args.group}, n_batch={args.n_batch}, n_mini={args.n_mini}, n_async={args.n_async}, "
          f"max_staleness={args.max_staleness}, completion lengths Pareto(alpha={args.alpha}) on "
          f"[{args.low}, {int(args.low * args.ratio)}], prompt {args.prompt_len}; "
          f"{args.updates - args.warmup} measured updates per mode and run, {args.pairs} alternating pair(s)")
    d = params.decode
    curve = f"{d.peak_tok_s:.0f} c / (c + {d.c_half:.1f}) tok/s" if not d.table else "the measured table"
    print(f"fitted: decode {curve}, trainer {params.train_a_s:.3f} s + {params.train_b_s * 1e3:.3f} ms/token, push "
          f"{params.push_s:.3f} s, start-up {params.prefill_s * 1e3:.1f} ms/sequence")
    print(f"{'measured':10}{'seq/s':>8}{'tok/s':>8}{'token lag mean/max':>20}{'stale drops':>12}"
          f"{'trained/all length':>20}{'gen cpu / trainer busy':>24}")
    for name, m in (("sync", sync), ("async", asyn)):
        stale = f"{statistics.fmean(m.staleness):.2f}/{max(m.staleness)}"
        print(f"{name:10}{m.seq_s:8.2f}{m.tok_s:8.0f}{stale:>20}{m.dropped_frac:12.1%}{m.length_ratio:20.3f}"
              f"{m.utilisation():>24}")
    layouts = (("1 gen / 1 trainer", sim), (f"{big.generators} gen / {args.sim_trainers} trainers, "
                                           f"lengths x{args.sim_ratio:g}", big_sim))
    print(f"{'simulated':44}{'seq/s':>9}{'tok/s':>9}{'token lag':>10}{'stale drops':>12}{'trained/all':>12}"
          f"{'gen util':>9}{'train util':>11}")
    for layout, res in layouts:
        for name in ("sync", "async"):
            r = res[name]
            print(f"{layout + ' ' + name:44}{r.sequences_per_s:9.2f}{r.tokens_per_s:9.0f}{r.token_staleness_mean:10.2f}"
                  f"{r.dropped_stale_frac:12.1%}{r.length_ratio:12.3f}{r.generator_util:9.1%}{r.trainer_util:11.1%}")
    print(f"{'async / sync':34}{'seq/s':>8}{'tok/s':>8}")
    rows = [("measured", asyn.seq_s / sync.seq_s, asyn.tok_s / sync.tok_s)]
    rows += [(f"simulated {layout.split(',')[0]}", r["async"].sequences_per_s / r["sync"].sequences_per_s,
              r["async"].tokens_per_s / r["sync"].tokens_per_s) for layout, r in layouts]
    for name, seq_x, tok_x in rows:
        print(f"{name:34}{seq_x:7.2f}x{tok_x:7.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--n-batch", type=int, default=32)
    ap.add_argument("--n-mini", type=int, default=2)
    ap.add_argument("--n-async", type=int, default=64)
    ap.add_argument("--max-staleness", type=int, default=4, help="rollout.max_staleness (its config default)")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--low", type=int, default=24, help="shortest completion (tokens)")
    ap.add_argument("--ratio", type=float, default=5.0, help="longest / shortest completion")
    ap.add_argument("--alpha", type=float, default=1.2, help="Pareto tail index")
    ap.add_argument("--updates", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--gen-core", type=int, default=0)
    ap.add_argument("--train-core", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pairs", type=int, default=3, help="sync + async runs, alternating (run-to-run noise: +-5-10%%)")
    ap.add_argument("--sim-generators", type=int, default=64, help="the scaled-out simulated layout")
    ap.add_argument("--sim-trainers", type=int, default=16)
    ap.add_argument("--sim-ratio", type=float, default=10.0, help="its longest / shortest completion")
    args = ap.parse_args()
    if args.updates <= args.warmup:
        ap.error("--updates must exceed --warmup")
    if args.pairs < 1:
        ap.error("--pairs must be >= 1")

    from megatron_rl.config import GeneratorConfig, RolloutConfig, config_from_dict
    from megatron_rl.rollout.generator import Generator
    from megatron_rl.rollout.server import ServerSpec, SGLangServer
    from megatron_rl.sync.group import free_port
    from megatron_rl.sync.sender import WeightSender
    from megatron_rl.sync.update import target_of
    from megatron_rl.train.trainer import Trainer
    from support.models import make_tiny_llama

    cores = sorted(os.sched_getaffinity(0))
    if {args.gen_core, args.train_core} - set(cores) or args.gen_core == args.train_core:
        ap.error(f"need two distinct cores among {cores}")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_llama(Path(tmp) / "model", layers=args.layers, hidden=args.hidden, heads=8, kv_heads=4,
                                intermediate=2 * args.hidden)
        longest = args.prompt_len + int(args.low * args.ratio) + 1
        spec = ServerSpec(str(model), free_port(), max_total_tokens=max(8192, 2 * args.n_async * longest), threads=1,
                          log_path=str(Path(tmp) / "sglang.log"))
        os.sched_setaffinity(0, {args.gen_core})  # the server's processes inherit this core
        gen = Generator(SGLangServer(spec), RolloutConfig(group_size=args.group, n_async=args.n_async,
                                                          n_batch=args.n_batch, n_mini=args.n_mini),
                        GeneratorConfig(), max_concurrency=args.n_async)
        t0 = time.perf_counter()
        gen.start()
        os.sched_setaffinity(0, {args.train_core})
        try:
            cfg = config_from_dict({"trainer": {"model": str(model), "precision": "fp32", "lr": 1e-5,
                                                "micro_batch_tokens": 1024}})
            trainer = Trainer(cfg)
            sender = WeightSender(0, [target_of(gen)], bucket_mb=64)
            print(f"set-up {time.perf_counter() - t0:.0f} s: model {args.layers} layers x {args.hidden} "
                  f"({sum(p.numel() for p in trainer.model_chunks[0].parameters()) / 1e6:.1f} M params); server on "
                  f"core {args.gen_core}, trainer on core {args.train_core}", flush=True)
            bench = Bench(args, gen, trainer, sender)
            table, prefill_s = bench.decode_model(sorted({1, 4, 16, args.n_batch, args.n_async}), 16, 64)
            print("decode tok/s by concurrency: " + ", ".join(f"{int(c)}: {t:.0f}" for c, t in table)
                  + f"; start-up {prefill_s * 1e3:.1f} ms per sequence", flush=True)
            pairs = []  # alternating, so that a drift of the machine's speed hits both modes alike
            for i in range(args.pairs):
                pairs.append((bench.run_sync(args.updates, args.warmup), bench.run_async(args.updates, args.warmup)))
                print(f"pair {i + 1}/{args.pairs}: sync {pairs[-1][0].seq_s:.2f} seq/s, async "
                      f"{pairs[-1][1].seq_s:.2f} seq/s", flush=True)
        finally:
            gen.close()
    sync, asyn = _pooled([s for s, _ in pairs]), _pooled([a for _, a in pairs])
    report(args, *simulated(args, table, prefill_s, sync, asyn), sync, asyn)
    if args.pairs > 1:
        ratios = sorted(a.seq_s / s.seq_s for s, a in pairs)
        print(f"measured async / sync seq/s per pair: {', '.join(f'{r:.2f}x' for r in ratios)} "
              f"(median {statistics.median(ratios):.2f}x; the table above pools the {args.pairs} pairs)")


if __name__ == "__main__":
    main()
