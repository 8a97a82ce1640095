"""Forward+backward time and peak memory of the fused clipped loss vs eager PyTorch and torch.compile.

    python benchmarks/fused_loss.py                       # CPU: T=8192, V=32768, bf16 logits
    python benchmarks/fused_loss.py --device cuda         # GPU: T=32768, V=131072, bf16, H=4096

Every variant runs in its own subprocess on identical inputs (fixed seed), so peak memory is clean:
CUDA -> torch.cuda.max_memory_allocated; CPU -> the RSS high-water mark (VmHWM, reset through
/proc/self/clear_refs after the inputs exist). "extra" is the peak above the inputs, i.e. what the
loss and its backward add (the logits gradient included: its size is the `logits` column).
Variants: eager (log_softmax in float32 + gather + algo.loss.clipped_token_loss), compile
(torch.compile of the same function), fused, fused_inplace (gradient written into the logits
buffer), and with --hidden: linear_eager (hidden @ W^T then eager) vs linear_fused (chunked).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

LOGITS_VARIANTS = ["eager", "compile", "fused", "fused_inplace"]
LINEAR_VARIANTS = ["linear_eager", "linear_fused"]
EPS_LOW, EPS_HIGH = 0.2, 0.28


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _rss_hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak(device) -> int:
    """Reset the peak counter; return the current usage (the baseline)."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    return _rss_bytes()


def _peak(device) -> int:
    if device == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return _rss_hwm_bytes()


def make_inputs(args):
    from megatron_rl.ops import token_logprobs

    dev, dtype = args.device, getattr(torch, args.dtype)
    g = torch.Generator(device=dev).manual_seed(0)
    t, v = args.tokens, args.vocab
    targets = torch.randint(0, v, (1, t), generator=g, device=dev)
    inputs = {"targets": targets}
    if args.variant.startswith("linear"):
        h = args.hidden
        inputs["hidden"] = torch.randn(1, t, h, generator=g, device=dev, dtype=dtype)
        inputs["weight"] = torch.randn(v, h, generator=g, device=dev, dtype=dtype) / h**0.5 * 2
        with torch.no_grad():  # behaviour logprobs near the true ones, chunked to stay small
            logp = torch.cat([token_logprobs(inputs["hidden"][:, a:a + 1024] @ inputs["weight"].t(),
                                             targets[:, a:a + 1024]) for a in range(0, t, 1024)], 1)
    else:
        inputs["logits"] = (torch.randn(1, t, v, generator=g, device=dev) * 2).to(dtype)
        logp = token_logprobs(inputs["logits"], targets)
    noise = 0.3 * torch.randn(1, t, generator=g, device=dev)
    inputs["behaviour"] = (logp - noise).float()
    inputs["adv"] = torch.randn(1, generator=g, device=dev)
    inputs["mask"] = torch.rand(1, t, generator=g, device=dev) > 0.1
    return inputs


def eager_loss(logits, targets, behaviour, adv, mask):
    from megatron_rl.algo.loss import clipped_token_loss

    logp = torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None])[..., 0]
    return clipped_token_loss(logp, behaviour, adv, mask, EPS_LOW, EPS_HIGH)


def build_step(args, inp):
    """A closure doing one forward+backward; leaves created outside the timed region."""
    from megatron_rl.ops import fused_clipped_loss, fused_linear_clipped_loss

    rest = (inp["targets"], inp["behaviour"], inp["adv"], inp["mask"])
    name = args.variant
    if name in LOGITS_VARIANTS:
        fn = {
            "eager": eager_loss,
            "compile": torch.compile(eager_loss, dynamic=False),
            "fused": lambda z, *r: fused_clipped_loss(z, *r, EPS_LOW, EPS_HIGH),
            "fused_inplace": lambda z, *r: fused_clipped_loss(z, *r, EPS_LOW, EPS_HIGH, inplace_backward=True),
        }[name]

        def prepare():
            return inp["logits"].clone().requires_grad_(True)

        def step(z):
            loss = fn(z, *rest)
            loss.backward()
            return loss.detach()
        return prepare, step

    def prepare():
        return inp["hidden"].clone().requires_grad_(True)

    w = inp["weight"].requires_grad_(True)

    def step(h):
        w.grad = None
        if name == "linear_eager":
            loss = eager_loss(h @ w.t(), *rest)
        else:
            loss = fused_linear_clipped_loss(h, w, *rest, EPS_LOW, EPS_HIGH, chunk_tokens=args.chunk)
        loss.backward()
        return loss.detach()
    return prepare, step


