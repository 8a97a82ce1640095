"""Rollout budget: n_async in flight, group completion and filtering, batching, staleness, resume."""
import random

import pytest

from megatron_rl.config import AlgoConfig, RolloutConfig
from megatron_rl.control.budget import RolloutBudget, flight_room, token_staleness
from megatron_rl.control.problems import ProblemQueue
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


def test_flight_room_by_enumeration():
    """Against its definition, over every small case: the samples that may start are the largest k with
    (in flight + k) <= n_async + extra and (busy + k) <= n_async, busy = those not waiting on a tool."""
    for n_async in range(1, 7):
        for extra in range(0, 5):
            for in_flight in range(0, n_async + extra + 3):
                for waiting in range(0, in_flight + 2):
                    busy = in_flight - min(waiting, in_flight)
                    want = max([k for k in range(0, 20) if in_flight + k <= n_async + extra and busy + k <= n_async],
                               default=0)
                    assert flight_room(n_async, extra, in_flight, waiting) == want
                    if extra == 0:
                        assert want == max(0, n_async - in_flight)  # waits change nothing without extra


def test_episodes_waiting_on_tools_free_slots_up_to_extra_in_flight():
    b = RolloutBudget(RolloutConfig(group_size=4, n_async=8, n_batch=8, n_mini=2, max_staleness=3), AlgoConfig(),
                      extra_in_flight=8)
    [b.start_group(_problem(i)) for i in range(2)]
    assert b.in_flight == 8 and b.free_group_slots() == 0
    b.env_waiting = 3  # 3 episodes in tools: 5 decoding, a group of 4 does not fit the 3 free slots
    assert b.free_group_slots() == 0
    b.env_waiting = 4
    assert b.free_group_slots() == 1
    b.start_group(_problem(2))
    b.env_waiting = 12  # all in tools: capped by n_async + extra = 16 in all
    assert b.in_flight == 12 and b.free_group_slots() == 1
    plain = RolloutBudget(RolloutConfig(group_size=4, n_async=8, n_batch=8, n_mini=2, max_staleness=3), AlgoConfig())
    [plain.start_group(_problem(i)) for i in range(2)]
    plain.env_waiting = 8
    assert plain.free_group_slots() == 0  # extra_in_flight 0: every episode counts
    b.env_waiting, b.cfg.max_staleness = 12, 0  # the staleness bound still holds: 12 committed > 1 batch
    assert b.free_group_slots() == 0


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
    assert clone.next_version == b.next_version == 1 and clone.batches_behind == b.batches_behind == 1
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


def test_admission_counts_the_batches_committed_ahead():
    # B=4, G=2, max_staleness=1: (1 + 1) batches of 4 may be committed while the generators are current
    b = _budget(group_size=2, n_batch=4, n_mini=1, max_staleness=1, n_async=100)
    assert b.free_group_slots() == 4
    groups = [b.start_group(_problem(i)).group_id for i in range(4)]
    assert b.committed == 8 and b.free_group_slots() == 0
    for g in groups[:2]:
        for i in range(2):
            b.add_graded(_rollout(g, i, float(i)))
    assert b.take_batch(0) is not None and b.committed == 4
    # the batch is with the trainer: one batch behind, so only (1 + 1 - 1) * 4 may be committed
    assert b.batches_behind == 1 and b.free_group_slots() == 0
    b.weights_served(1)
    assert b.batches_behind == 0 and b.free_group_slots() == 2
    assert _budget(group_size=2, n_batch=4, n_mini=1, max_staleness=1, n_async=6).free_group_slots() == 3


def test_admission_starts_a_group_while_the_trainer_waits_for_a_batch():
    b = _budget(group_size=3, n_batch=4, n_mini=1, max_staleness=0, n_async=12)
    assert b.free_group_slots() == 1  # room for 4 samples, a group of 3 fits
    b.start_group(_problem(0))
    assert b.free_group_slots() == 1  # 3 committed < n_batch: the batch could never form otherwise
    b.start_group(_problem(1))
    assert b.free_group_slots() == 0


def _fifo_run(max_staleness: int, n_batch: int, group: int, n_async: int, steps: int, seed: int):
    """Drive the budget like the controller, samples finishing in start order; return every trained
    sample's lag (batch version - the version it started on), the groups started and the drops."""
    rng = random.Random(seed)
    b = _budget(group_size=group, n_batch=n_batch, n_mini=1, max_staleness=max_staleness, n_async=n_async)
    started: list[tuple[str, int]] = []  # (group id, weights served when it started), in start order
    version, training, lags, serial = 0, False, [], 0
    for _ in range(steps):
        for _ in range(b.free_group_slots()):
            serial += 1
            started.append((b.start_group(_problem(serial)).group_id, b.served_version))
        if started and rng.random() < 0.6:  # the oldest started group finishes
            gid, v = started.pop(0)
            for i in range(group):
                b.add_graded(_rollout(gid, i, float(i), version=v))
        if training and rng.random() < 0.3:  # the update is trained and pushed
            version, training = version + 1, False
            b.weights_served(version)
        if not training:
            batch = b.take_batch(version)
            if batch is not None:
                training = True
                lags += [batch.policy_version - min(s.weight_versions) for s in batch.sequences]
    return lags, serial, b.counters.groups_dropped_stale


