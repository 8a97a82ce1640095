"""The rollout flow: from a problem to graded samples in the budget.

    fill     start groups of G samples as the budget admits them (n_async in flight, more while episodes
             wait on tools as the generators report; the staleness bound: budget.free_group_slots); each
             group goes whole, as one records.GroupRequest, to the least-loaded live generator (its G
             requests share the prompt's prefix cache)
    collect  a generator's finished rollouts come back carrying the length stage they were requested
             under (`Rollout.stage`) and are sent to grading with it (the controller's own pool, or
             verifier ranks in turn)
    settle   verdicts (`RewardBreakdown`s) go to the budget (groups, advantages, filtering; each group
             ends in a `GroupOutcome`); a failed grading is graded again or, given up on, drops its
             group (grading.GradingLedger)
A dead generator's samples are issued again to the live ones, a dead or hung verifier rank's items
sent to the live ones (verifiers.py).
Episodes in flight: generators report each one's turn boundaries (records.PartialEpisode); the latest
of each training episode goes into the checkpoint, and whenever a sample is issued again (a resume, a
lost generator) its episode continues from there instead of starting over.
Length stages (rollout.length_schedule): a sample is requested with the cap of the stage in force
when it is issued and graded with that stage's overlong-penalty window, even after a switch.
Evaluation samples take the same path; their group ids have their own namespace, and `groups_of` is
the one place that routes a group to the evaluation or to training (its sampling, its problem, where
its verdicts go).
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Protocol

from megatron_rl.config import Config, LengthStage, length_stages, stage_at
from megatron_rl.control.budget import GroupOutcome, PendingGroup, RolloutBudget
from megatron_rl.control.evaluation import Evaluation, is_eval_group
from megatron_rl.control.episodes import prompt_template
from megatron_rl.control.grading import GradingLedger, LocalGrader, apply_verdict
from megatron_rl.plan.layout import RankLayout
from megatron_rl.control.mailbox import Mailbox
from megatron_rl.control.problems import ProblemQueue
from megatron_rl.control.protocol import Cause, GenerateRequest, GradeItem, GradeRequest, Key, RolloutsReport, RunFailed
from megatron_rl.control.run_log import RunLog
from megatron_rl.control.verifiers import VerifierRanks
from megatron_rl.data.prompts import render_prompt_ids
from megatron_rl.env import own_reward
from megatron_rl.records import GroupRequest, PartialEpisode, Problem, Rollout
from megatron_rl.reward.types import RewardBreakdown


class Groups(Protocol):
    """Where the samples of a kind of group go (training: `TrainingGroups`; evaluation: `Evaluation`)."""

    @property
    def sampling(self) -> dict[str, Any]: ...  # overrides of the rollout's sampling

    def problem(self, group_id: str) -> Problem | None: ...  # None: no such group in flight (a late sample)

    def settle(self, rollout: Rollout, failed: bool) -> None: ...  # graded, or grading given up on


class TrainingGroups:
    """Training groups: verdicts go to the budget and the update window; a group that ends is recorded
    (its problem's pass rate, a group event) and its prompt forgotten."""

    sampling: dict[str, Any] = {}  # the rollout's own

    def __init__(self, budget: RolloutBudget, queue: ProblemQueue, log: RunLog, updates_done: Callable[[], int],
                 prompt_ids: dict[str, list[int]]):
        self.budget, self.queue, self.log, self.updates_done, self.prompt_ids = \
            budget, queue, log, updates_done, prompt_ids

    def problem(self, group_id: str) -> Problem | None:
        group = self.budget.groups.get(group_id)
        return None if group is None else group.problem

    def settle(self, rollout: Rollout, failed: bool) -> None:
        group = self.budget.groups.get(rollout.group_id)
        if failed:
            outcome = self.budget.add_failed(rollout.group_id, rollout.sample_index)
        else:
            self.log.window.graded.append(rollout)
            outcome = self.budget.add_graded(rollout)
        if outcome is not None and group is not None:
            self._done(group, outcome)

    def _done(self, group: PendingGroup, outcome: GroupOutcome) -> None:
        rollouts = group.rollouts.values()
        pass_rate = None  # a group with a sample nobody could grade says nothing about its problem
        if outcome is not GroupOutcome.GRADING_FAILED:
            pass_rate = sum(r.reward_components.get("correct", 0.0) for r in rollouts) / len(group.rollouts)
            self.queue.record(group.problem.problem_id, pass_rate)
        self.prompt_ids.pop(group.group_id, None)
        # every sample's fate: graded (a verdict) or failed (grading given up on), by index
        self.log.group_done({"group_id": group.group_id, "problem_id": group.problem.problem_id,
                             "fate": outcome.value, "pass_rate": pass_rate, "rewards": [r.reward for r in rollouts],
                             "graded": sorted(group.rollouts), "failed": sorted(group.failed),
                             "update": self.updates_done()})


class RolloutFlow:
    def __init__(self, cfg: Config, mailbox: Mailbox, layout: RankLayout, problems: list[Problem], tokenizer,
                 log: RunLog, updates_done: Callable[[], int], eval_problems: list[Problem] | None = None):
        self.mailbox, self.layout, self.log, self.tokenizer = mailbox, layout, log, tokenizer
        self.updates_done = updates_done  # the trainer updates so far: the length stage in force
        self.budget = RolloutBudget(cfg.rollout, cfg.algo, cfg.env.extra_in_flight)
        self.queue = ProblemQueue(problems, cfg.data.seed, cfg.data.drop_solved_above)
        # system prompt (name, text or file), chat-template kwargs and the environment's tools
        self.template = prompt_template(cfg)
        self.max_env_failures = cfg.env.max_consecutive_failures
        self.send_task = cfg.env.multi_turn  # the single-turn task never reads it (code tests are large)
        self.env_failures_in_a_row = 0
        self.length_stages = length_stages(cfg.rollout.length_schedule, cfg.rollout.max_new_tokens,
                                           cfg.reward)
        self.gen_load: dict[int, int] = {r: 0 for r in layout.generator_ranks}  # samples out per generator
        self.env_waiting: dict[int, int] = {}  # per generator: its samples in an environment step (last report)
        self.dead_generators: set[int] = set()
        self.sample_owner: dict[Key, int] = {}  # the generator each sample in flight was sent to
        self.prompt_ids: dict[str, list[int]] = {}  # group id -> prompt token ids
        self.boundaries: dict[Key, PartialEpisode] = {}  # the last turn boundary of each episode in flight
        self.ledger = GradingLedger(cfg.reward.regrade_attempts, cfg.rollout.n_async)  # samples being graded
        self.evaluation = Evaluation(cfg, eval_problems or [])  # its samples never reach the budget
        self.training = TrainingGroups(self.budget, self.queue, log, updates_done, self.prompt_ids)
        self.grader = LocalGrader(cfg.reward) if layout.verifiers == 0 else None
        self.verifiers = VerifierRanks(layout.verifier_ranks, cfg.reward)

    def stage(self) -> LengthStage:
        return stage_at(self.length_stages, self.updates_done())

    def alive_generators(self) -> list[int]:
        return [r for r in self.layout.generator_ranks if r not in self.dead_generators]

    def groups_of(self, group_id: str) -> Groups:
        """The one routing point: an evaluation group (its own id namespace) or a training group."""
        return self.evaluation if is_eval_group(group_id) else self.training

    # ================================================================== issuing
    def fill(self) -> None:
        requests: list[GroupRequest] = []
        for _ in range(self.budget.free_group_slots()):
            while self.budget.requeue:
                self.queue.requeue(self.budget.requeue.popleft())
            problem = self.queue.next()
            group = self.budget.start_group(problem)
            self.prompt_ids[group.group_id] = render_prompt_ids(self.tokenizer, problem, self.template)
            requests.append(self._request(group.group_id, range(self.budget.cfg.group_size)))
        if requests:
            self._issue(requests)
        self.log.window.in_flight_peak = max(self.log.window.in_flight_peak, self.budget.in_flight)

    def reissue_outstanding(self) -> None:
        """After a resume: prompts of the checkpointed groups, and every sample not yet graded."""
        for g in self.budget.groups.values():
            self.prompt_ids[g.group_id] = render_prompt_ids(self.tokenizer, g.problem, self.template)
        self._issue(self._requests(self.budget.outstanding_samples()))

    def start_eval(self, version: int) -> None:
        """Issue the held evaluation round's samples (weights `version` on every generator)."""
        requests = []
        for group_id, problem, k in self.evaluation.start(version):
            self.prompt_ids[group_id] = render_prompt_ids(self.tokenizer, problem, self.template)
            requests.append(self._request(group_id, range(k)))
        self._issue(requests)

    def finish_eval(self) -> dict[str, Any]:
        """The evaluated update's metrics line with the round's results."""
        for group_id in self.evaluation.round.verdicts:  # type: ignore[union-attr]
            self.prompt_ids.pop(group_id, None)
        return self.evaluation.finish()

    def _request(self, group_id: str, indices) -> GroupRequest:
        """Samples `indices` of a group, under the stage in force and the sampling of its kind."""
        groups = self.groups_of(group_id)
        problem = groups.problem(group_id)
        resume = {i: self.boundaries[group_id, i] for i in indices if (group_id, i) in self.boundaries}
        return GroupRequest(group_id, self.prompt_ids[group_id], list(indices), self.stage(), dict(groups.sampling),
                            task=dict(problem.task) if self.send_task and problem is not None else {}, resume=resume)

    def _requests(self, keys: list[Key]) -> list[GroupRequest]:
        """Samples by (group id, index), as one request per group (in the order the groups first appear)."""
        by_group: dict[str, list[int]] = {}
        for group_id, i in keys:
            by_group.setdefault(group_id, []).append(i)
        return [self._request(group_id, indices) for group_id, indices in by_group.items()]

    def _issue(self, requests: list[GroupRequest]) -> None:
        """Send groups to generators, each whole to the least-loaded live one (shared prefix cache)."""
        if not requests:
            return
        alive = self.alive_generators()
        if not alive:
            raise RunFailed("every generator is dead", Cause.LOST)
        per_rank: dict[int, list[GroupRequest]] = {}
        for group in requests:
            rank = min(alive, key=lambda r: self.gen_load[r])
            self.gen_load[rank] += len(group.sample_indices)
            for key in group.keys:
                self.sample_owner[key] = rank
            per_rank.setdefault(rank, []).append(group)
        for rank, groups in per_rank.items():
            self.mailbox.send(rank, GenerateRequest(groups))

    def on_generator_lost(self, rank: int) -> bool:
        """A generator died: issue its samples to the live ones (under the stage now in force). False
        when none is left."""
        self.dead_generators.add(rank)
        self._set_env_waiting(rank, 0)
        lost = [key for key, owner in self.sample_owner.items() if owner == rank]
        for key in lost:
            del self.sample_owner[key]
        if not self.alive_generators():
            return False
        self._issue(self._requests([(g, i) for g, i in lost if g in self.prompt_ids]))
        return True

    # ================================================================== collecting and grading
    def on_rollouts(self, rank: int, report: RolloutsReport) -> None:
        self.log.window.gen_idle_s += report.idle_s
        self.log.window.gen_busy_s += report.busy_s
        self._set_env_waiting(rank, report.env_waiting)
        for b in report.boundaries:
            if self.sample_owner.get(b.key) == rank:  # else a sample issued elsewhere since, or answered
                self.boundaries[b.key] = b
        items = []
        for r in report.rollouts:
            self.boundaries.pop(r.key, None)
            if self.sample_owner.pop(r.key, None) is None:
                continue  # a duplicate of a sample already re-issued and answered
            self.gen_load[rank] = max(0, self.gen_load[rank] - 1)
            problem = self.groups_of(r.group_id).problem(r.group_id)
            if problem is None:
                continue
            if r.stage is None:
                raise RunFailed(f"generator rank {rank} sent rollout {r.group_id}/{r.sample_index} without the "
                                f"length stage it was requested under")
            if self._settled_by_episode(r):
                continue
            items.append(self.ledger.add(r, GradeItem(r.key, problem.task, self.template.assistant_prefix + r.text,
                                                      len(r.completion_ids), r.stage)))
        if items:
            self._submit_grades(items)

    def _set_env_waiting(self, rank: int, n: int) -> None:
        self.env_waiting[rank] = n
        self.budget.env_waiting = sum(self.env_waiting.values())

    def _settled_by_episode(self, r: Rollout) -> bool:
        """An episode whose environment failed drops its group (never trained as reward 0; too many in a
        row stop the run); one the environment gave its own reward needs no verifier."""
        groups = self.groups_of(r.group_id)
        if r.episode.error is not None:
            self.log.window.env_failed += 1
            self.env_failures_in_a_row += 1
            if self.env_failures_in_a_row >= self.max_env_failures:
                raise RunFailed(f"the environment failed {self.env_failures_in_a_row} episodes in a row "
                                f"(env.max_consecutive_failures); last: {r.episode.error}")
            groups.settle(r, True)
            return True
        self.env_failures_in_a_row = 0
        if r.episode.reward is None:
            return False
        apply_verdict(r, own_reward(r.episode.reward, r.episode.correct))
        groups.settle(r, False)
        return True

    def _submit_grades(self, items: list[GradeItem]) -> None:
        if self.grader is not None:
            self.grader.submit(items)
            return
        rank = self.verifiers.pick()
        self.mailbox.send(rank, GradeRequest(items))
        self.verifiers.sent(rank, items)

    def on_verifier_lost(self, rank: int) -> bool:
        """A verifier rank failed: send what it held to the live ones. False when none is left."""
        items = self.verifiers.lost(rank)
        if not self.verifiers.live():
            return False
        if items:
            self._submit_grades(items)
        return True

    def _resend_overdue(self) -> None:
        for rank, items in self.verifiers.overdue():
            print(f"megatron-rl train: verifier rank {rank} answered no grading request within its reply "
                  f"timeout (reward.verifier_reply_timeout_s); its {len(items)} items go to the other verifier "
                  f"ranks", file=sys.stderr, flush=True)
            if not self.verifiers.live():
                raise RunFailed(f"verifier rank {rank} answered no grading request within its reply timeout "
                                f"(reward.verifier_reply_timeout_s) and no other verifier rank is live", Cause.LOST)
            if items:
                self._submit_grades(items)

    def collect_grades(self) -> None:
        """What the controller's own grading pool has finished (verifier ranks answer by message)."""
        if self.grader is not None:
            self.on_graded(self.grader.poll())
        else:
            self._resend_overdue()

    def on_graded(self, results: list[tuple[Key, RewardBreakdown]], rank: int | None = None) -> None:
        """Verdicts (from verifier `rank`, or the controller's pool) go where their group belongs; a failed
        grading is graded again or, given up on, drops its group."""
        if rank is not None:
            self.verifiers.answered(rank, [key for key, _ in results])
        settled, again = self.ledger.settle(results, self.log.window)
        if again:
            self._submit_grades(again)
        for rollout, failed in settled:
            self.groups_of(rollout.group_id).settle(rollout, failed)

    # ================================================================== state
    def state_dict(self) -> dict[str, Any]:
        outstanding = set(self.budget.outstanding_samples())  # training samples: an evaluation round re-runs whole
        episodes = [b.to_dict() for key, b in self.boundaries.items() if key in outstanding]
        return {"budget": self.budget.state_dict(), "queue": self.queue.state_dict(),
                "evaluation": self.evaluation.state_dict(), "episodes": episodes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.budget.load_state_dict(state["budget"])
        self.queue.load_state_dict(state["queue"])
        self.evaluation.load_state_dict(state.get("evaluation"))  # a round not finished: re-run
        self.boundaries = {b.key: b for b in map(PartialEpisode.from_dict, state.get("episodes", []))}

    def close(self) -> None:
        if self.grader is not None:
            self.grader.close()
