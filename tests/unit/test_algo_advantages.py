"""Group advantages, the non-diverse filter and minibatch normalisation against explicit references."""
from __future__ import annotations

import statistics

import pytest
import torch

from megatron_rl.algo.advantages import filter_non_diverse, group_advantages, normalize


def test_group_advantages_are_reward_minus_group_mean():
    r = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.1, 0.1, 1.0, 0.9]])
    want = [[x - statistics.fmean(row) for x in row] for row in r.tolist()]
    torch.testing.assert_close(group_advantages(r), torch.tensor(want))
    std = group_advantages(r, std=True)
    want_std = [[(x - statistics.fmean(row)) / (statistics.stdev(row) + 1e-6) for x in row] for row in r.tolist()]
    torch.testing.assert_close(std, torch.tensor(want_std))
    const = group_advantages(torch.full((1, 4), 0.7), std=True)
    assert (const == 0).all()  # no nan from 0/0
    with pytest.raises(ValueError, match="n_groups"):
        group_advantages(torch.zeros(4))


def test_filter_drops_only_groups_with_all_equal_rewards():
    r = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.1, 1.0, 0.1], [0.1 + 0.9, 1.0, 1.0],
                      [0.0, 0.0, 1e-3]])
    f = filter_non_diverse(r)
    assert f.keep.tolist() == [False, False, True, False, True]
    assert (f.n_dropped, f.n_kept) == (3, 2)
    assert filter_non_diverse(r, atol=1e-2).keep.tolist() == [False, False, True, False, False]
    # Dropped groups are exactly those with zero advantages everywhere.
    assert ((group_advantages(r).abs().amax(1) > 1e-6) == f.keep).all()


def _token_expand(adv, lengths):
    return [a for a, n in zip(adv, lengths) for _ in range(n)]


def test_minibatch_token_weighting_equals_stats_of_the_expanded_token_list():
    adv = torch.tensor([1.0, -0.5, 0.25, -2.0], dtype=torch.float64)
    lengths = [3, 1, 5, 2]
    mask = torch.arange(6)[None, :] < torch.tensor(lengths)[:, None]
    flat = _token_expand(adv.tolist(), lengths)
    mu, sd = statistics.fmean(flat), statistics.pstdev(flat)
    torch.testing.assert_close(normalize(adv, mask), (adv - mu) / sd)
    # The loss-weighted (token) mean of the result is 0 and its token std is 1.
    out = _token_expand(normalize(adv, mask).tolist(), lengths)
    assert statistics.fmean(out) == pytest.approx(0.0, abs=1e-12)
    assert statistics.pstdev(out) == pytest.approx(1.0)
    # Sequence weighting: plain stats over the 4 sequences.
    mu_s, sd_s = statistics.fmean(adv.tolist()), statistics.pstdev(adv.tolist())
    seq = normalize(adv, mask, weighting="sequence")
    torch.testing.assert_close(seq, (adv - mu_s) / sd_s)
    assert (seq - normalize(adv, mask)).abs().max() > 0.05  # they differ with unequal lengths


def test_token_and_sequence_weighting_agree_for_equal_lengths():
    adv = torch.randn(6, dtype=torch.float64)
    mask = torch.ones(6, 4, dtype=torch.bool)
    torch.testing.assert_close(normalize(adv, mask), normalize(adv, mask, weighting="sequence"))
    torch.testing.assert_close(normalize(adv), normalize(adv, mask))  # no mask: one weight each


