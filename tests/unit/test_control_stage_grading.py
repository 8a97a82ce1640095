"""A rollout requested under length stage A but graded after the switch to stage B gets stage A's
penalty: through the controller's own issue -> collect -> grade path (real budget, real verifier
pool, real reward.score), for grading inside the controller and on a verifier rank. Only the MPI
communicator and the tokenizer are stand-ins (no generator runs: rollouts are built by hand)."""
from __future__ import annotations

import json
import os
from fractions import Fraction

import pytest

from megatron_rl.config import LengthStage, config_from_dict
from megatron_rl.control.controller import Controller
from megatron_rl.plan.layout import RankLayout
from megatron_rl.control.metrics import METRICS_FILE, read_jsonl
from megatron_rl.control.protocol import GenerateRequest, RolloutsReport, Tag, TrainReport
from megatron_rl.records import Problem, Rollout
from megatron_rl.reward import VerifierPool
from support.control import CharTokenizer, PickleComm, grade_until

os.environ.setdefault("OMP_NUM_THREADS", "1")

GEN_RANK = 2  # rank 0 controller, rank 1 trainer, rank 2 generator, rank 3 verifier (when used)
ANSWER = "Two and two make four.</think>\nThe answer is $\\boxed{4}$."  # after the template's "<think>\n"


def closed_form(n: int, l_max: int, l_cache: int, p: Fraction = Fraction(1, 10)) -> float:
    if n <= l_max - l_cache:
        return 0.0
    return float(-p * Fraction(n - l_max + l_cache, l_cache)) if n <= l_max else float(-p)


def _controller(tmp_path, verifiers: int) -> tuple[Controller, PickleComm]:
    cfg = config_from_dict({
        # stage A (updates 0..): cap 40, window = the cap (l_max null), l_cache 16
        # stage B (update 1..): cap 80, its own window l_max 80, l_cache 20
        "rollout": {"group_size": 2, "n_async": 2, "n_batch": 2, "n_mini": 1, "max_new_tokens": 64,
                    "length_schedule": ["0:40", "1:80:80:20"]},
        "reward": {"l_max": None, "l_cache": 16, "language_check": False, "verifier_workers": 1,
                   "verifier_ranks": verifiers},
        "data": {"source": "jsonl", "path": "unused.jsonl", "system_prompt": "short"},
    })
    problems = [Problem(f"p{i}", "What is 2 + 2?", {"kind": "math", "answer": "4"}) for i in range(3)]
    comm = PickleComm()
    ctrl = Controller(comm, cfg, RankLayout(1, 1, verifiers), tmp_path, problems, CharTokenizer())
    return ctrl, comm


def _issue_one_group(ctrl: Controller, comm: PickleComm) -> GenerateRequest:
    ctrl.flow.fill()
    ((dest, request),) = comm.take(Tag.GENERATE)
    assert dest == GEN_RANK and sum(len(g.sample_indices) for g in request.groups) == 2
    return request


def _generate(request: GenerateRequest, lengths: list[int]) -> RolloutsReport:
    """What a generator would send back: completions of the given token counts (within the cap)."""
    rollouts = []
    samples = [(g, i) for g in request.groups for i in g.sample_indices]
    for (g, i), n in zip(samples, lengths):
        cap = g.sampling_overrides()["max_new_tokens"]
        assert n <= cap
        finish = "length" if n == cap else "stop"
        rollouts.append(Rollout(g.group_id, i, g.prompt_ids, list(range(5, 5 + n)), [-0.5] * n, [0] * n, finish,
                                text=ANSWER, stage=g.stage))  # the stage comes back on the rollout
    return RolloutsReport(rollouts, 0.0, 0.0)


