"""The async-pipeline simulator against closed forms, queueing identities and its own rules.

References are computed here independently of the event engine: the processor-sharing finish
times of a round, the synchronous cycle time, the generator-bound and trainer-bound throughputs,
Little's law, and the analytic means of the length distributions.
"""
from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from megatron_rl.plan.simulate import DecodeModel, LengthDist, SimParams, compare, parse_lengths, simulate

EXACT = dict(rel=1e-9, abs=1e-12)


def test_constant_lengths_instant_trainer_is_generator_bound():
    dec = DecodeModel(peak_tok_s=1000.0, c_half=8.0)
    p = SimParams(generators=4, decode=dec, n_async=128, n_batch=64, n_mini=4, group=16,
                  lengths=LengthDist("constant", mean=100), max_staleness=None, updates=50, warmup_updates=6)
    r = simulate(p, "async")
    c = 128 / 4  # every generator keeps 32 sequences: groups refill the moment they finish
    assert r.generator_util == pytest.approx(1.0, **EXACT)
    assert r.tokens_per_s == pytest.approx(4 * dec.tok_s(c), **EXACT)
    assert r.generated_tokens_per_s == pytest.approx(4 * dec.tok_s(c), **EXACT)
    assert r.sequences_per_s == pytest.approx(4 * dec.tok_s(c) / 100, **EXACT)
    assert r.trainer_util == 0.0 and r.dropped_frac == 0.0
    assert r.mean_in_flight == pytest.approx(128, **EXACT)


def test_sync_deterministic_cycle_matches_closed_form():
    dec = DecodeModel(peak_tok_s=800.0, c_half=20.0)
    p = SimParams(generators=2, decode=dec, prefill_s=0.01, train_a_s=3.0, train_b_s=1e-3, train_step_s=0.1,
                  push_s=0.5, n_async=64, n_batch=64, n_mini=4, group=16, prompt_len=10,
                  lengths=LengthDist("constant", mean=50), updates=12, warmup_updates=2)
    r = simulate(p, "sync")
    c = 32  # two groups per generator
    t_gen = c * 0.01 + 50 * c / dec.tok_s(c)  # prefill stall, then every sequence decodes 50 tokens
    t_train = 3.0 + 4 * 0.1 + 1e-3 * 64 * (50 + 10)
    cycle = t_gen + t_train + 0.5
    assert r.window_s == pytest.approx(10 * cycle, **EXACT)
    assert r.generator_util == pytest.approx(t_gen / cycle, **EXACT)
    assert r.trainer_util == pytest.approx(t_train / cycle, **EXACT)
    assert r.push_frac == pytest.approx(0.5 / cycle, **EXACT)
    assert r.sequences_per_s == pytest.approx(64 / cycle, **EXACT)
    assert r.staleness_max == 0 and r.versions_per_seq_max == 1


def test_sync_without_push_and_prefill_utilisation_is_tgen_over_tgen_plus_ttrain():
    p = SimParams(generators=1, decode=DecodeModel(500.0), train_a_s=2.0, n_async=16, n_batch=16, n_mini=1,
                  group=16, lengths=LengthDist("constant", mean=250), updates=5, warmup_updates=1)
    r = simulate(p, "sync")
    t_gen = 250 * 16 / 500.0
    assert r.generator_util == pytest.approx(t_gen / (t_gen + 2.0), **EXACT)
    assert r.trainer_util == pytest.approx(2.0 / (t_gen + 2.0), **EXACT)


def ps_finish_times(lengths: list[int], tok_s) -> list[float]:
    """Processor sharing from a common start: between finishes, k active sequences each decode at
    tok_s(k) / k, so the i-th shortest finishes after sum_j (L_(j) - L_(j-1)) * k_j / tok_s(k_j)."""
    out, t, prev = [], 0.0, 0
    for i, length in enumerate(sorted(lengths)):
        k = len(lengths) - i
        t += (length - prev) * k / tok_s(k)
        prev = length
        out.append(t)
    return out


@pytest.mark.parametrize("decode", [DecodeModel(300.0, c_half=6.0),
                                    DecodeModel(table=[(1, 40.0), (8, 200.0), (32, 420.0)])])
