"""Double-buffered bucket streams (sync/pipeline.py) deliver exactly what the serial path does."""
from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp

from megatron_rl.sync.buckets import bucketize, layout, plan_buckets
from megatron_rl.sync.group import _join, free_port
from megatron_rl.sync.pipeline import BucketStream, receive_buckets

BUCKET = 256  # bytes: small enough that the tensors below cross several bucket boundaries


def _mixed():
    """Mixed dtypes, non-contiguous views, a bucket filled to exactly BUCKET bytes, one over it."""
    g = torch.Generator().manual_seed(1)
    return [("a", torch.randn(8, 4, generator=g)),                      # 128 B
            ("b", torch.randn(16, 2, generator=g).t()),                 # 128 B, non-contiguous: bucket = 256 exactly
            ("c", torch.randn(3, generator=g).to(torch.bfloat16)),      # 6 B
            ("d", torch.randint(-9, 9, (5,), generator=g)),             # int64 after 6 B: new bucket
            ("e", torch.randn(10, 10, generator=g)[::2, 1:]),           # strided slice
            ("big", torch.randn(100, generator=g)),                     # 400 B > BUCKET: alone, zero copy
            ("big_t", torch.randn(10, 20, generator=g).t()),            # 800 B alone, non-contiguous
            ("f", torch.rand(7, generator=g) > 0.5),                    # bool
            ("g", torch.randn(4, 4, generator=g).to(torch.float16)[:, ::2])]


def _serial(named, first=None):
    return [(b.metas, b.flat.clone()) for b in bucketize(named, BUCKET, first)]


@pytest.mark.parametrize("first", [None, 64])  # 64: a ramp 64, 128, 256 B
def test_stream_is_bit_identical_to_serial_flatten(first):
    named = _mixed()
    streamed = [(b.metas, b.flat.clone())  # a copy: each bucket is valid until the next is asked for
                for b in BucketStream(iter(named), BUCKET, first_bucket_bytes=first)]
    serial = _serial(named, first)
    assert len(streamed) == len(serial) >= 5
    for (m0, f0), (m1, f1) in zip(serial, streamed):
        assert m0 == m1 and torch.equal(f0, f1)
    if first is None:
        assert [m.name for m in streamed[0][0]] == ["a", "b"]  # an exactly full bucket is not split


def test_contiguous_tensor_alone_is_sent_without_copy():
    named = _mixed()
    by_name = dict(named)
    for b in BucketStream(named, BUCKET):
        if b.names == ["big"]:
            assert b.flat.data_ptr() == by_name["big"].data_ptr()
        if b.names == ["big_t"]:
            assert b.flat.data_ptr() != by_name["big_t"].data_ptr()


def test_buffers_are_reused_and_stream_runs_at_most_one_bucket_ahead():
    pulled = []

    def gen():
        for i in range(8):
            pulled.append(i)
            yield f"t{i}", torch.full((16,), float(i))  # 64 B: two per bucket, copied into a buffer

    ptrs = set()
    for k, b in enumerate(BucketStream(gen(), 128)):
        assert torch.equal(b.flat.view(torch.float32), torch.tensor([2 * k] * 16 + [2 * k + 1] * 16, dtype=torch.float32))
        ptrs.add(b.flat.data_ptr())
        assert len(pulled) <= 2 * (k + 2) + 1  # this bucket, the next, one tensor of look-ahead
    assert len(ptrs) <= 2  # two buffers at most, reused (one when the consumer is the faster side)


def test_producer_error_surfaces_and_early_exit_does_not_hang():
    def bad():
        yield "x", torch.zeros(4)
        raise RuntimeError("exporter broke")

    with pytest.raises(RuntimeError, match="exporter broke"):
        list(BucketStream(bad(), 8))
    stream = iter(BucketStream(((f"t{i}", torch.zeros(64)) for i in range(100)), 256))
    next(stream)
    stream.close()  # stops the producer (joined in close)


def _receiver(port, out):
    pg = _join("gloo", "127.0.0.1", port, 2, 1, "test-pipe", timedelta(seconds=60))
    named = _mixed()
    params = {n: torch.zeros_like(t) for n, t in named}  # contiguous destinations
    manifests = [layout(g) for g in plan_buckets(named, BUCKET)]
    receive_buckets(pg, manifests, params)  # overlapped
    serial = {n: torch.zeros_like(t) for n, t in named}
    for metas in manifests:  # serial reference: one bucket at a time through a fresh buffer
        receive_buckets(pg, [metas], serial)
    # plain values back: tensors through a Queue would need the (exiting) child's shared memory
    out.put({n: (str(t.dtype), tuple(t.shape), torch.equal(params[n], t), torch.equal(serial[n], t))
             for n, t in named})


@pytest.mark.multiproc
def test_overlapped_push_over_gloo_is_bit_identical_to_serial():
    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(port, out))
    proc.start()
    pg = _join("gloo", "127.0.0.1", port, 2, 0, "test-pipe", timedelta(seconds=60))
    named = _mixed()
    import torch.distributed as dist
    for b in BucketStream(iter(named), BUCKET):  # overlapped sender
        dist.broadcast(b.flat, group=pg, group_src=0)
    for b in bucketize(named, BUCKET):  # serial sender
        dist.broadcast(b.flat, group=pg, group_src=0)
    got = out.get(timeout=60)
    proc.join(30)
    assert proc.exitcode == 0
    for n, t in named:  # the receiver compared with its own copy of the same seeded tensors
        assert got[n] == (str(t.dtype), tuple(t.shape), True, True), n


def test_pool_kept_across_pushes_reuses_its_buffers_and_stays_exact():
    from megatron_rl.sync.pipeline import BufferPool

    named = _mixed()
    pool = BufferPool(torch.device("cpu"))
    pushes = [[(b.metas, b.flat.clone(), b.flat.data_ptr()) for b in BucketStream(named, BUCKET, pool=pool)]
              for _ in range(2)]
    serial = _serial(named)
    for push in pushes:
        assert len(push) == len(serial)
        assert all(m0 == m1 and torch.equal(f0, f1) for (m0, f0, _), (m1, f1) in zip(push, serial))
    own = {dict(named)["big"].data_ptr()}
    assert {p for _, _, p in pushes[1]} - own <= {p for _, _, p in pushes[0]} - own  # no new buffers
    with pytest.raises(ValueError, match="pool"):
        BucketStream(named, BUCKET, device="meta", pool=pool)


def test_an_index_less_cuda_send_device_takes_the_current_gpu(monkeypatch):
    """A sender on "cuda" must compare equal to its tensors' cuda:N, else a one-tensor bucket is never
    sent from the tensor's own storage (the zero-copy path) on a GPU. CPU: the current device is faked."""
    from megatron_rl.sync.pipeline import BufferPool, resolve_device
    from megatron_rl.sync.sender import SyncTarget, WeightSender

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert resolve_device("cuda") == torch.device("cuda:3") == resolve_device(torch.device("cuda", 3))
    assert resolve_device("cuda:1") == torch.device("cuda:1") and resolve_device("cpu") == torch.device("cpu")
    sender = WeightSender(0, [SyncTarget("http://127.0.0.1:1")], backend="nccl")
    assert sender.device == torch.device("cuda:3")  # what a tensor on the trainer's GPU reports
    assert BucketStream(iter([]), BUCKET, "cuda", pool=BufferPool("cuda")).device == torch.device("cuda:3")
