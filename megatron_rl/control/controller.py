"""The controller (MPI rank 0): keeps the generators busy and the trainers fed.

`Controller.run` is the loop; the parts with state of their own live in their own modules:
  mailbox.py    typed messages over MPI, one poll loop
  rollouts.py   the rollout flow: issue samples, collect rollouts, grade, settle into the budget
  run_log.py    metrics and group events
The weight update is sync/'s: its coordinator (sync/coordinator.py, `WeightUpdate`: generators
pause -> trainers push -> generators finish, and whether a restarted generator needs another push)
sends its messages through the mailbox; the generator side is sync/generator_side.py, the trainer
side sync/trainer_push.py. The controller begins an update, hands it the update's messages, and
on `UpdateDone` does what follows an update here: admission, the metrics line, a checkpoint.
Checkpoints carry the controller's state (budget, problem cursor, versions): `--resume` loses and
repeats no prompt; samples in flight at a checkpoint are issued again on resume, an episode among
them from its last turn boundary (rollouts.py).
"""
from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

from megatron_rl.config import Config
from megatron_rl.plan.layout import RankLayout
from megatron_rl.control.mailbox import Mailbox
from megatron_rl.control.metrics import Progress, batch_stats, stage_metrics
from megatron_rl.control.protocol import (Cause, GeneratorStatus, Graded, LoadRequest, Loaded, Paused, Pushed,
                                          Resumed, RolloutsReport, RunFailed, SaveRequest, Saved, Stop, Trained,
                                          TrainReport, TrainRequest, WorkerFailure)
from megatron_rl.control.rollouts import RolloutFlow
from megatron_rl.control.run_log import RunLog
from megatron_rl.records import Problem
from megatron_rl.sync.coordinator import UpdateDone, WeightUpdate

REPLY_TIMEOUT_S = 3600.0  # a checkpoint save or load on the trainers