def test_sync_rounds_follow_processor_sharing_finish_times(decode):
    p = SimParams(generators=1, decode=decode, train_a_s=1.0, push_s=0.25, n_async=24, n_batch=24, n_mini=2,
                  group=8, lengths=parse_lengths("lognormal:mean=60,sigma=0.8"), updates=4, warmup_updates=1,
                  keep_trace=True)
    r = simulate(p, "sync")
    rounds: dict[float, list[dict]] = {}
    for s in r.trace:
        rounds.setdefault(s["admit_t"], []).append(s)
    assert len(rounds) == 4
    for start, seqs in rounds.items():
        want = ps_finish_times([s["length"] for s in seqs], decode.tok_s)
        got = sorted(s["finish_t"] - start for s in seqs)
        assert got == pytest.approx(want, rel=1e-9)


def test_trainer_bound_async_cycle_is_train_plus_push():
    # generators ~2x faster than the trainer consumes: a backlog builds, the trainer never waits
    p = SimParams(generators=4, decode=DecodeModel(300.0), train_a_s=1.5, train_b_s=1e-3, push_s=0.5,
                  n_async=64, n_batch=32, n_mini=4, group=8, lengths=LengthDist("constant", mean=40),
                  max_staleness=None, updates=20, warmup_updates=3)
    r = simulate(p, "async")
    t_train = 1.5 + 1e-3 * 32 * 40
    assert r.sequences_per_s == pytest.approx(32 / (t_train + 0.5), **EXACT)
    assert r.trainer_util == pytest.approx(t_train / (t_train + 0.5), **EXACT)


@pytest.mark.parametrize("bound", [0, 1, 3])
def test_token_staleness_never_exceeds_the_bound(bound):
    p = SimParams(generators=2, decode=DecodeModel(400.0, 4.0), train_a_s=0.5, train_b_s=2e-4, push_s=0.1,
                  n_async=96, n_batch=32, n_mini=2, group=8, lengths=parse_lengths("pareto:low=50,ratio=5,alpha=1.1"),
                  max_staleness=bound, updates=40, warmup_updates=4, keep_trace=True)
    r = simulate(p, "async")
    trained = [s for s in r.trace if s["trained_version"] is not None]
    # the rule is on the token-mean staleness of a group's samples taken into one batch
    lag: dict[tuple[int, int], list[float]] = {}
    for s in trained:
        acc = lag.setdefault((s["group"], s["trained_version"]), [0.0, 0.0])
        acc[0] += s["trained_version"] * s["length"] - s["version_sum"]
        acc[1] += s["length"]
    assert trained and max(t / n for t, n in lag.values()) <= bound + 1e-9
    assert r.token_staleness_mean <= bound
    if bound:  # in-flight updates: a sequence's tokens span several versions
        assert r.versions_per_seq_max >= 2
    unbounded = simulate(replace(p, max_staleness=None, keep_trace=False), "async")
    assert unbounded.staleness_max > bound  # so the bound was binding, not vacuous


def test_littles_law_holds():
    p = SimParams(generators=3, decode=DecodeModel(900.0, 10.0), prefill_s=0.002, train_a_s=0.8, train_b_s=1e-4,
                  push_s=0.3, n_async=120, n_batch=40, n_mini=4, group=10,
                  lengths=parse_lengths("pareto:low=80,ratio=5,alpha=1.2"), drop_prob=0.2, updates=120,
                  warmup_updates=10, max_staleness=None)  # n_async alone bounds what is in flight
    r = simulate(p, "async")
    assert r.mean_in_flight == pytest.approx(r.completions_per_s * r.mean_latency_s, rel=0.02)
    assert p.n_async - p.group < r.mean_in_flight <= p.n_async


def test_more_generators_never_lower_trainer_utilisation():
    base = SimParams(decode=DecodeModel(600.0, 16.0), train_a_s=1.0, train_b_s=5e-5, push_s=0.2, n_async=256,
                     n_batch=64, n_mini=4, group=16, lengths=parse_lengths("lognormal:mean=300,sigma=0.7"),
                     updates=40, warmup_updates=5)
    utils = [simulate(replace(base, generators=n), "async").trainer_util for n in (1, 2, 4, 8)]
    assert all(b >= a - 1e-9 for a, b in zip(utils, utils[1:])), utils
    assert utils[-1] > utils[0]


