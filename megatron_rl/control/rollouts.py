"""The rollout flow: from a problem to graded samples in the budget.

    fill     start groups of G samples as the budget admits them (n_async in flight, the staleness
             bound: budget.free_group_slots); each group goes whole to the least-loaded live generator
             (its G requests share the prompt's prefix cache)
    collect  a generator's finished rollouts are stamped with the length stage they were requested
             under and sent to grading (the controller's own pool, or verifier ranks in turn)
    settle   verdicts go to the budget (groups, advantages, filtering); a failed grading is graded
             again or, given up on, drops its group (grading.GradingLedger)
A dead generator's samples are issued again to the live ones, a dead or hung verifier rank's items
sent to the live ones (verifiers.py).
Length stages (rollout.length_schedule): a sample is requested with the cap of the stage in force
when it is issued and graded with that stage's overlong-penalty window, even after a switch.
"""
from __future__ import annotations

import sys
from typing import Any, Callable

from megatron_rl.config import Config, LengthStage, length_stages, stage_at
from megatron_rl.control.budget import PendingGroup, RolloutBudget
from megatron_rl.control.evaluation import Evaluation
from megatron_rl.control.grading import GradingLedger, LocalGrader
from megatron_rl.plan.layout import RankLayout
from megatron_rl.control.mailbox import Mailbox
from megatron_rl.control.problems import ProblemQueue
from megatron_rl.control.protocol import Cause, GenerateRequest, GradeItem, GradeRequest, Key, RolloutsReport, RunFailed
from megatron_rl.control.run_log import RunLog
from megatron_rl.control.verifiers import VerifierRanks
from megatron_rl.data.prompts import get_template, render_prompt_ids
from megatron_rl.records import Problem, SampleRequest


