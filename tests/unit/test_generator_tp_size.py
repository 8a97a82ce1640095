"""generator.tp_size reaches what the run does: SGLang's --tp-size, and the size of the weight-push
group the trainers open with each server (1 sender + the server's tp_size ranks)."""
from __future__ import annotations

from megatron_rl.config import config_from_dict
from megatron_rl.control.controller import Controller
from megatron_rl.control.layout import RankLayout
from megatron_rl.control.protocol import GeneratorStatus, PushRequest, Tag
from megatron_rl.records import Problem
from megatron_rl.rollout.server import ServerSpec
from support.control import PickleComm


def _flag(cmd: list[str], name: str):
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_server_command_carries_the_tp_size():
    assert _flag(ServerSpec("m", 30000).command(), "--tp-size") is None  # SGLang's default, 1
    assert _flag(ServerSpec("m", 30000, tp_size=4).command(), "--tp-size") == "4"


def test_push_targets_carry_the_generator_tp_size(tmp_path):
    for tp in (1, 2, 8):
        cfg = config_from_dict({"generator": {"tp_size": tp}, "run": {"output_dir": str(tmp_path)}})
        comm = PickleComm()
        ctrl = Controller(comm, cfg, RankLayout(1, 1, 1), tmp_path, [Problem("p", "q", {"kind": "math"})], None)
        gen_rank = ctrl.layout.generator_ranks[0]
        ctrl.gen_status[gen_rank] = GeneratorStatus(0, "http://127.0.0.1:30000", incarnation=3, version=0)
        ctrl.phase = "pausing"
        ctrl._advance_update()
        pushes = comm.take(Tag.PUSH)
        assert pushes, "no push was sent"
        req: PushRequest = pushes[0][1]
        assert req.targets == [("http://127.0.0.1:30000", tp, 3)]
