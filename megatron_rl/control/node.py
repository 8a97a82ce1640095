"""Where each rank runs: its node's address and its local rank, from the environment Slurm/MPI give it.

Every rank probes its own environment (`probe_node`): the address is resolved on the rank's own node
because only that node's resolver (/etc/hosts, DNS) is sure to know its name. The probes are then
allgathered over MPI and `assign_nodes` turns them into one address and local rank per rank; it is
pure, so every rank computes the same answer from the same list and no broadcast is needed.

- address: `MEGATRON_RL_NODE_ADDR` when set (tests with loopback aliases, clusters whose hostname
  resolves to the wrong interface), else the IP the hostname resolves to. When every rank reports
  the same hostname (one machine) and nobody overrides, everyone uses 127.0.0.1: the single-host
  default, which needs no resolvable hostname.
- local rank: `MEGATRON_RL_LOCAL_RANK`, else `SLURM_LOCALID`, `MPI_LOCALRANKID` (MPICH/Hydra),
  `OMPI_COMM_WORLD_LOCAL_RANK` (Open MPI), else the rank's position among the ranks of its node in
  rank order (placement.py's definition, what srun would give).

Who uses what: the trainers rendezvous on the first trainer's address (MASTER_ADDR); each SGLang server
listens on its node's address; a weight-update group rendezvouses on its sender's (a trainer's) address.
The collectives' own connections follow the same setting: with `MEGATRON_RL_NODE_ADDR` set, each rank
exports the interface holding that address as GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME (unless the
job sets them), for its own groups and the servers it starts; gloo would otherwise bind what the
hostname resolves to, the very address the override is there to avoid.

GPUs (`assign_gpus`): on each node, the ranks that own GPUs take them in local-rank order, a trainer
one, a generator `generator.tp_size` consecutive ones; the controller and verifiers take none. That
is placement.py's rule, so a job launched with `megatron-rl plan`'s hostfile gets exactly the GPUs the
plan printed. The local rank itself is not a GPU id: the controller is local rank 0 on node 0.

CPU cores (`assign_cpus`, under `run.cpu_placement: split` on a machine without a GPU): on each host,
the cores its ranks may run on (the union of their affinities, `gather_cores`) are split between the
processes that compute, in local-rank order: a trainer one share, a generator `generator.tp_size`
shares (its SGLang server runs there), a share being cores // shares (at least one; with fewer cores
than shares they are dealt round-robin). The controller and verifiers take no share: they keep every
core (they mostly wait). Why: two processes that each run an OpenMP pool over every core make each
other's parallel regions wait for a descheduled thread (a 16-row linear layer of the CPU demo cost
0.5 ms alone and ~15 ms beside a busy trainer); disjoint cores keep each pool's threads running.
"""
from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass
from typing import Callable, Mapping, MutableMapping, Sequence

from megatron_rl.plan.layout import Role
from megatron_rl.errors import InputError

