"""The controller's messages: one tag per message type, each batch sent once (to the first trainer,
which shares it with the others), and one weight update as the cycle pause -> push -> finish, driven
through the controller (the coordinator alone: tests/unit/test_sync_coordinator.py)."""
from __future__ import annotations

import pytest

from megatron_rl.config import config_from_dict
from megatron_rl.control.controller import Controller
from megatron_rl.plan.layout import RankLayout
from megatron_rl.control.mailbox import Mailbox
from megatron_rl.control.protocol import (MESSAGE_TYPES, FinishUpdate, GeneratorStatus, Paused, PauseForUpdate,
                                          Pushed, PushRequest, Resumed, RunFailed, Tag, Trained, TrainReport, TrainRequest,
                                          WorkerFailure, tag_of)
from megatron_rl.records import Problem, Rollout
from megatron_rl.sync.coordinator import Phase
from megatron_rl.sync.messages import PushReport
from megatron_rl.sync.sender import SyncTarget
from support.control import PickleComm

TRAINERS, GENERATORS = 4, 2


def test_every_message_type_has_its_own_tag():
    assert sorted(MESSAGE_TYPES) == list(Tag) and len(set(MESSAGE_TYPES.values())) == len(Tag)
    comm = PickleComm()
    Mailbox(comm).send(3, FinishUpdate(7))
    assert comm.sent == [(3, int(Tag.FINISH), FinishUpdate(7))] and tag_of(FinishUpdate(7)) is Tag.FINISH


def _controller(tmp_path) -> tuple[Controller, PickleComm]:
    cfg = config_from_dict({"rollout": {"group_size": 2, "n_async": 4, "n_batch": 4, "n_mini": 1},
                            "run": {"output_dir": str(tmp_path)}, "data": {"source": "jsonl", "path": "unused"}})
    comm = PickleComm()  # one verifier rank: no grading pool in this process
    return Controller(comm, cfg, RankLayout(TRAINERS, GENERATORS, 1), tmp_path, [Problem("p", "q", {})], None), comm


def _status(rank: int, version: int) -> GeneratorStatus:
    return GeneratorStatus(SyncTarget(f"http://gen{rank}", 1, 1), version)


def test_a_batch_goes_once_to_the_first_trainer_then_one_update_cycle(tmp_path):
    ctrl, comm = _controller(tmp_path)
    gens = ctrl.layout.generator_ranks
    budget = ctrl.flow.budget
    for _ in range(2):  # two diverse groups graded: n_batch = 4 sequences ready
        group = budget.start_group(Problem("p", "q", {}))
        for i, reward in enumerate((0.0, 1.0)):
            budget.add_graded(Rollout(group.group_id, i, [1], [2, 3], [-0.1, -0.2], [0, 0], "stop", reward=reward))
    ctrl._train()
    sent = comm.take(Tag.TRAIN)
    assert [dest for dest, _ in sent] == [ctrl.layout.first_trainer]  # not one copy per trainer
    assert isinstance(sent[0][1], TrainRequest) and len(sent[0][1].batch.sequences) == 4
    assert not comm.sent and ctrl.training
    assert budget.batches_behind == 1  # admission: the batch's weights are not served yet

    ctrl._dispatch(ctrl.layout.first_trainer, Trained(TrainReport(1, {"loss": 0.5})))
    assert [(d, type(m)) for d, m in comm.take(Tag.PAUSE)] == [(g, PauseForUpdate) for g in gens]
    assert ctrl.sync.cycle.phase is Phase.PAUSING and ctrl.version == ctrl.updates_done == 1
    ctrl._dispatch(gens[0], Paused(_status(gens[0], 0)))
    assert not comm.take(Tag.PUSH)  # waits for every generator
    ctrl._dispatch(gens[1], Paused(_status(gens[1], 0)))
    ((dest, push),) = comm.take(Tag.PUSH)
    assert dest == ctrl.layout.first_trainer and push == PushRequest(1, [_status(g, 0).target for g in gens])
    ctrl._dispatch(dest, Pushed(PushReport(1, tensors=3, bytes=10, send_s=0.1)))
    assert [(d, m) for d, m in comm.take(Tag.FINISH)] == [(g, FinishUpdate(1)) for g in gens]
    for g in gens:
        ctrl._dispatch(g, Resumed(_status(g, 1)))
    assert ctrl.sync.cycle.phase is Phase.IDLE and not ctrl.sync.push_needed and not comm.sent
    assert budget.batches_behind == 0 and budget.served_version == 1  # every generator serves it
    ctrl.shutdown()
    stops = [dest for dest, _, _ in comm.sent]
    assert stops == [ctrl.layout.first_trainer] + gens + ctrl.layout.verifier_ranks


def test_a_dead_generator_is_not_awaited_and_its_failure_carries_the_traceback(tmp_path):
    ctrl, comm = _controller(tmp_path)
    gens = ctrl.layout.generator_ranks
    ctrl._begin_update()
    ctrl._dispatch(gens[0], Paused(_status(gens[0], 0)))
    try:
        raise ConnectionError("server gone")
    except ConnectionError as e:
        died = WorkerFailure.of("generator", gens[1], "server died", e, fatal=False)
    ctrl._dispatch(gens[1], died)
    ((_, push),) = comm.take(Tag.PUSH)
    assert push.targets == [_status(gens[0], 0).target]  # the dead one left out
    try:
        raise ValueError("bad shape")
    except ValueError as e:
        failure = WorkerFailure.of("trainer", 2, "PushRequest failed", e)
    with pytest.raises(RunFailed) as raised:
        ctrl._dispatch(2, failure)
    text = str(raised.value)
    assert text == "trainer rank 2 failed: PushRequest failed: ValueError: bad shape"  # one line
    assert 'raise ValueError("bad shape")' in raised.value.failure.trace  # the failing rank's traceback
    ctrl.shutdown()