class Controller:
    def __init__(self, comm, cfg: Config, layout: RankLayout, run_dir: Path, problems: list[Problem], tokenizer,
                 eval_problems: list[Problem] | None = None):
        self.cfg, self.layout, self.run_dir = cfg, layout, run_dir
        self.mailbox = Mailbox(comm)
        self.log = RunLog(cfg.run, run_dir)
        self.flow = RolloutFlow(cfg, self.mailbox, layout, problems, tokenizer, self.log, lambda: self.updates_done,
                                eval_problems)
        self.sync = WeightUpdate(self.mailbox, layout.first_trainer, self.flow.alive_generators)
        self.version = 0  # trainer policy version (= number of updates)
        self.updates_done = 0
        self.training = False  # a batch is with the trainers
        self.stop_requested = False
        self._update_finished = False  # the weights of a trained update reached the generators
        self._idle_since: float | None = time.time()  # trainer idle since

    # ================================================================== the loop
    def run(self) -> dict[str, Any]:
        total = self.cfg.run.updates
        progress = Progress(total, self.updates_done)
        self._evaluate_initial_weights()
        try:
            while True:
                if not self.training and self.sync.idle:
                    if (self.updates_done >= total and not self.flow.evaluation.active) or self.stop_requested:
                        break
                    if self.sync.push_needed:
                        self._begin_update()  # push (weights the generators lack: restart, resume)
                    elif not self.flow.evaluation.active:  # an eval round is graded under one weight version
                        self._train()  # train on n_batch ready sequences, if there are
                if self.wants_groups():
                    self.flow.fill()  # fill: groups as the budget admits them (n_async, staleness bound)
                for source, message in self.mailbox.poll(timeout_s=0.005):
                    self._dispatch(source, message)  # collect: rollouts, grades, replies (train -> push)
                self.flow.collect_grades()  # grade: the controller's own grading pool
                if self.flow.evaluation.complete:
                    self._finish_eval(progress)  # the evaluated update's line, its checkpoint when due
                if self._update_finished:
                    self._after_update(progress)  # save: metrics line, checkpoint when due
        finally:
            progress.close()
        self._write_metrics()  # a stop between two metrics lines: one for the updates since the last
        path = self.checkpoint()
        return {"updates": self.updates_done, "version": self.version, "checkpoint": str(path),
                "stopped_early": self.updates_done < total}

    def wants_groups(self) -> bool:
        """Whether new groups may start: not after a stop request, nor once the last update's batch is
        with the trainers (they would never be trained and would hold the generators from the final
        evaluation)."""
        return not (self.stop_requested or self.updates_done + self.training >= self.cfg.run.updates)

    # ================================================================== train, push, save
    def _train(self) -> None:
        batch = self.flow.budget.take_batch(self.version)
        if batch is None:
            return
        if self._idle_since is not None:
            self.log.window.trainer_idle_s += time.time() - self._idle_since
            self._idle_since = None
        self.mailbox.send(self.layout.first_trainer, TrainRequest(batch))  # it shares it with the others
        self.log.batch = batch_stats(batch)
        self.training = True

    def _on_trained(self, report: TrainReport) -> None:
        self.version = report.version
        self.updates_done += 1
        self.log.train = report.metrics
        self.training = False
        self._begin_update()

    def _begin_update(self) -> None:
        self.sync.begin(self.version)  # pause -> push -> finish (sync/coordinator.py)

    def _on_update_done(self, done: UpdateDone | None) -> None:
        """What follows an update here once its weights reached the generators (None: not yet)."""
        if done is None:
            return
        self.log.pushed(done.push, done.push_wall_s)
        if done.served:
            self.flow.budget.weights_served(done.version)  # admission: new samples start on these weights
        self._idle_since = time.time()
        self._update_finished = True

    def _after_update(self, progress: Progress) -> None:
        self._update_finished = False
        if self.log.train:  # else a push of the same version (a restarted generator, a resume): nothing to log
            if self._write_metrics():
                self.log.show(progress, self.updates_done)
            self.log.train = {}
            if not self.flow.evaluation.active:  # else the checkpoint follows the evaluated update's line
                self._checkpoint_if_due()
        if self.flow.evaluation.waiting_to_start and not self.sync.push_needed:
            self.flow.start_eval(self.version)  # every generator serves the evaluated weights

    def _evaluate_initial_weights(self) -> None:
        """A fresh run's held-out round before the first update (run.eval_at_start): the line of update 0."""
        if self.flow.evaluation.hold_initial(self.version) and not self.sync.push_needed:
            self.flow.start_eval(self.version)  # else it starts once the push is done (_after_update)

    def _hold_for_eval(self, row: dict[str, Any]) -> bool:
        """True when an eval round evaluates this update: its line waits for the results (evaluation.py)."""
        if not self.log.train or not self.flow.evaluation.due(self.updates_done):
            return False
        self.flow.evaluation.hold(self.updates_done, row)
        return True

    def _finish_eval(self, progress: Progress) -> None:
        self.log.write_row(self.flow.finish_eval())
        self.log.show(progress, self.updates_done)
        self._checkpoint_if_due()

    def _checkpoint_if_due(self) -> None:
        every = self.cfg.run.checkpoint_every
        # none after the round at update 0: the initial weights are on disk already
        if every and 0 < self.updates_done < self.cfg.run.updates and self.updates_done % every == 0:
            self.checkpoint()

    def checkpoint(self) -> Path:
        """Trainer checkpoint with this controller's state inside (collective over trainer ranks)."""
        root = self.run_dir / "checkpoints"
        self.mailbox.send(self.layout.first_trainer, SaveRequest(str(root), {"controller": self.state_dict()}))
        # other messages wait: the state saved stays exactly what was sent
        return Path(self.mailbox.await_reply(Saved, REPLY_TIMEOUT_S, on_failure=self._on_failure).path)

    def _write_metrics(self) -> bool:
        state = self.flow.budget.counters.group_metrics()  # groups/completed, groups/dropped_<outcome>
        state |= {"in_flight": self.flow.budget.in_flight, "ready": len(self.flow.budget.ready)}
        state |= self.flow.budget.length_stats()  # trained vs all graded samples: the staleness rule's length bias
        return self.log.write_line(self.updates_done, self.version, state | stage_metrics(self.flow.stage()),
                                   hold=self._hold_for_eval)

    # ================================================================== start, resume, stop
    def install_signal_handlers(self) -> None:
        def request_stop(signum, frame):
            self.stop_requested = True

        signal.signal(signal.SIGTERM, request_stop)
        signal.signal(signal.SIGINT, request_stop)

    def wait_for_generators(self, timeout_s: float) -> None:
        deadline = time.time() + timeout_s
        while len(self.sync.status) + len(self.flow.dead_generators) < self.layout.generators:
            if time.time() > deadline:
                raise RunFailed(f"generators did not report within {timeout_s:.0f} s", Cause.LOST)
            for source, message in self.mailbox.poll(timeout_s=0.005):
                self._dispatch(source, message)
        if not self.flow.alive_generators():
            raise RunFailed("no generator started", Cause.LOST)

    def resume(self, root: Path) -> None:
        self.mailbox.send(self.layout.first_trainer, LoadRequest(str(root)))
        state = self.mailbox.await_reply(Loaded, REPLY_TIMEOUT_S, on_failure=self._on_failure).extra.get("controller")
        if not state:
            raise RunFailed(f"checkpoint under {root} has no controller state; cannot resume this run", Cause.INPUT)
        self.flow.load_state_dict(state)
        if "log" in state:  # rows and events written after the checkpoint are written again: drop them
            self.log.cut_back(state["log"])
        self.version, self.updates_done = state["version"], state["updates_done"]
        self.sync.push_needed = True  # generators start from disk weights
        self.flow.reissue_outstanding()

    def state_dict(self) -> dict[str, Any]:
        return self.flow.state_dict() | {"version": self.version, "updates_done": self.updates_done,
                                         "log": self.log.offsets()}

    def shutdown(self) -> None:
        stop_workers(self.mailbox, self.layout)
        self.flow.close()
        self.log.close()

    # ================================================================== messages
    def _dispatch(self, source: int, message: object) -> None:
        if isinstance(message, RolloutsReport):
            self.flow.on_rollouts(source, message)
        elif isinstance(message, Graded):
            self.flow.on_graded(message.results, source)
        elif isinstance(message, Trained):
            self._on_trained(message.report)
        elif isinstance(message, GeneratorStatus):  # start-up, a restart: the weights it serves
            self.sync.on_status(source, message, self.version)
        elif isinstance(message, (Paused, Resumed, Pushed)):  # a step of the update
            self._on_update_done(self.sync.on_step(source, message))
        elif isinstance(message, WorkerFailure):
            self._on_failure(source, message)
        else:
            raise RunFailed(f"unexpected {type(message).__name__} from rank {source}")

    def _on_failure(self, source: int, failure: WorkerFailure) -> None:
        if failure.role == "generator" and not failure.fatal and self.flow.on_generator_lost(failure.rank):
            print(f"megatron-rl train: {failure.error}; generator rank {failure.rank} left out, its samples "
                  f"issued to the others", file=sys.stderr, flush=True)
            self._on_update_done(self.sync.drop(failure.rank))
            return
        if failure.role == "verifier" and self.flow.on_verifier_lost(failure.rank):
            print(f"megatron-rl train: {failure.describe()}\n{failure.trace}verifier rank {failure.rank} left out, "
                  f"its items sent to the others", file=sys.stderr, flush=True)
            return
        raise RunFailed.of(failure)


def stop_workers(mailbox: Mailbox, layout: RankLayout) -> None:
    """Stop every worker rank (the first trainer passes it on to the other trainers)."""
    mailbox.send_all([layout.first_trainer] + layout.generator_ranks + layout.verifier_ranks, Stop())


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
