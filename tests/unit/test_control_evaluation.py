"""Evaluation during training, driven in-process through the controller's own issue -> collect -> grade
path (MPI and the verifier rank are stand-ins: grades are answered from a script): the evaluated
update's line waits for the round, eval samples never reach the rollout budget nor the window's
rewards, every training sample in flight meanwhile is graded into the budget, the line carries
pass@1 / pass@k per kind and language equal to an enumeration over subsets, ungradable samples are
counted apart, and a round unfinished at a checkpoint is re-run after resume and written once; a fresh
run's round on the initial weights is the line of update 0, never repeated by a resume."""
from __future__ import annotations

import dataclasses
import itertools
import json

import pytest

from megatron_rl.config import config_from_dict
from megatron_rl.control.controller import Controller
from megatron_rl.control.evaluation import is_eval_group
from megatron_rl.plan.layout import RankLayout
from megatron_rl.control.metrics import METRICS_FILE, Progress, read_jsonl
from megatron_rl.control.protocol import Graded, RolloutsReport, Tag
from megatron_rl.records import Problem, Rollout
from megatron_rl.reward.types import RewardBreakdown
from support.control import CharTokenizer, PickleComm

K, N_ASYNC, G = 3, 8, 2
TRAIN = [Problem(f"t{i}", f"What is {i} + 1?", {"kind": "math", "answer": str(i + 1)}) for i in range(10)]
EVAL = [Problem("e-math-en", "What is 2 + 2?", {"kind": "math", "answer": "4"}, "en"),
        Problem("e-math-fr", "Combien font 2 + 3 ?", {"kind": "math", "answer": "5"}, "fr"),
        Problem("e-code-en", "Print 1.", {"kind": "code", "language": "python",
                                          "tests": [{"input": "", "output": "1\n"}]}, "en"),
        Problem("e-unused", "Not evaluated (eval_max_problems).", {"kind": "math", "answer": "0"}, "en")]
# the verdict each eval sample gets: problem index -> per sample (C correct, W wrong, X grading crashed)
SCRIPT = {0: "CWW", 1: "CCX", 2: "WXX"}
BREAKDOWN = {"C": RewardBreakdown(status="ok", total=1.0, correct=True, format_ok=True),
             "W": RewardBreakdown(status="ok", total=0.0, correct=False, format_ok=True),
             "X": RewardBreakdown(status="crash", total=0.0, correct=False, format_ok=False, error="worker died")}


def _controller(tmp_path, **run) -> tuple[Controller, PickleComm]:
    cfg = config_from_dict({
        "rollout": {"group_size": G, "n_async": N_ASYNC, "n_batch": N_ASYNC, "n_mini": 1, "max_new_tokens": 16},
        "reward": {"verifier_ranks": 1, "regrade_attempts": 1},
        "data": {"source": "jsonl", "path": "unused.jsonl", "eval_path": "unused-eval.jsonl", "system_prompt": "short"},
        "run": {"output_dir": str(tmp_path), "updates": 4, "eval_every": 1, "eval_samples": K,
                "eval_temperature": 0.6, "eval_max_problems": 3, "checkpoint_every": 0} | run,
    })
    comm = PickleComm()
    return Controller(comm, cfg, RankLayout(1, 2, 1), tmp_path, TRAIN, CharTokenizer(), EVAL), comm


def _generate(ctrl: Controller, comm: PickleComm, version: int) -> list[Rollout]:
    """Answer every GenerateRequest sent as its generator would, one report per generator."""
    by_rank: dict[int, list[Rollout]] = {}
    for rank, request in comm.take(Tag.GENERATE):
        for g in request.groups:
            for i in g.sample_indices:
                if is_eval_group(g.group_id):
                    text = SCRIPT[int(g.group_id.rsplit("/", 1)[1])][i]
                else:
                    text = "CW"[i % 2]  # a diverse group
                by_rank.setdefault(rank, []).append(Rollout(g.group_id, i, g.prompt_ids, [7, 8], [-0.5, -0.5],
                                                            [version, version], "stop", text=text, stage=g.stage))
    for rank, rollouts in by_rank.items():
        ctrl._dispatch(rank, RolloutsReport(rollouts, 0.0, 0.0))
    return [r for rs in by_rank.values() for r in rs]


