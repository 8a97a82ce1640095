"""Trainer side of weight sync: stream (hf_name, tensor) pairs to generators as flat buckets.

One `WeightSender` per sending trainer rank (each pipeline stage sends its own layers; with TP the
tensors are already gathered to full HF layout by the exporter). It works on any iterable of
`(hf_name, tensor)` — `megatron_rl.train.hf_weights.export_hf_tensors(...)` or an HF model's
`named_parameters()` — and never holds more than two buckets of it: the one on the wire and the
next, which a producer thread converts and packs meanwhile (`sync.pipeline.BucketStream`).

Groups: one torch.distributed group per (sender, generator) pair, the sender as rank 0. With one
generator that is one group per sender rank. Pairs rather than one group spanning all generators:
SGLang's scheduler receives one bucket at a time, in the order update requests reach it, so two
senders sharing two multi-generator groups could be served in opposite orders by two generators
and deadlock; a pair group can only wait on its own sender.

Connecting (`connect`): the groups are opened one at a time, each proven at once by one 4-byte
broadcast the server joins (a tensor every supported SGLang model's load_weights skips), bounded by
the timeout. NCCL sets a communicator up inside its first collective and blocks there until every
member joins: done here, before the bucket stream's producer runs its TP/EP all-gathers and one group
at a time, no two communicators are set up at once on the GPU, and a server that never joins is
named after the timeout instead of hanging the push.

Per bucket and generator: POST the manifest (SGLang then joins a broadcast on the pair group) and
broadcast the flat bytes. A bucket the server reports as not loaded is re-sent up to `retries`
times (loading is idempotent); after that, or if the server never joined the broadcast, the send
raises `WeightSyncError`. Weights are stamped with a version only by the coordinator
(`sync.coordinator`) after *all* senders succeeded.
"""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Iterable

import torch
import torch.distributed as dist

from megatron_rl.rollout.client import SGLangClient
from megatron_rl.sync.buckets import Bucket, flatten, ramp_start
from megatron_rl.sync.group import close_update_group, default_backend, open_update_group
from megatron_rl.sync.pipeline import BucketStream, BufferPool, resolve_device


class WeightSyncError(RuntimeError):
    """A weight update failed or was partial; the generators were left paused, not half-updated."""


# The connecting broadcast's one tensor: SGLang's load_weights of every family the trainer builds skips
# a name holding "rotary_emb.inv_freq" (models/llama.py, which mistral.py extends, qwen2, qwen3,
# qwen3_moe, mixtral), so the server joins the broadcast and loads nothing.
HANDSHAKE_NAME = "model.rotary_emb.inv_freq"


@dataclass(frozen=True)
class SyncTarget:
    """A generator as a sender sees it: its URL, TP size, and server incarnation (restart count)."""

    url: str
    tp_size: int = 1
    incarnation: int = 0


@dataclass
class SendReport:
    sender_rank: int
    names: list[str] = field(default_factory=list)
    bytes: int = 0  # payload bytes per generator
    buckets: int = 0
    retries: int = 0
    seconds: float = 0.0


@dataclass
class _Link:
    target: SyncTarget
    client: SGLangClient
    group_name: str
    pg: dist.ProcessGroup | None = None


