"""Trainer/generator logprob mismatch on the real pair: SGLang (CPU engine) samples, the Megatron
trainer (fp32, CPU) scores the same tokens through its update path (`Trainer.evaluate`: the packing,
temperature and fused-loss forward that the RL step runs), and the `mismatch/lag0/...` metrics must be
small; after the generator's weights are perturbed (loaded from a perturbed copy, tagged with the
trainer's version as a broken sync would be) the same metrics must catch it.

Why lag 0 is small here: both sides compute in fp32 (the generator is launched with --dtype float32;
SGLang's default would serve this float32 checkpoint in float16) on the same weights, and both report
log_softmax(logits / T) at the sampling temperature (the trainer divides by the T each rollout
carries). What is left is rounding of differently ordered fp32 kernels (SGLang's torch_native attention,
RoPE cache, norms and matmuls vs Megatron's): measured |d| mean 2.9e-7, max 9.5e-7 over 192 tokens at
T=0.7 (a float16 server: mean 1.1e-4, max 4.5e-4). The bound is fp32's for the model's chain of
matmuls (tests/support/tolerances.py), below the float16 figure. A 5% perturbation of the generator's
weights moves |d| by about 10^4 times the fp32 figure.
"""
from __future__ import annotations

import shutil

import pytest
import torch

from megatron_rl.records import TrainSequence
from support.runs import running_generator
from support.tolerances import network_error

PROMPTS = [[1, 40, 41, 42, 43], [1, 100, 7, 250, 9, 11, 12]]
SAMPLING = {"temperature": 0.7, "max_new_tokens": 24, "ignore_eos": True}
# bound on max |trainer - generator| at lag 0: fp32 rounding through the tiny Llama's forward (2 layers,
# reductions <= 128; its logits are O(1)), divided by T: 2.0e-4 at T=0.7 (measured 9.5e-7; a float16 server 4.5e-4)
LAG0_ABS_MAX = 2 * network_error(9 * 2 + 1, 128) / SAMPLING["temperature"]
PERTURBED_VERSION = 7


@pytest.fixture(scope="module")
def gen(tiny_llama_dir, tmp_path_factory):
    with running_generator(tiny_llama_dir, tmp_path_factory.mktemp("sglang"), group_size=4, max_total_tokens=4096,
                           threads=1) as g:
        yield g


@pytest.fixture(scope="module")
def trainer(tiny_llama_dir):
    from support.policies import make_trainer

    return make_trainer(tiny_llama_dir, micro_batch_tokens=256)


def sample(gen, tag: str) -> list[TrainSequence]:
    for i, prompt in enumerate(PROMPTS):
        gen.submit(f"{tag}{i}", prompt, sampling=SAMPLING)
    rollouts = list(gen.completions(n=4 * len(PROMPTS), timeout=120))
    return [TrainSequence(r.prompt_ids + r.completion_ids, len(r.prompt_ids), r.behaviour_logprobs,
                          advantage=float(i % 2) - 0.5, weight_versions=r.weight_versions,
                          temperature=r.temperature) for i, r in enumerate(rollouts)]


def perturbed_copy(src, dst, seed=0, scale=0.05):
    """The model of `src` with every weight moved by `scale` of its std, saved as a model folder."""
    from transformers import LlamaForCausalLM

    shutil.copytree(src, dst)
    model = LlamaForCausalLM.from_pretrained(src, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * p.std() * torch.randn(p.shape, generator=g))
    model.save_pretrained(dst, safe_serialization=True)
    return dst


def test_lag0_mismatch_is_small_and_a_perturbed_generator_is_caught(gen, trainer, tiny_llama_dir, tmp_path):
    seqs = sample(gen, "same")
    assert {v for s in seqs for v in s.weight_versions} == {trainer.version}  # all lag 0
    m = trainer.evaluate(seqs)
    n_tokens = sum(s.completion_len for s in seqs)
    assert m["mismatch/lag0/tokens"] == m["mismatch/lag0_pure/tokens"] == n_tokens  # no update while sampling
    print("lag-0 mismatch, same weights:", {k: v for k, v in m.items() if k.startswith("mismatch/")})
    assert m["mismatch/lag0/abs_max"] < LAG0_ABS_MAX
    assert m["mismatch/lag0/out_of_band_frac"] == 0.0

    # the generator now serves other weights under the trainer's version (what a broken sync does)
    path = perturbed_copy(tiny_llama_dir, tmp_path / "perturbed")
    gen.begin_update()
    gen.server.client._checked("/update_weights_from_disk", {"model_path": str(path), "flush_cache": False})
    gen.finish_update(PERTURBED_VERSION)
    trainer.version = PERTURBED_VERSION
    bad = trainer.evaluate(sample(gen, "perturbed"))
    print("lag-0 mismatch, perturbed generator:", {k: v for k, v in bad.items() if k.startswith("mismatch/")})
    assert set(k.split("/")[1] for k in bad if k.startswith("mismatch/")) == {"lag0", "lag0_pure"}
    assert bad["mismatch/lag0/abs_mean"] > 2 * LAG0_ABS_MAX  # the mean alone is past the bound on the max
    assert bad["mismatch/lag0/kl_k3"] > 100 * m["mismatch/lag0/kl_k3"]
