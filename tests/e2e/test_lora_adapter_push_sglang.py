"""Adapter push (trainer.lora.push: adapter) into a real SGLang CPU server (fp32, tiny random Llama):
after the push, greedy tokens and every reported logprob equal HF + PEFT's with the same adapter; a wrong
scaling (alpha) is caught; an update while a turn runs leaves that turn on its adapter (tokens equal a run
of that adapter alone, all stamped with its version) while new turns take the new one; the base weights are
never sent (the server's own weight version stays the disk's)."""
import time

import pytest
import torch

from megatron_rl.config import GeneratorConfig, RolloutConfig
from megatron_rl.rollout.adapters import adapter_name, lora_server_args
from megatron_rl.rollout.generator import Generator
from megatron_rl.rollout.server import ServerSpec, SGLangServer
from megatron_rl.sync.adapter_push import AdapterSender
from megatron_rl.sync.update import target_of
from support.net import free_port

pytestmark = pytest.mark.e2e

RANK, ALPHA = 4, 8.0
PROMPTS = [[0, 5, 6, 7], [0, 40, 41, 42, 43, 44]]


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir):
    """Two PEFT models over the tiny Llama with random nonzero adapters, and their tensors."""
    from support.lora_refs import peft_model

    return [peft_model(tiny_llama_dir, rank=RANK, alpha=ALPHA, seed=s) for s in (0, 1)]


@pytest.fixture(scope="module")
def gen(tiny_llama_dir, tmp_path_factory):
    targets = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    spec = ServerSpec(model_path=str(tiny_llama_dir), port=free_port(), max_total_tokens=4096, dtype="float32",
                      log_path=str(tmp_path_factory.mktemp("sglang_lora") / "server.log"), threads=1,
                      extra_args=lora_server_args(RANK, targets))
    with Generator(SGLangServer(spec), RolloutConfig(), GeneratorConfig(), adapter_push=True) as g:
        yield g


def _config(alpha=ALPHA):
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return {"peft_type": "LORA", "r": RANK, "lora_alpha": alpha, "target_modules": modules, "bias": "none"}


def _push(gen, version, tensors, config):
    gen.begin_update()  # adapter push: nothing pauses
    report = AdapterSender().send(version, tensors, config, [target_of(gen)])
    gen.finish_update(version)
    return report


def _sample(gen, prompt, n=12):
    gen.submit(f"g{time.monotonic_ns()}", prompt, group_size=1,
               sampling={"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True})
    out = gen.get(timeout=300)
    assert not isinstance(out, BaseException), out
    return out


def _bound(model, logits, logp):
    from support.tolerances import logprob_error, network_error

    cfg = model.config
    matmuls = (9 + 14) * cfg.num_hidden_layers + 1  # the base's chain plus A and B of seven projections
    z_err = network_error(matmuls, max(cfg.hidden_size, cfg.intermediate_size)) * logits.abs().max()
    return 2 * z_err + logprob_error(cfg.vocab_size, logp)


def _peft_reference(model, prompt, n):
    with torch.no_grad():
        ids = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=2)[0, len(prompt):].tolist()
        logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
    return ids, logp, _bound(model, logits, logp)


def test_pushed_adapter_samples_as_hf_peft_and_a_wrong_alpha_is_caught(gen, adapters):
    (model, tensors), _ = adapters
    report = _push(gen, 1, tensors, _config())
    assert report.tensors == len(tensors) == 2 * 7 * model.config.num_hidden_layers
    assert gen.server.client.weight_version() == "0"  # the base was never re-sent
    for prompt in PROMPTS:
        ref_ids, ref_logp, bound = _peft_reference(model, prompt, 12)
        out = _sample(gen, prompt)
        assert out.completion_ids == ref_ids
        assert out.weight_versions == [1] * 12
        err = (torch.tensor(out.behaviour_logprobs) - ref_logp).abs()
        assert (err <= bound).all(), (err.max().item(), bound.min().item())
    # the same tensors under twice the scaling (alpha) — or no adapter at all — are far outside the bound
    _push(gen, 2, tensors, _config(alpha=2 * ALPHA))
    ref_ids, ref_logp, bound = _peft_reference(model, PROMPTS[0], 12)
    out = _sample(gen, PROMPTS[0])
    assert out.weight_versions == [2] * 12
    assert out.completion_ids != ref_ids or (torch.tensor(out.behaviour_logprobs) - ref_logp).abs().max() > 100 * bound.max()
    assert adapter_name(1) not in gen.server.client.loaded_adapters()  # idle: freed after the switch


def test_a_turn_in_flight_keeps_its_adapter_and_version(gen, adapters):
    (m1, t1), (m2, t2) = adapters
    _push(gen, 3, t1, _config())
    solo = _sample(gen, PROMPTS[0], n=200)
    before = gen.tokens_streamed
    gen.submit("long", PROMPTS[0], group_size=1, sampling={"temperature": 0.0, "max_new_tokens": 200, "ignore_eos": True})
    deadline = time.monotonic() + 120
    while gen.tokens_streamed == before and time.monotonic() < deadline:
        time.sleep(0.05)
    _push(gen, 4, t2, _config())  # while the long turn runs on adapter 3
    assert adapter_name(3) in gen.server.client.loaded_adapters()  # still in use: kept
    ref_ids, _, _ = _peft_reference(m2, PROMPTS[1], 8)
    new = _sample(gen, PROMPTS[1], n=8)
    assert new.completion_ids == ref_ids and new.weight_versions == [4] * 8
    long = gen.get(timeout=300)
    assert not isinstance(long, BaseException), long
    assert long.completion_ids == solo.completion_ids and long.weight_versions == [3] * 200
    assert max(abs(a - b) for a, b in zip(long.behaviour_logprobs, solo.behaviour_logprobs)) < 1e-4
    assert adapter_name(3) not in gen.server.client.loaded_adapters()  # its last turn returned: freed

