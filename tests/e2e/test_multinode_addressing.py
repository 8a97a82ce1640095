"""The whole loop as two simulated nodes on one machine: loopback aliases 127.0.0.2 and 127.0.0.3.

Linux routes all of 127.0.0.0/8 to `lo`, so each alias behaves as a node's own address. mpiexec
gives every rank its node's address and local rank through the environment, as Slurm would
(`MEGATRON_RL_NODE_ADDR`, `SLURM_LOCALID`, one MPMD block per rank). Layout (data-parallel 2 so
the trainers' rendezvous crosses nodes):

    node 127.0.0.2: rank 0 controller (local 0), rank 1 trainer 0 (local 1)
    node 127.0.0.3: rank 2 trainer 1 (local 0), rank 3 generator (local 1)

The test reads the sockets the processes actually hold (psutil) while the run is going: the SGLang
server listens on node 3's address only; the trainers' rendezvous store and the weight-update
group's store listen on the first trainer's (the sender's) node address and are reached there from
node 3; no process of the run listens on a wildcard address. Then the run must complete its updates,
each evaluated on a held-out set (run.eval_every: 1, a few problems x k samples), the initial weights
too (update 0): eval/... values in [0, 1] on every line, samples graded or ungradable = problems x k.
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megatron_rl.cli.train import _mpiexec
from megatron_rl.control.metrics import METRICS_FILE, read_jsonl
from test_train_loop import _config, policy  # noqa: F401  (the tiny policy fixture and its run config)

pytestmark = [pytest.mark.long, pytest.mark.timeout(600)]

NODES = {0: ("127.0.0.2", 0), 1: ("127.0.0.2", 1), 2: ("127.0.0.3", 0), 3: ("127.0.0.3", 1)}
WILDCARDS = {"0.0.0.0", "::"}


def _launch(config: Path) -> subprocess.Popen:
    cmd = [_mpiexec()]
    for rank, (addr, local) in NODES.items():
        if rank:
            cmd.append(":")
        cmd += ["-n", "1", "-env", "MEGATRON_RL_NODE_ADDR", addr, "-env", "SLURM_LOCALID", str(local),
                "-env", "OMP_NUM_THREADS", "1", sys.executable, "-m", "megatron_rl.cli.rank", str(config)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _ip(addr) -> str:
    return addr.ip.removeprefix("::ffff:")


def _rank_processes(proc: subprocess.Popen) -> dict[int, psutil.Process]:
    ranks = {}
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            if "megatron_rl.cli.rank" in " ".join(p.cmdline()):
                ranks[int(p.environ()["PMI_RANK"])] = p
        except (psutil.NoSuchProcess, KeyError):
            pass
    return ranks


def _sockets(procs) -> list:
    out = []
    for p in procs:
        try:
            out += p.net_connections("inet")
        except psutil.NoSuchProcess:
            pass
    return out


def test_two_simulated_nodes_listen_on_their_own_addresses(tmp_path, policy, free_port):
    from support.warm_start import addition_problems

    port = 35000 + free_port % 2000
    eval_set = addition_problems(tmp_path / "eval.jsonl", 8, seed=7)  # another draw than the training set's
    n_eval, k = 6, 4
    config = _config(tmp_path, policy, port, trainer={"data_parallel": 2}, rollout={"n_async": 16, "n_batch": 16},
                     data={"eval_path": str(eval_set)},
                     run={"output_dir": str(tmp_path / "run"), "updates": 3, "eval_every": 1, "eval_samples": k,
                          "eval_max_problems": n_eval})
    run_dir = tmp_path / "run"
    proc = _launch(config)
    deadline = time.time() + 400
    # update 1's line (update 0's comes before any push): after a push, the update groups exist
    while not any(r["update"] >= 1 for r in read_jsonl(run_dir / METRICS_FILE)):
        assert proc.poll() is None, proc.stdout.read()[-5000:]
        assert time.time() < deadline, "no update in 400 s"
        time.sleep(0.5)
    ranks = _rank_processes(proc)
    assert sorted(ranks) == [0, 1, 2, 3]
    socks = {r: _sockets([p]) for r, p in ranks.items()}
    socks["server"] = _sockets(ranks[3].children(recursive=True))  # SGLang and its workers
    listen = {who: {(_ip(c.laddr), c.laddr.port) for c in cs if c.status == psutil.CONN_LISTEN}
              for who, cs in socks.items()}
    reach = {who: {(_ip(c.raddr), c.raddr.port) for c in cs if c.raddr} for who, cs in socks.items()}
    owner = {who: NODES[3 if who == "server" else who][0] for who in socks}

    def on_port(port):
        return {(who, ip) for who, ls in listen.items() for ip, p in ls if p == port}

    # the generator's server: on node 3's address and nowhere else (no 127.0.0.1, no wildcard)
    assert on_port(port) == {("server", "127.0.0.3")}
    # the trainers' rendezvous (reached from trainer 1 on node 3) and the weight-update group's
    # (reached from the server on node 3) are the first trainer's stores, on node 2's address only
    trainers_store = {p for ip, p in reach[2] if ip == "127.0.0.2"}
    update_store = {p for ip, p in reach["server"] if ip == "127.0.0.2"}
    assert len(trainers_store) == 1 and len(update_store) == 1, (reach[2], reach["server"])
    for p in trainers_store | update_store:
        assert on_port(p) == {(1, "127.0.0.2")}
    # whatever listens on a node alias belongs to a process of that node
    for who, ls in listen.items():
        for ip, p in ls:
            assert not ip.startswith("127.0.0.") or ip in ("127.0.0.1", owner[who]), (who, ip, p)
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out[-5000:]
    rows = read_jsonl(run_dir / METRICS_FILE)
    assert [r["update"] for r in rows] == [0, 1, 2, 3] and all(r["version"] == r["update"] for r in rows)
    for r in rows:  # every update evaluated under its own weights, every sample accounted for
        assert r["eval/version"] == r["update"] and r["eval/off_version"] == 0
        assert r["eval/samples"] + r["eval/ungradable"] == n_eval * k and r["eval/problems"] == n_eval
        assert all(0.0 <= r[key] <= 1.0 for key in ("eval/pass@1", f"eval/pass@{k}", "eval/math/pass@1"))
        assert r["eval/pass@1"] <= r[f"eval/pass@{k}"]
