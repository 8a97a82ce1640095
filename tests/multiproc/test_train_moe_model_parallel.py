"""MoE with tensor, pipeline and context parallel (2 gloo processes): a tiny Qwen3-MoE trainer step at TP=2 with
sequence parallel and EP=2 over the TP ranks (Megatron's MoE layer needs SP under TP; moe.py refuses
TP > 1 at EP=1, where Megatron would not sum the whole experts' grads over the TP ranks' token halves)
and at PP=2 (one layer per stage), and at CP=2 gives the loss,
metrics, grad norm and every gradient (HF-named, TP-gathered; the two PP stages' names together) of
the same minibatch at DP=2, EP=1 (tests/multiproc/test_train_expert_parallel.py; its single-rank step
equals HF in tests/unit/test_train_moe.py). TP=2 and PP=2 each run the whole minibatch in one DP rank,
so their bins are the same (padded differently: SP to a multiple of TP, PP to a common length) and with
the router load-balancing loss on their steps equal each other too (the padding is kept out of it).
CP=2 with the aux loss did not (its gradient was neither CP=1's nor a multiple of it): moe.py refuses it.
Tolerance: the SP harness's (rtol 1e-4, atol 1e-6).
"""
from __future__ import annotations

import sys
from pathlib import Path

CASES = {  # name -> trainer keys
    "dp2": {"data_parallel": 2},
    "tp2_sp_ep2": {"tensor_parallel": 2, "sequence_parallel": True, "expert_parallel": 2},
    "pp2": {"pipeline_parallel": 2},
    "cp2": {"context_parallel": 2},
    "tp2_sp_ep2_aux": {"tensor_parallel": 2, "sequence_parallel": True, "expert_parallel": 2,
                       "moe_aux_loss_coef": 0.1},
    "pp2_aux": {"pipeline_parallel": 2, "moe_aux_loss_coef": 0.1},
}


def _stages_joined(records: list[dict]) -> dict:
    """A PP run's record with both stages' gradients in one dict (metrics are the same on both)."""
    assert not records[0]["grads"].keys() & records[1]["grads"].keys()
    return {**records[0], "grads": {**records[0]["grads"], **records[1]["grads"]}}


def test_moe_tp2_pp2_cp2_equal_dp2(tmp_path):
    import torch

    from support.moe_steps import assert_same_step, run_moe_cases

    got = run_moe_cases(__file__, tmp_path, CASES)
    base = got["dp2"][0]
    assert_same_step(got["dp2"][1], base, "dp2 rank 1")
    for r in got["tp2_sp_ep2"]:
        assert_same_step(r, base, "tp2_sp_ep2")
    assert_same_step(_stages_joined(got["pp2"]), base, "pp2")
    for r in got["cp2"]:
        assert_same_step(r, base, "cp2")
    # the aux loss: the two layouts agree with each other, and it does change the router's gradient
    tp_aux, pp_aux = got["tp2_sp_ep2_aux"], _stages_joined(got["pp2_aux"])
    for r in tp_aux:
        assert_same_step(r, pp_aux, "tp2_sp_ep2_aux vs pp2_aux")
    router = "model.layers.1.mlp.gate.weight"
    assert not torch.allclose(pp_aux["grads"][router], base["grads"][router])


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for `support`
    from support.moe_steps import moe_worker

    moe_worker(Path(sys.argv[1]), CASES)