@pytest.mark.parametrize("verifiers", [0, 1], ids=["controller_pool", "verifier_rank"])
def test_rollout_keeps_the_stage_it_was_requested_under(tmp_path, verifiers):
    ctrl, comm = _controller(tmp_path, verifiers)
    pool = VerifierPool(ctrl.cfg.reward).start() if verifiers else None
    try:
        request_a = _issue_one_group(ctrl, comm)
        assert [g.sampling_overrides()["max_new_tokens"] for g in request_a.groups] == [40]

        # The trainer finishes update 1 (stage B from now on) before these samples come back.
        ctrl._on_trained(TrainReport(1, {}))
        assert ctrl.updates_done == 1 and comm.take(Tag.PAUSE)
        report = _generate(request_a, [30, 40])
        keys = [(r.group_id, r.sample_index) for r in report.rollouts]
        ctrl.flow.on_rollouts(GEN_RANK, report)
        grade_until(ctrl, comm, pool, lambda: not any(k in ctrl.flow.ledger.pending for k in keys))
        graded_a = report.rollouts  # the controller updated these records in place
        for r, n in zip(graded_a, [30, 40]):
            assert (r.stage.max_new_tokens, r.stage.l_max, r.stage.l_cache) == (40, 40, 16)
            # stage A: ramp from 24 to 40 tokens (stage B's window would give 0 for both lengths)
            assert r.reward_components["length_penalty"] == pytest.approx(closed_form(n, 40, 16), abs=1e-12)
            assert r.reward == pytest.approx(1.0 + closed_form(n, 40, 16), abs=1e-12)
        assert closed_form(30, 40, 16) < 0 and closed_form(30, 80, 20) == 0  # the test can tell A from B

        # The metrics line of update 1: the stage now in force, and the stage the graded rollouts had.
        ctrl.log.train = {"loss": 0.0}
        ctrl._write_metrics()
        row = read_jsonl(tmp_path / METRICS_FILE)[-1]
        assert (row["max_new_tokens"], row["stage/start"], row["stage/l_max"], row["stage/l_cache"]) == (80, 1, 80, 20)
        assert (row["length/cap_mean"], row["length/l_max_mean"]) == (40, 40)

        # A group issued after the switch is requested and graded under stage B.
        request_b = _issue_one_group(ctrl, comm)
        assert [g.sampling_overrides()["max_new_tokens"] for g in request_b.groups] == [80]
        report = _generate(request_b, [30, 70])
        ctrl.flow.on_rollouts(GEN_RANK, report)
        keys = [(r.group_id, r.sample_index) for r in report.rollouts]
        grade_until(ctrl, comm, pool, lambda: not any(k in ctrl.flow.ledger.pending for k in keys))
        for r, n in zip(report.rollouts, [30, 70]):
            assert (r.stage.max_new_tokens, r.stage.l_max, r.stage.l_cache) == (80, 80, 20)
            assert r.reward_components["length_penalty"] == pytest.approx(closed_form(n, 80, 20), abs=1e-12)
        assert not ctrl.flow.sample_owner  # nothing left in flight

        # Checkpointed rollouts keep their stage (JSON, like the controller state in a checkpoint).
        again = Rollout.from_dict(json.loads(json.dumps(graded_a[0].to_dict())))
        assert (again.stage.max_new_tokens, again.stage.l_max, again.stage.l_cache) == (40, 40, 16)
    finally:
        ctrl.shutdown()
        if pool is not None:
            pool.close()


def test_rollouts_from_older_checkpoints_load_without_a_stage():
    r = Rollout("g", 0, [1], [2], [-0.1], [0], "stop", reward=0.5)
    old = {k: v for k, v in r.to_dict().items() if k not in ("stage", "loss_mask")}
    loaded = Rollout.from_dict(old)
    assert loaded == r and loaded.stage is None


def test_rollouts_of_the_previous_checkpoint_format_keep_their_stage():
    """Before `Rollout.stage`, a checkpointed rollout kept the stage's cap and window as three keys."""
    r = Rollout("g", 0, [1], [2], [-0.1], [0], "stop", reward=0.5)
    old = {k: v for k, v in r.to_dict().items() if k not in ("stage", "loss_mask")}
    loaded = Rollout.from_dict(old | {"max_new_tokens": 40, "l_max": 40, "l_cache": 16})
    assert loaded.stage == LengthStage(0, 40, 40, 16) and loaded.loss_mask is None
    assert Rollout.from_dict(old | {"max_new_tokens": None, "l_max": None, "l_cache": None}).stage is None
    again = Rollout.from_dict(json.loads(json.dumps(loaded.to_dict())))
    assert again == loaded
