"""Weight-sync throughput: bucketed path vs one raw broadcast of the same bytes on the same group.

A receiver process joins one gloo group per sender (as SGLang does: sender = rank 0) and receives
like SGLang's `flattened_bucket` loader: allocate from the manifest, broadcast, cut into tensors,
copy them into the model's parameters; buckets are received one at a time (SGLang's scheduler is
serial). The bucketed path = megatron_rl.sync.buckets (flatten per bucket) + one broadcast per bucket.
Baseline = one broadcast of an already-flat tensor of the same total size on the same group.

    .venv/bin/python benchmarks/weight_sync.py --total-mb 256 --buckets 16,64,256,1024 --senders 1,2
Prints GB/s of both and the ratio bucketed / raw for every (bucket size, senders) pair.
"""
from __future__ import annotations

import argparse
import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_rl.sync.buckets import bucketize, empty_like_manifest, plan_buckets, unflatten
from megatron_rl.sync.group import _join, free_port

TENSOR_MB = 4  # model tensors of 4 MB each (a 1024 x 1024 fp32 matrix)


def model(total_mb: int) -> list[tuple[str, torch.Tensor]]:
    n = max(1, total_mb // TENSOR_MB)
    return [(f"layers.{i}.weight", torch.randn(1024, TENSOR_MB * 256)) for i in range(n)]


def shard(named, senders, rank):
    per = (len(named) + senders - 1) // senders
    return named[rank * per:(rank + 1) * per]


def receiver(ports, total_mb, bucket_mbs, sender_counts, reps):
    torch.set_num_threads(1)
    params = dict(model(total_mb))
    groups = {}
    for s in sender_counts:
        for r in range(s):
            groups[(s, r)] = _join("gloo", "127.0.0.1", ports[(s, r)], 2, 1, f"bench-{s}-{r}", timedelta(seconds=600))
    for s in sender_counts:
        for mb in bucket_mbs:
            for _ in range(reps):
                for r in range(s):  # serial, like SGLang's scheduler
                    for group in plan_buckets(shard(list(params.items()), s, r), int(mb * (1 << 20))):
                        b = empty_like_manifest(_metas(group))  # from shapes alone, as SGLang does
                        dist.broadcast(b.flat, group=groups[(s, r)], group_src=0)
                        for name, t in unflatten(b):
                            params[name].copy_(t)
                raw = torch.empty(sum(t.numel() * 4 for t in params.values()) // s, dtype=torch.uint8)
                for r in range(s):
                    dist.broadcast(raw, group=groups[(s, r)], group_src=0)


def _metas(group):
    from megatron_rl.sync.buckets import TensorMeta, dtype_name

    metas, off = [], 0
    for n, t in group:
        nb = t.numel() * t.element_size()
        metas.append(TensorMeta(n, dtype_name(t.dtype), tuple(t.shape), off, nb))
        off += nb
    return metas


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--total-mb", type=int, default=256)
    ap.add_argument("--buckets", default="16,64,256,1024")
    ap.add_argument("--senders", default="1,2")
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    bucket_mbs = [float(x) for x in args.buckets.split(",")]
    sender_counts = [int(x) for x in args.senders.split(",")]
    ports = {(s, r): free_port() for s in sender_counts for r in range(s)}
    torch.manual_seed(0)
    named = model(args.total_mb)
    total = sum(t.numel() * t.element_size() for _, t in named)
    proc = mp.get_context("spawn").Process(target=receiver, args=(ports, args.total_mb, bucket_mbs,
                                                                  sender_counts, args.reps))
    proc.start()
    groups = {}
    for s in sender_counts:
        for r in range(s):
            groups[(s, r)] = _join("gloo", "127.0.0.1", ports[(s, r)], 2, 0, f"bench-{s}-{r}", timedelta(seconds=600))
    print(f"payload {total / 2**20:.0f} MB in {len(named)} tensors; gloo on loopback; {os.cpu_count()} cores")
    print(f"{'bucket MB':>9} {'senders':>7} {'bucketed GB/s':>13} {'raw GB/s':>9} {'ratio':>6}")
    for s in sender_counts:
        for mb in bucket_mbs:
            best_b = best_r = float("inf")
            for _ in range(args.reps):
                t0 = time.perf_counter()
                threads = [threading.Thread(target=_send_bucketed, args=(shard(named, s, r), mb, groups[(s, r)]))
                           for r in range(s)]
                [t.start() for t in threads]
                [t.join() for t in threads]
                best_b = min(best_b, time.perf_counter() - t0)
                raw = torch.empty(total // s, dtype=torch.uint8)
                t0 = time.perf_counter()
                threads = [threading.Thread(target=dist.broadcast, args=(raw,),
                                            kwargs={"group": groups[(s, r)], "group_src": 0}) for r in range(s)]
                [t.start() for t in threads]
                [t.join() for t in threads]
                best_r = min(best_r, time.perf_counter() - t0)
            gb_b, gb_r = total / best_b / 1e9, total / best_r / 1e9
            print(f"{mb:9.0f} {s:7d} {gb_b:13.2f} {gb_r:9.2f} {gb_b / gb_r:6.2f}")
    proc.join()


def _send_bucketed(named, mb, group):
    for b in bucketize(named, int(mb * (1 << 20))):
        dist.broadcast(b.flat, group=group, group_src=0)


if __name__ == "__main__":
    main()
