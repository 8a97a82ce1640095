"""trainer.lora under TP=2, TP=2 + sequence parallel, PP=2, CP=2 and DP=2 (2 gloo processes) equals one process:
the same RL-step loss and metrics and the same adapter gradients (PEFT-named, TP-gathered), starting
from the same nonzero adapters; and DP=2 with the distributed optimizer takes the same Adam step on the
adapters as DP=2 without it.

One torchrun launch of this file (its `__main__` part is the worker) per world size: 1 rank for the
reference, 2 ranks for every parallel case. The one-process run is itself checked against HF PEFT in
tests/unit/test_train_lora.py.
Tolerance: float32 through the adapted tiny model's chain of matmuls, reductions <= its 301-token
vocabulary (support.tolerances.network_error, 2.9e-4 relative, to each tensor's largest element): the
layouts sum the same terms in other orders (TP partial sums of A x, SP reduce-scatters, PP stages, CP
attention over gathered keys, DP and CP all-reduce of the gradient buffers).
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

CASES = {  # name -> (world size, trainer keys)
    "single": (1, {}),
    "tp2": (2, {"tensor_parallel": 2}),
    "tp2_sp": (2, {"tensor_parallel": 2, "sequence_parallel": True}),
    "pp2": (2, {"pipeline_parallel": 2}),
    "cp2": (2, {"context_parallel": 2}),  # adapters act per token; the gradients sum over the CP group too
    "dp2": (2, {"data_parallel": 2}),
    "dp2_distopt": (2, {"data_parallel": 2, "distributed_optimizer": True}),
}
LORA = {"rank": 4, "alpha": 8.0}
LR = 1e-2


def _config(model_dir: str, **keys):
    from megatron_rl.config import config_from_dict

    trainer = {"model": model_dir, "precision": "fp32", "micro_batch_tokens": 25, "lr": LR, "grad_clip": 1e6,
               "distributed_optimizer": False, "lora": LORA, **keys}
    return config_from_dict({"trainer": trainer, "algo": {"eps_low": 0.2, "eps_high": 0.28}})


def worker(root: Path, world: int) -> None:
    import torch.distributed as dist
    from safetensors.torch import load_file

    from megatron_rl.records import Batch, TrainSequence
    from megatron_rl.train.lora_weights import export_adapter_tensors, load_adapter_tensors
    from megatron_rl.train.parallel import destroy_parallel
    from megatron_rl.train.trainer import Trainer

    torch.set_num_threads(1)
    spec = json.loads((root / "spec.json").read_text())
    seqs = [TrainSequence(**d) for d in spec["seqs"]]
    adapters = load_file(str(root / "adapters.safetensors"))
    for name, (size, keys) in CASES.items():
        if size != world:
            continue
        trainer = Trainer(_config(spec["model_dir"], **keys))
        load_adapter_tensors(trainer.model_chunks, adapters)
        step, captured = trainer.optimizer.step, {}

        def capturing_step():  # the step's gradients before Adam uses them (every rank iterates: TP gather)
            captured["grads"] = {n: g.clone() for n, g in export_adapter_tensors(trainer.model_chunks, grads=True)}
            return step()

        trainer.optimizer.step = capturing_step
        metrics = trainer.train_on(Batch(seqs, n_mini=1, policy_version=0))
        after = {n: t.clone() for n, t in export_adapter_tensors(trainer.model_chunks)}
        if name == "tp2":  # resharded below into the one-process layout (TP padding differs: 4 vs 3 KV groups)
            trainer.save(root / "ckpt_tp2")
        torch.save({"metrics": {k: v for k, v in metrics.items() if isinstance(v, float)},
                    "grads": {} if keys.get("distributed_optimizer") else captured["grads"], "after": after,
                    "trainable": sorted(n for c in trainer.model_chunks for n, p in c.named_parameters()
                                        if p.requires_grad)},
                   root / f"{name}.rank{dist.get_rank()}.pt")
        destroy_parallel()
    if world == 1:  # the TP=2 checkpoint, adapters and their Adam state, loaded at TP=1
        trainer = Trainer(_config(spec["model_dir"]))
        trainer.load(root / "ckpt_tp2")
        torch.save({"after": {n: t.clone() for n, t in export_adapter_tensors(trainer.model_chunks)},
                    "optimizer_loaded": trainer.last_load.optimizer_loaded}, root / "resharded.pt")
        destroy_parallel()
    print("WORKER OK", flush=True)


# ---------------------------------------------------------------- the test (pytest side)

def test_lora_step_is_the_same_at_tp2_sp_pp2_dp2_as_one_process(tmp_path):
    import pytest
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import save_file

    from support.adam_steps import misses, step_tolerance
    from support.lora_refs import HF_TARGETS, lora_matmuls
    from support.tolerances import network_error
    from support.torchrun import run_ranks
    from support.train_models import make_tiny_hf
    from unit.test_train_step import hf_model, make_minibatch

    # 3 KV groups, MLP width 97, vocab 301: all padded at TP=2, so the adapters' padded rows / columns
    # (zero, with zero gradients) are exercised
    tiny_llama_dir = make_tiny_hf(tmp_path / "model", family="llama")
    hf = hf_model(tiny_llama_dir)
    seqs = make_minibatch(hf, n=6, seed=0)
    peft = get_peft_model(hf, LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], target_modules=HF_TARGETS))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # nonzero B: A's gradient is not zero, the outputs differ from the base
        for n, p in peft.named_parameters():
            if "lora_" in n:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    save_file({k: v.contiguous() for k, v in get_peft_model_state_dict(peft).items()},
              str(tmp_path / "adapters.safetensors"))
    (tmp_path / "spec.json").write_text(json.dumps(
        {"model_dir": str(tiny_llama_dir), "seqs": [dataclasses.asdict(s) for s in seqs]}))
    env = {"CUDA_VISIBLE_DEVICES": ""}
    run_ranks(2, __file__, tmp_path, 2, env=env)
    run_ranks(1, __file__, tmp_path, 1, env=env)

    got = {name: [torch.load(tmp_path / f"{name}.rank{r}.pt", weights_only=False) for r in range(size)]
           for name, (size, _) in CASES.items()}
    ref = got["single"][0]
    rtol = network_error(lora_matmuls(2), 301)
    assert len(ref["grads"]) == 2 * 7 * 2 and len(ref["trainable"]) == 16
    for name, ranks in got.items():
        for r in ranks:
            assert all(n.endswith((".lora_A", ".lora_B")) for n in r["trainable"]), name
            for key in ("loss", "ratio_mean", "entropy", "logprob_mean", "n_loss_tokens", "grad_norm"):
                assert r["metrics"][key] == pytest.approx(ref["metrics"][key], rel=rtol), (name, key)
            # PP: each stage exports its own layer's adapters; together they are the whole set
            grads = {n: t for rr in ranks for n, t in rr["grads"].items()} if name == "pp2" else r["grads"]
            if name == "dp2_distopt":
                continue
            assert grads.keys() == ref["grads"].keys(), name
            worst = max(float((gr - ref["grads"][p]).abs().max() / ref["grads"][p].abs().max())
                        for p, gr in grads.items())
            print(f"{name}: largest adapter-gradient difference {worst:.2e} of the tensor's max (bound {rtol:.2e})")
            for param, gr in grads.items():
                want = ref["grads"][param]
                assert want.abs().max() > 0, param
                torch.testing.assert_close(gr, want, rtol=rtol, atol=rtol * want.abs().max(),
                                           msg=lambda m: f"{name} {param}: {m}")
    # the distributed optimizer's Adam step on the adapters (DP-sharded state) equals the plain one's
    dp2 = got["dp2"][0]
    tol = step_tolerance(dp2["grads"], dp2["metrics"]["grad_norm"], dp2["after"], lr=LR, betas=(0.9, 0.95),
                         step=1, grad_clip=1e6, n_terms=301)
    for r in got["dp2_distopt"]:
        assert misses(r["after"], dp2["after"], tol) == {}
    # checkpoints reshard the adapters (TP=2 -> 1, padded rows / columns dropped) bit for bit
    resharded = torch.load(tmp_path / "resharded.pt", weights_only=False)
    assert resharded["optimizer_loaded"] and resharded["after"].keys() == got["tp2"][0]["after"].keys()
    for n, t in resharded["after"].items():
        assert torch.equal(t, got["tp2"][0]["after"][n]), n


if __name__ == "__main__":
    worker(Path(sys.argv[1]), int(sys.argv[2]))
