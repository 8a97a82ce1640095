"""Rollout budget: n_async in flight, group completion and filtering, batching, staleness, resume."""
import random

import pytest

from megatron_rl.config import AlgoConfig, RolloutConfig
from megatron_rl.control.budget import RolloutBudget
from megatron_rl.control.problems import ProblemQueue, max_new_tokens_at, parse_length_schedule
from megatron_rl.records import Problem, Rollout


def _problem(i: int) -> Problem:
    return Problem(f"p{i}", f"what is {i}?", {"kind": "math", "answer": str(i)})


def _rollout(group_id: str, idx: int, reward: float, version: int = 0, n: int = 3) -> Rollout:
    return Rollout(group_id, idx, [1, 2], list(range(10, 10 + n)), [-0.5] * n, [version] * n, "stop", reward=reward)


def _budget(**kw) -> RolloutBudget:
    cfg = dict(group_size=4, n_async=12, n_batch=8, n_mini=2, max_staleness=1)
    cfg.update(kw)
    return RolloutBudget(RolloutConfig(**cfg), AlgoConfig())


def test_keeps_n_async_sequences_in_flight():
    b = _budget()
    assert b.free_group_slots() == 3
    gid = [b.start_group(_problem(i)).group_id for i in range(3)][0]
    assert b.in_flight == 12 and b.free_group_slots() == 0
    for i in range(3):
        b.add_graded(_rollout(gid, i, float(i)))
    assert b.in_flight == 9 and b.free_group_slots() == 0  # a group needs G free slots
    b.add_graded(_rollout(gid, 3, 1.0))
    assert b.in_flight == 8 and b.free_group_slots() == 1


def test_group_centred_advantages_and_non_diverse_drop():
    b = _budget()
    g1 = b.start_group(_problem(1)).group_id
    g2 = b.start_group(_problem(2)).group_id
    rewards = [0.0, 1.0, 1.0, 0.1]
    fates = [b.add_graded(_rollout(g1, i, r)) for i, r in enumerate(rewards)]
    assert fates == [None, None, None, "kept"]
    mean = sum(rewards) / 4
    assert [r.advantage for r in b.ready] == pytest.approx([r - mean for r in rewards])
    assert [b.add_graded(_rollout(g2, i, 0.1)) for i in range(4)][-1] == "non_diverse"
    assert b.counters.groups_dropped_non_diverse == 1 and len(b.ready) == 4


def test_duplicates_and_unknown_groups_are_ignored():
    b = _budget()
    g = b.start_group(_problem(1)).group_id
    assert b.add_graded(_rollout(g, 0, 1.0)) is None
    assert b.add_graded(_rollout(g, 0, 0.0)) is None  # re-issued duplicate
    assert b.groups[g].rollouts[0].reward == 1.0
    assert b.add_graded(_rollout("nope#1", 0, 1.0)) is None
    with pytest.raises(ValueError, match="no reward"):
        b.add_graded(Rollout(g, 1, [1], [2], [0.0], [0], "stop"))


def _complete(b: RolloutBudget, problem: Problem, rewards, version=0) -> str:
    g = b.start_group(problem).group_id
    for i, r in enumerate(rewards):
        b.add_graded(_rollout(g, i, r, version))
    return g


def test_take_batch_exact_size_oldest_first_and_split_across_batches():
    b = _budget(n_batch=6, n_mini=3)
    _complete(b, _problem(1), [0, 1, 0, 1])
    assert b.take_batch(0) is None
    _complete(b, _problem(2), [1, 0, 0, 0])
    batch = b.take_batch(0)
    assert len(batch.sequences) == 6 and batch.n_mini == 3 and batch.policy_version == 0
    assert [s.advantage for s in batch.sequences[:4]] == pytest.approx([-0.5, 0.5, -0.5, 0.5])
    assert batch.sequences[0].token_ids == [1, 2, 10, 11, 12] and batch.sequences[0].prompt_len == 2
    assert len(b.ready) == 2  # the rest of group 2 waits for the next batch


