"""Measure one real training step's peak memory growth and speed on this machine, in a fresh process.

    measure(spec) -> {"growth_bytes", "tokens_per_s", "tokens", "n_micro_batches", ...}
    python -m megatron_rl.plan.step_memory SPEC.json   # the child: prints one JSON line

`spec`: {"model": HF config keyword arguments (random weights, nothing read from disk), "model_type": its
family (default "llama"; e.g. "mixtral" for an MoE),
"trainer": trainer config keys, "seq_lengths": [...], "prompt_len": int, "repeats": int, "seed": int,
"nproc": int (default 1)}. With nproc > 1 the child runs on that many gloo ranks (torchrun, each rank
`platform.threads_per_rank(nproc)` threads, e.g. `context_parallel: 2` with nproc 2); each rank measures its own
growth and step time, and `measure` returns rank 0's result with the largest growth and the lowest
tokens/s over the ranks (the step is as slow as its slowest rank) and every rank's under "ranks".
The child builds the `Trainer` (gloo), runs `step.forward_backward` (the RL loss, packing,
Megatron's schedule: the step without the optimizer) once to warm up, then measures the next one:
growth = peak RSS during the step - RSS before it (`platform.memory`, glibc returning large frees at
once), i.e. what the step's activations, logits and backward temporaries take at their peak. Then
`repeats` more steps are timed. On a GPU the CUDA allocator's peak is reported instead.
Used by benchmarks/recompute.py, benchmarks/context_parallel.py and tests/e2e/test_step_memory_estimate.py to check
`plan.estimate.activation_memory`.
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path


BENCH_VOCAB = 1024


def bench_llama(hidden: int, layers: int, max_positions: int):
    """The benchmarks' random Llama: (spec "model" kwargs, its `plan.estimate.Shapes`): GQA 8/2 heads,
    FFN 2.75 x hidden, vocab BENCH_VOCAB."""
    from megatron_rl.plan.estimate import Shapes

    ffn = int(2.75 * hidden)
    model = dict(vocab_size=BENCH_VOCAB, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                 num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=max_positions,
                 rms_norm_eps=1e-5)
    return model, Shapes(BENCH_VOCAB, hidden, layers, 8, 2, hidden // 8, ffn, False)


def bench_estimate(shapes, tokens: int, recompute: str, precision: str, context_parallel: int = 1) -> float:
    """`plan.estimate`'s activation bytes of a step on `tokens` tokens per rank (this device's kernels,
    `context_parallel` ranks sharing each bin) plus the float32 logits and their gradient: what `measure`
    reports as growth, for the benchmarks' tables."""
    import torch

    from megatron_rl.plan.estimate import activation_memory

    kernels = "fused" if torch.cuda.is_available() else "local"
    act = activation_memory(shapes, tokens, recompute=recompute, elem_bytes=4 if precision == "fp32" else 2,
                            kernels=kernels, context_parallel=context_parallel)["total"]
    return act + tokens * shapes.vocab * 4 * 2


def _sequences(spec: dict, vocab: int):
    import torch

    from megatron_rl.records import TrainSequence

    g = torch.Generator().manual_seed(int(spec.get("seed", 0)))
    p = int(spec.get("prompt_len", 16))
    seqs = []
    for i, n in enumerate(spec["seq_lengths"]):
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        # behaviour logprobs near the uniform policy's: ratios around 1, both clip branches reached
        blp = (-torch.log(torch.tensor(float(vocab))) + 0.3 * torch.randn(n - p, generator=g)).tolist()
        seqs.append(TrainSequence(ids, p, blp, advantage=1.0 if i % 2 else -1.0))
    return seqs


def child(spec: dict) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig

    from megatron_rl.config import config_from_dict
    from megatron_rl.platform import memory
    from megatron_rl.train.step import forward_backward
    from megatron_rl.train.trainer import Trainer

    torch.manual_seed(int(spec.get("seed", 0)))
    hf_config = AutoConfig.for_model(spec.get("model_type", "llama"), **spec["model"])
    config = config_from_dict({"trainer": {"model": "random", **spec["trainer"]}})
    trainer = Trainer(config, hf_config=hf_config, load_weights=False)
    seqs = _sequences(spec, hf_config.vocab_size)
    cuda = torch.cuda.is_available()
    out = forward_backward(trainer.model, seqs, trainer.ctx)  # warm-up: one-time buffers and caches
    gc.collect()
    dist.barrier()  # ranks start the measured step together (a no-op on one process)
    before = memory.start_peak_window()
    start = time.perf_counter()
    out = forward_backward(trainer.model, seqs, trainer.ctx)
    if cuda:
        torch.cuda.synchronize()
    first = time.perf_counter() - start
    peak = memory.window_peak()
    times = [first]
    for _ in range(int(spec.get("repeats", 0))):
        start = time.perf_counter()
        forward_backward(trainer.model, seqs, trainer.ctx)
        times.append(time.perf_counter() - start)
    tokens = sum(spec["seq_lengths"])
    return {"growth_bytes": peak - before, "before_bytes": before, "tokens": tokens,
            "tokens_per_s": tokens * len(times) / sum(times), "n_micro_batches": out.n_micro_batches,
            "loss": out.metrics["loss"], "device": "cuda" if cuda else "cpu", "rank": dist.get_rank()}


def measure(spec: dict, timeout: float = 900) -> dict:
    """Run `child(spec)` in a fresh Python process (its own allocator state and peak) and return its
    result; RuntimeError with the child's stderr tail when it fails."""
    from megatron_rl.platform import threads_per_rank
    from megatron_rl.platform.memory import exact_malloc_env

    repo = str(Path(__file__).resolve().parents[2])
    env = exact_malloc_env()
    env["PYTHONPATH"] = repo + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    nproc = int(spec.get("nproc", 1))
    launch = [sys.executable, "-m"]
    if nproc > 1:  # --standalone: a rendezvous on a free loopback port
        env["OMP_NUM_THREADS"] = str(threads_per_rank(nproc))
        launch += ["torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m"]
    proc = subprocess.Popen(launch + ["megatron_rl.plan.step_memory", json.dumps(spec)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=repo)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # torchrun starts each rank in a session of its own: only its SIGTERM handler stops them
        # (SIGTERM, then SIGKILL after its grace period); a SIGKILL here would orphan the ranks
        proc.terminate()
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        raise
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or len(lines) != nproc:
        raise RuntimeError(f"step_memory child failed (exit {proc.returncode}, {len(lines)} of {nproc} "
                           f"ranks reported): stdout {stdout[-1000:]!r}; stderr {stderr[-3000:]}")
    ranks = sorted((json.loads(line) for line in lines), key=lambda r: r["rank"])
    if nproc == 1:
        return ranks[0]
    return {**ranks[0], "growth_bytes": max(r["growth_bytes"] for r in ranks),
            "tokens_per_s": min(r["tokens_per_s"] for r in ranks), "ranks": ranks}


if __name__ == "__main__":
    result = child(json.loads(sys.argv[1]))
    # one write(2) per rank: the ranks share the pipe, and print() writes the text and its newline
    # separately when PYTHONUNBUFFERED is set, so two ranks' lines could interleave into one
    os.write(sys.stdout.fileno(), (json.dumps(result) + "\n").encode())
