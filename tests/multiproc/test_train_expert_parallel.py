"""Expert parallel (2 gloo processes, DP=2): a tiny Qwen3-MoE trainer step at EP=2 (two experts per
rank, tokens exchanged by Megatron's allgather token dispatcher, which gloo supports) gives the loss,
metrics, grad norm and every gradient (HF-named, experts gathered over EP) of the same step at EP=1
(all four experts on both ranks, expert grads all-reduced over DP). With the router load-balancing loss
on (trainer.moe_aux_loss_coef) the policy loss is unchanged, the router's gradient changes, and EP=2
still equals EP=1 (the bins' padding, which differs between the two, is kept out of the aux loss).

One torchrun launch of this file (its `__main__` part is the worker) runs every case. The EP=1 step is
checked against HF in tests/unit/test_train_moe.py (logprobs, grads). Tolerance: the SP harness's
(rtol 1e-4, atol 1e-6): EP sums the expert outputs in another order. Bins: under EP every rank runs
the same number of equally long micro-batches (step.prepare_minibatch pads them), which the allgather
dispatcher needs; the sequences here give the two DP ranks different bins, so that path is exercised.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

CASES = {  # name -> trainer keys on top of DP=2
    "ep1": {},
    "ep2": {"expert_parallel": 2},
    "ep1_aux": {"moe_aux_loss_coef": 0.1},
    "ep2_aux": {"expert_parallel": 2, "moe_aux_loss_coef": 0.1},
}


def _config(model_dir: str, **keys):
    from megatron_rl.config import config_from_dict

    return config_from_dict({
        "trainer": {"model": model_dir, "precision": "fp32", "micro_batch_tokens": 25, "data_parallel": 2,
                    "lr": 1e-2, "grad_clip": 1e6, **keys,
                    # grads all-reduced, not reduce-scattered: every rank then holds every full gradient
                    # (expert grads are DP-sharded at EP=1 and whole at EP=2 under the distributed optimizer)
                    "distributed_optimizer": False},
        "algo": {"eps_low": 0.2, "eps_high": 0.28}})


def worker(root: Path) -> None:
    import torch.distributed as dist

    from megatron_rl.records import TrainSequence
    from megatron_rl.train.hf_weights import export_hf_tensors
    from megatron_rl.train.parallel import destroy_parallel
    from megatron_rl.train.step import forward_backward
    from megatron_rl.train.trainer import Trainer

    torch.set_num_threads(1)
    spec = json.loads((root / "spec.json").read_text())
    seqs = [TrainSequence(**d) for d in spec["seqs"]]
    for name, keys in CASES.items():
        trainer = Trainer(_config(spec["model_dir"], **keys))
        experts = trainer.model_chunks[0].decoder.layers[0].mlp.experts.num_local_experts
        trainer.optimizer.zero_grad()
        out = forward_backward(trainer.model, seqs, trainer.ctx)
        grads = dict(export_hf_tensors(trainer.model_chunks, grads=True))  # experts gathered over EP
        ok, grad_norm, _ = trainer.optimizer.step()
        torch.save({"metrics": out.metrics, "grads": grads, "grad_norm": float(grad_norm), "ok": ok,
                    "local_experts": experts}, root / f"{name}.rank{dist.get_rank()}.pt")
        destroy_parallel()
    print("WORKER OK", flush=True)


# ---------------------------------------------------------------- the test (pytest side)

def test_expert_parallel_equals_ep1(tmp_path):
    import pytest

    from support.torchrun import run_two_ranks
    from support.train_models import make_tiny_moe
    from unit.test_train_step import hf_model, make_minibatch

    model_dir = make_tiny_moe(tmp_path / "moe", experts=4, topk=2)
    seqs = make_minibatch(hf_model(model_dir), n=6, seed=0)
    (tmp_path / "spec.json").write_text(json.dumps(
        {"model_dir": str(model_dir), "seqs": [dataclasses.asdict(s) for s in seqs]}))
    run_two_ranks(__file__, tmp_path, env={"CUDA_VISIBLE_DEVICES": ""}, timeout=900)

    got = {name: [torch.load(tmp_path / f"{name}.rank{r}.pt", weights_only=False) for r in range(2)]
           for name in CASES}
    assert [r["local_experts"] for r in got["ep1"] + got["ep2"]] == [4, 4, 2, 2]
    base = got["ep1"][0]
    for r in got["ep2"] + got["ep1"][1:]:
        assert r["ok"]
        for key in ("loss", "clip_frac_low", "clip_frac_high", "ratio_mean", "entropy", "logprob_mean",
                    "n_loss_tokens"):
            assert r["metrics"][key] == pytest.approx(base["metrics"][key], rel=1e-4, abs=1e-5), key
        assert r["grad_norm"] == pytest.approx(base["grad_norm"], rel=1e-4)
        assert r["grads"].keys() == base["grads"].keys()
        for param, g in r["grads"].items():
            torch.testing.assert_close(g, base["grads"][param], rtol=1e-4, atol=1e-6, msg=lambda m: f"{param}: {m}")
    # with the aux loss: the policy loss and its metrics are unchanged (the aux loss only adds gradient),
    # and EP=2 gives EP=1's gradients although EP pads every rank's bins to a common length and count
    # (the padding is kept out of the aux loss: tests/unit/test_train_moe_aux_loss.py)
    for r in got["ep1_aux"] + got["ep2_aux"]:
        for key in ("loss", "entropy", "n_loss_tokens"):
            assert r["metrics"][key] == pytest.approx(base["metrics"][key], rel=1e-4, abs=1e-5), key
    aux = got["ep1_aux"][0]
    for r in got["ep2_aux"] + got["ep1_aux"][1:]:
        assert r["grad_norm"] == pytest.approx(aux["grad_norm"], rel=1e-4)
        for param, g in r["grads"].items():
            torch.testing.assert_close(g, aux["grads"][param], rtol=1e-4, atol=1e-6, msg=lambda m: f"{param}: {m}")
    router = "model.layers.0.mlp.gate.weight"
    assert any(".experts.3." in n for n in got["ep2"][0]["grads"])  # the other rank's experts gathered
    assert float(got["ep1"][0]["grads"][router].abs().max()) > 1e-6
    # the aux loss reaches the router: its gradient changes (the policy loss itself does not)
    assert not torch.allclose(got["ep1_aux"][0]["grads"][router], got["ep1"][0]["grads"][router])


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