def test_per_token_advantages_are_normalised_over_unmasked_tokens():
    adv = torch.tensor([[1.0, 2.0, 99.0], [-1.0, 99.0, 99.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    vals = [1.0, 2.0, -1.0]
    mu, sd = statistics.fmean(vals), statistics.pstdev(vals)
    out = normalize(adv, mask)
    torch.testing.assert_close(out[mask], (torch.tensor(vals, dtype=torch.float64) - mu) / sd)
    assert (out[~mask] == 0).all()
    # Sequence weighting of [B, T]: each sequence has total weight 1 -> values 1.5 and -1 weigh alike.
    seq = normalize(adv, mask, weighting="sequence")
    w = torch.tensor([0.5, 0.5, 1.0], dtype=torch.float64)
    v = torch.tensor(vals, dtype=torch.float64)
    m = (w * v).sum() / w.sum()
    s = ((w * (v - m) ** 2).sum() / w.sum()).sqrt()
    torch.testing.assert_close(seq[mask], (v - m) / s)


def test_degenerate_minibatches_do_not_produce_nan():
    one = normalize(torch.tensor([0.7]), torch.ones(1, 5, dtype=torch.bool))
    assert one.tolist() == [0.0]
    const = normalize(torch.full((4,), 0.3), torch.ones(4, 3, dtype=torch.bool))
    assert torch.equal(const, torch.zeros(4))
    empty = normalize(torch.tensor([0.5, -0.5]), torch.zeros(2, 3, dtype=torch.bool))
    assert torch.isfinite(empty).all()


def test_group_mode_standardises_within_each_group_and_none_is_identity():
    adv = torch.tensor([1.0, -1.0, 3.0, 2.0, 0.0, 2.0], dtype=torch.float64)
    gid = torch.tensor([0, 0, 1, 1, 1, 7])
    out = normalize(adv, mode="group", group_ids=gid)
    torch.testing.assert_close(out[:2], torch.tensor([1.0, -1.0], dtype=torch.float64))
    g1 = adv[2:5]
    torch.testing.assert_close(out[2:5], (g1 - g1.mean()) / g1.std(unbiased=False))
    assert out[5] == 0.0  # a group of one
    assert normalize(adv, mode="none") is adv
    with pytest.raises(ValueError, match="group_ids"):
        normalize(adv, mode="group")
    with pytest.raises(ValueError, match="mode"):
        normalize(adv, mode="batch")
    with pytest.raises(ValueError, match="weighting"):
        normalize(adv, weighting="char")


def test_compute_group_advantages_follows_the_config():
    from megatron_rl.algo.advantages import compute_group_advantages
    from megatron_rl.algo.passk import pass_at_k_advantages
    from megatron_rl.config import AlgoConfig

    r = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.1, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 1.0, 1.0]])
    out = compute_group_advantages(r, AlgoConfig())
    assert out.n_dropped == 2 and out.keep.tolist() == [False, True, False, True]
    torch.testing.assert_close(out.advantages, group_advantages(r[[1, 3]]))
    out = compute_group_advantages(r, AlgoConfig(drop_non_diverse_groups=False, adv_norm="group"))
    torch.testing.assert_close(out.advantages, group_advantages(r, std=True))
    out = compute_group_advantages(r, AlgoConfig(pass_at_k=2))
    torch.testing.assert_close(out.advantages, pass_at_k_advantages(r[[1, 3]], 2))
    out = compute_group_advantages(r, AlgoConfig(pass_at_k=9))  # k above the group size: pass@G
    torch.testing.assert_close(out.advantages, pass_at_k_advantages(r[[1, 3]], 4))


