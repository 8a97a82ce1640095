"""Context parallel on GPU: Transformer Engine's THD CP attention (cp_comm_type p2p) gets the chunks
packing.py cuts, and CP=2 equals CP=1 there. Skipped without CUDA (conftest), without Transformer
Engine, and, for the step, without 2 GPUs (NCCL does not put two ranks on one device).

- `cp_token_index` (Megatron's load balancing, our bookkeeping) against TE's own
  `thd_get_partitioned_indices`, the function Megatron's `get_thd_batch_on_this_cp_rank` slices with.
- The CPU test's worker (tests/multiproc/test_train_context_parallel.py) on 2 GPUs: NCCL, the TE
  layer spec (TE runs CP only in its flash/fused kernels, so bf16), per-sequence logits, trainer
  logprobs, loss and gradients of CP=2 against DP=2, at bf16 tolerances.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu


def _tex():
    try:
        import transformer_engine_torch as tex
    except Exception as e:  # noqa: BLE001 - any broken install is a skip, with its reason
        pytest.skip(f"Transformer Engine is not importable: {e}")
    return tex


def test_cp_chunks_are_transformer_engines_thd_partitioning():
    from megatron_rl.train.packing import cp_token_index

    tex = _tex()
    for cp in (2, 4):
        for lengths in ([4 * cp], [2 * cp, 6 * cp, 2 * cp], [8 * cp, 2 * cp, 4 * cp, 10 * cp]):
            cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
            for rank in range(cp):
                theirs = tex.thd_get_partitioned_indices(cu.cuda(), int(cu[-1]), cp, rank)
                assert theirs.cpu().long().tolist() == cp_token_index(cu, cp, rank).tolist(), (cp, lengths, rank)


def test_te_context_parallel_equals_cp1_on_two_gpus(tiny_llama_dir, tmp_path):
    from support.torchrun import run_two_ranks

    from multiproc.test_train_context_parallel import CASES, _minibatch

    _tex()
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs for CP=2 over NCCL, this machine has {torch.cuda.device_count()}")
    worker = Path(__file__).with_name("test_train_context_parallel.py")
    seqs = _minibatch(tiny_llama_dir)
    (tmp_path / "spec.json").write_text(json.dumps(
        {"model_dir": str(tiny_llama_dir), "precision": "bf16", "seqs": [dataclasses.asdict(s) for s in seqs]}))
    run_two_ranks(worker, tmp_path)
    got = {n: [torch.load(tmp_path / f"{n}.rank{r}.pt", weights_only=False, map_location="cpu") for r in range(2)]
           for n in CASES}
    base = got["dp2"][0]
    assert all(r["te"].startswith("TE") and r["cp"] == 2 for r in got["cp2"])
    for r in got["cp2"]:
        for i in range(len(seqs)):  # bf16 logits: flash attention over chunks vs whole sequences
            torch.testing.assert_close(r["logits"][i], base["logits"][i], rtol=3e-2, atol=3e-2)
            torch.testing.assert_close(r["logprobs"][i], base["logprobs"][i], rtol=3e-2, atol=3e-2)
        assert r["metrics"]["loss"] == pytest.approx(base["metrics"]["loss"], rel=2e-2, abs=1e-3)
        assert r["metrics"]["n_loss_tokens"] == base["metrics"]["n_loss_tokens"]
        for name, g in r["grads"].items():
            want = base["grads"][name]
            assert float((g - want).norm()) <= 5e-2 * float(want.norm()) + 1e-6, name
