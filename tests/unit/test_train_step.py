"""The RL step on the tiny Llama against an independent HF transformers + autograd reference.

The reference runs each sequence unpacked through HF, computes the clipped surrogate by hand with
minibatch-normalised advantages and token-level normalisation over the whole minibatch, and
backpropagates. The Megatron step packs the same minibatch into several micro-batches, so equal loss
and gradients also check packing, accumulation and the per-token normaliser.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megatron_rl.config import config_from_dict
from megatron_rl.records import Batch, TrainSequence
from support.tolerances import network_error, sum_error, transformer_matmuls

EPS_LOW, EPS_HIGH = 0.2, 0.28
# Megatron parameter -> HF parameter with the same layout (no fused/permuted weights).
SAME_LAYOUT = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
    "decoder.layers.0.mlp.linear_fc2.weight": "model.layers.0.mlp.down_proj.weight",
    "decoder.layers.1.self_attention.linear_proj.weight": "model.layers.1.self_attn.o_proj.weight",
}


def make_config(model_dir, **trainer):
    base = {"model": str(model_dir), "precision": "fp32", "micro_batch_tokens": 24, "lr": 1e-3,
            "grad_clip": 1e6}
    base.update(trainer)
    return config_from_dict({"trainer": base, "algo": {"eps_low": EPS_LOW, "eps_high": EPS_HIGH}})


def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_completion_logprobs(model, seq: TrainSequence, with_entropy: bool = False):
    ids = torch.tensor(seq.token_ids)[None]
    logits = model(ids).logits[0].float()
    logp_all = torch.log_softmax(logits, -1)
    pos = torch.arange(seq.prompt_len - 1, len(seq.token_ids) - 1)
    lp = logp_all[pos, ids[0, pos + 1]]
    if with_entropy:
        return lp, -(logp_all[pos].exp() * logp_all[pos]).sum(-1)
    return lp


def make_minibatch(model, n: int = 6, seed: int = 0, noise: float = 0.4) -> list[TrainSequence]:
    """Sequences of varied lengths; behaviour logprobs = HF logprobs + noise (so ratios get clipped)."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    seqs = []
    for i in range(n):
        p, c = 2 + i % 3, 3 + (5 * i) % 7
        ids = torch.randint(3, vocab, (p + c,), generator=g).tolist()
        adv = float(torch.randn((), generator=g))
        seq = TrainSequence(ids, p, [0.0] * c, advantage=adv)
        with torch.no_grad():
            lp = hf_completion_logprobs(model, seq)
        seq.behaviour_logprobs = (lp + noise * torch.randn(c, generator=g)).tolist()
        seqs.append(seq)
    return seqs


def reference(model, seqs: list[TrainSequence]):
    """Loss, metrics and parameter gradients by hand, per sequence, with HF autograd."""
    model.zero_grad()
    lens = torch.tensor([s.completion_len for s in seqs], dtype=torch.float64)
    adv = torch.tensor([s.advantage for s in seqs], dtype=torch.float64)
    mean = (adv * lens).sum() / lens.sum()  # token-weighted minibatch statistics
    std = ((((adv - mean) ** 2) * lens).sum() / lens.sum()).sqrt()
    adv_n = ((adv - mean) / std).float()
    n_tok = int(lens.sum())
    total, ratios, ents, lps, low, high = 0.0, [], [], [], 0, 0
    for s, a in zip(seqs, adv_n):
        lp, ent = hf_completion_logprobs(model, s, with_entropy=True)
        r = torch.exp(lp - torch.tensor(s.behaviour_logprobs))
        per_tok = -torch.minimum(r * a, r.clamp(1 - EPS_LOW, 1 + EPS_HIGH) * a)
        total = total + per_tok.sum() / n_tok
        rd = r.detach()
        ratios.append(rd), ents.append(ent.detach()), lps.append(lp.detach())
        low += int(((rd < 1 - EPS_LOW) & (a < 0)).sum())
        high += int(((rd > 1 + EPS_HIGH) & (a > 0)).sum())
    total.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    r = torch.cat(ratios)
    metrics = {"loss": float(total), "clip_frac_low": low / n_tok, "clip_frac_high": high / n_tok,
               "ratio_mean": float(r.mean()), "ratio_min": float(r.min()), "ratio_max": float(r.max()),
               "entropy": float(torch.cat(ents).mean()), "logprob_mean": float(torch.cat(lps).mean()),
               "n_loss_tokens": n_tok,
               "grad_norm": math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values()))}
    return metrics, grads


