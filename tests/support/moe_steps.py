"""One trainer step of a tiny Qwen3-MoE per parallel layout, on 2 gloo ranks, for the multiproc MoE tests
(tests/multiproc/test_train_expert_parallel.py, test_train_moe_model_parallel.py).

Pytest side: `run_moe_cases(script, tmp_path)` writes the model and the minibatch, launches `script` on
2 ranks and returns {case: [rank 0 record, rank 1 record]}. Worker side (the script's `__main__`):
`moe_worker(root, cases)` runs each case's step and saves its record: metrics, grad norm, optimizer
verdict, every gradient under its HF name (TP/EP gathered; under PP each rank holds its stage's names)
and `extra(trainer)` when given.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable

import torch

METRICS = ("loss", "clip_frac_low", "clip_frac_high", "ratio_mean", "entropy", "logprob_mean", "n_loss_tokens")


def moe_config(model_dir: str, **keys):
    from megatron_rl.config import config_from_dict

    return config_from_dict({
        "trainer": {"model": model_dir, "precision": "fp32", "micro_batch_tokens": 25, "lr": 1e-2,
                    "grad_clip": 1e6,
                    # grads all-reduced, not reduce-scattered: every rank then holds every full gradient
                    # (under the distributed optimizer each rank holds only its shard's reduced grads)
                    "distributed_optimizer": False, **keys},
        "algo": {"eps_low": 0.2, "eps_high": 0.28}})


def moe_worker(root: Path, cases: dict[str, dict], extra: Callable | None = None) -> None:
    import torch.distributed as dist

    from megatron_rl.records import TrainSequence
    from megatron_rl.train.hf_weights import export_hf_tensors
    from megatron_rl.train.parallel import destroy_parallel
    from megatron_rl.train.step import forward_backward
    from megatron_rl.train.trainer import Trainer

    torch.set_num_threads(1)
    spec = json.loads((root / "spec.json").read_text())
    seqs = [TrainSequence(**d) for d in spec["seqs"]]
    for name, keys in cases.items():
        trainer = Trainer(moe_config(spec["model_dir"], **keys))
        trainer.optimizer.zero_grad()
        out = forward_backward(trainer.model, seqs, trainer.ctx)
        grads = dict(export_hf_tensors(trainer.model_chunks, grads=True))
        ok, grad_norm, _ = trainer.optimizer.step()
        record = {"metrics": out.metrics, "grads": grads, "grad_norm": float(grad_norm), "ok": ok,
                  **(extra(trainer) if extra else {})}
        torch.save(record, root / f"{name}.rank{dist.get_rank()}.pt")
        destroy_parallel()
    print("WORKER OK", flush=True)


def run_moe_cases(script: str, tmp_path: Path, cases) -> dict[str, list[dict]]:
    from support.torchrun import run_two_ranks
    from support.train_models import make_tiny_moe
    from unit.test_train_step import hf_model, make_minibatch

    model_dir = make_tiny_moe(tmp_path / "moe", experts=4, topk=2)
    seqs = make_minibatch(hf_model(model_dir), n=6, seed=0)
    (tmp_path / "spec.json").write_text(json.dumps(
        {"model_dir": str(model_dir), "seqs": [dataclasses.asdict(s) for s in seqs]}))
    run_two_ranks(script, tmp_path, env={"CUDA_VISIBLE_DEVICES": ""}, timeout=900)
    return {name: [torch.load(tmp_path / f"{name}.rank{r}.pt", weights_only=False) for r in range(2)]
            for name in cases}


def assert_same_step(got: dict, want: dict, what: str, rtol: float | None = None) -> None:
    """Metrics, grad norm and every gradient of `got` equal `want`'s within float32 reduction-order
    error: another layout sums the same terms in another order (TP/EP/DP splits, packing), through
    the tiny MoE's chain of matmuls with reductions <= its 301-token vocabulary (network_error: 2.0e-4);
    floors 1e-1 rtol for the O(1) metrics and 1e-2 rtol for the O(1e-2) gradients near zero. A top-k
    routing decision could flip within that error; none does for this model and batch."""
    import pytest

    from support.tolerances import network_error, transformer_matmuls

    rtol = rtol if rtol is not None else network_error(transformer_matmuls(2), 301)

    assert got["ok"], what
    for key in METRICS:
        assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=rtol, abs=rtol * 1e-1), (what, key)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=rtol), what
    assert got["grads"].keys() == want["grads"].keys(), what
    for param, g in got["grads"].items():
        torch.testing.assert_close(g, want["grads"][param], rtol=rtol, atol=rtol * 1e-2,
                                   msg=lambda m: f"{what} {param}: {m}")
