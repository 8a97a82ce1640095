"""Mismatch metrics and corrections of the trainer's RL update on the tiny Llama, against HF.

The "generator" logprobs are HF's logprobs of the same weights plus known noise, each sequence tagged
with weight versions (several lags, one sequence mixing versions token by token: its lag-0 tokens are
the `lag0_mixed` ones, one with none). The
expected metrics are computed here from the HF logprobs with the formulas of docs/train.md written out
(d = trainer - generator; mean/max |d|, mean of exp(d) - 1 - d, share of exp(d) outside [0.5, 2]).
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megatron_rl.algo.correction import is_correction
from megatron_rl.algo.loss import clipped_token_loss
from megatron_rl.records import Batch
from support.policies import EPS_HIGH, EPS_LOW, completion_logprobs, hf_model, hf_policy, make_trainer
from unit.test_train_kl_proximal import make_seqs, megatron_step, normalised

VERSION = 4


def tag_versions(seqs):
    """Lags 0, 1, 2, 4 (binned as 3+) by sequence; one sequence mixes lags 0 and 1; the last has none."""
    out = []
    for i, s in enumerate(seqs):
        c = s.completion_len
        if i == len(seqs) - 1:
            versions = []
        elif i == 1:
            versions = [VERSION - 1] * (c // 2) + [VERSION] * (c - c // 2)
        else:
            versions = [VERSION - (0, 1, 2, 4)[i % 4]] * c
        out.append(dataclasses.replace(s, weight_versions=versions))
    return out


def expected(trainer_lp, seqs):
    """Per-bin metrics from explicit per-token lists."""
    bins: dict[str, list[float]] = {}
    for lp, s in zip(trainer_lp, seqs):
        for t, (d, v) in enumerate(zip((lp - torch.tensor(s.behaviour_logprobs)).tolist(), s.weight_versions)):
            lag = VERSION - v
            bins.setdefault(f"lag{lag}" if lag < 3 else "lag3+", []).append(d)
            if lag == 0:  # one turn: mixed when an earlier token came from other weights
                mixed = any(e != v for e in s.weight_versions[:t])
                bins.setdefault("lag0_mixed" if mixed else "lag0_pure", []).append(d)
    out = {}
    for name, ds in bins.items():
        k = f"mismatch/{name}/"
        out.update({k + "tokens": len(ds), k + "abs_mean": sum(map(abs, ds)) / len(ds),
                    k + "abs_max": max(map(abs, ds)), k + "log_ratio_mean": sum(ds) / len(ds),
                    k + "kl_k3": sum(math.exp(d) - 1 - d for d in ds) / len(ds),
                    k + "out_of_band_frac": sum(not 0.5 <= math.exp(d) <= 2.0 for d in ds) / len(ds)})
    return out


def assert_metrics(got, want):
    assert {k for k in got if k.startswith("mismatch/")} == set(want)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-4, abs=1e-5), k


def test_evaluate_reports_mismatch_by_lag(tiny_llama_dir):
    trainer = make_trainer(tiny_llama_dir)
    trainer.version = VERSION
    init = hf_model(tiny_llama_dir)
    seqs = tag_versions(make_seqs(init, n=9, seed=1, noise=0.6))
    with torch.no_grad():
        lps = [completion_logprobs(init, s) for s in seqs]
    want = expected(lps, seqs)
    assert 0 < want["mismatch/lag0/out_of_band_frac"] < 1  # the noise puts some tokens outside the band
    assert_metrics(trainer.evaluate(seqs), want)


@pytest.mark.parametrize("proximal", ["behaviour", "trainer"])
def test_update_measures_the_weights_it_starts_from(tiny_llama_dir, proximal):
    """n_mini=2: with the proximal pass every minibatch is measured; without it, the first minibatch
    only (its forward is the one that still holds the update-start weights); no extra forward."""
    trainer = make_trainer(tiny_llama_dir, algo={"proximal": proximal})
    trainer.version = VERSION
    init = hf_model(tiny_llama_dir)
    seqs = tag_versions(make_seqs(init, n=8, seed=2, noise=0.4))
    with torch.no_grad():
        lps = [completion_logprobs(init, s) for s in seqs]
    measured = len(seqs) if proximal == "trainer" else len(seqs) // 2
    out = trainer.train_on(Batch(seqs, n_mini=2, policy_version=VERSION))
    assert_metrics(out, expected(lps[:measured], seqs[:measured]))


@pytest.mark.parametrize("algo", [{"is_correction": "token_mask", "mask_ratio_low": 0.7},
                                  {"is_correction": "sequence_tis", "tis_cap": 1.2},
                                  {"is_correction": "token_tis", "tis_cap": 1.2}],
                         ids=lambda a: a["is_correction"])
def test_correction_in_the_step_matches_hf_reference(tiny_llama_dir, algo):
    """The config key reaches the Megatron step: loss and lm_head gradient equal the loss of algo/ on
    HF logprobs with the same correction (itself checked token by token in test_algo_correction)."""
    trainer = make_trainer(tiny_llama_dir, algo={"proximal": "trainer", **algo})
    policy = hf_policy(trainer, tiny_llama_dir)
    seqs = make_seqs(policy, seed=6, noise=0.5)
    out, grad, _ = megatron_step(trainer, seqs)
    lens = torch.tensor([s.completion_len for s in seqs], dtype=torch.float64)
    adv = normalised(torch.tensor([s.advantage for s in seqs], dtype=torch.float64), lens).float()
    n_tok = int(lens.sum())
    policy.zero_grad()
    total = 0.0
    for s, a in zip(seqs, adv):
        lp = completion_logprobs(policy, s)[None]
        total = total + clipped_token_loss(lp, torch.tensor([s.behaviour_logprobs]), a[None],
                                           torch.ones_like(lp, dtype=torch.bool), EPS_LOW, EPS_HIGH,
                                           normalizer=n_tok, proximal_logprobs=lp.detach(),
                                           correction=is_correction(trainer.config.algo))
    total.backward()
    assert out.metrics["loss"] == pytest.approx(float(total), rel=1e-4, abs=1e-6)
    torch.testing.assert_close(grad, policy.lm_head.weight.grad, rtol=1e-4, atol=1e-6)
    if algo["is_correction"] == "token_mask":
        assert 0 < out.metrics["is_masked_frac"] < 1