def _grade_all(ctrl: Controller, comm: PickleComm) -> None:
    """The verifier rank: answer every GradeRequest from the script (re-sent items included)."""
    while True:
        requests = comm.take(Tag.GRADE)
        if not requests:
            return
        for rank, request in requests:
            verdict = {it.key: BREAKDOWN[it.response[-1]] for it in request.items}
            ctrl._dispatch(rank, Graded([(key, dataclasses.replace(b, length_penalty=0.0, language_ok=True))
                                         for key, b in verdict.items()]))


def _generate_requests(comm: PickleComm):
    return [m for _, tag, m in comm.sent if tag == Tag.GENERATE]


def _sample_keys(request) -> list[tuple[str, int]]:
    """(group id, sample index) of every sample a GenerateRequest asks for."""
    return [key for g in request.groups for key in g.keys]


def _finish_update(ctrl: Controller, update: int) -> None:
    ctrl.version = ctrl.updates_done = update
    ctrl.log.train = {"version": update, "loss": 0.25}
    ctrl._after_update(Progress(4, update - 1))


def _subsets_pass_at(outcomes: list[bool], k: int) -> float:
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(s) for s in subsets) / len(subsets)


def _reference(indices: list[int]) -> dict[str, float]:
    graded = [[v == "C" for v in SCRIPT[i] if v != "X"] for i in indices]
    enough = [o for o in graded if len(o) >= K]
    ref = {"pass@1": sum(_subsets_pass_at(o, 1) for o in graded if o) / sum(1 for o in graded if o),
           "samples": sum(map(len, graded)), "ungradable": sum(SCRIPT[i].count("X") for i in indices)}
    if enough:
        ref[f"pass@{K}"] = sum(_subsets_pass_at(o, K) for o in enough) / len(enough)
    return ref


def test_eval_samples_never_reach_the_budget_and_training_in_flight_is_all_graded(tmp_path):
    ctrl, comm = _controller(tmp_path)
    ctrl.flow.fill()  # training samples in flight before the update
    train_keys = {k for m in _generate_requests(comm) for k in _sample_keys(m)}
    assert len(train_keys) == N_ASYNC

    _finish_update(ctrl, 1)
    assert not read_jsonl(tmp_path / METRICS_FILE)  # update 1's line waits for its round
    assert ctrl.flow.evaluation.active
    issued = [(g.sampling_overrides(), k) for m in _generate_requests(comm) for g in m.groups
              if is_eval_group(g.group_id) for k in g.keys]
    assert sorted(k for _, k in issued) == [(f"eval@1/{i}", j) for i in range(3) for j in range(K)]  # problems x k
    assert all(sp["temperature"] == 0.6 for sp, _ in issued)

    rollouts = _generate(ctrl, comm, version=1)  # training and eval answered together, as a generator does
    assert len(rollouts) == N_ASYNC + 3 * K
    _grade_all(ctrl, comm)

    budget = ctrl.flow.budget
    assert not any(is_eval_group(g) for g in budget.groups) and not any(is_eval_group(r.group_id) for r in budget.ready)
    assert sorted(r.group_id for r in budget.ready) == sorted(g for g, _ in train_keys)  # every one in flight
    assert len(budget.ready) == N_ASYNC and budget.counters.groups_completed == N_ASYNC // G  # all trained
    assert len(ctrl.log.window.graded) == N_ASYNC  # eval rewards are not the training reward
    assert not any(is_eval_group(r.group_id) for r in ctrl.log.window.graded)
    assert ctrl.flow.evaluation.complete

    ctrl._finish_eval(Progress(4, 1))
    (row,) = read_jsonl(tmp_path / METRICS_FILE)
    assert row["update"] == 1 and row["train/loss"] == 0.25 and row["rollouts"] == 0  # the held line
    assert not ctrl.flow.evaluation.active and row["eval/version"] == 1 and row["eval/off_version"] == 0
    groups = {"": [0, 1, 2], "math/": [0, 1], "code/": [2], "en/": [0, 2], "fr/": [1]}
    for prefix, indices in groups.items():
        ref = _reference(indices)
        for key, value in ref.items():
            assert row[f"eval/{prefix}{key}"] == pytest.approx(value, abs=1e-12), (prefix, key)
        assert row[f"eval/{prefix}problems"] == len(indices)
    assert row["eval/samples"] + row["eval/ungradable"] == 3 * K
    assert "eval/code/pass@3" not in row  # its one problem has a single gradable sample: no pass@3
    from megatron_rl.experiments.plot import PANELS, _keys, plot_run

    (eval_panel,) = [keys for title, keys in PANELS if title.startswith("eval")]
    assert [k for pattern in eval_panel for k in _keys(pattern, [row])] == ["eval/pass@1", "eval/pass@3"]
    assert plot_run(tmp_path).stat().st_size > 0


