"""Clipped token loss: forward+backward time and memory, side by side in one run.

Compares, on the same [B, T] inputs (default B=64, T=4096, 30% padding, fp32 logprobs):
- baseline: a straightforward eager implementation (exp, clamp, min, multiply by the float mask, sum);
- reference: megatron_rl.algo.loss.clipped_token_loss (eager autograd, where()-masking, stats-ready);
Memory: bytes saved for backward (the activation memory the loss holds between forward and backward,
measured with saved-tensor hooks, device independent) and the peak during fwd+bwd above the inputs
(CUDA: max_memory_allocated; CPU/Linux: resident high-water mark, includes the 1 MiB-per-fp32 grad). Time: median over repetitions after warm-up. Prints ratios against the baseline.

    .venv/bin/python benchmarks/loss.py [--B 64] [--T 4096] [--dtype fp32|bf16] [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from megatron_rl.algo.loss import clipped_token_loss

EPS_LOW, EPS_HIGH = 0.2, 0.28


def baseline(logprobs, behaviour, adv, mask):
    ratio = torch.exp(logprobs - behaviour)
    a = adv[:, None]
    surrogate = torch.min(ratio * a, torch.clamp(ratio, 1 - EPS_LOW, 1 + EPS_HIGH) * a)
    m = mask.to(surrogate.dtype)
    return -(surrogate * m).sum() / m.sum()


def reference(logprobs, behaviour, adv, mask):
    return clipped_token_loss(logprobs, behaviour, adv, mask, EPS_LOW, EPS_HIGH)


def make_inputs(B, T, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(int(0.4 * T), T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    behaviour = -torch.rand(B, T, generator=g) * 4
    logprobs = behaviour + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    return (logprobs.to(device, dtype), behaviour.to(device, dtype), adv.to(device), mask.to(device))


def saved_bytes(fn, inputs):
    """Bytes of tensors autograd saves for backward (deduplicated by storage)."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    lp = inputs[0].detach().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(lp, *inputs[1:])
    leaf_ptrs = {x.untyped_storage().data_ptr() for x in inputs}
    out.backward()
    return sum(n for p, n in seen.items() if p not in leaf_ptrs)  # inputs are held anyway


def time_fwd_bwd(fn, inputs, reps, device):
    lp = inputs[0].detach().requires_grad_(True)
    times = []
    for i in range(reps + 3):
        lp.grad = None
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(lp, *inputs[1:]).backward()
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 3:  # warm-up
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cuda_peak(fn, inputs):
    lp = inputs[0].detach().requires_grad_(True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn(lp, *inputs[1:]).backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def cpu_peak(fn, inputs):
    """Peak resident memory above the start during fwd+bwd (Linux: VmHWM reset via clear_refs).

    Needs glibc to return big blocks to the OS at free (fixed MALLOC_MMAP_THRESHOLD_, set by main),
    else freed intermediates stay resident and the peak under-reports reuse.
    """
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the resident high-water mark
    except OSError:
        return None
    base = _status_kib("VmRSS")
    lp = inputs[0].detach().requires_grad_(True)
    fn(lp, *inputs[1:]).backward()
    return (_status_kib("VmHWM") - base) * 1024


IMPLS = (("baseline", baseline), ("reference", reference))


def cpu_peaks_in_child() -> dict:
    """CPU peaks measured in a child whose glibc returns big blocks to the OS at free (fixed mmap
    threshold); timing stays in this process with the default allocator."""
    if sys.platform != "linux":
        return {}
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--cpu-peak-child"], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--B", type=int, default=64)
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--threads", type=int, default=1, help="CPU threads (the dev box is shared)")
    p.add_argument("--cpu-peak-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    inputs = make_inputs(args.B, args.T, dtype, args.device)
    if args.cpu_peak_child:
        for _, fn in IMPLS:  # first calls allocate one-time state; keep it out of the peaks
            fn(inputs[0].detach().requires_grad_(True), *inputs[1:]).backward()
        print(json.dumps({name: cpu_peak(fn, inputs) for name, fn in IMPLS}))
        return

    # Same value and gradient first: a faster wrong loss is worthless.
    grads = []
    for fn in (baseline, reference):
        lp = inputs[0].detach().requires_grad_(True)
        v = fn(lp, *inputs[1:])
        v.backward()
        grads.append((v.item(), lp.grad.float()))
    (vb, gb), (vr, gr) = grads
    # The baseline computes in the input dtype; ours upcast. In bf16 the rounded ratio flips the clip
    # decision of tokens right at 1 - eps_low / 1 + eps_high, so allow a few such tokens there.
    tol, flips = (1e-5, 0.0) if dtype == torch.float32 else (2e-2, 0.01)
    assert abs(vb - vr) <= tol * max(1.0, abs(vr)), (vb, vr)
    off = ~torch.isclose(gb, gr, rtol=tol, atol=tol * gr.abs().max().item())
    assert off.float().mean().item() <= flips, off.float().mean().item()

    print(f"clipped token loss fwd+bwd, B={args.B} T={args.T} {args.dtype} on {args.device} "
          f"({torch.get_num_threads()} thread(s)), {int(inputs[3].sum())} unmasked tokens")
    peaks = cpu_peaks_in_child() if args.device == "cpu" else {}
    rows = {}
    for name, fn in IMPLS:
        t = time_fwd_bwd(fn, inputs, args.reps, args.device)
        sb = saved_bytes(fn, inputs)
        peak = cuda_peak(fn, inputs) if args.device == "cuda" else peaks.get(name)
        rows[name] = (t, sb, peak)
    bt, bs, bp = rows["baseline"]
    for name, (t, sb, peak) in rows.items():
        line = (f"  {name:9s} time {t * 1e3:8.2f} ms (x{bt / t:5.2f} speed vs baseline)   "
                f"saved for backward {sb / 2**20:7.1f} MiB (x{sb / bs:5.2f} of baseline)")
        if peak is not None:
            line += f"   {args.device} peak {peak / 2**20:7.1f} MiB (x{peak / bp:5.2f})"
        print(line)


if __name__ == "__main__":
    main()
