"""The controller's side of faults, driven in-process: a hung or failed verifier rank's items go to a live
one (each sample settled once), the logs cut back to a checkpoint on resume, and every group event names
each sample's fate. The hard kills themselves are tests/e2e/test_hard_kill.py."""
from __future__ import annotations

import json

import pytest

from megatron_rl.config import config_from_dict
from megatron_rl.control.controller import Controller
from megatron_rl.plan.layout import RankLayout
from megatron_rl.control.metrics import EVENTS_FILE, METRICS_FILE, read_jsonl
from megatron_rl.control.protocol import (Graded, Loaded, RolloutsReport, RunFailed, Tag, WorkerFailure)
from megatron_rl.control.verifiers import VerifierRanks, reply_timeout_s
from megatron_rl.records import Problem, Rollout
from megatron_rl.reward.types import RewardBreakdown
from support.control import CharTokenizer, PickleComm

G = 2


def _controller(tmp_path, verifiers: int = 2, **reward) -> tuple[Controller, PickleComm, list[float]]:
    cfg = config_from_dict({"rollout": {"group_size": G, "n_async": 4, "n_batch": 4, "n_mini": 1},
                            "reward": {"verifier_ranks": verifiers, **reward},
                            "run": {"output_dir": str(tmp_path)}, "data": {"source": "jsonl", "path": "unused"}})
    comm = PickleComm()
    problems = [Problem(f"p{i}", f"question {i}", {}) for i in range(5)]
    ctrl = Controller(comm, cfg, RankLayout(1, 1, verifiers), tmp_path, problems, CharTokenizer())
    now = [0.0]
    ctrl.flow.verifiers.clock = lambda: now[0]
    return ctrl, comm, now


def _generate(ctrl: Controller, comm: PickleComm) -> list[tuple[int, list]]:
    """Fill, answer every sample from the generator, return the grading requests sent (rank, items)."""
    ctrl.flow.fill()
    gen = ctrl.layout.generator_ranks[0]
    groups = [g for _, request in comm.take(Tag.GENERATE) for g in request.groups]
    rollouts = [Rollout(g.group_id, i, g.prompt_ids, [5, 6], [-0.1, -0.2], [0, 0], "stop",
                        text=f"answer {i}", stage=g.stage) for g in groups for i in g.sample_indices]
    ctrl._dispatch(gen, RolloutsReport(rollouts, 0.0, 0.0))
    return [(rank, request.items) for rank, request in comm.take(Tag.GRADE)]


def _verdicts(items, correct: float = 1.0) -> Graded:
    return Graded([(it.key, RewardBreakdown(total=correct, format_ok=True, correct=bool(correct),
                                            length_penalty=0.0, language_ok=True)) for it in items])


def test_a_hung_verifier_ranks_items_go_to_a_live_one_and_its_late_answer_counts_once(tmp_path, capsys):
    ctrl, comm, now = _controller(tmp_path, verifier_reply_timeout_s=5.0)
    ((hung, items),) = _generate(ctrl, comm)
    live = ({*ctrl.layout.verifier_ranks} - {hung}).pop()
    now[0] = 4.9
    ctrl.flow.collect_grades()
    assert not comm.take(Tag.GRADE)  # not yet late
    now[0] = 5.1
    ctrl.flow.collect_grades()
    ((dest, request),) = comm.take(Tag.GRADE)
    assert dest == live and [it.key for it in request.items] == [it.key for it in items]
    assert f"verifier rank {hung} answered no grading request" in capsys.readouterr().err
    ctrl._dispatch(live, _verdicts(request.items))
    ctrl._dispatch(hung, _verdicts(items, correct=0.0))  # woke up: a duplicate of settled samples
    events = read_jsonl(tmp_path / EVENTS_FILE)
    assert sorted(e["group_id"] for e in events) == sorted({k[0] for k in (it.key for it in items)})
    assert all(e["graded"] == list(range(G)) and e["failed"] == [] for e in events)
    assert all(e["rewards"] == [1.0] * G for e in events)  # the live rank's verdicts, not the late ones
    assert ctrl.flow.verifiers.live() == sorted([hung, live])  # it answered: live again
    ctrl.shutdown()


def test_a_failed_verifier_ranks_items_go_to_a_live_one_and_the_last_ones_failure_stops_the_run(tmp_path):
    ctrl, comm, _ = _controller(tmp_path)
    ((dead, items),) = _generate(ctrl, comm)
    ctrl._dispatch(dead, WorkerFailure("verifier", dead, "grading failed: OSError: pool broke"))
    ((live, request),) = comm.take(Tag.GRADE)
    assert live != dead and [it.key for it in request.items] == [it.key for it in items]
    with pytest.raises(RunFailed, match=rf"^verifier rank {live} failed: grading failed"):
        ctrl._dispatch(live, WorkerFailure("verifier", live, "grading failed: OSError: pool broke"))
    ctrl.shutdown()


def test_a_hung_last_verifier_rank_stops_the_run_naming_the_key(tmp_path):
    ctrl, comm, now = _controller(tmp_path, verifiers=1)
    _generate(ctrl, comm)
    now[0] = reply_timeout_s(ctrl.cfg.reward, 2 * G) + 1  # the derived timeout of that request
    with pytest.raises(RunFailed, match=r"verifier_reply_timeout_s\) and no other verifier rank is live"):
        ctrl.flow.collect_grades()
    ctrl.shutdown()


def test_the_derived_reply_timeout_covers_both_pool_attempts_of_every_round(tmp_path):
    cfg = config_from_dict({"reward": {"verifier_workers": 2, "verifier_item_timeout_s": 10.0}}).reward
    assert reply_timeout_s(cfg, 4) >= 2 * 2 * 10.0 and reply_timeout_s(cfg, 5) >= 2 * 3 * 10.0
    ranks = VerifierRanks([7], cfg, clock=lambda: 0.0)
    assert ranks.pick() == 7 and not ranks.overdue()


def test_resume_cuts_the_logs_back_to_the_checkpoint(tmp_path):
    ctrl, comm, _ = _controller(tmp_path)
    ctrl.log.metrics.write({"update": 1})
    ctrl.log.group_done({"group_id": "a"})
    state = ctrl.state_dict()  # what a checkpoint at update 1 holds
    ctrl.log.metrics.write({"update": 2})
    ctrl.log.group_done({"group_id": "b"})
    ctrl.log.events._f.write('{"group_id": "c", "fa')  # a kill mid-write
    ctrl.log.events._f.flush()
    ctrl.shutdown()

    again, comm, _ = _controller(tmp_path)
    comm.replies = {Loaded: Loaded({"controller": state})}
    again.mailbox.await_reply = lambda kind, timeout_s, on_failure=None: comm.replies[kind]
    again.resume(tmp_path / "checkpoints")
    again.log.metrics.write({"update": 2})
    again.shutdown()
    assert [r["update"] for r in read_jsonl(tmp_path / METRICS_FILE)] == [1, 2]
    lines = (tmp_path / EVENTS_FILE).read_text().splitlines()
    assert [json.loads(line)["group_id"] for line in lines] == ["a"]  # every line whole
