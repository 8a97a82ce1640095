"""generator.tp_size reaches what the run does: SGLang's --tp-size, and the size of the weight-push
group the trainers open with each server (1 sender + the server's tp_size ranks)."""
from __future__ import annotations

from megatron_rl.config import config_from_dict
from megatron_rl.control.controller import Controller
from megatron_rl.control.generator_worker import server_spec
from megatron_rl.plan.layout import RankLayout
from megatron_rl.control.protocol import Paused, PushRequest, Tag
from megatron_rl.records import Problem
from megatron_rl.rollout.generator import Generator
from megatron_rl.rollout.server import ServerSpec, SGLangServer
from megatron_rl.sync.generator_side import status_of
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
        # the status a generator rank sends once paused, from the server the rank builds (not started)
        gen = Generator(SGLangServer(server_spec(cfg, 0, str(tmp_path), tmp_path, 30000, "127.0.0.1")),
                        cfg.rollout, cfg.generator)
        try:
            ctrl._begin_update()
            assert [dest for dest, _ in comm.take(Tag.PAUSE)] == [gen_rank]
            ctrl._dispatch(gen_rank, Paused(status_of(gen)))
        finally:
            gen.close()
        pushes = comm.take(Tag.PUSH)
        assert [dest for dest, _ in pushes] == [ctrl.layout.first_trainer], "no push was sent"
        req: PushRequest = pushes[0][1]
        assert [(t.url, t.tp_size) for t in req.targets] == [("http://127.0.0.1:30000", tp)]
        ctrl.shutdown()