class WeightSender:
    def __init__(self, sender_rank: int, targets: list[SyncTarget], bucket_mb: float = 256,
                 backend: str | None = None, device: str | torch.device | None = None,
                 retries: int = 1, broadcast_timeout_s: float = 300.0, group_prefix: str = "mrl",
                 address: str = "127.0.0.1"):
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        if not targets:
            raise ValueError("a sender needs at least one generator target")
        self.sender_rank = sender_rank
        self.bucket_bytes = int(bucket_mb * (1 << 20))
        self.backend = backend or default_backend()
        self.device = resolve_device(device or ("cuda" if self.backend == "nccl" else "cpu"))
        self.retries = retries
        self.timeout_s = broadcast_timeout_s
        self.group_prefix = group_prefix
        self.address = address  # this sender's node address: the update groups rendezvous here
        self._links: list[_Link] = []
        self._pool = BufferPool(self.device)  # two buckets' buffers, kept from push to push
        self.retarget(targets)

    # ---------------------------------------------------------------- groups
    def retarget(self, targets: list[SyncTarget]) -> None:
        """Adopt a new target list; links to restarted (new incarnation) or removed servers are dropped."""
        keep = {(l.target.url, l.target.incarnation): l for l in self._links}
        links = []
        for i, t in enumerate(targets):
            link = keep.pop((t.url, t.incarnation), None)
            if link is None:
                name = f"{self.group_prefix}-s{self.sender_rank}-g{i}-i{t.incarnation}-{time.monotonic_ns() % 10**9}"
                link = _Link(t, SGLangClient(t.url, timeout_s=self.timeout_s), name)
            links.append(link)
        for stale in keep.values():
            close_update_group(None, stale.pg, stale.group_name)  # its server is gone or replaced
        self._links = links

    def connect(self) -> None:
        """Open the missing groups (one per generator), one at a time, each connected by its first
        broadcast before the next is opened (module docstring)."""
        for link in self._links:
            if link.pg is None:
                link.pg = open_update_group(link.client, link.group_name, link.target.tp_size, self.backend,
                                            address=self.address, timeout_s=self.timeout_s)
                self._handshake(link)

    def _handshake(self, link: _Link) -> None:
        """The group's first broadcast, within timeout_s even where the broadcast call itself blocks
        (NCCL's communicator set-up waits for every member inside it): run in a daemon thread."""
        bucket = flatten([(HANDSHAKE_NAME, torch.zeros(1, device=self.device))])
        what = f"the first broadcast on update group {link.group_name} (connecting it)"
        outcome: queue.Queue = queue.Queue()

        def run() -> None:
            try:
                outcome.put(self._post_and_broadcast(link, bucket, what))
            except BaseException as e:
                outcome.put(e)

        threading.Thread(target=run, daemon=True, name=f"connect-{link.group_name}").start()
        try:
            # _post_and_broadcast bounds itself by timeout_s, then waits up to 5 s for the broadcast
            answer = outcome.get(timeout=self.timeout_s + 10)
        except queue.Empty:
            answer = TimeoutError(f"no answer in {self.timeout_s:.0f} s")
        if isinstance(answer, WeightSyncError):
            raise answer
        if isinstance(answer, BaseException) or not answer.get("success"):
            link.pg = None
            raise WeightSyncError(f"sender {self.sender_rank} -> {link.target.url}: {what} failed; the server "
                                  f"did not join it (its log says why): {str(answer)[:400]}")

    def close(self) -> None:
        for link in self._links:
            close_update_group(link.client, link.pg, link.group_name)
            link.pg = None

    # ---------------------------------------------------------------- sending
    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SendReport:
        """Send every tensor to every generator; raises WeightSyncError on any failure."""
        self.connect()
        report = SendReport(self.sender_rank)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=len(self._links)) as pool:
            # bucket k+1 is converted and packed (producer thread) while bucket k is on the wire;
            # the first buckets ramp up to the cap so the unoverlapped first one is short
            for bucket in BucketStream(named_tensors, self.bucket_bytes, self.device, pool=self._pool,
                                       first_bucket_bytes=ramp_start(self.bucket_bytes)):
                for retries in pool.map(lambda l: self._send_bucket(l, bucket), self._links):
                    report.retries += retries
                report.names += bucket.names
                report.bytes += bucket.nbytes
                report.buckets += 1
        report.seconds = time.perf_counter() - t0
        if not report.names:
            raise WeightSyncError(f"sender {self.sender_rank}: nothing to send (empty tensor iterable)")
        return report

    def _send_bucket(self, link: _Link, bucket: Bucket) -> int:
        for attempt in range(self.retries + 1):
            answer = self._post_and_broadcast(link, bucket, f"broadcast of bucket [{bucket.names[0]} ..]")
            if isinstance(answer, dict) and answer.get("success"):
                return attempt
        raise WeightSyncError(f"sender {self.sender_rank} -> {link.target.url}: bucket "
                              f"[{bucket.names[0]} .. {bucket.names[-1]}] not loaded after "
                              f"{self.retries + 1} attempts: {str(answer)[:400]}")

    def _post_and_broadcast(self, link: _Link, bucket: Bucket, what: str) -> object:
        result: list[object] = []

        def post() -> None:
            try:
                result.append(link.client.update_weights_from_distributed(bucket.manifest(), link.group_name))
            except BaseException as e:
                result.append(e)

        t = threading.Thread(target=post, daemon=True)
        t.start()
        work = dist.broadcast(bucket.flat, group=link.pg, group_src=0, async_op=True)
        t.join(self.timeout_s)
        answer = result[0] if result else TimeoutError(f"no answer in {self.timeout_s} s")
        try:
            # the server answers only after its receive completed, unless it failed before joining
            ok = work.wait(timeout=timedelta(seconds=5 if isinstance(answer, BaseException)
                                             or not answer.get("success") else self.timeout_s))
        except Exception as e:
            ok, answer = False, answer if isinstance(answer, BaseException) else e
        if not ok:
            link.pg = None  # the group is out of step with the server: unusable
            raise WeightSyncError(f"sender {self.sender_rank} -> {link.target.url}: {what} did not complete: "
                                  f"{answer}")
        if isinstance(answer, BaseException):
            raise WeightSyncError(f"sender {self.sender_rank} -> {link.target.url}: {answer}") from answer
        return answer
