"""The whole RL step on CUDA (loss, gradients, one optimizer step) against the HF reference on CUDA,
and every tensor the loss and the collectives see on the GPU (issue 14: micro-batches used to be built
on the CPU and metric all-reduces sent CPU tensors over NCCL; the CPU shims hid both).

Like test_train_step.test_loss_metrics_and_gradients_match_hf_reference, with the Trainer on the GPU
(init_parallel: NCCL, cuda:LOCAL_RANK; Megatron's fusions where the kernels exist) and HF there too.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from test_train_step import EPS_HIGH, EPS_LOW, SAME_LAYOUT, hf_model, make_config, make_minibatch  # noqa: E402

pytestmark = pytest.mark.gpu


def _hf_logprobs(model, seq, device):
    ids = torch.tensor(seq.token_ids, device=device)[None]
    logp_all = torch.log_softmax(model(ids).logits[0].float(), -1)
    pos = torch.arange(seq.prompt_len - 1, len(seq.token_ids) - 1, device=device)
    return logp_all[pos, ids[0, pos + 1]], -(logp_all[pos].exp() * logp_all[pos]).sum(-1)


def _reference_on(model, seqs, device):
    """test_train_step.reference with every tensor on `device`: loss, metrics and HF gradients."""
    model.zero_grad()
    lens = torch.tensor([s.completion_len for s in seqs], dtype=torch.float64, device=device)
    adv = torch.tensor([s.advantage for s in seqs], dtype=torch.float64, device=device)
    mean = (adv * lens).sum() / lens.sum()
    std = ((((adv - mean) ** 2) * lens).sum() / lens.sum()).sqrt()
    adv_n = ((adv - mean) / std).float()
    n_tok = int(lens.sum())
    total, ratios, ents, lps, low, high = 0.0, [], [], [], 0, 0
    for s, a in zip(seqs, adv_n):
        lp, ent = _hf_logprobs(model, s, device)
        r = torch.exp(lp - torch.tensor(s.behaviour_logprobs, device=device))
        total = total - torch.minimum(r * a, r.clamp(1 - EPS_LOW, 1 + EPS_HIGH) * a).sum() / n_tok
        rd = r.detach()
        ratios.append(rd), ents.append(ent.detach()), lps.append(lp.detach())
        low += int(((rd < 1 - EPS_LOW) & (a < 0)).sum())
        high += int(((rd > 1 + EPS_HIGH) & (a > 0)).sum())
    total.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    r = torch.cat(ratios)
    return {"loss": float(total), "clip_frac_low": low / n_tok, "clip_frac_high": high / n_tok,
            "ratio_mean": float(r.mean()), "ratio_min": float(r.min()), "ratio_max": float(r.max()),
            "entropy": float(torch.cat(ents).mean()), "logprob_mean": float(torch.cat(lps).mean()),
            "n_loss_tokens": n_tok,
            "grad_norm": math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values()))}, grads


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


# fp32: the tolerances of the CPU test; bf16 (what GPU runs use): those of test_bf16_step_matches_fp32_...
# (bf16 rounding of weights and activations; a wrong sign, normaliser or missing token moves them by O(1)).
TOL = {"fp32": dict(metric=1e-4, grad=1e-4), "bf16": dict(metric=1e-2, grad=3e-2)}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_rl_step_on_cuda_matches_hf_reference_on_cuda(tiny_llama_dir, monkeypatch, precision):
    import torch.distributed as dist

    from megatron_rl.train import step
    from megatron_rl.train.device import model_device
    from megatron_rl.train.model import te_available
    from megatron_rl.train.parallel import destroy_parallel
    from megatron_rl.train.trainer import Trainer
    from support.collectives import spy_collectives

    if precision == "fp32" and te_available():
        pytest.skip("fp32 under Transformer Engine: no TE attention backend takes float32 THD input")
    if dist.is_initialized() and dist.get_backend() != "nccl":  # a group left by a gloo test: start over
        destroy_parallel(destroy_process_group=True)
    device = torch.device("cuda", torch.cuda.current_device())
    hf_cpu = hf_model(tiny_llama_dir)
    seqs = make_minibatch(hf_cpu)  # the data (behaviour logprobs from the CPU copy: any values will do)
    hf = hf_cpu.to(device)
    ref, ref_grads = _reference_on(hf, seqs, device)
    assert 0 < ref["clip_frac_low"] + ref["clip_frac_high"] < 1  # both branches exercised

    seen = {"mb": [], "out": [], "collective": []}
    loss_func = step._loss_func

    def spy_loss(mb, ctx, objective, output):
        seen["mb"].append({f.name: getattr(mb, f.name).device for f in dataclasses.fields(mb)
                           if isinstance(getattr(mb, f.name), torch.Tensor)})
        loss, count, stats = loss_func(mb, ctx, objective, output)
        seen["out"].append([output.device, loss.device, count.device] + [t.device for t in stats.values()])
        return loss, count, stats

    monkeypatch.setattr(step, "_loss_func", spy_loss)
    trainer = Trainer(make_config(tiny_llama_dir, precision=precision))
    assert dist.get_backend() == "nccl" and model_device(trainer.model).type == "cuda"
    spy_collectives(monkeypatch, seen["collective"])
    trainer.optimizer.zero_grad()
    out = step.forward_backward(trainer.model, seqs, trainer.ctx)
    assert out.n_micro_batches >= 3 and len(seen["mb"]) == out.n_micro_batches
    for fields in seen["mb"]:  # tokens, positions, cu_seqlens, labels, masks, logprobs, advantages...
        assert {"tokens", "position_ids", "cu_seqlens", "segment_ids"} <= set(fields)
        assert all(d.type == "cuda" for d in fields.values()), fields
    assert all(d.type == "cuda" for devices in seen["out"] for d in devices), seen["out"]
    assert seen["collective"] and all(d.type == "cuda" for _, d in seen["collective"]), seen["collective"]

    tol = TOL[precision]
    n = ref["n_loss_tokens"]
    assert out.metrics["n_loss_tokens"] == n
    for key in ("loss", "ratio_mean", "ratio_min", "ratio_max", "entropy", "logprob_mean"):
        assert out.metrics[key] == pytest.approx(ref[key], rel=tol["metric"], abs=tol["metric"] / 10), key
    for key in ("clip_frac_low", "clip_frac_high"):  # counts: a ratio at a clip boundary may flip one token
        assert abs(out.metrics[key] - ref[key]) <= 1.0 / n + 1e-9, key  # (bf16 rounding, GPU reduction order)
    params = dict(trainer.model_chunks[0].named_parameters())
    for meg, hf_name in SAME_LAYOUT.items():  # these names exist under the TE spec and the local one
        assert _rel_err(params[meg].main_grad, ref_grads[hf_name]) < tol["grad"], meg
    before = params["output_layer.weight"].detach().float().clone()
    ok, grad_norm, _ = trainer.optimizer.step()
    assert ok and grad_norm == pytest.approx(ref["grad_norm"], rel=tol["metric"])
    assert not torch.equal(params["output_layer.weight"].detach().float(), before)  # the step moved weights