ADDR_VAR = "MEGATRON_RL_NODE_ADDR"
LOCAL_RANK_VAR = "MEGATRON_RL_LOCAL_RANK"
# in priority order: the explicit override first, then what the launchers set
LOCAL_RANK_VARS = (LOCAL_RANK_VAR, "SLURM_LOCALID", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK")
LOOPBACK = "127.0.0.1"
IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")  # the interface gloo and NCCL connect through


class NodeEnvError(InputError, ValueError):
    """The environment names a bad address or local rank (the message names the variable)."""


@dataclass(frozen=True)
class NodeProbe:
    """What one rank found in its environment; errors are carried, not raised, so that a bad
    variable on one rank cannot leave the others waiting in the allgather."""

    hostname: str
    addr: str | None  # the override, or the hostname's resolution; None when it did not resolve
    overridden: bool
    local_rank: int | None
    error: str | None = None
    ifname: str | None = None  # the interface holding an overridden address (None without the override)


@dataclass(frozen=True)
class NodeInfo:
    addr: str
    local_rank: int


def local_rank_from_env(env: Mapping[str, str]) -> int | None:
    for var in LOCAL_RANK_VARS:
        value = env.get(var)
        if value is None or value == "":
            continue
        try:
            n = int(value)
        except ValueError:
            n = -1
        if n < 0:
            raise NodeEnvError(f"{var}={value!r}: the local rank must be an integer >= 0")
        return n
    return None


def addr_override(env: Mapping[str, str]) -> str | None:
    value = env.get(ADDR_VAR, "").strip()
    if not value:
        return None
    try:
        ip = ipaddress.ip_address(value)
    except ValueError:
        raise NodeEnvError(f"{ADDR_VAR}={value!r}: not an IP address") from None
    if ip.is_unspecified:  # a wildcard is not an address others can reach
        raise NodeEnvError(f"{ADDR_VAR}={value!r}: needs this node's own address, not a wildcard")
    return str(ip)


def interface_of(addr: str, interfaces: Mapping[str, list] | None = None) -> str | None:
    """The network interface of this node holding `addr` (psutil.net_if_addrs() by default): the one
    with that exact address, else an IPv4 one whose network contains it (a loopback alias such as
    127.0.0.2 lives on lo); None when no interface has it."""
    import psutil

    interfaces = psutil.net_if_addrs() if interfaces is None else interfaces
    ip = ipaddress.ip_address(addr)
    within = []
    for name, addrs in interfaces.items():
        for a in addrs:
            if a.family == socket.AF_INET6 and ipaddress.ip_address(a.address.split("%")[0]) == ip:
                return name
            if a.family != socket.AF_INET:
                continue
            if ipaddress.ip_address(a.address) == ip:
                return name
            if a.netmask and ip in ipaddress.ip_interface(f"{a.address}/{a.netmask}").network:
                within.append(name)
    return within[0] if within else None


def export_interface(probe: NodeProbe, env: MutableMapping[str, str] | None = None) -> None:
    """GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME from the interface of the overridden node address, for
    this rank and every process it starts; a value the job set itself wins."""
    env = os.environ if env is None else env
    if probe.ifname:
        for var in IFNAME_VARS:
            env.setdefault(var, probe.ifname)


def probe_node(env: Mapping[str, str] | None = None, hostname: str | None = None,
               resolve: Callable[[str], str] = socket.gethostbyname,
               find_interface: Callable[[str], str | None] = interface_of) -> NodeProbe:
    env = os.environ if env is None else env
    hostname = hostname or socket.gethostname()
    try:
        local_rank = local_rank_from_env(env)
        addr = addr_override(env)
    except NodeEnvError as e:
        return NodeProbe(hostname, None, False, None, str(e))
    if addr is not None:
        ifname = find_interface(addr)
        if ifname is None:  # nothing here could bind it: servers, stores and gloo would all fail later
            return NodeProbe(hostname, None, False, None,
                             f"{ADDR_VAR}={addr}: no network interface of this node holds that address")
        return NodeProbe(hostname, addr, True, local_rank, ifname=ifname)
    try:
        resolved = resolve(hostname)
    except OSError:
        resolved = None  # only an error if the job spans hosts (decided in assign_nodes)
    return NodeProbe(hostname, resolved, False, local_rank)


def assign_nodes(probes: Sequence[NodeProbe]) -> list[NodeInfo]:
    """One NodeInfo per rank from every rank's probe; NodeEnvError naming the variable or host."""
    for rank, p in enumerate(probes):
        if p.error:
            raise NodeEnvError(f"rank {rank} on {p.hostname}: {p.error}")
    single_host = len({p.hostname for p in probes}) == 1 and not any(p.overridden for p in probes)
    addrs = []
    for rank, p in enumerate(probes):
        if single_host:
            addrs.append(LOOPBACK)
            continue
        if p.addr is None:
            raise NodeEnvError(f"rank {rank}: hostname {p.hostname!r} does not resolve; set {ADDR_VAR}")
        if not p.overridden and ipaddress.ip_address(p.addr).is_loopback:
            # /etc/hosts often maps the hostname to 127.0.1.1: other nodes could not reach it
            raise NodeEnvError(f"rank {rank}: hostname {p.hostname!r} resolves to loopback {p.addr} but the "
                               f"job spans several hosts; set {ADDR_VAR} to this node's address")
        addrs.append(p.addr)
    seen: dict[str, int] = {}
    nodes = []
    for p, addr in zip(probes, addrs):
        position = seen.get(addr, 0)
        seen[addr] = position + 1
        nodes.append(NodeInfo(addr, position if p.local_rank is None else p.local_rank))
    return nodes


def assign_gpus(roles: Sequence[Role], nodes: Sequence[NodeInfo], generator_tp: int) -> list[tuple[int, ...]]:
    """Local GPU ids of every rank (empty for the controller and verifiers); pure, so every rank
    computes the same map."""
    wants = {"trainer": 1, "generator": generator_tp}
    gpus: list[tuple[int, ...]] = [() for _ in roles]
    next_free: dict[str, int] = {}
    for rank in sorted(range(len(roles)), key=lambda r: (nodes[r].addr, nodes[r].local_rank, r)):
        n = wants.get(roles[rank], 0)
        if n:
            first = next_free.get(nodes[rank].addr, 0)
            gpus[rank] = tuple(range(first, first + n))
            next_free[nodes[rank].addr] = first + n
    return gpus


def assign_cpus(roles: Sequence[Role], hosts: Sequence[str], host_cores: Mapping[str, Sequence[int]],
                generator_tp: int) -> list[tuple[int, ...]]:
    """Cores of every rank (empty: not placed, the controller and verifiers); pure, like assign_gpus.
    `hosts[r]`: rank r's host; `host_cores[h]`: the cores of host h (gather_cores)."""
    wants = {"trainer": 1, "generator": generator_tp}
    out: list[tuple[int, ...]] = [() for _ in roles]
    for host, cores in host_cores.items():
        ranks = [r for r in range(len(roles)) if hosts[r] == host and wants.get(roles[r], 0)]
        cores = sorted(cores)
        per = max(1, len(cores) // max(1, sum(wants[roles[r]] for r in ranks)))
        share = 0
        for r in ranks:
            n = wants[roles[r]]
            out[r] = tuple(sorted({cores[(share * per + i) % len(cores)] for i in range(n * per)}))
            share += n
    return out


def gather_cores(comm) -> tuple[list[str], dict[str, tuple[int, ...]]]:
    """Collective over `comm`: every rank's host name, and every host's cores (the union of the CPU
    affinities its ranks started with)."""
    probes = comm.allgather((socket.gethostname(), tuple(sorted(os.sched_getaffinity(0)))))
    cores: dict[str, set[int]] = {}
    for host, mine in probes:
        cores.setdefault(host, set()).update(mine)
    return [h for h, _ in probes], {h: tuple(sorted(c)) for h, c in cores.items()}


def check_gpus_exist(gpus: Sequence[int], visible: int, rank: int, role: str) -> None:
    """NodeEnvError when this rank was given GPU ids its node does not have (a launch that did not
    follow the plan's hostfile puts too many GPU ranks on one node)."""
    missing = [g for g in gpus if g >= visible]
    if missing:
        raise NodeEnvError(f"rank {rank} ({role}) needs GPU {missing[0]} but its node shows {visible}; launch "
                           f"with the hostfile of `megatron-rl plan` (one host per rank, in rank order)")


def gather_nodes(comm) -> list[NodeInfo]:
    """Collective over `comm`: every rank's NodeInfo, indexed by rank; then this rank exports the
    interface of its node address for gloo and NCCL (export_interface)."""
    probe = probe_node()
    nodes = assign_nodes(comm.allgather(probe))
    export_interface(probe)
    return nodes
