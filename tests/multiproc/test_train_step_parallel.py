"""The RL step at TP=2, PP=2, DP=2 and interleaved PP=2 x VPP=2 (2 gloo processes) vs the
single-process HF reference, and checkpoints written by each layout loaded resharded into TP=1.

One torchrun launch of this file (its `__main__` part is the worker) runs every layout; the test
compares loss, metrics, grad norm and gradients with the HF autograd reference of
tests/unit/test_train_step.py, then loads the checkpoints each layout saved into a TP=1 trainer here
and checks that it evaluates exactly as the writer did. The interleaved layout needs 4 layers (one
per virtual stage) and a micro-batch count that is a multiple of PP, so it runs on a 4-layer tiny
Llama with 18-token bins (4 micro-batches for the minibatch, 2 for its one-minibatch update).
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

# name -> (tp, pp, dp, vpp, model, micro_batch_tokens, n_mini of the update)
# "model4_dir" has 4 layers and an odd vocab (387): at TP=2 Megatron pads it to 388, so rank 1's
# vocab shard ends in a padding column that the loss must leave out.
LAYOUTS = {"tp2": (2, 1, 1, None, "model4_dir", 24, 2), "pp2": (1, 2, 1, None, "model_dir", 24, 2),
           "dp2": (1, 1, 2, None, "model_dir", 24, 2), "pp2vpp2": (1, 2, 1, 2, "model4_dir", 18, 1)}
ODD_VOCAB = 387
# (prompt length, completion lengths) of the shared-prompt minibatch at DP=2: each group fits a 24-token bin
SHARED_GROUPS = [(6, [3, 4, 2]), (5, [3, 4, 2]), (5, [4, 3, 3]), (6, [2, 2, 3])]
GRADS = ("embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight")
HF_NAMES = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
            "decoder.final_layernorm.weight": "model.norm.weight", "output_layer.weight": "lm_head.weight"}


# The off-policy/KL update checked across layouts: trainer-side proximal and reference passes, the
# per-sequence KL summed over DP ranks and broadcast from the last stage, leave-one-out group baselines.
KL_ALGO = {"kl_mode": "reward", "kl_coef": 0.5, "proximal": "trainer", "tis_cap": 2.0}


def _config(model_dir: str, tp: int = 1, pp: int = 1, dp: int = 1, vpp: int | None = None,
            micro_batch_tokens: int = 24, algo: dict | None = None):
    from megatron_rl.config import config_from_dict

    return config_from_dict({
        "trainer": {"model": model_dir, "precision": "fp32", "micro_batch_tokens": micro_batch_tokens,
                    "lr": 1e-2, "grad_clip": 1e6, "tensor_parallel": tp, "pipeline_parallel": pp,
                    "data_parallel": dp, "virtual_pipeline": vpp,
                    # per-rank optimizer shards: the optimizer reloads only where just DP changed
                    "checkpoint_optimizer": "dp_reshardable"},
        "algo": {"eps_low": 0.2, "eps_high": 0.28, **(algo or {})}})


def _odd_vocab_model(root: Path) -> str:
    """The tiny Llama with 4 layers and its vocab grown to ODD_VOCAB (new random rows)."""
    from transformers import AutoModelForCausalLM

    from support.models import make_tiny_llama

    path = make_tiny_llama(root, layers=4)
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.resize_token_embeddings(ODD_VOCAB, mean_resizing=False)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def _load_seqs(path: Path):
    from megatron_rl.records import TrainSequence

    return [TrainSequence(**d) for d in json.loads(path.read_text())]


def _full_grad(trainer, name: str):
    """This rank's main_grad of `name` (from whichever of its model chunks holds it), all-gathered
    over TP along its partition dim (or None)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    params = {}
    for chunk in trainer.model_chunks:  # under VPP the first and last stages are different chunks
        params.update((n, p) for n, p in chunk.named_parameters() if n in HF_NAMES)
    if name not in params:
        return None
    p = params[name]
    g = p.main_grad.detach().clone()
    if getattr(p, "tensor_model_parallel", False) and ps.get_tensor_model_parallel_world_size() > 1:
        parts = [torch.empty_like(g) for _ in range(ps.get_tensor_model_parallel_world_size())]
        dist.all_gather(parts, g, group=ps.get_tensor_model_parallel_group())
        g = torch.cat(parts, dim=p.partition_dim)
    return g  # vocab-sized tensors keep their TP padding rows: the test checks they got no gradient


