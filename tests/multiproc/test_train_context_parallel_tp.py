"""Context parallel with tensor parallel: TP=2 x CP=2 (4 gloo processes), with and without sequence parallel
(SP: the activations between the attention and MLP blocks split over TP along the sequence, on top of
CP's split), each equals one process (TP=CP=1)
in per-sequence logits (vocab shards gathered over TP), trainer logprobs, the RL step's loss and
metrics and every gradient (HF-named, TP-gathered by `hf_weights.export_hf_tensors`), on the packed
bins of several uneven sequences of tests/multiproc/test_train_context_parallel.py (a 3-token one
among them).

The one-process run is the reference (the same step is checked against HF autograd in
tests/unit/test_train_step.py). Both layouts run the same worker under torchrun (1 and 4 ranks).
Tolerance: the CP test's (rtol 1e-4, atol 1e-5 on logits and logprobs, 1e-6 on gradients): TP splits
the matmuls and the vocab softmax, CP the attention and the gradient sums.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

LAYOUTS = {"single": (1, {}), "tp2cp2": (4, {"tensor_parallel": 2, "context_parallel": 2}),
           "tp2cp2sp": (4, {"tensor_parallel": 2, "context_parallel": 2, "sequence_parallel": True})}
METRICS = ("loss", "clip_frac_low", "clip_frac_high", "ratio_mean", "ratio_min", "ratio_max", "entropy",
           "logprob_mean", "n_loss_tokens", "tokens", "n_sequences")


def worker(root: Path, name: str) -> None:
    import torch.distributed as dist

    from megatron_rl.records import TrainSequence
    from megatron_rl.train.hf_weights import export_hf_tensors
    from megatron_rl.train.parallel import destroy_parallel
    from megatron_rl.train.step import _forward, collect_logprobs, forward_backward, prepare_minibatch
    from megatron_rl.train.trainer import Trainer
    from multiproc.test_train_context_parallel import _config
    from support.context_parallel import full_vocab, per_sequence, row_order

    torch.set_num_threads(1)
    spec = json.loads((root / "spec.json").read_text())
    seqs = [TrainSequence(**d) for d in spec["seqs"]]
    trainer = Trainer(_config(spec["model_dir"], **LAYOUTS[name][1]))
    chunk = trainer.model_chunks[0]
    prepared = prepare_minibatch(trainer.model, seqs, trainer.ctx)
    mbs = prepared.packed.micro_batches
    with torch.no_grad():
        logits = per_sequence(prepared, [row_order(full_vocab(_forward(chunk, mb, trainer.ctx.use_thd)[0],
                                                              spec["vocab"]), mb) for mb in mbs])
    collect_logprobs(trainer.model, prepared, trainer.ctx, "proximal_logprobs")
    logprobs = per_sequence(prepared, [row_order(mb.proximal_logprobs[0], mb) for mb in mbs])
    trainer.optimizer.zero_grad()
    out = forward_backward(trainer.model, prepared, trainer.ctx)
    grads = {k: g.float().cpu() for k, g in export_hf_tensors(trainer.model_chunks, grads=True)}
    layout = (chunk.config.tensor_model_parallel_size, chunk.config.context_parallel_size,
              chunk.config.sequence_parallel)
    if dist.get_rank() == 0:
        torch.save({"logits": logits, "logprobs": logprobs, "metrics": out.metrics, "grads": grads,
                    "layout": layout, "n_seqs": [len(mb.seq_indices) for mb in mbs]}, root / f"{name}.pt")
    destroy_parallel()
    print("WORKER OK", flush=True)


@pytest.mark.long
@pytest.mark.timeout(1800)  # three launches (1 + 4 + 4 processes): 16 min on 2 cores shared with an experiment
def test_tp2_cp2_equals_one_process(tiny_llama_dir, tmp_path):
    from multiproc.test_train_context_parallel import _minibatch
    from support.torchrun import run_ranks
    from transformers import AutoConfig

    seqs = _minibatch(tiny_llama_dir)
    (tmp_path / "spec.json").write_text(json.dumps(
        {"model_dir": str(tiny_llama_dir), "vocab": AutoConfig.from_pretrained(tiny_llama_dir).vocab_size,
         "seqs": [dataclasses.asdict(s) for s in seqs]}))
    for name, (nproc, _) in LAYOUTS.items():
        run_ranks(nproc, __file__, tmp_path, name, env={"CUDA_VISIBLE_DEVICES": ""})
    base, *others = (torch.load(tmp_path / f"{name}.pt", weights_only=False) for name in LAYOUTS)
    assert base["layout"] == (1, 1, False) and [r["layout"] for r in others] == [(2, 2, False), (2, 2, True)]
    for got in others:
        _assert_equal(got, base, seqs)


def _assert_equal(got: dict, base: dict, seqs) -> None:
    sp = got["layout"][2]
    assert max(got["n_seqs"]) >= 3  # bins of several sequences
    assert sorted(got["logits"]) == sorted(base["logits"]) == list(range(len(seqs)))
    for i, s in enumerate(seqs):
        torch.testing.assert_close(got["logits"][i], base["logits"][i], rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"SP={sp} logits of sequence {i}: {m}")
        span = slice(s.prompt_len - 1, len(s.token_ids) - 1)
        torch.testing.assert_close(got["logprobs"][i][span], base["logprobs"][i][span], rtol=1e-4, atol=1e-5)
    for key in METRICS:
        assert got["metrics"][key] == pytest.approx(base["metrics"][key], rel=1e-4, abs=1e-5), (sp, key)
    assert sorted(got["grads"]) == sorted(base["grads"])
    for hf_name, g in got["grads"].items():
        torch.testing.assert_close(g, base["grads"][hf_name], rtol=1e-4, atol=1e-6,
                                   msg=lambda m: f"SP={sp} grad {hf_name}: {m}")
    assert float(base["grads"]["model.layers.0.self_attn.k_proj.weight"].abs().max()) > 1e-6


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for `support` and `multiproc`
    worker(Path(sys.argv[1]), sys.argv[2])