def test_a_round_unfinished_at_a_checkpoint_is_re_run_after_resume_and_written_once(tmp_path):
    ctrl, comm = _controller(tmp_path)
    _finish_update(ctrl, 1)
    first = sorted(k for _, m in comm.take(Tag.GENERATE) for k in _sample_keys(m))
    state = json.loads(json.dumps(ctrl.state_dict()))  # a stop during the round: the checkpoint holds it
    ctrl.shutdown()

    resumed, comm2 = _controller(tmp_path)
    resumed.flow.load_state_dict(state)
    resumed.version = resumed.updates_done = state["updates_done"]
    assert resumed.flow.evaluation.waiting_to_start
    resumed.sync.push_needed = True  # generators serve disk weights until the resume push
    resumed._after_update(Progress(4, 1))
    assert not comm2.take(Tag.GENERATE)
    resumed.sync.push_needed = False  # the push finished: the round starts again, under the evaluated weights
    resumed._after_update(Progress(4, 1))
    assert sorted(k for m in _generate_requests(comm2) for k in _sample_keys(m)) == first
    _generate(resumed, comm2, version=1)
    _grade_all(resumed, comm2)
    resumed._finish_eval(Progress(4, 1))
    rows = read_jsonl(tmp_path / METRICS_FILE)
    assert [r["update"] for r in rows] == [1] and rows[0]["train/loss"] == 0.25
    assert rows[0]["eval/pass@1"] == pytest.approx(_reference([0, 1, 2])["pass@1"])
    resumed.shutdown()


def _eval_round(ctrl: Controller, comm: PickleComm, update: int) -> None:
    """Generate and grade the running round, then write its line."""
    _generate(ctrl, comm, version=update)
    _grade_all(ctrl, comm)
    ctrl._finish_eval(Progress(4, update))


def test_a_fresh_run_evaluates_the_initial_weights_as_update_0_before_any_training(tmp_path):
    ctrl, comm = _controller(tmp_path, checkpoint_every=1)
    saved = []
    ctrl.checkpoint = lambda: saved.append(ctrl.updates_done)  # the trainers are stand-ins here
    ctrl.flow.fill()
    ctrl._evaluate_initial_weights()
    assert ctrl.flow.evaluation.active  # the loop sends no batch while the round runs
    eval_keys = sorted(k for m in _generate_requests(comm) for g in m.groups if is_eval_group(g.group_id)
                       for k in g.keys)
    assert eval_keys == [(f"eval@0/{i}", j) for i in range(3) for j in range(K)]
    _eval_round(ctrl, comm, 0)
    (row,) = read_jsonl(tmp_path / METRICS_FILE)
    assert (row["update"], row["version"], row["eval/version"]) == (0, 0, 0) and "train/loss" not in row
    assert row["eval/pass@1"] == pytest.approx(_reference([0, 1, 2])["pass@1"])
    assert row["eval/correct_by_problem"] == [s.count("C") for s in SCRIPT.values()]
    assert row["eval/graded_by_problem"] == [K - s.count("X") for s in SCRIPT.values()]
    assert not saved  # no checkpoint of the initial weights
    ctrl._evaluate_initial_weights()
    assert not ctrl.flow.evaluation.active  # once only
    _finish_update(ctrl, 1)
    _eval_round(ctrl, comm, 1)
    assert [r["update"] for r in read_jsonl(tmp_path / METRICS_FILE)] == [0, 1] and saved == [1]
    ctrl.shutdown()


