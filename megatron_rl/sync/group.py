"""A torch.distributed group between one sender (rank 0) and one SGLang server's TP ranks.

SGLang's `/init_weights_update_group` makes each of its TP workers join a group through a TCP
rendezvous at `master_address:master_port` with rank `rank_offset + tp_rank`, then wraps the store
in a PrefixStore named after the group. The sender must join the same rendezvous as rank 0 with the
same prefix; it does not need (or touch) the trainer's default process group, so a Megatron rank
can own such a group next to its own world.

The rendezvous is the sender's: its store listens on `address`, the sender's node address
(control/node.py; 127.0.0.1 on one host), on a socket bound before the port is told to SGLang, so
the servers' workers on other nodes can reach it and no other process can take the port meanwhile.
"""
from __future__ import annotations

import socket
import threading
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world, rendezvous

from megatron_rl.rollout.client import SGLangClient


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def bind_listener(addr: str) -> socket.socket:
    """A listening TCP socket on `addr` with a port the OS picked: holding it from the pick until
    the rendezvous store adopts it (`listening_store`) leaves no window for another process to take
    the port, and binding the node's own address keeps the store off the wildcard address."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind((addr, 0))
    sock.listen(128)
    return sock


def listening_store(listener: socket.socket, world_size: int, timeout):
    """The rendezvous TCPStore server on `listener` (its address and port), instead of torch's
    default of listening on every interface; the other members join it as TCPStore clients."""
    addr, port = listener.getsockname()[:2]
    fd = listener.detach()  # the store owns the descriptor from here on
    return dist.TCPStore(addr, port, world_size, True, timeout=timeout, master_listen_fd=fd,
                         wait_for_workers=False)


def _join(backend: str, address: str, port: int, world_size: int, rank: int, group_name: str,
          timeout: timedelta, listener: socket.socket | None = None) -> dist.ProcessGroup:
    """Join the group at `address:port`; with `listener` (bound there), serve its store on it."""
    if listener is not None:
        store = listening_store(listener, world_size, timeout)
    else:  # a plain tcp:// rendezvous (benchmarks/weight_sync.py plays both sides this way)
        store, rank, world_size = next(rendezvous(f"tcp://{address}:{port}", rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
    pg, _ = _new_process_group_helper(world_size, rank, [], dist.Backend(backend), PrefixStore(group_name, store),
                                      group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def open_update_group(client: SGLangClient, group_name: str, tp_size: int = 1, backend: str | None = None,
                      address: str = "127.0.0.1", timeout_s: float = 300.0) -> dist.ProcessGroup:
    """Create the group on both sides at once (the HTTP call blocks until both joined)."""
    backend = backend or default_backend()
    listener = bind_listener(address)
    port = listener.getsockname()[1]
    err: list[BaseException] = []

    def server_side() -> None:
        try:
            client.init_weights_update_group(address, port, 1, 1 + tp_size, group_name, backend)
        except BaseException as e:  # surfaced below
            err.append(e)

    t = threading.Thread(target=server_side, daemon=True)
    t.start()
    try:
        pg = _join(backend, address, port, 1 + tp_size, 0, group_name, timedelta(seconds=timeout_s),
                   listener)
    finally:
        t.join(timeout=timeout_s)
    if err:
        raise err[0]
    return pg


def close_update_group(client: SGLangClient | None, pg: dist.ProcessGroup | None, group_name: str) -> None:
    """Best effort on both sides (the server may be gone)."""
    if client is not None:
        try:
            client.destroy_weights_update_group(group_name)
        except Exception:
            pass
    if pg is not None:
        try:
            dist.destroy_process_group(pg)
        except Exception:
            pass
