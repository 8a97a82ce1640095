"""The sender connects each weight-update group at once (sync/sender.py `connect`): one group at a time,
each proven by a first broadcast the server joins, and a server that never joins it is named after the
timeout. On gloo on CPU; SGLang's side is a stand-in whose group member lives in a child process (torch
registers a group by name, once per process), joined as its TP rank joins in init_weights_update_group."""
from __future__ import annotations

import multiprocessing as mp
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from megatron_rl.sync import sender as sender_mod
from megatron_rl.sync.sender import HANDSHAKE_NAME, SyncTarget, WeightSender, WeightSyncError


def _member(conn) -> None:
    """Child: join groups and receive broadcasts on command (what SGLang's TP worker does)."""
    from megatron_rl.sync.buckets import empty_like_manifest, layout
    from megatron_rl.sync.group import _join

    groups = {}
    for command, *args in iter(conn.recv, ("stop",)):
        if command == "init":
            address, port, rank, world, name, backend = args
            groups[name] = _join(backend, address, port, world, rank, name, timedelta(seconds=30))
            conn.send("joined")
        else:  # "receive": one bucket by broadcast, as update_weights_from_distributed receives it
            name, manifest = args
            metas = layout([(n, torch.empty(s, dtype=getattr(torch, d)))
                            for n, d, s in zip(manifest["names"], manifest["dtypes"], manifest["shapes"])])
            bucket = empty_like_manifest(metas)
            dist.broadcast(bucket.flat, group=groups[name], group_src=0)
            conn.send(bucket.flat.numel())


@pytest.fixture(scope="module")
def member():
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_member, args=(child,), daemon=True)
    proc.start()
    yield parent
    parent.send(("stop",))
    proc.join(10)


class FakeServer:
    """SGLang's HTTP side: init_weights_update_group makes the member join; each posted bucket is
    received by broadcast when `joins`, else the post hangs as a server that never comes to it."""

    def __init__(self, url: str, member, events: list[str], joins: bool = True):
        self.url, self.member, self.events, self.joins = url, member, events, joins
        self.received: list[tuple[list[str], int]] = []
        self.release = threading.Event()

    def init_weights_update_group(self, address, port, rank_offset, world_size, group_name, backend):
        self.events.append(f"init {self.url}")
        self.member.send(("init", address, port, rank_offset, world_size, group_name, backend))
        assert self.member.recv() == "joined"

    def update_weights_from_distributed(self, manifest: dict, group_name: str) -> dict:
        self.events.append(f"post {self.url}")
        if not self.joins:
            self.release.wait(60)
            return {"success": False, "message": "released"}
        self.member.send(("receive", group_name, manifest))
        self.received.append((manifest["names"], self.member.recv()))
        self.events.append(f"received {self.url}")
        return {"success": True}

    def destroy_weights_update_group(self, group_name: str) -> None:
        pass


def _sender(monkeypatch, servers: list[FakeServer], timeout_s: float = 30.0) -> WeightSender:
    by_url = {s.url: s for s in servers}
    monkeypatch.setattr(sender_mod, "SGLangClient", lambda url, timeout_s: by_url[url])
    return WeightSender(0, [SyncTarget(s.url) for s in servers], backend="gloo", broadcast_timeout_s=timeout_s)


def test_groups_connect_one_at_a_time_each_by_a_broadcast_its_server_joins(monkeypatch, member):
    events: list[str] = []
    servers = [FakeServer(f"http://10.0.0.{i}:30000", member, events) for i in (1, 2)]
    sender = _sender(monkeypatch, servers)
    sender.connect()
    # the second group is opened only after the first one's broadcast arrived
    assert events == [f"{step} {s.url}" for s in servers for step in ("init", "post", "received")]
    for s in servers:
        assert s.received == [([HANDSHAKE_NAME], 4)]  # one float32 under a name no model loads
    sender.connect()  # connected groups are kept: no second handshake
    assert len(events) == 6


def test_a_server_that_never_joins_the_first_broadcast_is_named_after_the_timeout(monkeypatch, member):
    events: list[str] = []
    silent = FakeServer("http://10.0.0.7:30001", member, events, joins=False)
    sender = _sender(monkeypatch, [silent], timeout_s=2.0)
    t0 = time.monotonic()
    try:
        with pytest.raises(WeightSyncError, match=r"-> http://10\.0\.0\.7:30001: the first broadcast on update "
                                                  r"group \S+ \(connecting it\) did not complete"):
            sender.connect()
        assert time.monotonic() - t0 < 2.0 + 5 + 5  # the timeout, the broadcast's grace, slack
        assert events == [f"init {silent.url}", f"post {silent.url}"]
    finally:
        silent.release.set()
