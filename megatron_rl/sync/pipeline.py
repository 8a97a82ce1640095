"""Double-buffered bucket streams: filling bucket k+1 overlaps the transfer of bucket k.

Sender (`BucketStream`): a producer thread pulls the (hf_name, tensor) pairs — so the conversion to
HF layout that the exporter does lazily runs in that thread too — plans buckets and writes each
into one of two reusable buffers while the caller sends the previous one. A bucket that is one
tensor already contiguous on the send device is sent from the tensor's own storage (no copy at
all); any other tensor is copied once, from wherever it lives, straight into its slot.

Receiver (`receive_buckets`): the broadcast into buffer k+1 is posted before bucket k is copied
into the parameters; a bucket that is one tensor whose destination is contiguous with the same
dtype and shape is received straight into it.

Two buffers are enough for a full overlap: one on the wire, one being filled (or copied out).
Reusing them (`BufferPool`, kept across pushes) also saves the page faults of a fresh bucket, which
on CPU cost several times the copy itself. Only k and k+1 overlap, so the first bucket's packing runs
alone: senders ramp the bucket size up (`buckets.ramp_start`) to keep it short. On CUDA every hand-over synchronises the thread's current stream,
so a buffer is never refilled while a collective still reads it, whatever stream that ran on.
"""
from __future__ import annotations

import queue
import threading
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

from megatron_rl.sync.buckets import Bucket, TensorMeta, as_bytes, bucket_size, layout, plan_buckets, unflatten, write_into

_DONE = object()


def resolve_device(device: torch.device | str) -> torch.device:
    """`device` with its index: torch.device("cuda") never equals a tensor's cuda:N, so an index-less
    send device would never take the zero-copy path (nor match a pool made with the index)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _settle(device: torch.device) -> None:
    """Wait for what this thread queued on `device` (copies, stream waits on a collective)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class _Stopped(Exception):
    pass


def _acquire(sem: threading.Semaphore, stop: threading.Event | None) -> None:
    while not sem.acquire(timeout=0.1):
        if stop is not None and stop.is_set():
            raise _Stopped()


class BufferPool:
    """Reusable uint8 buffers on one device, grown to the largest bucket asked for. Keep one across
    pushes (a `WeightSender` does): on CPU a fresh buffer costs its page faults, measured at 5-6x
    the copy into it (docs/rollout.md), on every bucket or at least every push."""

    def __init__(self, device: torch.device | str):
        self.device = resolve_device(device)
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            buf = self._free.pop() if self._free else None
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buf

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)


class BucketStream:
    """Iterate buckets of `named`; each is valid until the next one is asked for (then its buffer is
    refilled). At most `buffers` buckets exist at a time: the one being sent and the one(s) being
    filled, so an exporter that materialises tensors one by one never holds much more than that."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                 device: torch.device | str = "cpu", buffers: int = 2, pool: BufferPool | None = None,
                 first_bucket_bytes: int | None = None):
        if buffers < 2:
            raise ValueError(f"a double-buffered stream needs >= 2 buffers, got {buffers}")
        self.device = resolve_device(device)
        if pool is not None and pool.device != self.device:
            raise ValueError(f"buffer pool on {pool.device}, stream on {self.device}")
        self._named, self._bucket_bytes, self._first = named, bucket_bytes, first_bucket_bytes
        self._buffers = pool or BufferPool(self.device)
        self._slots = threading.Semaphore(buffers)
        self._ready: queue.Queue = queue.Queue()
        self._stop = threading.Event()

    def _build(self, group: list[tuple[str, torch.Tensor]]) -> tuple[Bucket, torch.Tensor | None]:
        """The bucket and the pooled buffer it occupies (None when it is a tensor's own storage)."""
        if len(group) == 1 and group[0][1].device == self.device:
            own = as_bytes(group[0][1])
            if own is not None:
                return Bucket(flat=own, metas=layout(group)), None
        buf = self._buffers.take(bucket_size(layout(group)))
        bucket = write_into(group, buf)
        _settle(self.device)  # the bytes are in place before the consumer's collective reads them
        return bucket, buf

    def _produce(self, cuda_device: int | None, grad: bool) -> None:
        # the exporter runs here: give it the caller's thread-local state (current device, grad mode)
        if cuda_device is not None:
            torch.cuda.set_device(cuda_device)
        torch.set_grad_enabled(grad)
        try:
            groups = plan_buckets(self._named, self._bucket_bytes, self._first)
            while True:
                _acquire(self._slots, self._stop)  # before pulling: bounds what the exporter materialises
                group = next(groups, None)
                if group is None or self._stop.is_set():
                    break
                self._ready.put(self._build(group))
        except _Stopped:
            return
        except BaseException as e:  # surfaced in the consumer
            self._ready.put(e)
            return
        self._ready.put(_DONE)

    def __iter__(self) -> Iterator[Bucket]:
        # the current CUDA device is per thread (a new one starts on device 0), and the exporter's
        # gathers may allocate on it
        cuda_device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        producer = threading.Thread(target=self._produce, args=(cuda_device, torch.is_grad_enabled()),
                                    name="bucket-producer", daemon=True)
        producer.start()
        try:
            while True:
                item = self._ready.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                bucket, buf = item
                yield bucket
                if buf is not None:
                    _settle(self.device)  # the collective that read it has finished
                    self._buffers.give(buf)
                self._slots.release()
        finally:
            self._stop.set()
            producer.join()


def receive_buckets(group: dist.ProcessGroup, manifests: Iterable[list[TensorMeta]],
                    params: dict[str, torch.Tensor], device: torch.device | str = "cpu", src: int = 0,
                    pool: BufferPool | None = None) -> int:
    """Receive buckets broadcast by group rank `src` into `params` (by name); bytes received.

    Double buffered: bucket k+1's broadcast is in flight while bucket k is copied out, so at most
    two buffers exist: the one being received, the one being copied out."""
    device = resolve_device(device)
    buffers = pool or BufferPool(device)
    pending: tuple | None = None
    total = 0
    for metas in manifests:
        direct = _direct_target(metas, params)
        buf = None if direct is not None else buffers.take(bucket_size(metas))
        flat = direct if direct is not None else buf[:bucket_size(metas)]
        work = dist.broadcast(flat, group=group, group_src=src, async_op=True)
        if pending is not None:
            _finish(pending, params, buffers)
        pending = (work, Bucket(flat=flat, metas=list(metas)), buf)
        total += flat.numel()
    if pending is not None:
        _finish(pending, params, buffers)
    return total


def _direct_target(metas: list[TensorMeta], params: dict[str, torch.Tensor]) -> torch.Tensor | None:
    if len(metas) != 1:
        return None
    m = metas[0]
    p = params[m.name]
    if p.dtype != m.torch_dtype or tuple(p.shape) != m.shape:
        return None
    return as_bytes(p)


def _finish(pending: tuple, params: dict[str, torch.Tensor], buffers: BufferPool) -> None:
    work, bucket, buf = pending
    work.wait()
    if buf is None:
        return  # received in place
    for name, t in unflatten(bucket):
        params[name].copy_(t)
    _settle(buffers.device)  # the copies out are done before the buffer is received into again
    buffers.give(buf)
