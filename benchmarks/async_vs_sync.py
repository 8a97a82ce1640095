"""Async vs synchronous RL throughput, measured on the real generator + trainer, and simulated.

Same hardware, model, prompts and heavy-tailed completion lengths in both modes:
- generator: one real SGLang server (`megatron_rl.rollout.Generator`) on a tiny random Llama
  (`tests/support/models.py:make_tiny_llama`), pinned to core `--gen-core`; lengths are forced per
  request (`max_new_tokens` from a bounded Pareto on [low, ratio * low], `ignore_eos`);
- trainer: the real Megatron-Core `Trainer` on the same model in this process, pinned to core
  `--train-core` (so are this process's HTTP client threads); weights pushed in place after every
  update with `sync.update.push_in_process` (`WeightSender`, gloo) from the trainer's HF export;
- bookkeeping: the controller's own `RolloutBudget` (groups, staleness bound, batches).
Sync: issue the groups of one batch, wait for all of them, train, push. Async: keep `n_async`
sequences in flight; the trainer (a thread) trains whenever `n_batch` are ready, then pushes while
generation continues. Throughput = trained sequences (tokens) / wall time over updates after
`--warmup`. The simulator (`megatron_rl.control.simulate`) is then calibrated on this run's
measured rates (decode tokens/s measured at several concurrencies and fitted with
peak * c / (c + c_half), the trainer's time per update against its tokens,
the push time) and its async / sync ratio is printed next to the measured one.

    .venv/bin/python benchmarks/async_vs_sync.py            # ~3 minutes on 2 cores
    .venv/bin/python benchmarks/async_vs_sync.py --updates 8 --n-async 64 --low 32
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
    staleness: list[int] = field(default_factory=list)
    dropped_frac: float = 0.0  # groups dropped as stale / groups completed (whole phase)

    @property
    def seq_s(self) -> float:
        return self.seqs / self.seconds

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


class Bench:
    def __init__(self, args, gen, trainer, sender):
        from megatron_rl.config import AlgoConfig, RolloutConfig
        from megatron_rl.control.simulate import LengthDist

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
        res.train.append((tokens, t1 - t0))
        res.push.append(t2 - t1)
        if measured:
            res.seqs += len(batch.sequences)
            res.tokens += sum(s.completion_len for s in batch.sequences)
            res.staleness += [batch.policy_version - min(s.weight_versions) for s in batch.sequences]

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
                t_start = time.perf_counter()
        res.seconds = time.perf_counter() - t_start
        res.dropped_frac = budget.counters.groups_dropped_stale / max(1, budget.counters.groups_completed)
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
                if u + 1 == warmup:
                    t_start = time.perf_counter()
            res.seconds = time.perf_counter() - t_start
        finally:
            stop.set()
            worker.join()
        res.dropped_frac = budget.counters.groups_dropped_stale / max(1, budget.counters.groups_completed)
        while budget.in_flight:  # drain so the next phase starts on an idle server
            self._graded(budget, timeout=600)
        return res

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


def simulated(args, table, prefill_s: float, sync: ModeResult, asyn: ModeResult):
    from megatron_rl.control.simulate import DecodeModel, LengthDist, SimParams, compare
    from megatron_rl.control.simulate_calibration import fit_line

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
    return p, compare(p)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--n-batch", type=int, default=32)
    ap.add_argument("--n-mini", type=int, default=2)
    ap.add_argument("--n-async", type=int, default=64)
    ap.add_argument("--max-staleness", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--low", type=int, default=24, help="shortest completion (tokens)")
    ap.add_argument("--ratio", type=float, default=5.0, help="longest / shortest completion")
    ap.add_argument("--alpha", type=float, default=1.2, help="Pareto tail index")
    ap.add_argument("--updates", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--gen-core", type=int, default=0)
    ap.add_argument("--train-core", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.updates <= args.warmup:
        ap.error("--updates must exceed --warmup")

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
            sync = bench.run_sync(args.updates, args.warmup)
            print(f"sync done: {sync.seq_s:.2f} seq/s", flush=True)
            asyn = bench.run_async(args.updates, args.warmup)
        finally:
            gen.close()
    params, sim = simulated(args, table, prefill_s, sync, asyn)
    print(f"\nworkload: G={args.group}, n_batch={args.n_batch}, n_mini={args.n_mini}, n_async={args.n_async}, "
          f"max_staleness={args.max_staleness}, completion lengths Pareto(alpha={args.alpha}) on "
          f"[{args.low}, {int(args.low * args.ratio)}], prompt {args.prompt_len}; "
          f"{args.updates - args.warmup} measured updates per mode")
    d = params.decode
    curve = f"{d.peak_tok_s:.0f} c / (c + {d.c_half:.1f}) tok/s" if not d.table else "the measured table"
    print(f"fitted: decode {curve}, trainer {params.train_a_s:.3f} s + {params.train_b_s * 1e3:.3f} ms/token, push "
          f"{params.push_s:.3f} s, start-up {params.prefill_s * 1e3:.1f} ms/sequence")
    print(f"{'':10}{'seq/s':>9}{'tok/s':>9}{'staleness mean/max':>20}{'stale drops':>12}{'sim seq/s':>11}"
          f"{'sim drops':>10}{'sim gen util':>13}{'sim train util':>15}")
    for name, m, s in (("sync", sync, sim["sync"]), ("async", asyn, sim["async"])):
        stale = f"{statistics.fmean(m.staleness):.2f}/{max(m.staleness)}"
        print(f"{name:10}{m.seq_s:9.2f}{m.tok_s:9.0f}{stale:>20}{m.dropped_frac:12.1%}{s.sequences_per_s:11.2f}"
              f"{s.dropped_frac:10.1%}{s.generator_util:13.1%}{s.trainer_util:15.1%}")
    print(f"async / sync sequences/s: measured {asyn.seq_s / sync.seq_s:.2f}x, simulated "
          f"{sim['async'].sequences_per_s / sim['sync'].sequences_per_s:.2f}x "
          f"(tokens/s: measured {asyn.tok_s / sync.tok_s:.2f}x, simulated "
          f"{sim['async'].tokens_per_s / sim['sync'].tokens_per_s:.2f}x; async batches favour short completions)")


if __name__ == "__main__":
    main()