def worker(root: Path) -> None:
    import torch.distributed as dist

    from megatron_rl.records import Batch
    from megatron_rl.train.parallel import destroy_parallel
    from megatron_rl.train.step import forward_backward
    from megatron_rl.train.trainer import Trainer

    torch.set_num_threads(1)
    spec = json.loads((root / "spec.json").read_text())
    for name, (tp, pp, dp, vpp, model, mbt, n_mini) in LAYOUTS.items():
        seqs = _load_seqs(root / f"seqs_{model}.json")
        train_seqs = _load_seqs(root / f"train_seqs_{model}.json")
        trainer = Trainer(_config(spec[model], tp, pp, dp, vpp, mbt))
        trainer.optimizer.zero_grad()
        # DP: prompt groups are dealt whole (trainer.share_prompts), the loss still the whole minibatch's
        shared = (forward_backward(trainer.model, _load_seqs(root / "shared_seqs.json"), trainer.ctx).metrics
                  if dp > 1 else None)
        out = forward_backward(trainer.model, seqs, trainer.ctx)
        grads = {g: _full_grad(trainer, g) for g in GRADS}
        ok, grad_norm, _ = trainer.optimizer.step()
        trainer.train_on(Batch(train_seqs, n_mini=n_mini, policy_version=1))
        after = trainer.evaluate(seqs)
        trainer.save(root / f"{name}_ckpt", extra={"layout": name})
        destroy_parallel()
        kl_trainer = Trainer(_config(spec[model], tp, pp, dp, vpp, mbt, algo=KL_ALGO))
        kl_trainer.train_on(Batch(train_seqs, n_mini=n_mini, policy_version=0))
        kl_after = kl_trainer.evaluate(seqs)
        torch.save({"metrics": out.metrics, "shared": shared, "grad_norm": float(grad_norm), "ok": ok, "grads": grads,
                    "after": after, "kl_after": kl_after, "n_micro_batches": out.n_micro_batches},
                   root / f"{name}.rank{dist.get_rank()}.pt")
        destroy_parallel()
    print("WORKER OK", flush=True)


# ---------------------------------------------------------------- the test (pytest side)

