"""The controller (MPI rank 0): keeps the rollout budget full and the trainer fed.

Event loop, never blocking on any one worker:
  fill     start groups of G samples until n_async sequences are in flight (least-loaded generator)
  collect  finished rollouts -> graders; graded samples -> budget (groups, advantages, filtering)
  train    when the trainer is idle and n_batch sequences are ready (after the staleness bound)
  update   after each trainer update: generators pause in place -> trainers push weight buckets ->
           generators stamp the version and continue (in-flight sequences keep their KV cache)
  save     every `run.checkpoint_every` updates, at the end, and on SIGTERM/SIGINT: the trainer's
           checkpoint carries this controller's state (budget, problem cursor), so `--resume` loses
           and repeats no prompt.
Length stages (rollout.length_schedule): each sample is requested with the cap of the stage in force
when it is issued and graded with that stage's overlong-penalty window, even if graded after a switch
(the stage is stamped on the Rollout, so checkpointed rollouts keep it). Samples in flight at a
checkpoint are re-issued on resume, i.e. generated afresh under the stage in force then.
"""
from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

from megatron_rl.config import Config, LengthStage
from megatron_rl.control.budget import RolloutBudget
from megatron_rl.control.grading import GradingLedger, LocalGrader
from megatron_rl.control.layout import RankLayout
from megatron_rl.control.metrics import EVENTS_FILE, METRICS_FILE, JsonlWriter, Progress, UpdateWindow, stage_metrics
from megatron_rl.control.problems import ProblemQueue, parse_length_schedule, stage_at
from megatron_rl.control.protocol import (GenerateRequest, GeneratorStatus, GradeItem, PushRequest, RolloutsReport,
                                          RunFailed, SampleSpec, SaveRequest, Tag, WorkerFailure)
from megatron_rl.data.prompts import get_template, render_prompt_ids
from megatron_rl.records import Problem


