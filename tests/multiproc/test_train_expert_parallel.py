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

import sys
from pathlib import Path

import torch

CASES = {  # name -> trainer keys (DP=2 throughout)
    "ep1": {"data_parallel": 2},
    "ep2": {"data_parallel": 2, "expert_parallel": 2},
    "ep1_aux": {"data_parallel": 2, "moe_aux_loss_coef": 0.1},
    "ep2_aux": {"data_parallel": 2, "expert_parallel": 2, "moe_aux_loss_coef": 0.1},
}


def _local_experts(trainer) -> dict:
    return {"local_experts": trainer.model_chunks[0].decoder.layers[0].mlp.experts.num_local_experts}


def test_expert_parallel_equals_ep1(tmp_path):
    import pytest

    from support.moe_steps import assert_same_step, run_moe_cases

    got = run_moe_cases(__file__, tmp_path, CASES)
    assert [r["local_experts"] for r in got["ep1"] + got["ep2"]] == [4, 4, 2, 2]
    base = got["ep1"][0]
    for r in got["ep2"] + got["ep1"][1:]:
        assert_same_step(r, base, "ep2 vs ep1")
    # with the aux loss: the policy loss and its metrics are unchanged (the aux loss only adds gradient),
    # and EP=2 gives EP=1's gradients although EP pads every rank's bins to a common length and count
    # (the padding is kept out of the aux loss: tests/unit/test_train_moe_aux_loss.py)
    for r in got["ep1_aux"] + got["ep2_aux"]:
        for key in ("loss", "entropy", "n_loss_tokens"):
            assert r["metrics"][key] == pytest.approx(base["metrics"][key], rel=1e-4, abs=1e-5), key
    for r in got["ep2_aux"] + got["ep1_aux"][1:]:
        assert_same_step(r, got["ep1_aux"][0], "ep2 vs ep1 with the aux loss")
    router = "model.layers.0.mlp.gate.weight"
    assert any(".experts.3." in n for n in got["ep2"][0]["grads"])  # the other rank's experts gathered
    assert float(got["ep1"][0]["grads"][router].abs().max()) > 1e-6
    # the aux loss reaches the router: its gradient changes (the policy loss itself does not)
    assert not torch.allclose(got["ep1_aux"][0]["grads"][router], got["ep1"][0]["grads"][router])


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for `support`
    from support.moe_steps import moe_worker

    moe_worker(Path(sys.argv[1]), CASES, extra=_local_experts)