def test_loss_metrics_and_gradients_match_hf_reference(tiny_llama_dir):
    from megatron_rl.train.step import forward_backward
    from megatron_rl.train.trainer import Trainer

    hf = hf_model(tiny_llama_dir)
    seqs = make_minibatch(hf)
    ref, ref_grads = reference(hf, seqs)
    assert 0 < ref["clip_frac_low"] + ref["clip_frac_high"] < 1  # both branches exercised

    trainer = Trainer(make_config(tiny_llama_dir))
    trainer.optimizer.zero_grad()
    rows = []  # the output layer makes logits at the positions with a loss label only (step._logit_positions)
    hook = trainer.model_chunks[0].output_layer.register_forward_hook(lambda _, a, out: rows.append(out[0].shape[0]))
    out = forward_backward(trainer.model, seqs, trainer.ctx)
    hook.remove()
    assert out.n_micro_batches >= 3  # accumulation over several packed micro-batches
    assert sum(rows) == ref["n_loss_tokens"] < sum(len(s.token_ids) for s in seqs)
    # Megatron and HF run other kernels in other orders: float32 through the tiny model's chain of
    # matmuls (reductions <= its 384-token vocabulary), 2.1e-4 relative; absolute floors for values
    # near zero (metrics are O(1), gradients O(1e-2)); a clip fraction flips with one token (1/n)
    rtol = network_error(transformer_matmuls(2), 384)
    for key in ("loss", "ratio_mean", "ratio_min", "ratio_max", "entropy", "logprob_mean", "n_loss_tokens"):
        assert out.metrics[key] == pytest.approx(ref[key], rel=rtol, abs=rtol * 1e-1), key
    for key in ("clip_frac_low", "clip_frac_high"):
        assert out.metrics[key] == pytest.approx(ref[key], abs=1e-9), key  # no ratio within rtol of a clip edge
    params = dict(trainer.model_chunks[0].named_parameters())
    for meg, hf_name in SAME_LAYOUT.items():
        torch.testing.assert_close(params[meg].main_grad, ref_grads[hf_name], rtol=rtol, atol=rtol * 1e-2,
                                   msg=lambda m: f"{meg}: {m}")
    # log_entropy=False: the same loss, gradients and metrics without the entropy pass (no entropy key)
    quiet = dataclasses.replace(trainer.ctx, trainer=dataclasses.replace(trainer.ctx.trainer, log_entropy=False))
    out2 = forward_backward(trainer.model, seqs, quiet)
    assert "entropy" not in out2.metrics
    for key in ("loss", "clip_frac_low", "clip_frac_high", "ratio_mean", "ratio_min", "ratio_max", "logprob_mean"):
        # the same kernels on the same inputs, but the entropy pass no longer shares the logits buffer
        assert out2.metrics[key] == pytest.approx(out.metrics[key], rel=sum_error(384), abs=1e-7), key
    torch.testing.assert_close(params["output_layer.weight"].main_grad, ref_grads["lm_head.weight"],
                               rtol=rtol, atol=rtol * 1e-2)
    sft = forward_backward(trainer.model, seqs, quiet, objective="sft", forward_only=True).metrics
    assert "entropy" not in sft
    assert sft["loss"] == pytest.approx(-ref["logprob_mean"], rel=rtol)  # SFT: mean NLL of the tokens
    ok, grad_norm, _ = trainer.optimizer.step()
    assert ok and grad_norm == pytest.approx(ref["grad_norm"], rel=rtol)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_bf16_step_matches_fp32_reference_with_bf16_logits(tiny_llama_dir, monkeypatch):
    """precision=bf16: the same step against the fp32 HF reference, and the logits reach the loss in
    bf16 (no float32 [tokens, vocab] copy from Float16Module or the loss function).

    Tolerance: the bf16 model rounds weights and every activation to 8 mantissa bits (relative error
    up to 2^-9 ~ 0.2% per rounding, compounding over the layers), so the metrics move by ~0.1% and
    whole gradient tensors by ~0.7% (relative L2, measured). We allow 1% on loss/ratio/entropy metrics
    and the grad norm and 3% relative L2 per gradient tensor: bf16 rounding, while a wrong sign,
    normaliser, advantage or missing token moves them by O(1). Clip fractions are counts over ~40
    tokens: a ratio right at a clip boundary may flip, so they may differ by one token.
    """
    import megatron_rl.ops as ops
    from megatron_rl.train import step
    from megatron_rl.train.step import forward_backward
    from megatron_rl.train.trainer import Trainer

    hf = hf_model(tiny_llama_dir)
    seqs = make_minibatch(hf)
    ref, ref_grads = reference(hf, seqs)
    seen = {"loss_func": [], "fused": []}
    loss_func, fused = step._loss_func, ops.fused_clipped_loss

    def spy_loss_func(mb, ctx, objective, output):
        seen["loss_func"].append(output.dtype)
        return loss_func(mb, ctx, objective, output)

    def spy_fused(logits, *args, **kwargs):
        seen["fused"].append(logits.dtype)
        return fused(logits, *args, **kwargs)

    monkeypatch.setattr(step, "_loss_func", spy_loss_func)
    monkeypatch.setattr(step, "fused_clipped_loss", spy_fused)
    trainer = Trainer(make_config(tiny_llama_dir, precision="bf16"))
    trainer.optimizer.zero_grad()
    out = forward_backward(trainer.model, seqs, trainer.ctx)
    assert out.n_micro_batches >= 3
    assert seen["loss_func"] == [torch.bfloat16] * out.n_micro_batches
    assert seen["fused"] == [torch.bfloat16] * out.n_micro_batches  # the RL loss is the fused op
    n = ref["n_loss_tokens"]
    assert out.metrics["n_loss_tokens"] == n
    for key in ("loss", "ratio_mean", "ratio_min", "ratio_max", "entropy", "logprob_mean"):
        assert out.metrics[key] == pytest.approx(ref[key], rel=1e-2, abs=1e-3), key
    for key in ("clip_frac_low", "clip_frac_high"):
        assert abs(out.metrics[key] - ref[key]) <= 1.0 / n + 1e-9, key
    params = dict(trainer.model_chunks[0].named_parameters())
    for meg, hf_name in SAME_LAYOUT.items():
        err = _rel_err(params[meg].main_grad, ref_grads[hf_name])
        assert err < 3e-2, (meg, err)
    ok, grad_norm, _ = trainer.optimizer.step()
    assert ok and grad_norm == pytest.approx(ref["grad_norm"], rel=1e-2)


