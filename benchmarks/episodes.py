"""Multi-turn episodes vs single-turn samples on one real generator, and the python tool's overhead.

    .venv/bin/python benchmarks/episodes.py                 # ~4 minutes on 2 idle cores
    .venv/bin/python benchmarks/episodes.py --episodes 32 --in-flight 8 --turns 3 --tool-ms 50

1. Throughput. One SGLang server (tiny random Llama, tests/support/models.py) plays `--episodes`
   episodes of `--turns` turns of exactly `--turn-tokens` sampled tokens each (ignore_eos), with a
   scripted tool of a fixed cost (`--tool-ms` of sleep per step) between turns; then the same number of
   single-turn samples of turns x turn-tokens tokens each: the same sampled tokens. Both keep
   `--in-flight` samples running, starting the next as one finishes: the regime of the training loop,
   whose budget refills as samples finish (`--lockstep` starts them all at once instead: every episode
   calls its tool at the same moment, the worst case, seen only at a run's start). Printed: sampled
   tokens/s of each and their ratio (target: >= 0.8 when the tool's time is below a turn's decode time),
   the generator's busy fraction while tools run (of the time tools ran, the share during which the
   server was decoding or prefilling some other request), and the cached share of the turns' prompt
   tokens. The multi-turn episodes run twice: admission counting every episode against `--in-flight`,
   and with `--extra-in-flight` more admitted while episodes wait on their tool (env.extra_in_flight:
   control/budget.flight_room on the generator's `env_waiting`): the controller's two regimes.
2. Tool overhead. `PythonTool.step` on a `print(1)` tool call vs the bare sandbox run of the same code
   (`Jail.run` with the tool's limits), medians over `--calls`, interleaved: the environment's per-call
   overhead (parsing, workspace, slots, observation).
Modes alternate `--pairs` times (the machine's speed drifts); medians over pairs.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from megatron_rl.control.budget import flight_room  # noqa: E402
from megatron_rl.data.prompts import get_template  # noqa: E402
from megatron_rl.data.turns import ChatTurns  # noqa: E402
from megatron_rl.env import Environment, PythonTool, StepResult  # noqa: E402
from megatron_rl.records import GroupRequest  # noqa: E402
from megatron_rl.rollout.episode import EpisodeLimits, EpisodeSetup  # noqa: E402
from support.runs import RecordedClient  # noqa: E402


class FixedCostTool(Environment):
    """A tool that takes `seconds` per call and answers "ok" for `turns` turns; each call's (start, end)
    goes to `calls`."""

    def __init__(self, turns: int, seconds: float, calls: list | None = None):
        self.turns, self.seconds, self.k, self.calls = turns, seconds, 0, calls if calls is not None else []

    def reset(self, task):
        self.k = 0
        return []

    def step(self, turn):
        self.k += 1
        if self.k == self.turns:
            return StepResult(done=True, reward=0.0)
        t = time.perf_counter()
        time.sleep(self.seconds)
        self.calls.append((t, time.perf_counter()))
        return StepResult([{"role": "tool", "content": "ok"}], info={"tool_calls": 1})


def covered(spans: list[tuple[float, float]], by: list[tuple[float, float]]) -> float:
    """Seconds of `spans` during which at least one interval of `by` runs."""
    merged: list[list[float]] = []
    for a, b in sorted(by):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return sum(max(0.0, min(b, y) - max(a, x)) for a, b in spans for x, y in merged)


def run_mode(gen, prompt, n, in_flight, turns, turn_tokens, tool_s, chat, extra: int = 0) -> dict:
    multi, calls = turns > 1, []
    gen.episodes = EpisodeSetup(lambda: FixedCostTool(turns, tool_s, calls) if multi else FixedCostTool(1, 0.0),
                                EpisodeLimits(turns, turn_tokens if multi else None, 64), chat if multi else None)
    sampling = {"temperature": 1.0, "ignore_eos": True,
                "max_new_tokens": turns * turn_tokens * 4 if multi else turn_tokens}  # room for observations
    client = gen.server.client = RecordedClient(gen.server.client)
    t0 = time.perf_counter()
    try:
        issued, rollouts = 0, []
        while len(rollouts) < n:
            # the controller's admission (control/budget.flight_room) on the generator's own count
            while issued < n and flight_room(in_flight, extra, issued - len(rollouts), gen.env_waiting) > 0:
                gen.submit_group(GroupRequest(f"g{issued}", prompt, [0], sampling=sampling))
                issued += 1
            r = gen.get(timeout=0.005)  # polled: admission follows the tool waits too
            if r is not None:
                rollouts.append(r)
            elif time.perf_counter() - t0 > 1800:
                raise TimeoutError(f"{len(rollouts)} of {n} samples in 30 min")
        wall = time.perf_counter() - t0
    finally:
        gen.server.client = client.client
    sampled = sum(sum(r.loss_mask) if r.loss_mask else len(r.completion_ids) for r in rollouts)
    prompt_tokens = sum(r.episode.prompt_tokens for r in rollouts)
    tool_total = sum(b - a for a, b in calls)
    return {"wall_s": wall, "tokens_per_s": sampled / wall, "sampled": sampled,
            "busy_in_tools": covered(calls, client.spans) / tool_total if tool_total else None,
            "cached_frac": sum(r.episode.cached_tokens for r in rollouts) / max(1, prompt_tokens)}


def tool_overhead(calls: int) -> tuple[float, float]:
    tool = PythonTool(timeout_s=10, max_tool_calls=calls + 1)
    tool.reset({})
    code = "print(1)"
    turn = '<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>'
    env_s, bare_s = [], []
    try:
        for _ in range(calls):
            t = time.perf_counter()
            tool.step(turn)
            env_s.append(time.perf_counter() - t)
            t = time.perf_counter()
            tool._run(code)
            bare_s.append(time.perf_counter() - t)
    finally:
        tool.close()
    return statistics.median(env_s), statistics.median(bare_s)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--episodes", type=int, default=32)
    p.add_argument("--in-flight", type=int, default=8)
    p.add_argument("--lockstep", action="store_true", help="start every sample at once (the worst case)")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--turn-tokens", type=int, default=48)
    p.add_argument("--tool-ms", type=float, default=100.0)
    p.add_argument("--extra-in-flight", type=int, default=None,
                   help="env.extra_in_flight of the admitting arm (default: --in-flight)")
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--server-arg", action="append", default=[], help="extra SGLang server argument (repeatable)")
    args = p.parse_args()

    from transformers import AutoTokenizer

    from support.models import make_tiny_llama
    from support.runs import running_generator

    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_llama(Path(tmp) / "tiny")
        tok = AutoTokenizer.from_pretrained(model)
        newline = tok("\n", add_special_tokens=False).input_ids[0]
        chat = ChatTurns(tok, get_template("none"), stop_ids=(newline,))
        prompt = tok(tok.apply_chat_template([{"role": "user", "content": "go"}], add_generation_prompt=True,
                                             tokenize=False), add_special_tokens=False).input_ids
        in_flight = args.episodes if args.lockstep else args.in_flight
        extra = 0 if args.lockstep else in_flight if args.extra_in_flight is None else args.extra_in_flight
        with running_generator(model, Path(tmp), group_size=1, concurrency=in_flight + extra, threads=1,
                               extra_args=args.server_arg) as gen:
            run_mode(gen, prompt, 2, 2, 2, 8, 0.0, chat)  # warm-up: server caches, first requests
            multi, admitting, single = [], [], []
            for _ in range(args.pairs):
                multi.append(run_mode(gen, prompt, args.episodes, in_flight, args.turns, args.turn_tokens,
                                      args.tool_ms / 1000, chat))
                if extra:
                    admitting.append(run_mode(gen, prompt, args.episodes, in_flight, args.turns, args.turn_tokens,
                                              args.tool_ms / 1000, chat, extra))
                single.append(run_mode(gen, prompt, args.episodes, in_flight, 1, args.turns * args.turn_tokens, 0.0,
                                       chat))
    med = lambda rows, k: statistics.median(r[k] for r in rows)  # noqa: E731
    decode_s = args.turn_tokens / (med(single, "tokens_per_s") / in_flight)  # one turn, at this concurrency
    print(f"{args.episodes} episodes, {in_flight} in flight{' (lockstep)' if args.lockstep else ''}, x {args.turns} "
          f"turns x {args.turn_tokens} tokens, tool {args.tool_ms:g} ms per call (a turn decodes in "
          f"~{decode_s * 1000:.0f} ms at this concurrency); {args.pairs} pairs")
    print(f"  single-turn  {med(single, 'tokens_per_s'):8.1f} sampled tokens/s  ({med(single, 'sampled'):.0f} tokens)")
    arms = [("multi-turn", multi, "n_async counts every episode")]
    if admitting:
        arms.append((f"multi-turn, extra_in_flight {extra}", admitting,
                     f"up to {in_flight} outside tools, {in_flight + extra} in all"))
    for name, rows, how in arms:
        print(f"  {name}: {med(rows, 'tokens_per_s'):.1f} sampled tokens/s ({med(rows, 'sampled'):.0f} tokens; {how})")
        print(f"    ratio to single-turn: {med(rows, 'tokens_per_s') / med(single, 'tokens_per_s'):.2f} (target >= 0.8); "
              f"generator busy while tools ran: {med(rows, 'busy_in_tools'):.2f} of the tool time; cached share of "
              f"the turns' prompt tokens: {med(rows, 'cached_frac'):.2f}")
    env_s, bare_s = tool_overhead(args.calls)
    print(f"python tool, median of {args.calls} calls: PythonTool.step {env_s * 1000:.1f} ms, bare sandbox run "
          f"{bare_s * 1000:.1f} ms, ratio {env_s / bare_s:.2f} (overhead {1000 * (env_s - bare_s):.1f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
