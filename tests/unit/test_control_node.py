"""control/node.py: a rank's node address and local rank from the Slurm/MPI environment."""
from __future__ import annotations

import os
import socket

import pytest

from megatron_rl.control.node import (ADDR_VAR, LOCAL_RANK_VAR, NodeEnvError, NodeInfo, NodeProbe, assign_cpus,
                                      assign_nodes, gather_cores, local_rank_from_env, probe_node)


def _resolve(table):
    def resolve(host):
        if host not in table:
            raise socket.gaierror(f"unknown host {host}")
        return table[host]
    return resolve


@pytest.mark.parametrize("env,expected", [
    ({}, None),
    ({"SLURM_LOCALID": "3"}, 3),
    ({"MPI_LOCALRANKID": "2"}, 2),
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "1"}, 1),
    ({LOCAL_RANK_VAR: "5", "SLURM_LOCALID": "3", "MPI_LOCALRANKID": "7"}, 5),  # override first
    ({"SLURM_LOCALID": "3", "MPI_LOCALRANKID": "7"}, 3),  # srun's over mpiexec's
    ({LOCAL_RANK_VAR: "", "SLURM_LOCALID": "0"}, 0),  # empty means unset
])
def test_local_rank_priority(env, expected):
    assert local_rank_from_env(env) == expected


@pytest.mark.parametrize("env,var", [({"SLURM_LOCALID": "x"}, "SLURM_LOCALID"),
                                     ({LOCAL_RANK_VAR: "-1"}, LOCAL_RANK_VAR),
                                     ({ADDR_VAR: "node7"}, ADDR_VAR),
                                     ({ADDR_VAR: "0.0.0.0"}, ADDR_VAR)])
def test_bad_variable_is_one_line_naming_it(env, var):
    probe = probe_node(env, hostname="n0", resolve=_resolve({"n0": "10.0.0.1"}))
    with pytest.raises(NodeEnvError) as e:
        assign_nodes([probe, probe_node({}, hostname="n0", resolve=_resolve({"n0": "10.0.0.1"}))])
    assert var in str(e.value) and "\n" not in str(e.value) and "rank 0" in str(e.value)


def test_one_host_uses_loopback_even_when_hostname_does_not_resolve():
    probes = [probe_node({"MPI_LOCALRANKID": str(i)}, hostname="vm", resolve=_resolve({})) for i in range(3)]
    assert assign_nodes(probes) == [NodeInfo("127.0.0.1", i) for i in range(3)]


def test_several_hosts_use_resolved_addresses_and_local_rank_defaults_to_position_on_node():
    resolve = _resolve({"a": "10.0.0.1", "b": "10.0.0.2"})
    probes = [probe_node({}, hostname=h, resolve=resolve) for h in ("a", "a", "b", "a", "b")]
    assert assign_nodes(probes) == [NodeInfo("10.0.0.1", 0), NodeInfo("10.0.0.1", 1), NodeInfo("10.0.0.2", 0),
                                    NodeInfo("10.0.0.1", 2), NodeInfo("10.0.0.2", 1)]


def test_override_wins_and_counts_as_multi_node_on_one_machine():
    # the loopback-alias simulation: one hostname, two "nodes" given by the override
    envs = [{ADDR_VAR: "127.0.0.2", "SLURM_LOCALID": "0"}, {ADDR_VAR: "127.0.0.2", "SLURM_LOCALID": "1"},
            {ADDR_VAR: "127.0.0.3", "SLURM_LOCALID": "0"}]
    probes = [probe_node(env, hostname="vm", resolve=_resolve({"vm": "127.0.0.1"})) for env in envs]
    assert assign_nodes(probes) == [NodeInfo("127.0.0.2", 0), NodeInfo("127.0.0.2", 1), NodeInfo("127.0.0.3", 0)]


def test_multi_host_refuses_a_hostname_resolving_to_loopback_or_nothing():
    resolve = _resolve({"a": "127.0.1.1", "b": "10.0.0.2"})
    with pytest.raises(NodeEnvError, match=f"rank 0: hostname 'a' resolves to loopback 127.0.1.1.*{ADDR_VAR}"):
        assign_nodes([probe_node({}, hostname=h, resolve=resolve) for h in ("a", "b")])
    with pytest.raises(NodeEnvError, match=f"rank 1: hostname 'c' does not resolve; set {ADDR_VAR}"):
        assign_nodes([probe_node({}, hostname=h, resolve=resolve) for h in ("b", "c")])


def test_probe_carries_errors_instead_of_raising():
    # a rank that raised before the allgather would leave the others waiting in it forever
    p = probe_node({"SLURM_LOCALID": "two"}, hostname="a", resolve=_resolve({"a": "10.0.0.1"}))
    assert isinstance(p, NodeProbe) and p.error and "SLURM_LOCALID" in p.error