class Controller:
    def __init__(self, comm, cfg: Config, layout: RankLayout, run_dir: Path, problems: list[Problem], tokenizer):
        self.comm, self.cfg, self.layout, self.run_dir = comm, cfg, layout, run_dir
        self.budget = RolloutBudget(cfg.rollout, cfg.algo)
        self.queue = ProblemQueue(problems, cfg.data.seed, cfg.data.drop_solved_above)
        self.template = get_template(cfg.data.system_prompt)
        self.tokenizer = tokenizer
        self.length_stages = parse_length_schedule(cfg.rollout.length_schedule, cfg.rollout.max_new_tokens,
                                                   cfg.reward)
        self.version = 0  # trainer policy version (= number of updates)
        self.updates_done = 0
        self.phase = "idle"  # idle | training | pausing | pushing | finishing
        self.pending_acks: set[int] = set()
        self.push_needed = False  # a restarted generator serves stale disk weights
        self.gen_status: dict[int, GeneratorStatus] = {}
        self.gen_load: dict[int, int] = {r: 0 for r in layout.generator_ranks}
        self.dead_generators: set[int] = set()
        self.sample_owner: dict[tuple[str, int], int] = {}
        self.sample_stage: dict[tuple[str, int], LengthStage] = {}  # the stage each sample was issued under
        self.prompt_ids: dict[str, list[int]] = {}  # group id -> prompt token ids
        self.grader = LocalGrader(cfg.reward) if layout.verifiers == 0 else None
        self._verifier_next = 0
        self.window = UpdateWindow()
        self.metrics = JsonlWriter(run_dir / METRICS_FILE)
        self.events = JsonlWriter(run_dir / EVENTS_FILE)
        self.stop_requested = False
        self.last_train_metrics: dict[str, Any] = {}
        self._idle_since: float | None = time.time()
        self.ledger = GradingLedger(cfg.reward.regrade_attempts, cfg.rollout.n_async)  # samples being graded
        self._awaited: dict[Tag, Any] = {}
        self._held: list[tuple[int, Tag, Any]] = []  # messages that arrived during an _await
        self._row_ready = False
        self._last_row: dict[str, Any] = {}
        self._batch_stats: dict[str, Any] = {}
        self._last_push: dict[str, Any] = {}
        self._push_started = 0.0

    # ================================================================== lifecycle
    def install_signal_handlers(self) -> None:
        def request_stop(signum, frame):
            self.stop_requested = True

        signal.signal(signal.SIGTERM, request_stop)
        signal.signal(signal.SIGINT, request_stop)

    def _send(self, dest: int, obj: Any, tag: Tag) -> None:
        self.comm.send(obj, dest=dest, tag=int(tag))

    def _broadcast(self, ranks: list[int], obj: Any, tag: Tag) -> None:
        for r in ranks:
            self._send(r, obj, tag)

    def _alive_generators(self) -> list[int]:
        return [r for r in self.layout.generator_ranks if r not in self.dead_generators]

    def wait_for_generators(self, timeout_s: float) -> None:
        deadline = time.time() + timeout_s
        while len(self.gen_status) + len(self.dead_generators) < self.layout.generators:
            if time.time() > deadline:
                raise RunFailed(f"generators did not report within {timeout_s:.0f} s")
            self._poll_messages()
        if not self._alive_generators():
            raise RunFailed("no generator started")

    def resume(self, root: Path) -> None:
        self._broadcast(self.layout.trainer_ranks, str(root), Tag.LOAD)
        extra = self._await(Tag.LOADED)
        state = extra.get("controller")
        if not state:
            raise RunFailed(f"checkpoint under {root} has no controller state; cannot resume this run")
        self.budget.load_state_dict(state["budget"])
        self.queue.load_state_dict(state["queue"])
        self.version, self.updates_done = state["version"], state["updates_done"]
        self.push_needed = True  # generators start from disk weights
        for g in self.budget.groups.values():
            self.prompt_ids[g.group_id] = render_prompt_ids(self.tokenizer, g.problem, self.template)
        self._issue([SampleSpec(s.group_id, s.sample_index, self.prompt_ids[s.group_id])
                     for s in self.budget.outstanding_requests()])

    def state_dict(self) -> dict[str, Any]:
        return {"budget": self.budget.state_dict(), "queue": self.queue.state_dict(), "version": self.version,
                "updates_done": self.updates_done}

    # ================================================================== main loop
    def run(self) -> dict[str, Any]:
        total = self.cfg.run.updates
        progress = Progress(total, self.updates_done)
        try:
            while True:
                if self.phase == "idle":
                    if self.updates_done >= total or self.stop_requested:
                        break
                    if self.push_needed:
                        self._begin_update()
                    else:
                        self._maybe_train()
                self._fill()
                self._poll_messages()
                self._collect_grades()
                if self.phase == "idle" and self._row_ready:
                    self._row_ready = False
                    progress.update(self.updates_done, self._progress_info())
        finally:
            progress.close()
        self._write_metrics()  # a stop between two metrics lines: one for the updates since the last
        path = self.checkpoint()
        return {"updates": self.updates_done, "version": self.version, "checkpoint": str(path),
                "stopped_early": self.updates_done < total}

    def shutdown(self) -> None:
        for r in self.layout.trainer_ranks + self.layout.generator_ranks + self.layout.verifier_ranks:
            self._send(r, None, Tag.STOP)
        if self.grader is not None:
            self.grader.close()
        self.metrics.close()
        self.events.close()

    # ================================================================== rollouts
    def _stage(self) -> LengthStage:
        return stage_at(self.length_stages, self.updates_done)

    def _fill(self) -> None:
        if self.stop_requested or self.updates_done >= self.cfg.run.updates:
            return
        specs: list[SampleSpec] = []
        for _ in range(self.budget.free_group_slots()):
            while self.budget.requeue:
                self.queue.requeue(self.budget.requeue.popleft())
            problem = self.queue.next()
            requests = self.budget.start_group(problem)
            group_id = requests[0].group_id
            self.prompt_ids[group_id] = render_prompt_ids(self.tokenizer, problem, self.template)
            specs += [SampleSpec(r.group_id, r.sample_index, self.prompt_ids[group_id]) for r in requests]
        if specs:
            self._issue(specs)

    def _issue(self, specs: list[SampleSpec]) -> None:
        """Send samples to generators, keeping each group on one generator (shared prefix cache)."""
        alive = self._alive_generators()
        if not alive:
            raise RunFailed("every generator is dead")
        by_group: dict[str, list[SampleSpec]] = {}
        for s in specs:
            by_group.setdefault(s.group_id, []).append(s)
        per_rank: dict[int, list[SampleSpec]] = {}
        stage = self._stage()
        for group in by_group.values():
            rank = min(alive, key=lambda r: self.gen_load[r])
            self.gen_load[rank] += len(group)
            for s in group:
                self.sample_owner[(s.group_id, s.sample_index)] = rank
                self.sample_stage[(s.group_id, s.sample_index)] = stage
            per_rank.setdefault(rank, []).extend(group)
        sampling = {"max_new_tokens": stage.max_new_tokens}
        for rank, samples in per_rank.items():
            self._send(rank, GenerateRequest(samples, sampling), Tag.GENERATE)

    def _on_rollouts(self, rank: int, report: RolloutsReport) -> None:
        self.window.gen_idle_s += report.idle_s
        self.window.gen_busy_s += report.busy_s
        items = []
        for r in report.rollouts:
            key = (r.problem_id, r.sample_index)
            if self.sample_owner.pop(key, None) is None:
                continue  # a duplicate of a sample already re-issued and answered
            stage = self.sample_stage.pop(key)
            self.gen_load[rank] = max(0, self.gen_load[rank] - 1)
            group = self.budget.groups.get(r.problem_id)
            if group is None:
                continue
            r.max_new_tokens, r.l_max, r.l_cache = stage.max_new_tokens, stage.l_max, stage.l_cache
            items.append(self.ledger.add(r, GradeItem(key, group.problem.task, self.template.assistant_prefix + r.text,
                                                      len(r.completion_ids), l_max=r.l_max, l_cache=r.l_cache)))
        if items:
            self._submit_grades(items)

    def _submit_grades(self, items: list[GradeItem]) -> None:
        if self.grader is not None:
            self.grader.submit(items)
            return
        ranks = self.layout.verifier_ranks
        rank = ranks[self._verifier_next % len(ranks)]
        self._verifier_next += 1
        self._send(rank, items, Tag.GRADE)

    def _collect_grades(self) -> None:
        if self.grader is not None:
            self._on_graded(self.grader.poll())

    def _on_graded(self, results: list[tuple[tuple[str, int], dict]]) -> None:
        """Verdicts go to the budget; a failed grading is graded again or, given up on, drops its group."""
        settled, again = self.ledger.settle(results, self.window)
        if again:
            self._submit_grades(again)
        for rollout, failed in settled:
            group = self.budget.groups.get(rollout.problem_id)
            if failed:
                fate = self.budget.add_failed(rollout.problem_id, rollout.sample_index)
            else:
                self.window.graded.append(rollout)
                fate = self.budget.add_graded(rollout)
            if fate is not None and group is not None:
                self._on_group_done(group, fate)

    def _on_group_done(self, group, fate: str) -> None:
        rollouts = group.rollouts.values()
        pass_rate = None  # a group with a sample nobody could grade says nothing about its problem
        if fate != "grading_failed":
            pass_rate = sum(r.reward_components.get("correct", 0.0) for r in rollouts) / len(group.rollouts)
            self.queue.record(group.problem.problem_id, pass_rate)
        self.prompt_ids.pop(group.group_id, None)
        self.events.write({"group_id": group.group_id, "problem_id": group.problem.problem_id, "fate": fate,
                           "pass_rate": pass_rate, "rewards": [r.reward for r in rollouts],
                           "update": self.updates_done})

    # ================================================================== training and updates
    def _maybe_train(self) -> None:
        batch = self.budget.take_batch(self.version)
        if batch is None:
            return
        if self._idle_since is not None:
            self.window.trainer_idle_s += time.time() - self._idle_since
            self._idle_since = None
        self._broadcast(self.layout.trainer_ranks, batch, Tag.TRAIN)
        self._batch_stats = {"batch/sequences": len(batch.sequences),
                             "batch/tokens": sum(s.completion_len for s in batch.sequences)}
        self.phase = "training"

    def _begin_update(self) -> None:
        self.phase = "pausing"
        self.pending_acks = set(self._alive_generators())
        self._broadcast(sorted(self.pending_acks), None, Tag.UPDATE_BEGIN)

    def _on_trained(self, metrics: dict[str, Any]) -> None:
        self.version = int(metrics["version"])
        self.updates_done += 1
        self.last_train_metrics = metrics
        self._begin_update()

    def _on_update_ack(self, rank: int, status: GeneratorStatus) -> None:
        self.gen_status[rank] = status
        self.pending_acks.discard(rank)
        self._advance_update()

    def _advance_update(self) -> None:
        """Move to the next update phase once every live generator has acknowledged the current one."""
        if self.pending_acks or self.phase not in ("pausing", "finishing"):
            return
        if self.phase == "pausing":  # all paused with an open update session: trainers push
            self.phase = "pushing"
            tp = self.cfg.generator.tp_size  # the update group of each server: 1 sender + its tp_size ranks
            targets = [(self.gen_status[r].url, tp, self.gen_status[r].incarnation) for r in self._alive_generators()]
            self._push_started = time.time()
            self._broadcast(self.layout.trainer_ranks, PushRequest(self.version, targets), Tag.PUSH)
            return
        self.phase = "idle"  # all stamped the new version and continue generating
        # A generator restarted during the update serves its disk weights: push again.
        self.push_needed = any(self.gen_status[r].version != self.version for r in self._alive_generators())
        self._idle_since = time.time()
        if self.last_train_metrics:
            self._write_metrics()
            self.last_train_metrics = {}
        if self._checkpoint_due():
            self.checkpoint()

    def _on_pushed(self, report: dict[str, Any]) -> None:
        self.phase = "finishing"
        self._last_push = dict(report, wall_s=time.time() - self._push_started)
        self.pending_acks = set(self._alive_generators())
        self._broadcast(sorted(self.pending_acks), self.version, Tag.UPDATE_FINISH)

    def _checkpoint_due(self) -> bool:
        every = self.cfg.run.checkpoint_every
        return bool(every) and self.updates_done % every == 0 and self.updates_done < self.cfg.run.updates

    def checkpoint(self) -> Path:
        """Trainer checkpoint with this controller's state inside (collective over trainer ranks)."""
        root = self.run_dir / "checkpoints"
        self._broadcast(self.layout.trainer_ranks, SaveRequest(str(root), {"controller": self.state_dict()}),
                        Tag.SAVE)
        return Path(self._await(Tag.SAVED))

    # ================================================================== metrics
    def _write_metrics(self) -> None:  # after an update, and at the end (no last_train_metrics: a stop)
        row = self.window.line(self.cfg.run, self.updates_done, self.version, self.last_train_metrics,
                               self._batch_stats, self._last_push)
        if row is None:  # no line due (run.log_every)
            return
        c = self.budget.counters
        row.update({"groups/dropped_non_diverse": c.groups_dropped_non_diverse,
                    "groups/dropped_stale": c.groups_dropped_stale, "groups/completed": c.groups_completed,
                    "groups/dropped_grading": c.groups_dropped_grading,
                    "in_flight": self.budget.in_flight, "ready": len(self.budget.ready)})
        row.update(stage_metrics(self._stage()))
        self.metrics.write(row)
        self._last_row = row
        self._row_ready = True
        self.window = UpdateWindow()

    def _progress_info(self) -> dict[str, float]:
        row = self._last_row
        keys = {"reward/mean": "reward", "pass_rate": "pass", "length/mean": "len", "train/loss": "loss"}
        return {short: row[k] for k, short in keys.items() if isinstance(row.get(k), (int, float))}

    # ================================================================== messages
    def _await(self, tag: Tag, timeout_s: float = 3600.0) -> Any:
        """Wait for one reply with `tag` from the trainer lead. Other messages are held back and
        handled afterwards, so a checkpoint's controller state stays exactly what was sent."""
        self._awaited = {tag: None}
        deadline = time.time() + timeout_s
        try:
            while self._awaited[tag] is None:
                if time.time() > deadline:
                    raise RunFailed(f"no {tag.name} reply from the trainers within {timeout_s:.0f} s")
                self._poll_messages()
        finally:
            reply = self._awaited.pop(tag)
            held, self._held = self._held, []
        for source, held_tag, msg in held:
            self._dispatch(source, held_tag, msg)
        return reply

    def _poll_messages(self, wait_s: float = 0.005) -> None:
        from mpi4py import MPI

        status = MPI.Status()
        handled = 0
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status):
            source, tag = status.Get_source(), Tag(status.Get_tag())
            msg = self.comm.recv(source=source, tag=tag)
            self._dispatch(source, tag, msg)
            handled += 1
        if not handled:
            time.sleep(wait_s)

    def _dispatch(self, source: int, tag: Tag, msg: Any) -> None:
        if tag in self._awaited:
            self._awaited[tag] = msg
        elif self._awaited and tag != Tag.FAILED:
            self._held.append((source, tag, msg))
        elif tag == Tag.ROLLOUTS:
            self._on_rollouts(source, msg)
        elif tag == Tag.GEN_STATUS:
            restarted = source in self.gen_status and msg.incarnation != self.gen_status[source].incarnation
            self.gen_status[source] = msg
            if restarted or msg.version != self.version:
                self.push_needed = True
        elif tag in (Tag.UPDATE_READY, Tag.UPDATE_DONE):
            self._on_update_ack(source, msg)
        elif tag == Tag.TRAINED:
            self._on_trained(msg)
        elif tag == Tag.PUSHED:
            self._on_pushed(msg)
        elif tag == Tag.GRADED:
            self._on_graded(msg)
        elif tag == Tag.FAILED:
            self._on_failure(msg)
        else:
            raise RunFailed(f"unexpected message {tag.name} from rank {source}")

    def _on_failure(self, failure: WorkerFailure) -> None:
        if failure.role == "generator" and not failure.fatal:
            self.dead_generators.add(failure.rank)
            self.pending_acks.discard(failure.rank)
            lost = [s for (g, i), r in list(self.sample_owner.items()) if r == failure.rank
                    for s in [SampleSpec(g, i, self.prompt_ids.get(g, []))]]
            for s in lost:
                del self.sample_owner[(s.group_id, s.sample_index)]
                self.sample_stage.pop((s.group_id, s.sample_index), None)
            if self._alive_generators():
                self._issue([s for s in lost if s.prompt_ids])
                self._advance_update()
                return
        raise RunFailed(f"{failure.role} rank {failure.rank} failed: {failure.error}")


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