def test_tp2_pp2_dp2_vpp_match_reference_and_reshard_to_tp1(tiny_llama_dir, tmp_path):
    import pytest

    from support.torchrun import run_two_ranks
    from unit.test_train_shared_prompts import _groups
    from unit.test_train_step import hf_completion_logprobs, hf_model, make_minibatch, reference

    models = {"model_dir": str(tiny_llama_dir), "model4_dir": _odd_vocab_model(tmp_path / "tiny4")}
    refs, seq_sets, train_seq_sets = {}, {}, {}
    for key, path in models.items():
        hf = hf_model(path)
        seqs = make_minibatch(hf, n=6, seed=0)  # token ids drawn from the whole (odd) vocab
        # weight versions 1 and 0: evaluated after one update (version 1), lags 0 and 1 (mismatch metrics)
        seqs = [dataclasses.replace(s, weight_versions=[1 - i % 2] * s.completion_len) for i, s in enumerate(seqs)]
        # two groups of two: each sample's leave-one-out KL baseline may sit on another DP rank
        train_seqs = [dataclasses.replace(s, group_id=f"g{i % 2}") for i, s in
                      enumerate(make_minibatch(hf, n=4, seed=3))]
        refs[key] = reference(hf, seqs)
        seq_sets[key] = seqs
        train_seq_sets[key] = train_seqs
        (tmp_path / f"seqs_{key}.json").write_text(json.dumps([dataclasses.asdict(s) for s in seqs]))
        (tmp_path / f"train_seqs_{key}.json").write_text(json.dumps([dataclasses.asdict(s) for s in train_seqs]))
    (tmp_path / "spec.json").write_text(json.dumps(models))
    hf = hf_model(models["model_dir"])
    shared_seqs = _groups(SHARED_GROUPS, hf.config.vocab_size)
    with torch.no_grad():
        for s in shared_seqs:
            s.behaviour_logprobs = (hf_completion_logprobs(hf, s) + 0.3).tolist()
    shared_ref = reference(hf, shared_seqs)[0]
    (tmp_path / "shared_seqs.json").write_text(json.dumps([dataclasses.asdict(s) for s in shared_seqs]))
    run_two_ranks(__file__, tmp_path)

    from megatron_rl.records import Batch
    from megatron_rl.train.trainer import Trainer

    tp1 = {}
    for name, (_, _, _, vpp, model, _, n_mini) in LAYOUTS.items():
        ref, ref_grads = refs[model]
        ranks = [torch.load(tmp_path / f"{name}.rank{r}.pt", weights_only=False) for r in range(2)]
        if vpp:  # a real interleaved schedule: several micro-batch groups per virtual stage
            assert ranks[0]["n_micro_batches"] >= 2 * 2, name
        for r in ranks:  # metrics are reduced and shared: identical on every rank
            assert r["ok"]
            for key in ("loss", "clip_frac_low", "clip_frac_high", "ratio_mean", "ratio_min", "ratio_max",
                        "entropy", "n_loss_tokens"):
                assert r["metrics"][key] == pytest.approx(ref[key], rel=1e-4, abs=1e-5), (name, key)
            assert r["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4), name
            if r["shared"] is not None:  # every group whole on one rank: each prompt held exactly once
                held_once = sum((len(c) - 1) * (p - 1) for p, c in SHARED_GROUPS)
                assert r["shared"]["shared_prompt_fraction"] * r["shared"]["tokens"] == pytest.approx(held_once)
                for key in ("loss", "clip_frac_low", "clip_frac_high", "ratio_mean", "n_loss_tokens"):
                    assert r["shared"][key] == pytest.approx(shared_ref[key], rel=1e-4, abs=1e-5), key
        # With the DistributedOptimizer at DP=2 each rank's grad buffer is reduced only on the shard it
        # owns (reduce-scatter), so elementwise grads are compared for TP/PP; for DP the global grad
        # norm and the metrics above cover the sharded reduction.
        for g in GRADS if name != "dp2" else ():
            held = [r["grads"][g] for r in ranks if r["grads"][g] is not None]
            assert held, (name, g)
            for t in held:
                want = ref_grads[HF_NAMES[g]]
                torch.testing.assert_close(t[: want.shape[0]], want, rtol=1e-4, atol=1e-6,
                                           msg=lambda m: f"{name} {g}: {m}")
                assert torch.count_nonzero(t[want.shape[0]:]) == 0, (name, g)  # padding rows
            if name == "tp2":  # the padded layout really is padded
                assert held[0].shape[0] == ODD_VOCAB + 1 or g == "decoder.final_layernorm.weight"
        # resharding on load: TP=1 evaluates each layout's checkpoint exactly as its writer did
        if model not in tp1:
            tp1[model] = Trainer(_config(models[model]))
        reader = tp1[model]
        extra = reader.load(tmp_path / f"{name}_ckpt")
        assert extra == {"layout": name} and reader.version == 1
        assert reader.step == n_mini  # the update's optimizer steps (the manual one is not counted)
        assert reader.last_load.optimizer_loaded == (name == "dp2")  # dp_reshardable: only DP may change
        mine = reader.evaluate(seq_sets[model])
        mismatch = [k for k in mine if k.startswith("mismatch/")]
        # lags 0 and 1, and lag 0 again as lag0_pure (one version per sequence), reduced over DP ranks and
        # shared from the last stage
        assert len(mismatch) == 3 * 6
        for key in ("loss", "entropy", "ratio_mean", "logprob_mean", *mismatch):
            for r in ranks:
                assert r["after"][key] == pytest.approx(mine[key], rel=1e-5, abs=1e-6), (name, key)
        # the KL-in-reward + decoupled update equals the same update in one process
        if ("kl", model, n_mini) not in tp1:
            single = Trainer(_config(models[model], algo=KL_ALGO))
            single.train_on(Batch(train_seq_sets[model], n_mini=n_mini, policy_version=0))
            tp1[("kl", model, n_mini)] = single.evaluate(seq_sets[model])
        want = tp1[("kl", model, n_mini)]
        assert abs(want["kl"]) > 1e-4  # the update moved the policy away from its reference
        for r in ranks:
            for key in ("loss", "logprob_mean", "is_weight_mean", "ratio_mean", *mismatch):
                assert r["kl_after"][key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (name, key)
            # kl is a small difference of float32 logprob sums of magnitude ~250 per sequence set:
            # their rounding (~1e-5 each) bounds the agreement, not a relative 1e-4 of the small KL
            assert r["kl_after"]["kl"] == pytest.approx(want["kl"], abs=1e-4), name


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
