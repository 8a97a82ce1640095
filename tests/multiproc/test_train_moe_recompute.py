"""Full recompute with expert parallel and the router load-balancing loss (2 gloo processes, DP=2, EP=2): a
tiny Qwen3-MoE trainer step with `trainer.recompute: full` gives the loss, metrics, grad norm and every
gradient (HF-named, experts gathered over EP) of the same step without recompute.

Why this case: EP evens the ranks' bin counts with all-padding bins (the allgather dispatcher is collective
over EP), and an all-pad bin must add no aux loss. Full recompute re-runs each layer inside the backward and
Megatron adds the aux loss in that re-run, after the bin's forward has ended; moe.router_padding keeps the
coefficient at 0 until the bin's backward pass ends. Without that the pad tokens of that bin gave the router
an aux-loss gradient (the combination used to be refused). The minibatch here gives one DP rank fewer bins
than the other (asserted), so that rank runs an all-pad bin. The recompute-free EP=2 step equals EP=1's in
tests/multiproc/test_train_expert_parallel.py. Tolerance: the SP harness's (rtol 1e-4, atol 1e-6).
"""
from __future__ import annotations

import sys
from pathlib import Path

# at 27-token bins the two DP shares of support.moe_steps' minibatch pack into 2 and 1 bins (asserted)
EP2_AUX = {"data_parallel": 2, "expert_parallel": 2, "moe_aux_loss_coef": 0.1, "micro_batch_tokens": 27}
CASES = {  # name -> trainer keys
    "ep2_aux": EP2_AUX,
    "ep2_aux_full": {**EP2_AUX, "recompute": "full"},
}


def _bins_per_rank(tmp_path: Path) -> list[int]:
    """Bins each DP rank packs from its share before EP evens the counts (step.prepare_minibatch)."""
    import json

    from megatron_rl.records import TrainSequence
    from megatron_rl.train.packing import pack_sequences, split_balanced
    from support.moe_steps import moe_config

    spec = json.loads((tmp_path / "spec.json").read_text())
    seqs = [TrainSequence(**d) for d in spec["seqs"]]
    capacity = moe_config(spec["model_dir"], **EP2_AUX).trainer.micro_batch_tokens
    shares = split_balanced([len(s.token_ids) for s in seqs], 2)
    return [len(pack_sequences([seqs[i] for i in share], capacity, pad_to_common=True).micro_batches)
            for share in shares]


def test_full_recompute_with_ep_and_aux_loss_equals_no_recompute(tmp_path):
    import torch

    from support.moe_steps import assert_same_step, run_moe_cases

    got = run_moe_cases(__file__, tmp_path, CASES)
    counts = _bins_per_rank(tmp_path)
    assert counts[0] != counts[1], counts  # the rank with fewer bins runs an all-pad bin
    assert [r["recompute"] for r in got["ep2_aux"] + got["ep2_aux_full"]] == [None, None, "full", "full"]
    base = got["ep2_aux"][0]
    assert_same_step(got["ep2_aux"][1], base, "ep2_aux rank 1")
    for r in got["ep2_aux_full"]:
        assert_same_step(r, base, "full recompute vs none (EP=2, aux loss)")
    router = "model.layers.0.mlp.gate.weight"
    assert float(base["grads"][router].abs().max()) > 1e-6
    assert all(torch.isfinite(g).all() for r in got["ep2_aux_full"] for g in r["grads"].values())


def _recompute_granularity(trainer) -> dict:
    return {"recompute": trainer.model_chunks[0].config.recompute_granularity}


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for `support`
    from support.moe_steps import moe_worker

    moe_worker(Path(sys.argv[1]), CASES, extra=_recompute_granularity)
