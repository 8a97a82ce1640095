"""The weight-update coordinator (sync/coordinator.py) on its own: the phases of one update
(`UpdateCycle`), and `WeightUpdate` over any transport with send/send_all (here a recording one, no
MPI), deciding when an update is done and whether a restarted generator needs another push."""
from __future__ import annotations

import pytest

from megatron_rl.sync.coordinator import Phase, UpdateCycle, UpdateDone, WeightUpdate
from megatron_rl.sync.messages import (FinishUpdate, GeneratorStatus, Paused, PauseForUpdate, PushReport, Pushed,
                                       PushRequest, Resumed)
from megatron_rl.sync.sender import SyncTarget, WeightSyncError

TRAINER, GENS = 1, [2, 3]


def test_update_cycle_phases():
    cycle: UpdateCycle[str] = UpdateCycle()
    assert cycle.begin(3, ["b", "a"]) == ["a", "b"] and cycle.phase is Phase.PAUSING
    with pytest.raises(WeightSyncError):
        cycle.advance()  # "b" has not paused
    assert not cycle.ack("a", SyncTarget("u-a")) and cycle.ack("b", SyncTarget("u-b"))
    assert cycle.advance() is Phase.PUSHING and cycle.push_targets() == [SyncTarget("u-a"), SyncTarget("u-b")]
    with pytest.raises(WeightSyncError):
        cycle.ack("a")  # nobody answers during the push
    assert cycle.advance() is Phase.FINISHING and cycle.waiting == {"a", "b"}
    assert not cycle.drop("a")  # died while finishing: "b" is still awaited
    assert cycle.ack("b") and cycle.advance() is Phase.IDLE
    with pytest.raises(WeightSyncError):
        cycle.ack("b")
    assert cycle.begin(4, ["a"]) == ["a"] and cycle.drop("a")  # the only one died: the wait is over


class Recorder:
    """A transport: what the coordinator sent, in order."""

    def __init__(self):
        self.sent: list[tuple[int, object]] = []

    def send(self, dest: int, message: object) -> None:
        self.sent.append((dest, message))

    def send_all(self, ranks: list[int], message: object) -> None:
        for r in ranks:
            self.send(r, message)

    def take(self) -> list[tuple[int, object]]:
        out, self.sent = self.sent, []
        return out


def _status(rank: int, version: int, incarnation: int = 1) -> GeneratorStatus:
    return GeneratorStatus(SyncTarget(f"http://gen{rank}", 1, incarnation), version)


def _coordinator() -> tuple[WeightUpdate, Recorder]:
    transport = Recorder()
    update = WeightUpdate(transport, TRAINER, lambda: list(GENS))
    for g in GENS:
        update.on_status(g, _status(g, 0), 0)
    assert not update.push_needed and update.idle
    return update, transport


def _run_to_push(update: WeightUpdate, transport: Recorder, version: int, incarnations=(1, 1)) -> None:
    update.begin(version)
    assert transport.take() == [(g, PauseForUpdate()) for g in GENS] and not update.idle
    for g, inc in zip(GENS, incarnations):
        assert update.on_step(g, Paused(_status(g, version - 1, inc))) is None
    assert transport.take() == [(TRAINER, PushRequest(version, [_status(g, 0, i).target
                                                                for g, i in zip(GENS, incarnations)]))]


def test_one_update_over_a_plain_transport():
    update, transport = _coordinator()
    _run_to_push(update, transport, 1)
    report = PushReport(1, tensors=3, bytes=30, send_s=0.2)
    assert update.on_step(TRAINER, Pushed(report)) is None
    assert transport.take() == [(g, FinishUpdate(1)) for g in GENS]
    assert update.on_step(GENS[0], Resumed(_status(GENS[0], 1))) is None  # waits for every generator
    done = update.on_step(GENS[1], Resumed(_status(GENS[1], 1)))
    assert isinstance(done, UpdateDone) and (done.version, done.push, done.served) == (1, report, True)
    assert done.push_wall_s >= 0 and update.idle and not update.push_needed and not transport.sent


def test_a_generator_restarted_during_the_update_gets_another_push():
    update, transport = _coordinator()
    _run_to_push(update, transport, 1)
    update.on_step(TRAINER, Pushed(PushReport(1, 3, 30, 0.2)))
    transport.take()
    update.on_step(GENS[0], Resumed(_status(GENS[0], 1)))
    # the other server died before it stamped the version: relaunched, it serves its disk weights
    done = update.on_step(GENS[1], Resumed(_status(GENS[1], 0, incarnation=2)))
    assert done is not None and not done.served and update.push_needed and update.idle
    _run_to_push(update, transport, 1, incarnations=(1, 2))  # the same version again, to the new server


def test_status_reports_decide_a_push():
    update, _ = _coordinator()
    update.on_status(GENS[0], _status(GENS[0], 0), 0)  # the same server again: nothing to push
    assert not update.push_needed
    update.on_status(GENS[0], _status(GENS[0], 0, incarnation=2), 0)  # restarted: its weights are the disk's
    assert update.push_needed
    update, _ = _coordinator()
    update.on_status(GENS[1], _status(GENS[1], 0), 5)  # behind the trainers' version (a resume)
    assert update.push_needed


def test_a_generator_dying_ends_the_wait_of_a_pause():
    update, transport = _coordinator()
    update.begin(1)
    transport.take()
    update.on_step(GENS[0], Paused(_status(GENS[0], 0)))
    assert update.drop(GENS[1]) is None  # the wait is over: the push goes to the one left
    assert transport.take() == [(TRAINER, PushRequest(1, [_status(GENS[0], 0).target]))]
