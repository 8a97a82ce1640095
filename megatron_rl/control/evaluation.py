"""Evaluation during training: pass@1 and pass@k on a held-out set, on the generators, between updates.

After every `run.eval_every` updates the controller holds that update's metrics line and starts a
round (and, with `run.eval_at_start`, once before the first update on the initial weights: a line of
its own, update 0, the baseline every later round is compared with): `run.eval_samples` (k) samples of each evaluation problem (`data.eval_path`, the first
`run.eval_max_problems`) at `run.eval_temperature`, as ordinary generate requests beside the training
samples in flight (those keep going: nothing is lost). The trainer takes no new batch until the round
is graded, so every sample of a round comes from the weights of the update it evaluates (a generator
restarted meanwhile gets those weights pushed again; `eval/off_version` counts samples with a token
from other weights). The results go on the held line (`eval/pass@1`, `eval/pass@k`,
`eval/<kind>/...`, `eval/<language>/...`, `eval/ungradable`, and per problem in file order
`eval/correct_by_problem` / `eval/graded_by_problem`: two rounds pair by problem,
`evaluation.paired`), which is then written, followed by the checkpoint if one is due at that update.

Evaluation samples never reach the rollout budget: their group ids live in their own namespace
("eval@<update>/<index>", never containing the '#' of a training group id) and the rollout flow routes
them here by that namespace alone (`is_eval_group`, in `RolloutFlow.groups_of`): their sampling, their
problem and their verdicts; a sample of a round already finished is ignored here.
Grading goes through the same graders; a sample nobody could grade is counted in
`eval/ungradable`, never as a wrong answer (evaluation/scoring.py aggregates, as `megatron-rl evaluate`).

Checkpoints: a round not finished at a checkpoint (a stop during the round) is saved as "pending" with
its held line, its samples dropped; the resumed run re-runs it from the start under the same weights
and then writes the line. So a round is neither lost nor doubled; the round at update 0 included (a
resumed run starts no new one: it was done, or is pending in the checkpoint).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from megatron_rl.config import Config
from megatron_rl.records import Problem, Rollout
from megatron_rl.evaluation.scoring import ProblemResult, Verdict, problem_language, problem_result, summarize

PREFIX = "eval@"
METRIC_PREFIX = "eval/"


def is_eval_group(group_id: str) -> bool:
    return group_id.startswith(PREFIX) and "#" not in group_id


@dataclass
class EvalRound:
    update: int  # the update whose weights are evaluated; its metrics line waits for the results
    row: dict[str, Any]  # that line
    version: int = -1  # the weights the samples were requested under (-1: not started)
    started: float = 0.0
    verdicts: dict[str, list[Verdict | None]] = field(default_factory=dict)  # group id -> one per sample
    off_version: int = 0

    def group_id(self, index: int) -> str:
        return f"{PREFIX}{self.update}/{index}"


class Evaluation:
    def __init__(self, cfg: Config, problems: list[Problem]):
        run = cfg.run
        self.every, self.k = run.eval_every, run.eval_samples
        self.temperature = cfg.rollout.temperature if run.eval_temperature is None else run.eval_temperature
        self.problems = problems[: run.eval_max_problems] if run.eval_max_problems else list(problems)
        if self.every and not self.problems:
            raise ValueError("run.eval_every > 0 but the evaluation set (data.eval_path) has no problems")
        self.languages = [problem_language(p) for p in self.problems]  # detected once
        self.round: EvalRound | None = None
        self.at_start = bool(self.every) and run.eval_at_start  # cleared by a resume (load_state_dict)

    # ------------------------------------------------------------ when
    def due(self, update: int) -> bool:
        return bool(self.every) and update > 0 and update % self.every == 0

    def hold_initial(self, version: int) -> bool:
        """A fresh run's round on the initial weights (run.eval_at_start), once: True when held now."""
        if not self.at_start:
            return False
        self.at_start = False
        self.hold(0, {"update": 0, "version": version, "time": time.time()})
        return True

    @property
    def active(self) -> bool:
        """A round is held or running: the trainer takes no new batch (one weight version per round)."""
        return self.round is not None

    @property
    def waiting_to_start(self) -> bool:
        return self.round is not None and self.round.version < 0

    def hold(self, update: int, row: dict[str, Any]) -> None:
        """Update `update`'s metrics line waits for the round that evaluates it."""
        if self.round is not None:
            raise RuntimeError(f"an evaluation round (update {self.round.update}) is still running")
        self.round = EvalRound(update, row)

    # ------------------------------------------------------------ samples
    def start(self, version: int) -> list[tuple[str, Problem, int]]:
        """(group id, problem, samples) to issue, all under weight `version`."""
        r = self.round
        assert r is not None and r.version < 0
        r.version, r.started = version, time.time()
        r.verdicts = {r.group_id(i): [None] * self.k for i in range(len(self.problems))}
        return [(r.group_id(i), p, self.k) for i, p in enumerate(self.problems)]

    @property
    def sampling(self) -> dict[str, Any]:
        """Overrides of the rollout's sampling for evaluation samples."""
        return {"temperature": self.temperature}

    def _current(self, group_id: str) -> bool:
        return self.round is not None and group_id in self.round.verdicts

    def problem(self, group_id: str) -> Problem | None:
        """The problem of an evaluation group of the running round (None: not of it, a late sample)."""
        return self.problems[int(group_id.rsplit("/", 1)[1])] if self._current(group_id) else None

    def settle(self, rollout: Rollout, failed: bool) -> None:
        """A graded evaluation sample (failed: no verdict exists); never the budget's, nor the window's."""
        r = self.round
        if r is None or not self._current(rollout.group_id):
            return  # a sample of a round already finished
        slots = r.verdicts[rollout.group_id]
        if slots[rollout.sample_index] is not None:
            return  # a duplicate (a sample re-issued after a generator died)
        c = rollout.reward_components
        slots[rollout.sample_index] = (Verdict(False, False, None, "ungradable", gradable=False) if failed else
                                       Verdict(c.get("correct", 0.0) > 0, c.get("format_ok", 0.0) > 0,
                                               rollout.reward, "ok"))
        r.off_version += any(v != r.version for v in rollout.model_versions)

    @property
    def complete(self) -> bool:
        r = self.round
        return r is not None and r.version >= 0 and all(v is not None for vs in r.verdicts.values() for v in vs)

    def finish(self) -> dict[str, Any]:
        """The held line with the round's results; the round ends."""
        r = self.round
        assert r is not None and self.complete
        self.round = None
        rows = [problem_result(p, list(r.verdicts[r.group_id(i)]), self.languages[i])  # type: ignore[arg-type]
                for i, p in enumerate(self.problems)]
        return r.row | eval_metrics(rows, self.k) | {"eval/version": r.version, "eval/off_version": r.off_version,
                                                     "eval/wall_s": time.time() - r.started,
                                                     "eval/correct_by_problem": [x.correct for x in rows],
                                                     "eval/graded_by_problem": [x.n for x in rows]}

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any] | None:
        """A round not finished: its update and held line (its samples are dropped, re-run on resume)."""
        r = self.round
        return None if r is None else {"update": r.update, "row": r.row}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self.round = None if not state else EvalRound(int(state["update"]), dict(state["row"]))
        self.at_start = False  # a resumed run: its update-0 round was written, or is the pending one


def eval_metrics(rows: list[ProblemResult], k: int) -> dict[str, Any]:
    """`eval/<metric>` overall, `eval/<kind>/<metric>` and `eval/<language>/<metric>`: pass@1, pass@k,
    problems, samples (graded), ungradable, format_rate, mean_reward (evaluation/scoring.summarize)."""
    summary = summarize(rows, sorted({1, k}))
    out = {f"{METRIC_PREFIX}{m}": v for m, v in summary.items() if not isinstance(v, dict)}
    for group in ("by_kind", "by_language"):
        for name, metrics in summary[group].items():
            out |= {f"{METRIC_PREFIX}{name or 'unknown'}/{m}": v for m, v in metrics.items()}
    return out