def test_async_beats_sync_on_heavy_tail_when_both_sides_matter():
    p = SimParams(generators=4, decode=DecodeModel(1000.0, 8.0), train_a_s=2.0, train_b_s=1e-4, push_s=0.5,
                  n_async=256, n_batch=128, n_mini=4, group=8, lengths=parse_lengths("pareto:low=100,ratio=5"),
                  updates=30, warmup_updates=5)
    res = compare(p)
    assert res["async"].sequences_per_s > res["sync"].sequences_per_s
    assert res["async"].generator_util > res["sync"].generator_util
    assert res["sync"].staleness_max == 0


def test_non_diverse_drop_fraction():
    p = SimParams(generators=2, decode=DecodeModel(1000.0), n_async=64, n_batch=32, n_mini=1, group=8,
                  lengths=LengthDist("uniform", low=20, ratio=5), drop_prob=0.25, max_staleness=None,
                  updates=400, warmup_updates=10)
    r = simulate(p, "async")
    assert r.dropped_frac == pytest.approx(0.25, abs=0.03)
    assert r.sequences_per_s == pytest.approx((1 - r.dropped_frac) * r.completions_per_s, rel=0.02)


def bounded_pareto_mean(lo: float, hi: float, a: float) -> float:
    return (lo ** a / (1 - (lo / hi) ** a)) * a / (a - 1) * (lo ** (1 - a) - hi ** (1 - a))


def test_length_distributions():
    rng = random.Random(3)
    draw = parse_lengths("pareto:low=100,ratio=5,alpha=1.5").sampler(rng)
    xs = [draw() for _ in range(40000)]
    assert min(xs) == 100 and max(xs) == 500  # longest is 5x the shortest
    assert sum(xs) / len(xs) == pytest.approx(bounded_pareto_mean(100, 500, 1.5), rel=0.01)
    draw = parse_lengths("lognormal:mean=400,sigma=0.6,max_len=100000").sampler(rng)
    xs = [draw() for _ in range(40000)]
    assert sum(xs) / len(xs) == pytest.approx(400, rel=0.02)
    draw = parse_lengths("lognormal:mean=400,sigma=0.6,max_len=300").sampler(rng)
    assert max(draw() for _ in range(1000)) == 300
    assert parse_lengths("constant:7").sampler(rng)() == 7
    assert {parse_lengths("empirical:3,9").sampler(rng)() for _ in range(100)} == {3, 9}


def test_decode_table_interpolates():
    m = DecodeModel(table=[(4, 100.0), (1, 40.0), (16, 160.0)])
    assert [m.tok_s(c) for c in (1, 4, 16, 64)] == [40.0, 100.0, 160.0, 160.0]
    assert m.tok_s(10) == pytest.approx(130.0)
    assert m.tok_s(0) == 0.0
    assert DecodeModel(table=[(2, 50.0)]).tok_s(1) == 25.0
    assert DecodeModel(100.0, 4.0).tok_s(4) == 50.0


@pytest.mark.parametrize("bad, msg", [
    (dict(n_batch=10, n_mini=3), "n_mini"), (dict(n_async=8, group=16), "n_async"),
    (dict(drop_prob=1.0), "drop_prob"), (dict(push_s=-1.0), "times"), (dict(updates=3, warmup_updates=3), "warmup"),
])
def test_invalid_parameters_are_rejected(bad, msg):
    with pytest.raises(ValueError, match=msg):
        simulate(SimParams(**bad))


@pytest.mark.parametrize("spec", ["pareto:low=0", "weird:1", "lognormal:mu=3", "empirical:", "uniform:ratio=0.5"])
def test_bad_length_specs(spec):
    with pytest.raises(ValueError):
        parse_lengths(spec)


