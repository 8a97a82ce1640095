"""MoE with tensor, pipeline and context parallel (2 gloo processes): a tiny Qwen3-MoE trainer step at TP=2
with sequence parallel (Megatron's MoE layer needs SP under TP) at EP=1 (experts whole on both TP ranks,
each seeing its SP half of the tokens: moe.reduce_expert_grads_over_expert_dp sums their grads over the TP
ranks) and at EP=2 over the TP ranks, at PP=2 (one layer per stage) and at CP=2 gives the loss, metrics,
grad norm and every gradient (HF-named, TP-gathered; the two PP stages' names together) of the same
minibatch at DP=2, EP=1 (tests/multiproc/test_train_expert_parallel.py; its single-rank step equals HF in
tests/unit/test_train_moe.py). TP=2 at EP=1 under the distributed optimizer (experts sharded over the
expert-data-parallel group, here the TP ranks) gives DP=2's metrics and grad norm, and the weights of the
plain optimizer's step.

The router load-balancing loss is per micro-batch (f_i and P_i of one packed bin), so layouts agree on it
only when they pack the same bins. TP=2, PP=2 and CP=2 each run the whole minibatch in one DP rank, but CP
pads every sequence to a multiple of 2*CP before packing, which can group the sequences differently
(at 25-token bins it does: that was the CP=2 "mismatch" once refused). At AUX_BIN tokens CP=1 and CP=2
pack the same bins (asserted), and with the aux loss on TP=2 (EP=2) and CP=2 equal PP=2 (TP=1, CP=1: the
single-rank loss, whose per-layer value is checked against the hand-written Switch loss in
tests/unit/test_train_moe_aux_loss.py); the padding (SP, PP and CP each pad differently) is kept out of it.
Tolerance: the SP harness's (rtol 1e-4, atol 1e-6).
"""
from __future__ import annotations

import sys
from pathlib import Path

AUX_BIN = 48  # micro_batch_tokens at which this minibatch packs into the same 2 bins at CP=1 and CP=2
AUX = {"moe_aux_loss_coef": 0.1, "micro_batch_tokens": AUX_BIN}
CASES = {  # name -> trainer keys
    "dp2": {"data_parallel": 2},
    "tp2_sp": {"tensor_parallel": 2, "sequence_parallel": True},
    "tp2_sp_distopt": {"tensor_parallel": 2, "sequence_parallel": True, "distributed_optimizer": True},
    "tp2_sp_ep2": {"tensor_parallel": 2, "sequence_parallel": True, "expert_parallel": 2},
    "pp2": {"pipeline_parallel": 2},
    "cp2": {"context_parallel": 2},
    "pp2_aux": {"pipeline_parallel": 2, **AUX},
    "tp2_sp_ep2_aux": {"tensor_parallel": 2, "sequence_parallel": True, "expert_parallel": 2, **AUX},
    "cp2_aux": {"context_parallel": 2, **AUX},
}


def _stages_joined(records: list[dict]) -> dict:
    """A PP run's record with both stages' gradients in one dict (metrics are the same on both)."""
    assert not records[0]["grads"].keys() & records[1]["grads"].keys()
    return {**records[0], "grads": {**records[0]["grads"], **records[1]["grads"]}}


def _bins(tmp_path: Path, cp: int) -> list[list[int]]:
    import json

    from megatron_rl.records import TrainSequence
    from megatron_rl.train.packing import pack_sequences

    seqs = [TrainSequence(**d) for d in json.loads((tmp_path / "spec.json").read_text())["seqs"]]
    return [mb.seq_indices for mb in pack_sequences(seqs, AUX_BIN, cp=(cp, 0)).micro_batches]


def test_moe_tp2_pp2_cp2_equal_dp2(tmp_path):
    import pytest
    import torch

    from support.moe_steps import METRICS, assert_same_step, run_moe_cases

    got = run_moe_cases(__file__, tmp_path, CASES)
    base = got["dp2"][0]
    assert_same_step(got["dp2"][1], base, "dp2 rank 1")
    for name in ("tp2_sp", "tp2_sp_ep2", "cp2"):
        for r in got[name]:
            assert_same_step(r, base, name)
    assert_same_step(_stages_joined(got["pp2"]), base, "pp2")
    # the distributed optimizer reduce-scatters the grads: compare what its step made of them with the plain
    # optimizer's step at the same layout (whose grads equal DP=2's; DP=2's own weights are no reference: Adam's
    # first step is ~lr * sign(g), so a 1e-8 grad that differs in the last digits moves a weight visibly)
    for r, plain in zip(got["tp2_sp_distopt"], got["tp2_sp"]):
        assert r["ok"]
        for key in METRICS:
            assert r["metrics"][key] == pytest.approx(base["metrics"][key], rel=1e-4, abs=1e-5), key
        assert r["grad_norm"] == pytest.approx(base["grad_norm"], rel=1e-4)
        assert r["weights"].keys() == plain["weights"].keys()
        for param, w in r["weights"].items():
            torch.testing.assert_close(w, plain["weights"][param], rtol=1e-5, atol=1e-7, msg=param)
    # the aux loss: the same bins at CP=1 and CP=2, the three layouts agree, and it changes the router's grad
    assert _bins(tmp_path, 1) == _bins(tmp_path, 2) and len(_bins(tmp_path, 1)) > 1
    pp_aux = _stages_joined(got["pp2_aux"])
    for name in ("tp2_sp_ep2_aux", "cp2_aux"):
        for r in got[name]:
            assert_same_step(r, pp_aux, f"{name} vs pp2_aux")
    router = "model.layers.1.mlp.gate.weight"
    assert not torch.allclose(pp_aux["grads"][router], base["grads"][router])


def _weights_after_step(trainer) -> dict:
    from megatron_rl.train.hf_weights import export_hf_tensors

    return {"weights": dict(export_hf_tensors(trainer.model_chunks))}


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for `support`
    from support.moe_steps import moe_worker

    moe_worker(Path(sys.argv[1]), CASES, extra=_weights_after_step)