def test_algo_imports_only_torch_and_the_standard_library():
    import ast
    import sys
    from pathlib import Path

    import megatron_rl.algo as algo

    for path in Path(algo.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                roots = [] if node.level else [node.module.split(".")[0]]
            else:
                continue
            for root in roots:
                assert root == "torch" or root in sys.stdlib_module_names, f"{path.name} imports {root}"


def test_magistral_recipe_end_to_end_against_exact_rationals():
    """Rewards -> drop non-diverse groups -> r - group mean -> token-weighted minibatch standardisation ->
    on-policy gradient of the token-normalised loss, against a Fraction transcription of the formulas:
    d loss / d logp_it = -A_norm_i / (total tokens of the minibatch) at ratio 1."""
    import math
    from fractions import Fraction

    from megatron_rl.algo.advantages import compute_group_advantages
    from megatron_rl.algo.loss import clipped_token_loss
    from megatron_rl.config import AlgoConfig

    rewards = [["0", "1", "1", "0.1"], ["1", "1", "1", "1"], ["0.1", "0", "0.2", "1"], ["0", "0", "0", "0"]]
    lengths = [[3, 1, 4, 2], [5, 5, 5, 5], [1, 6, 2, 3], [2, 2, 2, 2]]
    exact = [[Fraction(x) for x in row] for row in rewards]
    kept = [i for i, row in enumerate(exact) if max(row) != min(row)]
    adv = [x - sum(exact[i]) / len(exact[i]) for i in kept for x in exact[i]]
    lens = [n for i in kept for n in lengths[i]]
    total = sum(lens)
    mu = sum(a * n for a, n in zip(adv, lens)) / total
    var = sum((a - mu) ** 2 * n for a, n in zip(adv, lens)) / total
    want = [float(a - mu) / math.sqrt(var) for a in adv]

    r = torch.tensor([[float(x) for x in row] for row in exact], dtype=torch.float64)
    out = compute_group_advantages(r, AlgoConfig())
    assert out.keep.tolist() == [i in kept for i in range(len(rewards))]
    flat = out.advantages.reshape(-1)
    mask = torch.arange(max(lens))[None, :] < torch.tensor(lens)[:, None]
    a_norm = normalize(flat, mask)
    torch.testing.assert_close(a_norm, torch.tensor(want, dtype=torch.float64), rtol=1e-13, atol=1e-13)

    lp = -torch.rand(mask.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    lp.requires_grad_(True)
    clipped_token_loss(lp, lp.detach(), a_norm, mask).backward()
    grad_want = torch.tensor([[-w / total if t < n else 0.0 for t in range(mask.shape[1])]
                              for w, n in zip(want, lens)], dtype=torch.float64)
    torch.testing.assert_close(lp.grad, grad_want, rtol=1e-13, atol=1e-15)


def test_std_at_or_below_eps_gives_exactly_zero_and_above_it_divides():
    """The documented rule (docs/algo.md): population std <= eps -> exactly 0 (equal advantages in any
    number, dtype and weighting: no rounding residue of the mean), above it (A - mean) / std."""
    for scale, divided in ((1e-7, False), (1e-3, True)):
        vals = [scale, -scale, 3 * scale, scale]
        mu, sd = statistics.fmean(vals), statistics.pstdev(vals)
        want = [(v - mu) / sd if divided else 0.0 for v in vals]
        got = normalize(torch.tensor(vals, dtype=torch.float64))
        torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=0.0)
    g = torch.Generator().manual_seed(0)
    for b in (1, 3, 7, 64):
        mask = torch.arange(7)[None, :] < torch.randint(1, 8, (b,), generator=g)[:, None]
        for v in (0.1, 0.3, 1 / 3, -0.4):
            for dtype in (torch.float32, torch.float64):
                for weighting in ("token", "sequence"):
                    adv = torch.full((b,), v, dtype=dtype)
                    assert (normalize(adv, mask, weighting=weighting) == 0).all()
                    assert (normalize(adv[:, None].expand(b, 7), mask, weighting=weighting) == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_constant_groups_give_exactly_zero_in_both_modes_whatever_the_value_and_size(dtype):
    """All-equal rewards: r - mean = 0 exactly (the formula), also (r - mean) / (std + eps); a rounded
    mean would leave ~1e-8 in float32, which the std ablation divides into ~1e-2."""
    for g in range(2, 33):
        for v in (0.1, 0.3, 0.7, 1 / 3, -0.4, 1.1):
            r = torch.full((2, g), v, dtype=dtype)
            r[1, 0] = v + 0.5  # a diverse group next to it is unaffected
            for std in (False, True):
                out = group_advantages(r, std=std)
                assert (out[0] == 0).all(), (g, v, std)
                row = r[1].tolist()
                mu = statistics.fmean(row)
                want = [(x - mu) / ((statistics.stdev(row) + 1e-6) if std else 1.0) for x in row]
                torch.testing.assert_close(out[1], torch.tensor(want, dtype=out.dtype))