def test_same_inputs_same_outputs():
    p = SimParams(lengths=parse_lengths("lognormal:mean=100,sigma=1"), train_a_s=0.1, updates=10, warmup_updates=2)
    assert simulate(p).to_dict() == simulate(p).to_dict()
    assert not math.isnan(simulate(p, "sync").sequences_per_s)


# ---------------------------------------------------------------- episodes: turns and tool latency
def test_sync_episode_cycle_adds_each_tool_wait_and_request_to_the_closed_form():
    """One synchronous round of G episodes of T turns in lockstep: each turn decodes L/T tokens with all G
    on the generator, then every episode waits tool_s off it; each turn is a request (G prefills)."""
    dec = DecodeModel(peak_tok_s=600.0, c_half=10.0)
    G, L, T, tool, pre = 16, 90, 3, 0.7, 0.01
    p = SimParams(generators=1, decode=dec, prefill_s=pre, train_a_s=2.0, n_async=G, n_batch=G, n_mini=1,
                  group=G, lengths=LengthDist("constant", mean=L), turns=T, tool_s=tool, updates=6, warmup_updates=1)
    r = simulate(p, "sync")
    turn = G * pre + (L / T) * G / dec.tok_s(G)
    cycle = T * turn + (T - 1) * tool + 2.0
    assert r.window_s == pytest.approx(5 * cycle, **EXACT)
    assert r.generator_util == pytest.approx(T * turn / cycle, **EXACT)
    assert r.mean_in_flight == pytest.approx(G * T * turn / cycle, **EXACT)  # decoding, not waiting on tools


def test_enough_episodes_in_flight_hide_the_tools_and_a_push_during_a_tool_wait_versions_the_next_turn():
    dec = DecodeModel(peak_tok_s=1000.0)  # constant rate: throughput is the peak whenever one sequence decodes
    base = SimParams(generators=1, decode=dec, n_async=64, n_batch=32, n_mini=1, group=8, max_staleness=None,
                     lengths=LengthDist("lognormal", mean=200, sigma=0.5), updates=40, warmup_updates=5)
    single = simulate(base)
    tools = simulate(replace(base, turns=4, tool_s=0.01))  # a tool step well under a turn's decode time
    assert single.generator_util == pytest.approx(1.0, **EXACT)
    assert tools.generated_tokens_per_s / single.generated_tokens_per_s > 0.95
    starved = simulate(replace(base, n_async=8, turns=4, tool_s=2.0))  # every episode mostly in its tool
    assert starved.generator_util < 0.5
    # a push while a sequence waits on its tool: its later turns carry the new version
    trace = simulate(replace(base, turns=4, tool_s=0.5, train_a_s=0.2, keep_trace=True)).trace
    assert any(s["finish_version"] > s["start_version"] for s in trace)
    assert all(s["version_sum"] <= s["finish_version"] * s["length"] + 1e-6 for s in trace if s["finish_t"] >= 0)


def test_extra_in_flight_keeps_n_async_decoding_while_episodes_wait_on_tools():
    """env.extra_in_flight in the model: episodes in their tools free budget slots, so the generator keeps
    about n_async sequences decoding (an episode back from its tool goes on at once, so briefly more) and
    the throughput of a concurrency-bound generator rises; with single-turn samples it changes nothing."""
    dec = DecodeModel(peak_tok_s=1000.0, c_half=16.0)
    base = SimParams(generators=1, decode=dec, n_async=16, n_batch=16, n_mini=1, group=4, max_staleness=4,
                     lengths=LengthDist("lognormal", mean=120, sigma=0.3), turns=3, tool_s=0.3, updates=30,
                     warmup_updates=5)
    plain, extra = simulate(base), simulate(replace(base, extra_in_flight=16))
    assert plain.mean_in_flight < 0.85 * base.n_async  # tools hold budget slots off the generator
    assert 0.9 * base.n_async < extra.mean_in_flight < base.n_async + 16
    assert extra.generated_tokens_per_s > 1.1 * plain.generated_tokens_per_s
    no_tools = replace(base, turns=1, tool_s=0.0)
    assert simulate(replace(no_tools, extra_in_flight=16)).generated_tokens_per_s == pytest.approx(
        simulate(no_tools).generated_tokens_per_s, **EXACT)
