"""Token logprobs + entropy from logits (forward + backward), SmolLM2 vocab, one rank:
megatron_rl.train.logprobs (chunked, custom backward) vs log_softmax over the full vocab + gather.
Prints time and peak-RSS growth of each (measured in separate subprocesses) and their ratios.

    .venv/bin/python benchmarks/train_logprobs.py [--tokens 1024] [--vocab 49152]
"""
import argparse
import json
import resource
import subprocess
import sys
import time

import torch


def run(impl: str, tokens: int, vocab: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(tokens, vocab, generator=g).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(repeats):
        logits.grad = None
        t0 = time.perf_counter()
        if impl == "megatron_rl":
            from megatron_rl.train.logprobs import token_logprobs

            lp, ent = token_logprobs(logits, targets, with_entropy=True)
        else:
            logp = torch.log_softmax(logits.float(), -1)
            lp = logp.gather(-1, targets[:, None]).squeeze(-1)
            ent = -(logp.exp() * logp).sum(-1)
        (lp.sum() + 0.01 * ent.sum()).backward()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"s": min(times), "extra_mb": (peak - base) / 1024}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--impl")
    a = ap.parse_args()
    if a.impl:
        print(json.dumps(run(a.impl, a.tokens, a.vocab, a.repeats)))
        return
    res = {}
    for impl in ("megatron_rl", "full_log_softmax"):
        out = subprocess.run([sys.executable, __file__, "--impl", impl, "--tokens", str(a.tokens),
                              "--vocab", str(a.vocab), "--repeats", str(a.repeats)],
                             capture_output=True, text=True, check=True)
        res[impl] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{impl:18s} fwd+bwd {res[impl]['s'] * 1e3:8.1f} ms   peak RSS growth {res[impl]['extra_mb']:8.1f} MB")
    m, f = res["megatron_rl"], res["full_log_softmax"]
    print(f"tokens={a.tokens} vocab={a.vocab} (logits {a.tokens * a.vocab * 4 / 2**20:.0f} MB fp32): "
          f"speed ratio full/ours = {f['s'] / m['s']:.2f}x, memory ratio full/ours = "
          f"{f['extra_mb'] / max(m['extra_mb'], 1e-9):.2f}x")


if __name__ == "__main__":
    main()
