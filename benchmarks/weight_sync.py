"""Weight-sync throughput: the bucketed push vs one raw broadcast of the same bytes, in the same run.

The sender process runs one thread per sender (disjoint layers, one group each, sender = rank 0);
a receiver process joins every group and receives each sender's buckets in order on its own
thread, allocating from the manifest and copying every tensor into the model's parameters, as
SGLang's `flattened_bucket` loader does. Paths:
  overlapped  megatron_rl.sync.pipeline: bucket k+1 packed (sender) / copied out (receiver) while
              bucket k is on the wire, two reused buffers each side, lone contiguous tensors
              sent and received in place, first buckets ramping up to the cap (what WeightSender
              sends)
  serial      the previous path: flatten a fresh bucket, broadcast, receive into a fresh buffer,
              copy out, next bucket
  raw         one broadcast per sender of an already-flat, preallocated tensor of its share
Every timing is sender start -> receiver done (the receiver answers once its last copy landed).

    .venv/bin/python benchmarks/weight_sync.py --total-mb 256 --buckets 16,64,256,1024 --senders 1,2
    .venv/bin/python benchmarks/weight_sync.py --backend nccl --device cuda   # needs 2 GPUs
    .venv/bin/python benchmarks/weight_sync.py --backend gloo --device cuda   # 1 GPU: packing on it, gloo stages via host
NCCL cannot put two ranks of one communicator on the same GPU, so with one GPU the NCCL run skips.
Prints GB/s of each path, bucketed / raw for every (bucket size, senders) pair, and the speed-up
of 2 senders over 1 for each path.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_rl.sync.buckets import bucketize, empty_like_manifest, layout, plan_buckets, ramp_start, unflatten
from megatron_rl.sync.group import _join, free_port
from megatron_rl.sync.pipeline import BucketStream, BufferPool, receive_buckets

TENSOR_MB = 4  # model tensors of 4 MB each (a 1024 x 1024 fp32 matrix)
TIMEOUT = timedelta(seconds=600)


def model(total_mb: int, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    torch.manual_seed(0)
    n = max(1, total_mb // TENSOR_MB)
    return [(f"layers.{i}.weight", torch.randn(1024, TENSOR_MB * 256, device=device)) for i in range(n)]


def shard(named, senders, rank):
    per = (len(named) + senders - 1) // senders
    return named[rank * per:(rank + 1) * per]


def schedule(args):
    """The trials both processes walk through in the same order."""
    for s in args.senders:
        for mb in args.buckets:
            for _ in range(args.reps):
                for path in args.paths + ["raw"]:
                    yield s, mb, path


def _signal(pg, device):
    dist.broadcast(torch.zeros(1, device=device), group=pg, group_src=1)  # receiver -> sender


def _settle(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------ receiver
def receiver(args, ports, device_name, cpu_out):
    torch.set_num_threads(1)
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    named = model(args.total_mb, device)
    groups = {(s, r): _join(args.backend, "127.0.0.1", ports[(s, r)], 2, 1, f"bench-{s}-{r}", TIMEOUT)
              for s in args.senders for r in range(s)}
    raw_buf = {s: torch.zeros(_bytes(named) // s + 1, dtype=torch.uint8, device=device) for s in args.senders}
    pools = {key: BufferPool(device) for key in groups}  # long-lived, like a receiver's
    cpu = []
    for s, mb, path in schedule(args):
        threads = [threading.Thread(target=_receive_one, args=(shard(named, s, r), mb, path, groups[(s, r)],
                                                                raw_buf[s], device, pools[(s, r)])) for r in range(s)]
        c0 = time.process_time()
        [t.start() for t in threads]
        [t.join() for t in threads]
        cpu.append(time.process_time() - c0)
    cpu_out.put(cpu)  # plain floats: CPU seconds of each trial, all threads of this process


def _receive_one(named, mb, path, pg, raw_buf, device, pool):
    if device.type == "cuda":
        torch.cuda.set_device(device)  # the current device is per thread
    params = dict(named)
    cap = int(mb * (1 << 20))
    first = ramp_start(cap) if path == "overlapped" else None  # what WeightSender sends
    manifests = [layout(g) for g in plan_buckets(named, cap, first)]  # from shapes alone, as SGLang
    _signal(pg, device)  # ready
    if path == "overlapped":
        receive_buckets(pg, manifests, params, device, pool=pool)
    elif path == "serial":
        for metas in manifests:
            b = empty_like_manifest(metas, device)
            dist.broadcast(b.flat, group=pg, group_src=0)
            for name, t in unflatten(b):
                params[name].copy_(t)
    else:
        dist.broadcast(raw_buf[:_bytes(named)], group=pg, group_src=0)
    _settle(device)
    _signal(pg, device)  # done: everything is in the parameters


def _bytes(named):
    return sum(t.numel() * t.element_size() for _, t in named)


# ------------------------------------------------------------------ sender
def _send_one(named, mb, path, pg, raw_buf, device, pool):
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _signal(pg, device)
    if path == "overlapped":
        cap = int(mb * (1 << 20))
        for b in BucketStream(named, cap, device, pool=pool, first_bucket_bytes=ramp_start(cap)):
            dist.broadcast(b.flat, group=pg, group_src=0)
    elif path == "serial":
        for b in bucketize(named, int(mb * (1 << 20))):
            dist.broadcast(b.flat, group=pg, group_src=0)
    else:
        dist.broadcast(raw_buf[:_bytes(named)], group=pg, group_src=0)
    _settle(device)
    _signal(pg, device)


def run_trial(named, s, mb, path, groups, raw_buf, device, pools) -> float:
    threads = [threading.Thread(target=_send_one, args=(shard(named, s, r), mb, path, groups[(s, r)],
                                                         raw_buf[s], device, pools[(s, r)])) for r in range(s)]
    t0 = time.perf_counter()  # includes the ready handshake: one tiny broadcast, the same in every path
    [t.start() for t in threads]
    [t.join() for t in threads]
    return time.perf_counter() - t0


def devices(args) -> tuple[str, str] | None:
    """(sender device, receiver device), or None (with the reason printed) when the run must skip."""
    if args.device == "cpu":
        if args.backend == "nccl":
            print("skip: NCCL needs --device cuda")
            return None
        return "cpu", "cpu"
    if not torch.cuda.is_available():
        print("skip: --device cuda but CUDA is not available")
        return None
    if args.backend == "nccl" and torch.cuda.device_count() < 2:
        print(f"skip: NCCL needs sender and receiver on distinct GPUs, found {torch.cuda.device_count()}")
        return None
    return "cuda:0", f"cuda:{min(1, torch.cuda.device_count() - 1)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--total-mb", type=int, default=256)
    ap.add_argument("--buckets", default="16,64,256,1024", help="bucket sizes in MB, comma-separated")
    ap.add_argument("--senders", default="1,2", help="sender counts, comma-separated")
    ap.add_argument("--reps", type=int, default=3, help="trials per point; the best is reported")
    ap.add_argument("--paths", default="overlapped,serial", help="bucketed paths: overlapped,serial")
    ap.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = ap.parse_args()
    args.buckets = [float(x) for x in args.buckets.split(",")]
    args.senders = [int(x) for x in args.senders.split(",")]
    args.paths = [p for p in args.paths.split(",") if p]
    if not set(args.paths) <= {"overlapped", "serial"}:
        sys.exit(f"--paths: unknown path in {args.paths} (overlapped, serial)")
    devs = devices(args)
    if devs is None:
        return
    torch.set_num_threads(1)
    device = torch.device(devs[0])
    ports = {(s, r): free_port() for s in args.senders for r in range(s)}
    ctx = mp.get_context("spawn")
    cpu_out = ctx.Queue()
    proc = ctx.Process(target=receiver, args=(args, ports, devs[1], cpu_out))
    proc.start()
    named = model(args.total_mb, device)
    total = _bytes(named)
    groups = {(s, r): _join(args.backend, "127.0.0.1", ports[(s, r)], 2, 0, f"bench-{s}-{r}", TIMEOUT)
              for s in args.senders for r in range(s)}
    raw_buf = {s: torch.zeros(total // s + 1, dtype=torch.uint8, device=device) for s in args.senders}
    pools = {key: BufferPool(device) for key in groups}  # long-lived, like a WeightSender's
    best: dict[tuple, float] = {}
    cpu: dict[tuple, float] = {}
    sender_cpu = []
    for s, mb, path in schedule(args):
        c0 = time.process_time()
        sec = run_trial(named, s, mb, path, groups, raw_buf, device, pools)
        sender_cpu.append(time.process_time() - c0)
        best[(s, mb, path)] = min(best.get((s, mb, path), float("inf")), sec)
    for key, c_send, c_recv in zip(schedule(args), sender_cpu, cpu_out.get()):
        cpu[key] = min(cpu.get(key, float("inf")), c_send + c_recv)
    proc.join()
    report(args, best, cpu, total, devs)


def report(args, best, cpu, total, devs) -> None:
    """GB/s (wall), and CPU seconds per GB moved (both processes, all threads): with C cores a path
    cannot beat C / (CPU s/GB) GB/s, which is what bounds it on a small CPU-only machine."""
    gbs = {k: total / v / 1e9 for k, v in best.items()}
    cpg = {k: v / (total / 1e9) for k, v in cpu.items()}
    print(f"payload {total / 2**20:.0f} MB in {total // (TENSOR_MB << 20)} tensors of {TENSOR_MB} MB; "
          f"{args.backend} {devs[0]} -> {devs[1]}; {os.cpu_count()} cores; best of {args.reps}")
    head = "".join(f" {p + ' GB/s':>15} {p[:4] + '/raw':>8} {'CPU s/GB':>8}" for p in args.paths)
    print(f"{'bucket MB':>9} {'senders':>7} {'raw GB/s':>9} {'CPU s/GB':>8}{head}")
    for s in args.senders:
        for mb in args.buckets:
            row = "".join(f" {gbs[(s, mb, p)]:15.2f} {gbs[(s, mb, p)] / gbs[(s, mb, 'raw')]:8.2f}"
                          f" {cpg[(s, mb, p)]:8.2f}" for p in args.paths)
            print(f"{mb:9.0f} {s:7d} {gbs[(s, mb, 'raw')]:9.2f} {cpg[(s, mb, 'raw')]:8.2f}{row}")
    if len(args.senders) > 1:
        lo, hi = min(args.senders), max(args.senders)
        print(f"speed-up of {hi} senders over {lo} (same path, same bucket size):")
        for mb in args.buckets:
            row = "  ".join(f"{p} {gbs[(hi, mb, p)] / gbs[(lo, mb, p)]:.2f}x" for p in args.paths + ["raw"])
            print(f"{mb:9.0f} MB  {row}")


if __name__ == "__main__":
    main()