def test_environment_tokens_of_an_episode_get_no_gradient(tiny_llama_dir):
    """Episodes (records.TrainSequence.loss_mask): the step equals the HF reference whose loss, token
    normaliser and advantage weights count the model's tokens only, and the environment tokens'
    placeholder logprobs can be anything: a masked token gets no gradient."""
    from megatron_rl.train.step import forward_backward
    from megatron_rl.train.trainer import Trainer

    hf = hf_model(tiny_llama_dir)
    seqs = []
    for s in make_minibatch(hf):  # every completion of >= 3 tokens: its middle token(s) are the environment's
        c = s.completion_len
        mask = [1] + [0] * ((c - 1) // 2) + [1] * (c - 1 - (c - 1) // 2)
        seqs.append(dataclasses.replace(s, loss_mask=mask))
    assert all(0 < s.n_loss_tokens < s.completion_len for s in seqs)

    hf.zero_grad()
    weights = torch.tensor([s.n_loss_tokens for s in seqs], dtype=torch.float64)
    adv = torch.tensor([s.advantage for s in seqs], dtype=torch.float64)
    mean = (adv * weights).sum() / weights.sum()
    adv_n = ((adv - mean) / ((((adv - mean) ** 2) * weights).sum() / weights.sum()).sqrt()).float()
    total = 0.0
    for s, a in zip(seqs, adv_n):
        keep = torch.tensor(s.loss_mask, dtype=torch.bool)
        r = torch.exp(hf_completion_logprobs(hf, s) - torch.tensor(s.behaviour_logprobs))[keep]
        total = total + (-torch.minimum(r * a, r.clamp(1 - EPS_LOW, 1 + EPS_HIGH) * a)).sum() / weights.sum()
    total.backward()

    trainer = Trainer(make_config(tiny_llama_dir))
    params = dict(trainer.model_chunks[0].named_parameters())
    grads = []
    for placeholder in (0.0, 5.0):  # what an environment token's "behaviour logprob" holds does not matter
        episode = [dataclasses.replace(s, behaviour_logprobs=[lp if m else placeholder for lp, m in
                                                              zip(s.behaviour_logprobs, s.loss_mask)]) for s in seqs]
        trainer.optimizer.zero_grad()
        out = forward_backward(trainer.model, episode, trainer.ctx)
        grads.append({k: params[k].main_grad.detach().clone() for k in SAME_LAYOUT})
        assert out.metrics["n_loss_tokens"] == sum(s.n_loss_tokens for s in seqs)
    rtol = network_error(transformer_matmuls(2), 384)
    assert out.metrics["loss"] == pytest.approx(float(total), rel=rtol, abs=rtol * 1e-1)
    for meg, hf_name in SAME_LAYOUT.items():
        torch.testing.assert_close(grads[0][meg], hf.get_parameter(hf_name).grad, rtol=rtol, atol=rtol * 1e-2,
                                   msg=lambda m: f"{meg}: {m}")
        torch.testing.assert_close(grads[1][meg], grads[0][meg], rtol=0, atol=0)


def test_rl_steps_raise_logprob_of_positive_sequences(tiny_llama_dir):
    """A few updates: rewarded (A > 0) completions become likelier, penalised ones less likely."""
    from megatron_rl.train.trainer import Trainer

    hf = hf_model(tiny_llama_dir)
    seqs = make_minibatch(hf, n=8, seed=1, noise=0.0)  # on-policy behaviour logprobs
    for i, s in enumerate(seqs):
        s.advantage = 1.0 if i % 2 == 0 else -1.0
    pos, neg = seqs[0::2], seqs[1::2]
    trainer = Trainer(make_config(tiny_llama_dir, micro_batch_tokens=32, lr=3e-3, grad_clip=1.0))
    before_pos = trainer.evaluate(pos, objective="sft")["logprob_mean"]
    before_neg = trainer.evaluate(neg, objective="sft")["logprob_mean"]
    metrics = [trainer.train_on(Batch(seqs, n_mini=2, policy_version=v)) for v in range(3)]
    after_pos = trainer.evaluate(pos, objective="sft")["logprob_mean"]
    after_neg = trainer.evaluate(neg, objective="sft")["logprob_mean"]
    assert after_pos > before_pos + 0.05 and after_neg < before_neg - 0.05
    assert trainer.version == 3 and trainer.step == 6
    first = metrics[0]["steps"][0]
    assert first["ratio_min"] == pytest.approx(1.0, abs=1e-4) and first["ratio_max"] == pytest.approx(1.0, abs=1e-4)
    for m in metrics:
        for key in ("loss", "clip_frac_low", "clip_frac_high", "ratio_mean", "entropy", "grad_norm",
                    "tokens_per_s", "padding_fraction"):
            assert math.isfinite(m[key]), key
        assert 0.0 <= m["padding_fraction"] < m["naive_padding_fraction"]


def test_bad_inputs_raise_clear_errors(tiny_llama_dir):
    from megatron_rl.train.trainer import Trainer

    trainer = Trainer(make_config(tiny_llama_dir, micro_batch_tokens=16))
    long_seq = TrainSequence(list(range(3, 23)), 2, [0.0] * 18, advantage=1.0)
    with pytest.raises(ValueError, match="micro-batch capacity"):
        trainer.train_on(Batch([long_seq], n_mini=1, policy_version=0))
    with pytest.raises(TypeError, match="records.Batch"):
        trainer.train_on([long_seq])