class RolloutFlow:
    def __init__(self, cfg: Config, mailbox: Mailbox, layout: RankLayout, problems: list[Problem], tokenizer,
                 log: RunLog, updates_done: Callable[[], int], eval_problems: list[Problem] | None = None):
        self.mailbox, self.layout, self.log, self.tokenizer = mailbox, layout, log, tokenizer
        self.updates_done = updates_done  # the trainer updates so far: the length stage in force
        self.budget = RolloutBudget(cfg.rollout, cfg.algo)
        self.queue = ProblemQueue(problems, cfg.data.seed, cfg.data.drop_solved_above)
        self.template = get_template(cfg.data)  # system prompt (name, text or file) and chat-template kwargs
        self.length_stages = length_stages(cfg.rollout.length_schedule, cfg.rollout.max_new_tokens,
                                           cfg.reward)
        self.gen_load: dict[int, int] = {r: 0 for r in layout.generator_ranks}  # samples out per generator
        self.dead_generators: set[int] = set()
        self.sample_owner: dict[Key, int] = {}  # the generator each sample in flight was sent to
        self.sample_stage: dict[Key, LengthStage] = {}  # the stage each sample was issued under
        self.prompt_ids: dict[str, list[int]] = {}  # group id -> prompt token ids
        self.ledger = GradingLedger(cfg.reward.regrade_attempts, cfg.rollout.n_async)  # samples being graded
        self.evaluation = Evaluation(cfg, eval_problems or [])  # its samples never reach the budget
        self.grader = LocalGrader(cfg.reward) if layout.verifiers == 0 else None
        self.verifiers = VerifierRanks(layout.verifier_ranks, cfg.reward)

    def stage(self) -> LengthStage:
        return stage_at(self.length_stages, self.updates_done())

    def alive_generators(self) -> list[int]:
        return [r for r in self.layout.generator_ranks if r not in self.dead_generators]

    # ================================================================== issuing
    def fill(self) -> None:
        requests: list[SampleRequest] = []
        for _ in range(self.budget.free_group_slots()):
            while self.budget.requeue:
                self.queue.requeue(self.budget.requeue.popleft())
            problem = self.queue.next()
            group = self.budget.start_group(problem)
            self.prompt_ids[group.group_id] = render_prompt_ids(self.tokenizer, problem, self.template)
            requests += self._requests(group.group_id, range(self.budget.cfg.group_size))
        if requests:
            self._issue(requests)

    def reissue_outstanding(self) -> None:
        """After a resume: prompts of the checkpointed groups, and every sample not yet graded."""
        for g in self.budget.groups.values():
            self.prompt_ids[g.group_id] = render_prompt_ids(self.tokenizer, g.problem, self.template)
        self._issue([r for group_id, i in self.budget.outstanding_samples() for r in self._requests(group_id, [i])])

    def start_eval(self, version: int) -> None:
        """Issue the held evaluation round's samples (weights `version` on every generator)."""
        for group_id, problem, k in self.evaluation.start(version):
            self.prompt_ids[group_id] = render_prompt_ids(self.tokenizer, problem, self.template)
            self._issue(self._requests(group_id, range(k)), self._eval_sampling())

    def finish_eval(self) -> dict[str, Any]:
        """The evaluated update's metrics line with the round's results."""
        for group_id in self.evaluation.round.verdicts:  # type: ignore[union-attr]
            self.prompt_ids.pop(group_id, None)
        return self.evaluation.finish()

    def _eval_sampling(self) -> dict[str, Any]:
        return {"temperature": self.evaluation.temperature}

    def _requests(self, group_id: str, indices) -> list[SampleRequest]:
        return [SampleRequest(group_id, i, self.prompt_ids[group_id]) for i in indices]

    def _issue(self, requests: list[SampleRequest], sampling: dict[str, Any] | None = None) -> None:
        """Send samples to generators, keeping each group on one generator (shared prefix cache);
        `sampling` overrides the rollout's sampling (the evaluation's temperature)."""
        alive = self.alive_generators()
        if not alive:
            raise RunFailed("every generator is dead", Cause.LOST)
        by_group: dict[str, list[SampleRequest]] = {}
        for s in requests:
            by_group.setdefault(s.group_id, []).append(s)
        per_rank: dict[int, list[SampleRequest]] = {}
        stage = self.stage()
        for group in by_group.values():
            rank = min(alive, key=lambda r: self.gen_load[r])
            self.gen_load[rank] += len(group)
            for s in group:
                self.sample_owner[s.key] = rank
                self.sample_stage[s.key] = stage
            per_rank.setdefault(rank, []).extend(group)
        for rank, samples in per_rank.items():
            self.mailbox.send(rank, GenerateRequest(samples, {"max_new_tokens": stage.max_new_tokens} | (sampling or {})))

    def on_generator_lost(self, rank: int) -> bool:
        """A generator died: issue its samples to the live ones. False when none is left."""
        self.dead_generators.add(rank)
        lost = [key for key, owner in self.sample_owner.items() if owner == rank]
        for key in lost:
            del self.sample_owner[key]
            self.sample_stage.pop(key, None)
        if not self.alive_generators():
            return False
        again = [r for g, i in lost if g in self.prompt_ids for r in self._requests(g, [i])]
        evals = [r for r in again if self.evaluation.owns(r.group_id)]
        self._issue([r for r in again if not self.evaluation.owns(r.group_id)])
        if evals:
            self._issue(evals, self._eval_sampling())
        return True

    # ================================================================== collecting and grading
    def on_rollouts(self, rank: int, report: RolloutsReport) -> None:
        self.log.window.gen_idle_s += report.idle_s
        self.log.window.gen_busy_s += report.busy_s
        items = []
        for r in report.rollouts:
            if self.sample_owner.pop(r.key, None) is None:
                continue  # a duplicate of a sample already re-issued and answered
            stage = self.sample_stage.pop(r.key)
            self.gen_load[rank] = max(0, self.gen_load[rank] - 1)
            # an evaluation sample (its own group id namespace) or a training group's
            group = self.budget.groups.get(r.group_id)
            problem = self.evaluation.problem(r.group_id) if self.evaluation.owns(r.group_id) else \
                group.problem if group is not None else None
            if problem is None:
                continue
            r.max_new_tokens, r.l_max, r.l_cache = stage.max_new_tokens, stage.l_max, stage.l_cache
            items.append(self.ledger.add(r, GradeItem(r.key, problem.task,
                                                      self.template.assistant_prefix + r.text,
                                                      len(r.completion_ids), l_max=r.l_max, l_cache=r.l_cache)))
        if items:
            self._submit_grades(items)

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

    def on_graded(self, results: list[tuple[Key, dict]], rank: int | None = None) -> None:
        """Verdicts (from verifier `rank`, or the controller's pool) go to the budget; a failed grading is
        graded again or, given up on, drops its group."""
        if rank is not None:
            self.verifiers.answered(rank, [key for key, _ in results])
        settled, again = self.ledger.settle(results, self.log.window)
        if again:
            self._submit_grades(again)
        for rollout, failed in settled:
            if self.evaluation.owns(rollout.group_id):  # never the budget's, nor the window's rewards
                self.evaluation.record(rollout, failed)
                continue
            group = self.budget.groups.get(rollout.group_id)
            if failed:
                fate = self.budget.add_failed(rollout.group_id, rollout.sample_index)
            else:
                self.log.window.graded.append(rollout)
                fate = self.budget.add_graded(rollout)
            if fate is not None and group is not None:
                self._on_group_done(group, fate)

    def _on_group_done(self, group: PendingGroup, fate: str) -> None:
        rollouts = group.rollouts.values()
        pass_rate = None  # a group with a sample nobody could grade says nothing about its problem
        if fate != "grading_failed":
            pass_rate = sum(r.reward_components.get("correct", 0.0) for r in rollouts) / len(group.rollouts)
            self.queue.record(group.problem.problem_id, pass_rate)
        self.prompt_ids.pop(group.group_id, None)
        # every sample's fate: graded (a verdict) or failed (grading given up on), by index
        self.log.group_done({"group_id": group.group_id, "problem_id": group.problem.problem_id, "fate": fate,
                             "pass_rate": pass_rate, "rewards": [r.reward for r in rollouts],
                             "graded": sorted(group.rollouts), "failed": sorted(group.failed),
                             "update": self.updates_done()})

    # ================================================================== state
    def state_dict(self) -> dict[str, Any]:
        return {"budget": self.budget.state_dict(), "queue": self.queue.state_dict(),
                "evaluation": self.evaluation.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.budget.load_state_dict(state["budget"])
        self.queue.load_state_dict(state["queue"])
        self.evaluation.load_state_dict(state.get("evaluation"))  # a round not finished: re-run

    def close(self) -> None:
        if self.grader is not None:
            self.grader.close()
