"""The lag-0 split of the mismatch metrics by the versions of a token's context (algo.mismatch).

`reference_mixed` states the rule token by token in plain Python (walk the turn, compare every earlier
model token's version); the vectorised `mixed_context` and the binned sums are checked against it on
constructed completions: single turns with in-place updates, episodes whose environment tokens separate
turns, a turn re-prefilled under new weights, versions that are not monotone.
"""
from __future__ import annotations

import math
import random

import pytest
import torch

from megatron_rl.algo import mismatch
from megatron_rl.records import ENV_VERSION, TrainSequence
from megatron_rl.train.packing import pack_sequences


def reference_mixed(versions: list[int], mask: list[int]) -> list[bool]:
    out = []
    for t, (v, m) in enumerate(zip(versions, mask)):
        earlier, s = [], t - 1
        while s >= 0 and mask[s]:  # back to the start of this model turn
            earlier.append(versions[s])
            s -= 1
        out.append(bool(m) and any(e != v for e in earlier))
    return out


CASES = [
    ([5, 5, 5, 5], [1, 1, 1, 1]),  # one version throughout: all pure
    ([5, 5, 6, 6, 7], [1, 1, 1, 1, 1]),  # two in-place updates inside one turn
    ([3, 3, ENV_VERSION, ENV_VERSION, 4, 4], [1, 1, 0, 0, 1, 1]),  # the next turn re-prefills under 4
    ([3, 4, ENV_VERSION, 4, 4, 5], [1, 1, 0, 1, 1, 1]),  # mixed in both turns
    ([ENV_VERSION, 2, 2], [0, 1, 1]),  # an environment token first
    ([7, 6, 7], [1, 1, 1]),  # not monotone: the last 7 still attended to a 6
]


@pytest.mark.parametrize("versions,mask", CASES)
def test_mixed_context_follows_the_rule(versions, mask):
    got = mismatch.mixed_context(torch.tensor(versions), torch.tensor(mask, dtype=torch.float32))
    assert got.tolist() == reference_mixed(versions, mask)


def test_mixed_context_on_random_episodes():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 40)
        mask = [rng.random() < 0.8 for _ in range(n)]
        versions, v = [], rng.randint(0, 3)
        for m in mask:
            v += rng.random() < 0.1
            versions.append(v if m else ENV_VERSION)
        got = mismatch.mixed_context(torch.tensor(versions), torch.tensor(mask))
        assert got.tolist() == reference_mixed(versions, [int(m) for m in mask])


def test_lag0_split_sums_equal_per_token_lists():
    """Bins lag0_pure and lag0_mixed partition lag0; the other bins do not change."""
    torch.manual_seed(0)
    versions = [4, 4, 4, 3, 3, 4, 4, 2, ENV_VERSION, 4, 4]
    mask = [1, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1]
    trainer = torch.randn(len(versions)) * 0.1
    generator = trainer + torch.randn(len(versions)) * 0.05
    lag = torch.tensor([4 - v if v >= 0 else -1 for v in versions])
    mixed = mismatch.mixed_context(torch.tensor(versions), torch.tensor(mask))
    sums, maxes = mismatch.mismatch_sums(trainer[None], generator[None], lag[None], torch.tensor(mask)[None],
                                         mixed[None])
    got = mismatch.metrics(sums, maxes)
    ref_mixed = reference_mixed(versions, mask)
    d = (trainer - generator).tolist()
    groups = {"lag0": [], "lag0_pure": [], "lag0_mixed": []}
    for t, v in enumerate(versions):
        if mask[t] and v == 4:
            groups["lag0"].append(d[t])
            groups["lag0_mixed" if ref_mixed[t] else "lag0_pure"].append(d[t])
    # pure: the first three 4s and the second turn's two; mixed: the two 4s decoded after the 3s
    assert len(groups["lag0_pure"]) == 5 and len(groups["lag0_mixed"]) == 2
    for name, ds in groups.items():
        key = f"mismatch/{name}/"
        assert got[key + "tokens"] == len(ds)
        assert got[key + "abs_mean"] == pytest.approx(sum(map(abs, ds)) / len(ds), rel=1e-5)
        assert got[key + "abs_max"] == pytest.approx(max(map(abs, ds)), rel=1e-6)
        assert got[key + "kl_k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in ds) / len(ds), rel=1e-4)
    merged = mismatch.merge([got, got])
    assert merged["mismatch/lag0_mixed/tokens"] == 4
    assert merged["mismatch/lag0_pure/abs_mean"] == pytest.approx(got["mismatch/lag0_pure/abs_mean"])
    unsplit = mismatch.metrics(*mismatch.mismatch_sums(trainer[None], generator[None], lag[None],
                                                       torch.tensor(mask)[None]))
    assert not any(k.startswith(("mismatch/lag0_pure", "mismatch/lag0_mixed")) for k in unsplit)
    assert {k: v for k, v in got.items() if k in unsplit} == unsplit


def test_packing_places_the_flag_at_each_tokens_label_position():
    ep = TrainSequence(token_ids=list(range(10, 19)), prompt_len=2, behaviour_logprobs=[0.0] * 7, advantage=1.0,
                       weight_versions=[3, 4, ENV_VERSION, 4, 4, 5, 5], loss_mask=[1, 1, 0, 1, 1, 1, 1])
    mb = pack_sequences([ep], capacity=16).micro_batches[0]
    # completion token k of the sequence is scored at position k - 1 (prompt_len 2: positions 1..7)
    assert mb.mixed_context[0, 1:8].tolist() == reference_mixed(ep.weight_versions, ep.loss_mask)
    assert not mb.mixed_context[0, 0] and not mb.mixed_context[0, 8:].any()
