"""Routing replay under every parallel layout (2 gloo processes): a tiny Qwen3-MoE trainer step whose
sequences carry random routes (not the routers' own choices, so replay changes every layer's output) at
TP=2 with sequence parallel (each router replays its SP slice), TP=2 x EP=2 (routing before dispatch),
PP=2 (each stage its own layers), PP=2 with full recompute (1F1B: the recompute of a micro-batch in its
backward takes that micro-batch's routes from the queue, after later micro-batches ran forward) and CP=2
(each rank its chunks of every sequence) gives the loss, metrics, grad norm, every gradient and the
routing agreement of the same minibatch at DP=2 (whose single-rank step equals HF forced onto the same
experts: tests/unit/test_train_routing_replay.py). Tolerance: the MoE layouts' (support.moe_steps).
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

CASES = {  # name -> trainer keys
    "dp2": {"data_parallel": 2},
    "tp2_sp": {"tensor_parallel": 2, "sequence_parallel": True},
    "tp2_sp_ep2": {"tensor_parallel": 2, "sequence_parallel": True, "expert_parallel": 2},
    "pp2": {"pipeline_parallel": 2},
    "pp2_recompute": {"pipeline_parallel": 2, "recompute": "full"},
    "cp2": {"context_parallel": 2},
}
EXPERTS, TOPK, LAYERS = 4, 2, 2


def routed(seq, seed: int):
    from megatron_rl.records import RoutedExperts

    g = torch.Generator().manual_seed(seed)
    n = len(seq.token_ids) - 1
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(n * LAYERS)])
    return dataclasses.replace(seq, routed_experts=RoutedExperts(ids.to(torch.uint8).numpy().tobytes(), LAYERS, TOPK))


@pytest.mark.long
def test_routing_replay_in_every_layout_equals_dp2(tmp_path):
    from support.moe_steps import assert_same_step
    from support.torchrun import run_two_ranks
    from support.train_models import make_tiny_moe
    from unit.test_train_step import hf_model, make_minibatch

    model_dir = make_tiny_moe(tmp_path / "moe", experts=EXPERTS, topk=TOPK)
    seqs = [routed(s, i) for i, s in enumerate(make_minibatch(hf_model(model_dir), n=6, seed=0))]
    spec = [dataclasses.asdict(s) | {"routed_experts": s.routed_experts.to_dict()} for s in seqs]
    (tmp_path / "spec.json").write_text(json.dumps({"model_dir": str(model_dir), "seqs": spec}))
    run_two_ranks(__file__, tmp_path, env={"CUDA_VISIBLE_DEVICES": ""}, timeout=900)
    got = {name: [torch.load(tmp_path / f"{name}.rank{r}.pt", weights_only=False) for r in range(2)] for name in CASES}
    base = got["dp2"][0]
    assert 0 < base["metrics"]["routing_agreement"] < 1
    for name, records in got.items():
        if name.startswith("pp2"):  # each stage holds its layers' gradients
            assert not records[0]["grads"].keys() & records[1]["grads"].keys()
            records = [{**records[0], "grads": {**records[0]["grads"], **records[1]["grads"]}}]
        for r in records:
            assert_same_step(r, base, name)
            assert r["metrics"]["routing_agreement"] == base["metrics"]["routing_agreement"], name


def worker(root: Path) -> None:
    import torch.distributed as dist

    from megatron_rl.records import RoutedExperts, TrainSequence
    from megatron_rl.train.hf_weights import export_hf_tensors
    from megatron_rl.train.parallel import destroy_parallel
    from megatron_rl.train.step import forward_backward
    from megatron_rl.train.trainer import Trainer
    from support.moe_steps import moe_config

    torch.set_num_threads(1)
    spec = json.loads((root / "spec.json").read_text())
    seqs = [TrainSequence(**(d | {"routed_experts": RoutedExperts.from_dict(d["routed_experts"])})) for d in spec["seqs"]]
    for name, keys in CASES.items():
        config = moe_config(spec["model_dir"], **keys)
        config.algo.routing_replay = True
        trainer = Trainer(config)
        trainer.optimizer.zero_grad()
        out = forward_backward(trainer.model, seqs, trainer.ctx)
        grads = dict(export_hf_tensors(trainer.model_chunks, grads=True))
        ok, grad_norm, _ = trainer.optimizer.step()
        record = {"metrics": out.metrics, "grads": grads, "grad_norm": float(grad_norm), "ok": ok}
        torch.save(record, root / f"{name}.rank{dist.get_rank()}.pt")
        destroy_parallel()
    print("WORKER OK", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for `support`
    worker(Path(sys.argv[1]))
