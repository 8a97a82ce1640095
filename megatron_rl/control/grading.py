"""Grading from the controller's point of view: submit items, poll finished breakdowns.

`LocalGrader` runs a `reward.VerifierPool` in a background thread of the controller process (the
pool's worker processes do the grading); `verifier_loop` serves the same pool on a dedicated
verifier rank, fed over MPI by the controller (see controller.py). Both survive hung items
(per-item timeout -> status "timeout") and crashed grading processes (re-issued).

A result whose status is not OK (reward.types.GradeStatus: timeout, crash, error,
sandbox_unavailable) is a grading FAILURE, never a reward: `GradingLedger` sends the sample to be graded again (reward.regrade_attempts times),
then gives up on it, and the controller drops its whole group (`RolloutBudget.add_failed`).

Each item is graded with the overlong-penalty window of the length stage its rollout was requested
under (`GradeItem.stage`, from `Rollout.stage`), never the stage current when it is graded: with
asynchronous generation a sample requested before a stage switch is often graded after it. Verdicts
travel as `RewardBreakdown`s (`Graded.results`) and are read by their typed fields.
"""
from __future__ import annotations

import queue
import threading

from megatron_rl.config import RewardConfig
from megatron_rl.control.metrics import UpdateWindow
from megatron_rl.control.mailbox import CONTROLLER, Mailbox
from megatron_rl.control.protocol import GradeItem, Graded, Key, RunFailed, Stop, WorkerFailure
from megatron_rl.records import Rollout
from megatron_rl.reward import VerifierPool
from megatron_rl.reward.types import GradeStatus, RewardBreakdown


def grade(pool: VerifierPool, items: list[GradeItem]) -> list[tuple[Key, RewardBreakdown]]:
    """Grade items (what both LocalGrader and verifier ranks run)."""
    return list(zip((it.key for it in items), pool.map([it.score_item() for it in items])))


def apply_verdict(rollout: Rollout, breakdown: RewardBreakdown) -> None:
    """Stamp a graded (OK) breakdown on its rollout: the reward and its components."""
    rollout.reward = float(breakdown.total)
    rollout.reward_components = breakdown.components()


class GradingLedger:
    """Samples out for grading, until each has a verdict or is given up on.

    A failed grading is counted by status in the update window and the sample is graded again, up to
    `regrade_attempts` times (a timeout under load, a crashed worker or a verifier node without a
    sandbox may pass the next time, on another worker or rank). Then it is given up on: `settle`
    reports it as failed and the caller drops its group. When `give_up_after` samples in a row are
    given up on with no verdict in between, grading itself is broken (e.g. no sandbox on any
    verifier): RunFailed with the last error, rather than a run that silently trains on nothing.
    """

    def __init__(self, regrade_attempts: int, give_up_after: int):
        if regrade_attempts < 0 or give_up_after < 1:
            raise ValueError(f"need regrade_attempts >= 0 and give_up_after >= 1, got {regrade_attempts}, "
                             f"{give_up_after}")
        self.regrade_attempts, self.give_up_after = regrade_attempts, give_up_after
        self.pending: dict[Key, tuple[Rollout, GradeItem]] = {}
        self._failures: dict[Key, int] = {}
        self._given_up_in_a_row = 0

    def add(self, rollout: Rollout, item: GradeItem) -> GradeItem:
        self.pending[item.key] = (rollout, item)
        return item

    def settle(self, results: list[tuple[Key, RewardBreakdown]], window: UpdateWindow
               ) -> tuple[list[tuple[Rollout, bool]], list[GradeItem]]:
        """(rollout, failed) for each sample now settled (verdicts stamped on their rollouts), and the
        items to grade again. Results for samples no longer pending (late duplicates) are ignored."""
        settled: list[tuple[Rollout, bool]] = []
        again: list[GradeItem] = []
        for key, breakdown in results:
            key = tuple(key)
            if key not in self.pending:
                continue
            rollout, item = self.pending[key]
            status = GradeStatus(breakdown.status)
            if status is GradeStatus.OK:
                apply_verdict(rollout, breakdown)
                self._given_up_in_a_row = 0
            else:
                window.grading_failed[status] += 1
                self._failures[key] = self._failures.get(key, 0) + 1
                if self._failures[key] <= self.regrade_attempts:
                    window.regraded += 1
                    again.append(item)
                    continue
                self._given_up_in_a_row += 1
                if self._given_up_in_a_row >= self.give_up_after:
                    why = " ".join(breakdown.error.split())[:300]
                    raise RunFailed(f"grading failed for {self._given_up_in_a_row} samples in a row with no "
                                    f"verdict in between (last: {status}: {why}); `megatron-rl doctor` checks "
                                    f"the sandbox")
            del self.pending[key]
            self._failures.pop(key, None)
            settled.append((rollout, status is not GradeStatus.OK))
        return settled, again


class LocalGrader:
    def __init__(self, config: RewardConfig):
        self.pool = VerifierPool(config).start()
        self._in: queue.Queue[GradeItem | None] = queue.Queue()
        self._out: queue.Queue[tuple[Key, RewardBreakdown]] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name="grader", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            while True:
                first = self._in.get()
                if first is None:
                    return
                items = [first]
                while not self._in.empty():  # grade whatever has accumulated, in parallel
                    nxt = self._in.get()
                    if nxt is None:
                        self._in.put(None)
                        break
                    items.append(nxt)
                for result in grade(self.pool, items):
                    self._out.put(result)
        except BaseException as e:  # surfaced by poll(): grading must never fail silently
            self._error = e

    def submit(self, items: list[GradeItem]) -> None:
        for it in items:
            self._in.put(it)

    def poll(self) -> list[tuple[Key, RewardBreakdown]]:
        if self._error is not None:
            raise RuntimeError(f"grading thread failed: {self._error}") from self._error
        out = []
        while not self._out.empty():
            out.append(self._out.get())
        return out

    def close(self) -> None:
        self._in.put(None)
        self._thread.join(timeout=30)
        self.pool.close()


def verifier_loop(mailbox: Mailbox, config: RewardConfig, poll_s: float = 0.01) -> None:
    """Body of a verifier rank: grade what the controller sends until it says Stop."""
    try:
        with VerifierPool(config) as pool:
            while True:
                for _, msg in mailbox.poll(timeout_s=poll_s, source=CONTROLLER):
                    if isinstance(msg, Stop):
                        return
                    mailbox.send(CONTROLLER, Graded(grade(pool, msg.items)))
    except Exception as e:
        mailbox.fail(WorkerFailure.of("verifier", mailbox.rank, "grading failed", e))
        mailbox.wait_for_stop()