def test_no_round_at_update_0_when_switched_off(tmp_path):
    ctrl, comm = _controller(tmp_path, eval_at_start=False)
    ctrl._evaluate_initial_weights()
    assert not ctrl.flow.evaluation.active and not comm.take(Tag.GENERATE)
    ctrl.shutdown()


@pytest.mark.parametrize("stop", ["during_the_round", "after_its_line"])
def test_a_resumed_run_never_evaluates_update_0_twice(tmp_path, stop):
    ctrl, comm = _controller(tmp_path)
    ctrl._evaluate_initial_weights()
    if stop == "after_its_line":
        _eval_round(ctrl, comm, 0)
    state = json.loads(json.dumps(ctrl.state_dict()))  # the checkpoint of the stop, at update 0
    ctrl.shutdown()

    resumed, comm2 = _controller(tmp_path)
    resumed.log.cut_back(state["log"])
    resumed.flow.load_state_dict(state)
    resumed.sync.push_needed = True  # generators serve disk weights until the resume push
    resumed._evaluate_initial_weights()  # run() does this first: nothing new on a resume
    assert not comm2.take(Tag.GENERATE)
    resumed.sync.push_needed = False
    resumed._after_update(Progress(4, 0))  # the push is done: a pending round starts again
    if stop == "during_the_round":
        _eval_round(resumed, comm2, 0)
    else:
        assert not resumed.flow.evaluation.active
    assert [r["update"] for r in read_jsonl(tmp_path / METRICS_FILE)] == [0]
    resumed.shutdown()


@pytest.mark.parametrize("overrides,key", [
    (["run.eval_every=2"], "data.eval_path"),
    (["run.eval_every=3", "run.log_every=2", "data.eval_path=e.jsonl"], "run.eval_every"),
    (["run.eval_samples=0"], "run.eval_samples"),
    (["run.eval_temperature=-1"], "run.eval_temperature"),
    (["run.eval_max_problems=0"], "run.eval_max_problems"),
])
def test_bad_evaluation_settings_name_their_key(overrides, key):
    from megatron_rl.config import ConfigError

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config_from_dict({"data": {"source": "jsonl", "path": "p.jsonl"}}, overrides)


def test_a_dead_generators_eval_samples_go_to_a_live_one_with_the_eval_sampling(tmp_path):
    ctrl, comm = _controller(tmp_path)
    ctrl.flow.fill()
    _finish_update(ctrl, 1)
    sent = comm.take(Tag.GENERATE)
    dead = next(rank for rank, m in sent if any(is_eval_group(g.group_id) for g in m.groups))
    lost = sorted(k for rank, m in sent if rank == dead for k in _sample_keys(m))
    assert ctrl.flow.on_generator_lost(dead)
    again = comm.take(Tag.GENERATE)
    assert {rank for rank, _ in again} == {r for r in ctrl.layout.generator_ranks if r != dead}
    assert sorted(k for _, m in again for k in _sample_keys(m)) == lost
    for _, m in again:
        for g in m.groups:  # each group carries its own sampling: eval and training ones never mix
            assert (g.sampling_overrides().get("temperature") == 0.6) == is_eval_group(g.group_id)
    ctrl.shutdown()


def test_no_group_starts_once_the_last_batch_is_taken(tmp_path):
    """The run's last batch with the trainers: groups started then would never be trained, and would
    hold the generators from the final round; before it (and before any batch) the budget fills."""
    ctrl, comm = _controller(tmp_path, updates=2)
    assert ctrl.wants_groups()
    ctrl.flow.fill()
    rollouts = _generate(ctrl, comm, version=0)
    _grade_all(ctrl, comm)
    assert len(rollouts) == N_ASYNC and len(ctrl.flow.budget.ready) == N_ASYNC
    ctrl._train()  # update 1's batch
    assert ctrl.training and ctrl.wants_groups()
    ctrl.flow.fill()  # while it trains
    _generate(ctrl, comm, version=0)
    _grade_all(ctrl, comm)
    ctrl.training, ctrl.updates_done = False, 1
    ctrl._train()  # update 2's, the last
    assert ctrl.training and not ctrl.wants_groups()
    ctrl.training, ctrl.updates_done = False, 2
    assert not ctrl.wants_groups()
    ctrl.updates_done, ctrl.stop_requested = 0, True
    assert not ctrl.wants_groups()
