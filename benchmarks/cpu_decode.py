"""SGLang's CPU decode with the stub's batched torch_native attention vs SGLang's own per-request loop.

    .venv/bin/python benchmarks/cpu_decode.py                     # ~5 minutes on 2 idle cores
    .venv/bin/python benchmarks/cpu_decode.py --batch 32 --tokens 96 --pairs 3

One real SGLang server on the shipped SmolLM2-135M (float32, the demo's generator), started once per
mode: `batched` (the sgl_kernel stub's `_batched_decode`, what every CPU generator runs) and `loop`
(MEGATRON_RL_SGLANG_DECODE_LOOP=1: SGLang's torch_native decode, one SDPA call per request per layer).
Each mode samples `--batch` completions of exactly `--tokens` tokens at once (ignore_eos), all in
flight together, after a warm-up round; printed: sampled tokens/s per mode (median over `--pairs`
alternations, the server restarted each time) and the ratio batched / loop. Both modes sample at
temperature 0 from the same prompts, so their completions are compared too (equal up to near-ties).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from megatron_rl.control.model_files import generator_model_dir  # noqa: E402
from megatron_rl.records import GroupRequest  # noqa: E402
from megatron_rl.train.hf_source import resolve_model  # noqa: E402

LOOP_SWITCH = "MEGATRON_RL_SGLANG_DECODE_LOOP"  # _batched_decode.LOOP_SWITCH (the stub is the server's only)
PROMPTS = ["What is 17 + 25?", "Name three prime numbers.", "Write a haiku about the sea.", "What is 9 x 8?"]


def run_mode(mode: str, model_dir: Path, prompts: list[list[int]], batch: int, tokens: int, threads: int,
             tmp: Path) -> tuple[float, list[list[int]]]:
    from support.runs import running_generator

    if mode == "loop":
        os.environ[LOOP_SWITCH] = "1"
    try:
        with running_generator(model_dir, tmp, group_size=1, concurrency=batch, max_total_tokens=16384,
                               threads=threads) as gen:
            sampling = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": tokens}

            def round_(tag: str) -> tuple[float, list]:
                t = time.perf_counter()
                for i in range(batch):
                    gen.submit_group(GroupRequest(f"{tag}{i}", prompts[i % len(prompts)], [0], sampling=sampling))
                out = sorted(gen.completions(batch, timeout=1800), key=lambda r: int(r.group_id[len(tag):]))
                return time.perf_counter() - t, [r.completion_ids for r in out]

            round_("warm")
            wall, ids = round_("m")
    finally:
        os.environ.pop(LOOP_SWITCH, None)
    return batch * tokens / wall, ids


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16, help="completions decoded together (default 16)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per completion (default 64)")
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="server OMP threads")
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = generator_model_dir("smollm2-135m", "fp32", cache=Path(tmp) / "cache")
        tok = resolve_model(model_dir).tokenizer()
        prompts = [tok(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                               tokenize=False), add_special_tokens=False).input_ids for q in PROMPTS]
        rates: dict[str, list[float]] = {"batched": [], "loop": []}
        same = total = 0
        for _ in range(args.pairs):
            outs = {}
            for mode in rates:
                rate, outs[mode] = run_mode(mode, model_dir, prompts, args.batch, args.tokens, args.threads,
                                            Path(tmp))
                rates[mode].append(rate)
            same += sum(a == b for a, b in zip(outs["batched"], outs["loop"]))
            total += args.batch
    med = {m: statistics.median(r) for m, r in rates.items()}
    print(f"SmolLM2-135M fp32 on SGLang CPU, {args.batch} completions x {args.tokens} tokens at once, "
          f"{args.threads} threads, {args.pairs} pairs")
    for mode, r in rates.items():
        print(f"  {mode:8s} {med[mode]:8.1f} sampled tokens/s  (runs: {', '.join(f'{x:.1f}' for x in r)})")
    print(f"  ratio batched / loop: {med['batched'] / med['loop']:.2f}")
    print(f"  greedy completions identical in both modes: {same} of {total}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