def worker(args) -> dict:
    torch.manual_seed(0)
    inp = make_inputs(args)
    prepare, step = build_step(args, inp)
    loss = step(prepare())  # warm-up: JIT/extension load, torch.compile, allocator
    times, extra = [], 0
    for _ in range(args.reps):
        leaf = prepare()
        _sync(args.device)
        base = _reset_peak(args.device)
        t0 = time.perf_counter()
        loss = step(leaf)
        _sync(args.device)
        times.append(time.perf_counter() - t0)
        extra = max(extra, _peak(args.device) - base)
        del leaf
    big = inp.get("logits", None)
    logits_bytes = args.tokens * args.vocab * torch.finfo(getattr(torch, args.dtype)).bits // 8
    return {"variant": args.variant, "time_s": min(times), "peak_extra_bytes": extra,
            "logits_bytes": logits_bytes if big is None else big.numel() * big.element_size(),
            "loss": float(loss)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--tokens", type=int)
    p.add_argument("--vocab", type=int)
    p.add_argument("--hidden", type=int, help="also run the fused-linear pair at this hidden size "
                   "(default: 4096 on cuda, 256 on cpu; 0 skips)")
    p.add_argument("--chunk", type=int, default=None, help="fused-linear tokens per chunk")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--variants", nargs="*", default=None)
    p.add_argument("--variant", help=argparse.SUPPRESS)  # worker mode
    args = p.parse_args()
    gpu = args.device == "cuda"
    args.tokens = args.tokens or (32768 if gpu else 8192)
    args.vocab = args.vocab or (131072 if gpu else 32768)
    args.hidden = (4096 if gpu else 256) if args.hidden is None else args.hidden
    if args.variant:
        print(json.dumps(worker(args)))
        return 0

    variants = args.variants or (LOGITS_VARIANTS + (LINEAR_VARIANTS if args.hidden else []))
    print(f"device={args.device} T={args.tokens} V={args.vocab} H={args.hidden} dtype={args.dtype} "
          f"threads={torch.get_num_threads()} reps={args.reps} (best time, max peak)")
    results = {}
    for name in variants:
        cmd = [sys.executable, __file__, "--variant", name, "--device", args.device, "--tokens",
               str(args.tokens), "--vocab", str(args.vocab), "--hidden", str(args.hidden), "--dtype",
               args.dtype, "--reps", str(args.reps)] + (["--chunk", str(args.chunk)] if args.chunk else [])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = proc.stderr.strip().splitlines()[-1:] or ["?"]
            print(f"{name:14s} FAILED: {tail[0][:200]}")
            continue
        results[name] = r = json.loads(proc.stdout.strip().splitlines()[-1])
        base = results.get("linear_eager" if name.startswith("linear") else "eager")
        speed = f"{base['time_s'] / r['time_s']:5.2f}x" if base else "   - "
        mem = f"{r['peak_extra_bytes'] / max(base['peak_extra_bytes'], 1):5.2f}x" if base else "   - "
        dloss = f"{abs(r['loss'] - base['loss']) / max(abs(base['loss']), 1e-12):.1e}" if base else "-"
        print(f"{name:14s} time {r['time_s'] * 1e3:9.1f} ms  speedup vs eager {speed}  "
              f"peak extra {r['peak_extra_bytes'] / 2**20:9.1f} MiB (= {r['peak_extra_bytes'] / r['logits_bytes']:4.2f}"
              f" x logits; {mem} of eager)  loss {r['loss']:.6f} (rel diff {dloss})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