class _Addr:  # psutil's snicaddr, as net_if_addrs lists it
    def __init__(self, family, address, netmask=None):
        self.family, self.address, self.netmask = family, address, netmask


_NODE = {"lo": [_Addr(socket.AF_INET, "127.0.0.1", "255.0.0.0"), _Addr(socket.AF_INET6, "::1")],
         "eth0": [_Addr(socket.AF_INET, "10.1.0.5", "255.255.0.0")],
         "ib0": [_Addr(socket.AF_INET, "10.2.0.5", "255.255.0.0"), _Addr(socket.AF_INET6, "fe80::5%ib0")]}


@pytest.mark.parametrize("addr,ifname", [("10.2.0.5", "ib0"), ("10.1.0.5", "eth0"), ("fe80::5", "ib0"),
                                         ("127.0.0.3", "lo"),  # a loopback alias: inside lo's network
                                         ("10.1.0.9", "eth0"), ("192.168.0.1", None)])
def test_interface_of_an_address(addr, ifname):
    from megatron_rl.control.node import interface_of

    assert interface_of(addr, _NODE) == ifname


def test_gloo_and_nccl_take_the_interface_of_the_node_address_override():
    """MEGATRON_RL_NODE_ADDR is the one setting: its interface becomes GLOO_SOCKET_IFNAME and
    NCCL_SOCKET_IFNAME (gloo would bind the hostname's address otherwise); the job's own values win."""
    from megatron_rl.control.node import export_interface, interface_of

    find = lambda addr: interface_of(addr, _NODE)  # noqa: E731
    probe = probe_node({ADDR_VAR: "10.2.0.5"}, hostname="n0", resolve=_resolve({"n0": "10.1.0.5"}),
                       find_interface=find)
    env: dict[str, str] = {}
    export_interface(probe, env)
    assert env == {"GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "ib0"}
    env = {"NCCL_SOCKET_IFNAME": "=ib1"}
    export_interface(probe, env)
    assert env == {"GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "=ib1"}
    plain = probe_node({}, hostname="n0", resolve=_resolve({"n0": "10.1.0.5"}), find_interface=find)
    env = {}
    export_interface(plain, env)  # no override: gloo's and NCCL's own choice stays
    assert env == {}
    elsewhere = probe_node({ADDR_VAR: "192.168.0.1"}, hostname="n0", resolve=_resolve({}), find_interface=find)
    with pytest.raises(NodeEnvError, match=rf"^rank 0 on n0: {ADDR_VAR}=192\.168\.0\.1: no network interface "
                                           "of this node holds that address$"):
        assign_nodes([elsewhere])


@pytest.mark.parametrize("n_cores", [1, 2, 3, 4, 7, 16])
@pytest.mark.parametrize("roles,tp", [
    (["controller", "trainer", "generator"], 1),
    (["controller", "trainer", "trainer", "generator", "generator", "verifier"], 1),
    (["controller", "trainer", "trainer", "trainer", "trainer", "generator"], 2),
])
def test_cpu_shares_are_disjoint_equal_and_cover_what_they_can(n_cores, roles, tp):
    """Against the rule stated in node.py, counted independently: with at least as many cores as
    shares, each compute rank gets shares x (cores // total shares) cores, no core twice; with fewer,
    one core each, every core used; the controller and verifiers get none."""
    cores = tuple(range(100, 100 + n_cores))  # ids need not start at 0 (a cgroup's cores)
    got = assign_cpus(roles, ["h"] * len(roles), {"h": cores}, tp)
    shares = {"trainer": 1, "generator": tp}
    total = sum(shares.get(r, 0) for r in roles)
    placed = [(r, c) for r, c in zip(roles, got) if c]
    assert [r for r, _ in placed] == [r for r in roles if r in shares]
    assert all(set(c) <= set(cores) for _, c in placed)
    if n_cores >= total:
        assert all(len(c) == shares[r] * (n_cores // total) for r, c in placed)
        flat = [x for _, c in placed for x in c]
        assert len(flat) == len(set(flat))
    else:
        assert {x for _, c in placed for x in c} == set(cores)


def test_cpu_shares_are_per_host_in_local_rank_order():
    roles = ["controller", "trainer", "generator", "trainer", "generator"]
    hosts = ["a", "a", "a", "b", "b"]
    got = assign_cpus(roles, hosts, {"a": (0, 1, 2, 3), "b": (4, 5)}, 1)
    assert got == [(), (0, 1), (2, 3), (4,), (5,)]


def test_gather_cores_unions_the_affinities_of_a_hosts_ranks():
    class Comm:
        def allgather(self, mine):
            return [("a", (0, 1)), ("a", (2,)), ("b", (0,)), mine]
    hosts, cores = gather_cores(Comm())
    assert hosts[:3] == ["a", "a", "b"] and cores["a"][:3] == (0, 1, 2)
    assert set(cores[hosts[3]]) >= set(os.sched_getaffinity(0))
