"""Sequence parallel at TP=2 (2 gloo processes): logits, loss, metrics and every gradient equal those
of TP=2 without sequence parallel, on packed multi-sequence bins whose token counts are odd (packing
must pad them to a multiple of TP, since SP splits the bin's tokens over the TP ranks). Also with full
activation recompute on top of SP (the recomputed layer inputs are then SP shards).

One torchrun launch of this file (its `__main__` part is the worker) runs every case; the TP=2 step
without SP is itself checked against HF autograd in tests/multiproc/test_train_step_parallel.py.
Tolerance: that harness's (rtol 1e-4, atol 1e-6): SP changes the reduction order (reduce-scatter of
partial sums, norm-weight grads summed over the two token halves), so float32 rounding differs.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

CASES = {  # name -> trainer keys on top of TP=2
    "tp2": {},
    "tp2_sp": {"sequence_parallel": True},
    "tp2_sp_full": {"sequence_parallel": True, "recompute": "full", "recompute_num_layers": 2},
}
MICRO_BATCH_TOKENS = 25  # odd: bins of several sequences with an odd token count


def _config(model_dir: str, **keys):
    from megatron_rl.config import config_from_dict

    return config_from_dict({
        "trainer": {"model": model_dir, "precision": "fp32", "micro_batch_tokens": MICRO_BATCH_TOKENS,
                    "lr": 1e-2, "grad_clip": 1e6, "tensor_parallel": 2, **keys},
        "algo": {"eps_low": 0.2, "eps_high": 0.28}})


def _full(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """`g` (of parameter `p`) all-gathered over TP along its partition dim when TP-split."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not getattr(p, "tensor_model_parallel", False):
        return g
    parts = [torch.empty_like(g) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, g.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=p.partition_dim)


def worker(root: Path) -> None:
    import torch.distributed as dist

    from megatron_rl.records import TrainSequence
    from megatron_rl.train.parallel import destroy_parallel
    from megatron_rl.train.step import _forward, forward_backward, prepare_minibatch
    from megatron_rl.train.trainer import Trainer

    torch.set_num_threads(1)
    spec = json.loads((root / "spec.json").read_text())
    seqs = [TrainSequence(**d) for d in spec["seqs"]]
    for name, keys in CASES.items():
        trainer = Trainer(_config(spec["model_dir"], **keys))
        chunk = trainer.model_chunks[0]
        prepared = prepare_minibatch(trainer.model, seqs, trainer.ctx)
        bins = [dict(length=mb.length, real=mb.n_real_tokens, n_seqs=len(mb.seq_indices))
                for mb in prepared.packed.micro_batches]
        with torch.no_grad():  # the logits of every bin, gathered over the vocab shards
            logits = [_full(chunk.output_layer.weight, _forward(m, mb, trainer.ctx.use_thd)[0].transpose(0, 1))
                      .transpose(0, 1) for m, mb in zip(trainer.model, prepared.packed.micro_batches)]
        trainer.optimizer.zero_grad()
        out = forward_backward(trainer.model, seqs, trainer.ctx)
        grads = {n: _full(p, p.main_grad.detach()) for n, p in chunk.named_parameters()}
        ok, grad_norm, _ = trainer.optimizer.step()
        torch.save({"metrics": out.metrics, "grads": grads, "grad_norm": float(grad_norm), "ok": ok,
                    "bins": bins, "logits": [x[:b["real"]] for x, b in zip(logits, bins)],
                    "sp": chunk.config.sequence_parallel},
                   root / f"{name}.rank{dist.get_rank()}.pt")
        destroy_parallel()
    print("WORKER OK", flush=True)


# ---------------------------------------------------------------- the test (pytest side)

def test_sequence_parallel_equals_tp2_without_it(tiny_llama_dir, tmp_path):
    import pytest

    from support.torchrun import run_two_ranks
    from unit.test_train_step import hf_model, make_minibatch

    seqs = make_minibatch(hf_model(tiny_llama_dir), n=6, seed=0)
    (tmp_path / "spec.json").write_text(json.dumps(
        {"model_dir": str(tiny_llama_dir), "seqs": [dataclasses.asdict(s) for s in seqs]}))
    run_two_ranks(__file__, tmp_path, env={"CUDA_VISIBLE_DEVICES": ""})

    got = {name: [torch.load(tmp_path / f"{name}.rank{r}.pt", weights_only=False) for r in range(2)]
           for name in CASES}
    base = got["tp2"][0]
    assert not base["sp"] and all(got[n][0]["sp"] for n in CASES if n != "tp2")
    # the packing: several bins holding several sequences each, some with an odd token count; with SP
    # every bin is padded to a multiple of TP=2, without SP it is not padded at all
    assert len(base["bins"]) >= 2 and any(b["n_seqs"] >= 2 and b["real"] % 2 for b in base["bins"])
    assert all(b["length"] == b["real"] for b in base["bins"])
    for name in CASES:
        for r in got[name]:
            assert [b["real"] for b in r["bins"]] == [b["real"] for b in base["bins"]]
            if r["sp"]:
                assert all(b["length"] % 2 == 0 and b["length"] - b["real"] <= 1 for b in r["bins"])
            assert r["ok"]
            for want, have in zip(base["logits"], r["logits"]):
                torch.testing.assert_close(have, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} logits: {m}")
            for key in ("loss", "clip_frac_low", "clip_frac_high", "ratio_mean", "ratio_min", "ratio_max",
                        "entropy", "logprob_mean", "n_loss_tokens"):
                assert r["metrics"][key] == pytest.approx(base["metrics"][key], rel=1e-4, abs=1e-5), (name, key)
            assert r["grad_norm"] == pytest.approx(base["grad_norm"], rel=1e-4), name
            assert r["grads"].keys() == base["grads"].keys()
            for param, g in r["grads"].items():
                torch.testing.assert_close(g, base["grads"][param], rtol=1e-4, atol=1e-6,
                                           msg=lambda m: f"{name} {param}: {m}")
    # the norm weights are the parameters SP changes most (their grads are summed over the token
    # shards of both TP ranks): nonzero, so the comparison above is not vacuous
    norm = "decoder.final_layernorm.weight"
    assert float(base["grads"][norm].abs().max()) > 1e-6


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
