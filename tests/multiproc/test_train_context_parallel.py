"""Context parallel at CP=2 (2 gloo processes) equals CP=1 (DP=2 on the same 2 processes): per-sequence
logits and trainer logprobs (collect_logprobs), the RL step's loss and metrics, every gradient, the
gradient norm and the weights after the optimizer step, on packed bins holding several sequences of
uneven lengths, one of them (3 tokens) shorter than the 2*CP = 4 chunks it is cut into and one a
two-turn episode whose environment tokens carry no loss (loss_mask). Twice: a tiny
Llama, and a tiny Mistral whose sliding window (4 keys) is shorter than most sequences (so the CP chunks'
windows cut their key prefixes; its DP=2 logits are also checked against HF transformers directly).

CP=1 at DP=2 is the reference: the DP=2 step is itself checked against HF autograd in
tests/multiproc/test_train_step_parallel.py. Under CP each rank holds its load-balanced chunks of every
sequence; the logits are put back in row order with `packing.cp_token_index` (tests/support/context_parallel.py),
independently of the attention's own bookkeeping. Tolerance: the harness's (rtol 1e-4, atol 1e-6): CP sums gradients
over ranks in another order and attends in blocks merged by log-sum-exp over gathered keys; weights
after the step are compared where the gradient exceeds its own tolerance (Adam's first step
normalises near-zero gradients, see below).
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

# no distributed optimizer: every rank then holds the whole all-reduced gradient
CASES = {"dp2": {"data_parallel": 2}, "cp2": {"context_parallel": 2}}
MICRO_BATCH_TOKENS = 32
WINDOW = 4  # Mistral's sliding_window: a token sees itself and 3 keys back


def _config(model_dir: str, precision: str = "fp32", **keys):
    from megatron_rl.config import config_from_dict

    return config_from_dict({
        "trainer": {"model": model_dir, "precision": precision, "micro_batch_tokens": MICRO_BATCH_TOKENS,
                    "lr": 1e-2, "grad_clip": 1e6, "distributed_optimizer": False, **keys},
        "algo": {"eps_low": 0.2, "eps_high": 0.28}})


def worker(root: Path) -> None:
    import torch.distributed as dist

    from megatron_rl.records import TrainSequence
    from megatron_rl.train.parallel import destroy_parallel
    from megatron_rl.train.step import _forward, collect_logprobs, forward_backward, prepare_minibatch
    from megatron_rl.train.trainer import Trainer
    from support.context_parallel import per_sequence, row_order

    torch.set_num_threads(1)
    spec = json.loads((root / "spec.json").read_text())
    seqs = [TrainSequence(**d) for d in spec["seqs"]]
    for name, keys in CASES.items():
        trainer = Trainer(_config(spec["model_dir"], spec.get("precision", "fp32"), **keys))
        chunk = trainer.model_chunks[0]
        prepared = prepare_minibatch(trainer.model, seqs, trainer.ctx)
        mbs = prepared.packed.micro_batches
        with torch.no_grad():
            logits = per_sequence(prepared, [row_order(_forward(chunk, mb, trainer.ctx.use_thd)[0], mb) for mb in mbs])
        collect_logprobs(trainer.model, prepared, trainer.ctx, "proximal_logprobs")
        logprobs = per_sequence(prepared, [row_order(mb.proximal_logprobs[0], mb) for mb in mbs])
        bins = [dict(local=mb.length, cu=mb.cu_seqlens.tolist(), n_seqs=len(mb.seq_indices)) for mb in mbs]
        trainer.optimizer.zero_grad()
        out = forward_backward(trainer.model, prepared, trainer.ctx)
        grads = {n: p.main_grad.detach().float().cpu() for n, p in chunk.named_parameters()}
        ok, grad_norm, _ = trainer.optimizer.step()
        weights = {n: p.detach().float().cpu() for n, p in chunk.named_parameters()}
        reload = None
        if chunk.config.context_parallel_size > 1 and spec["reload"]:  # a CP checkpoint loads back whole
            path = trainer.save(root / "ckpt")
            with torch.no_grad():
                for p in chunk.parameters():
                    p.zero_()
            trainer.load(path)
            back = all(torch.equal(p.float().cpu(), weights[n]) for n, p in chunk.named_parameters())
            reload = {"weights_back": back,
                      "rng_restored": trainer.last_load.rng_restored,
                      "optimizer_loaded": trainer.last_load.optimizer_loaded}
        torch.save({"metrics": out.metrics, "grads": grads, "grad_norm": float(grad_norm), "ok": ok,
                    "weights": weights, "bins": bins, "logits": logits, "logprobs": logprobs,
                    "cp": chunk.config.context_parallel_size, "reload": reload,
                    "te": type(chunk.decoder.layers[0].self_attention.core_attention).__name__},
                   root / f"{name}.rank{dist.get_rank()}.pt")
        destroy_parallel()
    print("WORKER OK", flush=True)


# ---------------------------------------------------------------- the test (pytest side)

def _minibatch(model_dir):
    from megatron_rl.records import TrainSequence
    from unit.test_train_step import hf_completion_logprobs, hf_model, make_minibatch

    model = hf_model(model_dir)
    seqs = make_minibatch(model, n=7, seed=1)
    short = TrainSequence([5, 9, 14], 2, [0.0], advantage=0.7)  # 3 tokens: under 2*CP chunks
    with torch.no_grad():
        short.behaviour_logprobs = (hf_completion_logprobs(model, short) - 0.1).tolist()
    # A two-turn episode: its environment tokens (mask 0) carry the placeholder logprob 0.0, which would be
    # clipped and counted if either layout trained them; its chunks straddle the turn boundary.
    longest = max(seqs, key=lambda s: s.completion_len)
    n = longest.completion_len
    mask = [1] * (n // 3) + [0] * (n // 3) + [1] * (n - 2 * (n // 3))
    episode = dataclasses.replace(longest, loss_mask=mask, advantage=-0.4, behaviour_logprobs=[
        lp if m else 0.0 for lp, m in zip(longest.behaviour_logprobs, mask)])
    return seqs[:3] + [short] + seqs[3:] + [episode]


@pytest.mark.parametrize("family", ["llama", "mistral_window"])
def test_context_parallel_equals_cp1(request, tmp_path, family):
    from support.torchrun import run_two_ranks
    from support.train_models import make_tiny_hf
    from unit.test_train_step import hf_model

    window = family == "mistral_window"
    model_dir = (make_tiny_hf(tmp_path / "mistral", family="mistral", sliding_window=WINDOW) if window
                 else request.getfixturevalue("tiny_llama_dir"))
    seqs = _minibatch(model_dir)
    (tmp_path / "spec.json").write_text(json.dumps(
        {"model_dir": str(model_dir), "seqs": [dataclasses.asdict(s) for s in seqs],
         "reload": not window}))  # the checkpoint round trip is checked once, on the Llama
    run_two_ranks(__file__, tmp_path, env={"CUDA_VISIBLE_DEVICES": ""})

    got = {name: [torch.load(tmp_path / f"{name}.rank{r}.pt", weights_only=False) for r in range(2)]
           for name in CASES}
    base = got["dp2"][0]
    assert base["cp"] == 1 and all(r["cp"] == 2 for r in got["cp2"])
    # CP: every segment a multiple of 2*CP, each rank holding half of each bin; bins of several sequences
    for r in got["cp2"]:
        assert any(b["n_seqs"] >= 3 for b in r["bins"])
        for b in r["bins"]:
            assert all((e - a) % 4 == 0 for a, e in zip(b["cu"], b["cu"][1:])) and b["local"] * 2 == b["cu"][-1]
    assert sorted(base["logits"]) == list(range(len(seqs)))
    # only sampled tokens carry loss, in both layouts (the episode's environment tokens do not)
    assert 0 in seqs[-1].loss_mask
    for name in CASES:
        for r in got[name]:
            assert r["metrics"]["n_loss_tokens"] == sum(s.n_loss_tokens for s in seqs), name
    # the DP=2 reference holds the episode's prompt once with the sequence it was made from (one group,
    # dealt whole); CP never shares: the two layouts compute the same sequences from different rows
    assert base["metrics"]["shared_prompt_fraction"] > 0
    assert all(r["metrics"]["shared_prompt_fraction"] == 0 for r in got["cp2"])
    for r in got["cp2"]:
        assert window or r["reload"] == {"weights_back": True, "rng_restored": True, "optimizer_loaded": True}
    if window:  # the reference itself: each sequence alone through HF, windowed (sequences up to 12 tokens)
        assert max(len(s.token_ids) for s in seqs) > WINDOW + 4
        hf = hf_model(model_dir)
        assert hf.config.sliding_window == WINDOW
        with torch.no_grad():
            for i, s in enumerate(seqs):
                ref = hf(torch.tensor([s.token_ids])).logits[0].float()
                torch.testing.assert_close(base["logits"][i][:, :ref.shape[-1]], ref, rtol=1e-4, atol=2e-5,
                                           msg=lambda m: f"HF logits of sequence {i}: {m}")
    for name in CASES:
        for r in got[name]:
            assert r["ok"]
            for i, s in enumerate(seqs):
                torch.testing.assert_close(r["logits"][i], base["logits"][i], rtol=1e-4, atol=1e-5,
                                           msg=lambda m: f"{name} logits of sequence {i}: {m}")
                n = len(s.token_ids)
                torch.testing.assert_close(r["logprobs"][i][s.prompt_len - 1:n - 1],
                                           base["logprobs"][i][s.prompt_len - 1:n - 1], rtol=1e-4, atol=1e-5)
            for key in ("loss", "clip_frac_low", "clip_frac_high", "ratio_mean", "ratio_min", "ratio_max",
                        "entropy", "logprob_mean", "n_loss_tokens", "tokens", "n_sequences"):
                assert r["metrics"][key] == pytest.approx(base["metrics"][key], rel=1e-4, abs=1e-5), (name, key)
            assert r["grad_norm"] == pytest.approx(base["grad_norm"], rel=1e-4), name
            for param, g in r["grads"].items():
                torch.testing.assert_close(g, base["grads"][param], rtol=1e-4, atol=1e-6,
                                           msg=lambda m: f"{name} grad {param}: {m}")
                # Adam's first step is lr * g / (|g| + eps): where |g| is within the gradient tolerance (1e-6)
                # of zero, e.g. ~1e-8 = eps, a rounding difference of 1e-11 in g moves the step by ~1e-3 of
                # the learning rate (1e-2), so those elements' weights are not compared (0.1 % of them here;
                # zero gradients, e.g. unused vocabulary rows, are compared: no step on either side)
                g_base = base["grads"][param]
                pinned = (g_base.abs() > 1e-6) | (g_base == 0)
                torch.testing.assert_close(r["weights"][param][pinned], base["weights"][param][pinned],
                                           rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} weight {param}: {m}")
    # the attention weights' gradients reach across chunks (K/V of one rank, queries of the other)
    assert float(base["grads"]["decoder.layers.0.self_attention.linear_qkv.weight"].abs().max()) > 1e-6


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for `support`
    worker(Path(sys.argv[1]))