def test_stale_groups_are_dropped_and_requeued_once():
    b = _budget(n_batch=4, n_mini=1, max_staleness=1)
    _complete(b, _problem(1), [0, 1, 0, 1], version=0)
    _complete(b, _problem(2), [0, 1, 1, 1], version=2)
    batch = b.take_batch(trainer_version=2)  # group 1 is 2 versions old: dropped
    assert b.counters.groups_dropped_stale == 1
    assert [p.problem_id for p in b.requeue] == ["p1"]
    assert [s.advantage for s in batch.sequences] == pytest.approx([-0.75, 0.25, 0.25, 0.25])


def test_adv_norm_group_divides_by_the_group_std_and_the_batch_carries_group_and_temperature():
    import statistics

    b = RolloutBudget(RolloutConfig(group_size=4, n_async=12, n_batch=4, n_mini=1), AlgoConfig(adv_norm="group"))
    gid = b.start_group(_problem(1)).group_id
    rewards = [0.0, 1.0, 1.0, 0.1]
    for i, r in enumerate(rewards):
        ro = _rollout(gid, i, r)
        ro.temperature = 0.7
        b.add_graded(ro)
    mean, std = statistics.mean(rewards), statistics.stdev(rewards)  # unbiased group std
    batch = b.take_batch(trainer_version=0)
    assert [s.advantage for s in batch.sequences] == pytest.approx([(r - mean) / std for r in rewards], rel=1e-5)
    assert {s.group_id for s in batch.sequences} == {gid} and {s.temperature for s in batch.sequences} == {0.7}


def test_reweight_policy_keeps_stale_groups():
    b = _budget(n_batch=4, n_mini=1, max_staleness=0, stale_policy="reweight")
    _complete(b, _problem(1), [0, 1, 0, 1], version=0)
    assert b.take_batch(trainer_version=5) is not None and b.counters.groups_dropped_stale == 0


def test_state_round_trip_resumes_exactly():
    rng = random.Random(0)
    b = _budget()
    groups = [b.start_group(_problem(i)).group_id for i in range(3)]
    for g in groups[:2]:
        for i in range(4):
            b.add_graded(_rollout(g, i, rng.random()))
    b.add_graded(_rollout(groups[2], 1, 0.5))
    clone = _budget()
    clone.load_state_dict(b.state_dict())
    assert clone.outstanding_samples() == \
           [(groups[2], i) for i in (0, 2, 3)]
    assert clone.take_batch(0).sequences == b.take_batch(0).sequences
    assert clone.start_group(_problem(9)).group_id == b.start_group(_problem(9)).group_id


def test_problem_queue_epochs_requeue_curriculum_and_resume():
    problems = [_problem(i) for i in range(5)]
    q = ProblemQueue(problems, seed=3, drop_solved_above=0.9)
    first = [q.next().problem_id for _ in range(5)]
    assert sorted(first) == [p.problem_id for p in problems]  # one epoch = each problem once
    q.record(first[0], 1.0)
    q.requeue(problems[2])
    assert q.next().problem_id == "p2"
    clone = ProblemQueue(problems, seed=3, drop_solved_above=0.9)
    clone.load_state_dict(q.state_dict())
    second = [q.next().problem_id for _ in range(4)]
    assert [clone.next().problem_id for _ in range(4)] == second
    assert first[0] not in second and sorted(second) == sorted(set(first) - {first[0]})


def test_length_schedule():
    stages = parse_length_schedule(["10:256", "30:512"], default=128)
    assert [max_new_tokens_at(stages, u) for u in (0, 9, 10, 29, 30, 99)] == [128, 128, 256, 256, 512, 512]
    with pytest.raises(ValueError, match="UPDATE:TOKENS"):
        parse_length_schedule(["abc"], 1)


def test_no_new_groups_while_enough_batches_wait_to_go_stale():
    b = _budget(n_batch=4, n_mini=1, max_staleness=1, n_async=8)
    for i in range(2):
        _complete(b, _problem(i), [0, 1, 0, 1])
    assert len(b.ready) == 8 and b.in_flight == 0 and b.free_group_slots() == 0
    b.take_batch(0)
    assert b.free_group_slots() == 2
    reweight = _budget(n_batch=4, n_mini=1, max_staleness=1, n_async=8, stale_policy="reweight")
    for i in range(2):
        _complete(reweight, _problem(i), [0, 1, 0, 1])
    assert reweight.free_group_slots() == 2