@pytest.mark.parametrize("max_staleness,n_batch,group,n_async", [(0, 4, 2, 64), (1, 4, 2, 64), (2, 6, 3, 9)])
def test_admitted_samples_are_consumed_within_the_bound(max_staleness, n_batch, group, n_async):
    lags, started, dropped = _fifo_run(max_staleness, n_batch, group, n_async, steps=400, seed=max_staleness)
    assert started > 20 and len(lags) >= 5 * n_batch
    assert max(lags) <= max_staleness and dropped == 0
    assert max_staleness == 0 or max(lags) == max_staleness  # the bound is used, not undershot


def test_token_staleness_counts_each_token_of_a_group():
    b = _budget(n_batch=4, n_mini=1, max_staleness=1)
    fresh = b.start_group(_problem(1)).group_id  # started at version 0, finished at 2: partly fresh
    versions = [[0, 2, 2], [0, 0, 2], [2, 2, 2], [0, 2, 2, 2, 2]]
    for i, vs in enumerate(versions):
        b.add_graded(Rollout(fresh, i, [1], [5] * len(vs), [-0.1] * len(vs), vs, "stop", reward=float(i)))
    rs = [r.rollout for r in b.ready]
    tokens = [2 - v for vs in versions for v in vs]
    assert token_staleness(rs, 2) == pytest.approx(sum(tokens) / len(tokens))  # 8/14, below 1
    old = _complete(b, _problem(2), [0, 1, 0, 1], version=0)  # every token 2 versions old
    batch = b.take_batch(trainer_version=2)
    assert [s.group_id for s in batch.sequences] == [fresh] * 4  # the oldest-token rule would drop both
    assert b.counters.groups_dropped_stale == 1 and [p.problem_id for p in b.requeue] == ["p2"]
    assert old not in {r.group_id for r in b.ready}


def test_length_stats_trained_against_all_graded():
    b = _budget(n_batch=4, n_mini=1, max_staleness=0)
    kept = _complete(b, _problem(1), [0, 1, 0, 1], version=1)
    g = b.start_group(_problem(2)).group_id
    for i in range(4):
        b.add_graded(_rollout(g, i, float(i), version=0, n=7))  # long, and stale at version 1
    b.take_batch(trainer_version=1)
    stats = b.length_stats()
    assert stats["length/completed_mean"] == pytest.approx((4 * 3 + 4 * 7) / 8)
    assert stats["length/trained_mean"] == 3 and kept not in b._problems
    assert stats["length/trained_vs_completed"] == pytest.approx(3 / 5)


def test_reweight_keeps_stale_groups_but_admits_within_the_bound():
    reweight = _budget(n_batch=4, n_mini=1, max_staleness=1, n_async=16, stale_policy="reweight")
    for i in range(2):
        _complete(reweight, _problem(i), [0, 1, 0, 1])
    assert reweight.free_group_slots() == 0  # two batches wait: (1 + 1) * 4 committed
    assert reweight.take_batch(trainer_version=5) is not None and reweight.counters.groups_dropped_stale == 0
    reweight.weights_served(6)
    assert reweight.free_group_slots() == 1


def test_take_batch_takes_the_groups_with_the_oldest_tokens_first():
    b = _budget(n_batch=4, n_mini=1, max_staleness=3)
    newer = _complete(b, _problem(1), [0, 1, 0, 1], version=2)  # completed first
    older = _complete(b, _problem(2), [1, 0, 0, 0], version=1)
    tie = _complete(b, _problem(3), [1, 0, 1, 0], version=2)
    assert [s.group_id for s in b.take_batch(trainer_version=3).sequences] == [older] * 4
    assert [s.group_id for s in b.take_batch(trainer_version=3).sequences] == [newer] * 4  # ties: completion order
    assert [r.group_id for r in b.ready] == [tie] * 4


def test_batch_stats_count_the_staleness_of_every_token():
    from megatron_rl.control.metrics import batch_stats

    b = _budget(n_batch=4, n_mini=1, max_staleness=3)
    g = b.start_group(_problem(1)).group_id
    versions = [[1, 2], [2, 2, 2], [0, 1, 2, 3], [3]]
    for i, vs in enumerate(versions):
        b.add_graded(Rollout(g, i, [1], [5] * len(vs), [-0.1] * len(vs), vs, "stop", reward=float(i)))
    stats = batch_stats(b.take_batch(trainer_version=3))
    lags = [3 - v for vs in versions for v in vs]
    assert stats == {"batch/sequences": 4, "batch/tokens": len(lags), "batch/loss_tokens": len(lags),
                     "batch/staleness_mean": pytest.approx(sum(lags) / len(lags)), "batch/staleness_min": 0,
                     "batch/staleness_max": 3}
