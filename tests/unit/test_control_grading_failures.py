"""A sample whose grading failed is never trained on: the budget drops its whole group, the controller
re-grades it a bounded number of times first and counts every failure in the metrics line.

The controller is driven in-process through its own issue -> collect -> grade path with a real
verifier pool (real reward.score, a real sandbox behind a bwrap that refuses like a host without user
namespaces, or grading functions that hang / raise); only MPI and the tokenizer are stand-ins."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

import pytest

from megatron_rl.config import AlgoConfig, RolloutConfig, config_from_dict
from megatron_rl.control.budget import RolloutBudget
from megatron_rl.control.controller import Controller, RunFailed
from megatron_rl.control.grading import GradingLedger
from megatron_rl.plan.layout import RankLayout
from megatron_rl.control.metrics import EVENTS_FILE, METRICS_FILE, UpdateWindow, read_jsonl
from megatron_rl.control.protocol import GradeItem, RolloutsReport, Tag
from megatron_rl.records import Problem, Rollout
from megatron_rl.reward import VerifierPool, score
from megatron_rl.reward.types import RewardBreakdown
from support.control import CharTokenizer, PickleComm, grade_until

os.environ.setdefault("OMP_NUM_THREADS", "1")

GEN_RANK = 2  # rank 0 controller, rank 1 trainer, rank 2 generator, rank 3 verifier (when used)
MATH = {"kind": "math", "answer": "4", "problem": "What is 2 + 2?"}
CODE = {"kind": "code", "language": "python", "problem": "Print the sum of two integers.",
        "tests": [{"input": "1 2\n", "output": "3\n"}, {"input": "10 -4\n", "output": "6\n"}]}
# completions after the template's "<think>\n"
MATH_RIGHT = "Two and two make four.</think>\nThe answer is $\\boxed{4}$."
MATH_WRONG = "Two and two make five.</think>\nThe answer is $\\boxed{5}$."
CODE_RIGHT = "Read and add.</think>\n```python\na, b = map(int, input().split())\nprint(a + b)\n```"
REFUSED = "bwrap: No permissions to creating new namespace, likely because the kernel does not allow " \
          "non-privileged user namespaces."


def scripted(task, response, config, num_tokens, **window):
    """Grading with injected faults keyed by the response (module level: spawned workers import it)."""
    if "HANG" in response:
        time.sleep(300)
    if "FLAKY:" in response:  # raises the first time only: a marker file remembers the attempt
        marker = response.split("FLAKY:")[1].split()[0]
        if not os.path.exists(marker):
            open(marker, "w").close()
            raise RuntimeError("verifier bug, once")
    return score(task, response, config, num_tokens, **window)


def _controller(tmp_path, problems, verifiers=0, regrade_attempts=1, n_async=4, item_timeout_s=60.0
                ) -> tuple[Controller, PickleComm]:
    cfg = config_from_dict({
        "rollout": {"group_size": 2, "n_async": n_async, "n_batch": 2, "n_mini": 1, "max_new_tokens": 64},
        "reward": {"l_max": 64, "l_cache": 16, "language_check": False, "verifier_workers": 1,
                   "verifier_ranks": verifiers, "verifier_item_timeout_s": item_timeout_s,
                   "regrade_attempts": regrade_attempts},
        "data": {"source": "jsonl", "path": "unused.jsonl", "system_prompt": "short"},
    })
    comm = PickleComm()
    return Controller(comm, cfg, RankLayout(1, 1, verifiers), tmp_path, problems, CharTokenizer()), comm


def _generate(ctrl: Controller, comm: PickleComm, text_for) -> list[Rollout]:
    """Issue groups and answer them as a generator would: text_for(problem, sample_index) -> completion."""
    ctrl.flow.fill()
    rollouts = []
    for _, request in comm.take(Tag.GENERATE):
        for g in request.groups:
            problem = ctrl.flow.budget.groups[g.group_id].problem
            rollouts += [Rollout(g.group_id, i, g.prompt_ids, [7] * 10, [-0.5] * 10, [0] * 10, "stop",
                                 text=text_for(problem, i), stage=g.stage) for i in g.sample_indices]
    ctrl.flow.on_rollouts(GEN_RANK, RolloutsReport(rollouts, 0.0, 0.0))
    return rollouts


def _metrics_row(ctrl: Controller, tmp_path) -> dict:
    ctrl.log.train = {"loss": 0.0}
    ctrl._write_metrics()
    return read_jsonl(tmp_path / METRICS_FILE)[-1]


@pytest.fixture
def refusing_bwrap(monkeypatch):
    """PATH holds only a bwrap that exits like bwrap on a host that refuses user namespaces."""
    path = tempfile.mkdtemp(prefix="mrl-fakebwrap-")
    os.chmod(path, 0o755)  # reachable by the sandbox's unprivileged uid
    with open(os.path.join(path, "bwrap"), "w") as f:
        f.write(f"#!/bin/sh\necho \"{REFUSED}\" >&2\nexit 1\n")
    os.chmod(os.path.join(path, "bwrap"), 0o755)
    monkeypatch.setenv("PATH", path)  # inherited by the verifier workers the controller spawns
    yield
    shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------- the budget alone

def _rollout(group_id: str, idx: int, reward: float | None = None) -> Rollout:
    return Rollout(group_id, idx, [1, 2], [10, 11, 12], [-0.5] * 3, [0] * 3, "stop", reward=reward)


def test_budget_drops_a_group_with_a_failed_sample_whole_once_all_are_back():
    b = RolloutBudget(RolloutConfig(group_size=3, n_async=6, n_batch=3, n_mini=1), AlgoConfig())
    problem = Problem("p", "q", MATH)
    g = b.start_group(problem).group_id
    b.start_group(problem)
    assert b.add_graded(_rollout(g, 0, 1.0)) is None
    assert b.add_failed(g, 1) is None and b.in_flight == 4  # a failed sample is back, not in flight
    assert [i for group_id, i in b.outstanding_samples() if group_id == g] == [2]
    assert b.add_failed(g, 1) is None and b.add_graded(_rollout(g, 1, 0.0)) is None  # duplicates ignored
    assert b.groups[g].rollouts.keys() == {0}
    restored = RolloutBudget(b.cfg, b.algo)  # a checkpoint keeps which samples failed
    restored.load_state_dict(json.loads(json.dumps(b.state_dict())))
    assert restored.groups[g].failed == {1} and restored.in_flight == 4
    assert b.add_graded(_rollout(g, 2, 0.0)) == "grading_failed"  # complete: dropped whole
    assert g not in b.groups and not b.ready and b.take_batch(0) is None
    assert (b.counters.groups_dropped_grading, b.counters.groups_completed) == (1, 1)
    old = b.state_dict()  # a checkpoint written before groups recorded failures still loads
    for group in old["groups"]:
        del group["failed"]
    del old["counters"]["groups_dropped_grading"]
    restored.load_state_dict(old)
    assert restored.in_flight == 3 and restored.counters.groups_dropped_grading == 0


def test_ledger_regrades_then_gives_up_and_fails_the_run_when_nothing_grades():
    window = UpdateWindow()
    ledger = GradingLedger(regrade_attempts=2, give_up_after=2)
    rollouts = [_rollout("g#1", i) for i in range(3)]
    items = [ledger.add(r, GradeItem(("g#1", i), MATH, "x", 3)) for i, r in enumerate(rollouts)]
    timeout = RewardBreakdown(status="timeout", error="grading exceeded\nthe limit", total=0.0)
    verdict = RewardBreakdown(status="ok", total=0.7, format_ok=True, correct=True, length_penalty=-0.3,
                              language_ok=False)
    for attempt in range(2):  # sample 0: failed and sent again twice
        assert ledger.settle([(["g#1", 0], timeout)], window) == ([], [items[0]])
    assert ledger.settle([(("g#1", 1), verdict)], window) == ([(rollouts[1], False)], [])
    assert (rollouts[1].reward, rollouts[1].reward_components["length_penalty"]) == (0.7, -0.3)
    assert ledger.settle([(("g#1", 0), timeout)], window) == ([(rollouts[0], True)], [])  # given up
    assert rollouts[0].reward is None and ledger.settle([(("g#1", 0), verdict)], window) == ([], [])
    assert (dict(window.grading_failed), window.regraded) == ({"timeout": 3}, 2)
    ledger.regrade_attempts = 0
    with pytest.raises(RunFailed, match="2 samples in a row .*timeout: grading exceeded the limit"):
        ledger.settle([(("g#1", 2), timeout)], window)  # the second give-up without a verdict between


# ---------------------------------------------------------------- through the controller

@pytest.mark.parametrize("regrade_attempts", [0, 2])
def test_unavailable_sandbox_drops_the_group_and_only_graded_samples_are_trained(tmp_path, refusing_bwrap,
                                                                               regrade_attempts):
    problems = [Problem("code", CODE["problem"], CODE), Problem("math", MATH["problem"], MATH)]
    ctrl, comm = _controller(tmp_path, problems, regrade_attempts=regrade_attempts)
    try:
        text = {("code", 0): CODE_RIGHT, ("code", 1): CODE_RIGHT, ("math", 0): MATH_RIGHT, ("math", 1): MATH_WRONG}
        rollouts = _generate(ctrl, comm, lambda p, i: text[(p.problem_id, i)])
        assert sorted(r.group_id.split("#")[0] for r in rollouts) == ["code", "code", "math", "math"]
        grade_until(ctrl, comm, None, lambda: not ctrl.flow.ledger.pending)

        code_group = next(r.group_id for r in rollouts if r.group_id.startswith("code"))
        math_group = next(r.group_id for r in rollouts if r.group_id.startswith("math"))
        assert all(r.reward is None for r in rollouts if r.group_id == code_group)  # no fake 0
        batch = ctrl.flow.budget.take_batch(ctrl.version)
        assert batch is not None and len(batch.sequences) == 2
        math_prompt = next(r.prompt_ids for r in rollouts if r.group_id == math_group)
        assert all(s.token_ids[:s.prompt_len] == math_prompt for s in batch.sequences)
        # the math group's own rewards: 0.1 + 0.9 (right) and 0.1 (wrong), centred on their mean
        assert sorted(s.advantage for s in batch.sequences) == pytest.approx([-0.45, 0.45])
        assert not ctrl.flow.budget.ready and not ctrl.flow.budget.groups and ctrl.flow.budget.in_flight == 0

        row = _metrics_row(ctrl, tmp_path)
        attempts = 2 * (1 + regrade_attempts)
        assert (row["grading/failed"], row["grading/failed/sandbox_unavailable"], row["grading/regraded"]) == \
               (attempts, attempts, 2 * regrade_attempts), row
        assert (row["groups/dropped_grading"], row["groups/completed"], row["rollouts"]) == (1, 2, 2)
        assert row["reward/mean"] == pytest.approx((1.0 + 0.1) / 2)  # the failed samples are no rewards
        fates = {e["problem_id"]: (e["fate"], e["pass_rate"]) for e in read_jsonl(tmp_path / EVENTS_FILE)}
        assert fates == {"code": ("grading_failed", None), "math": ("kept", 0.5)}
    finally:
        ctrl.shutdown()


def test_run_fails_when_no_sample_can_be_graded(tmp_path, refusing_bwrap):
    problems = [Problem(f"code{i}", CODE["problem"], CODE) for i in range(2)]
    ctrl, comm = _controller(tmp_path, problems, regrade_attempts=0, n_async=4)  # gives up after 4 in a row
    try:
        _generate(ctrl, comm, lambda p, i: CODE_RIGHT)
        with pytest.raises(RunFailed, match="4 samples in a row .*sandbox_unavailable: .*No permissions"):
            grade_until(ctrl, comm, None, lambda: not ctrl.flow.ledger.pending)
        assert not ctrl.flow.budget.ready
    finally:
        ctrl.shutdown()


def test_verifier_rank_timeout_and_grader_error_are_regraded_then_dropped(tmp_path):
    problems = [Problem(f"m{i}", MATH["problem"], MATH) for i in range(2)]
    ctrl, comm = _controller(tmp_path, problems, verifiers=1, regrade_attempts=1, item_timeout_s=4.0)
    marker = os.path.join(tmp_path, "flaky")
    pool = VerifierPool(ctrl.cfg.reward, workers=2, fn=scripted).start()
    try:
        first = []

        def text_for(problem, i):  # first group: one flaky grading; second group: one that always hangs
            first.append(problem.problem_id) if not first else None
            if i == 1:
                return MATH_WRONG
            return MATH_RIGHT.replace("four.", f"four. FLAKY:{marker} ") if problem.problem_id == first[0] \
                else MATH_RIGHT.replace("four.", "four. HANG")

        rollouts = _generate(ctrl, comm, text_for)
        grade_until(ctrl, comm, pool, lambda: not ctrl.flow.ledger.pending)
        flaky_group = next(r.group_id for r in rollouts if "FLAKY" in r.text)
        hang_group = next(r.group_id for r in rollouts if "HANG" in r.text)
        assert [r.reward is None for r in rollouts if r.group_id == hang_group] == [True, False]  # no fake 0
        assert [r.reward for r in sorted((r for r in rollouts if r.group_id == flaky_group),
                                         key=lambda r: r.sample_index)] == pytest.approx([1.0, 0.1])
        batch = ctrl.flow.budget.take_batch(ctrl.version)
        assert sorted(s.advantage for s in batch.sequences) == pytest.approx([-0.45, 0.45])
        flaky_prompt = next(r.prompt_ids for r in rollouts if r.group_id == flaky_group)
        assert all(s.token_ids[:s.prompt_len] == flaky_prompt for s in batch.sequences)
        row = _metrics_row(ctrl, tmp_path)
        assert (row["grading/failed"], row["grading/failed/error"], row["grading/failed/timeout"]) == (3, 1, 2)
        assert (row["grading/regraded"], row["groups/dropped_grading"]) == (2, 1)
    finally:
        ctrl.shutdown()
        pool.close()
