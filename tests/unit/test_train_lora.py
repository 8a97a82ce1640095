"""LoRA in the Megatron trainer (train/lora.py) against HF PEFT, one process (TP=PP=DP=1): the same
logprobs and adapter gradients with the same (nonzero) adapters, merged weights equal PEFT's merge,
frozen base weights, and one-line refusals naming the key."""
import pytest
import torch

from support.lora_refs import ALL_TARGETS, lora_matmuls, peft_grads, peft_model
from support.tolerances import network_error
from support.train_models import make_tiny_hf

VOCAB = 301
# float32 through the adapted tiny model's chain of matmuls (reductions <= its 301-token vocabulary),
# Megatron's fused kernels against PEFT's separate ones: relative error per result
RTOL = network_error(lora_matmuls(2), VOCAB)


@pytest.fixture(scope="module", params=["llama", "qwen2_tied"])
def tiny(request, tmp_path_factory):
    spec = dict(family="llama") if request.param == "llama" else dict(family="qwen2", tie=True, seed=2)
    return make_tiny_hf(tmp_path_factory.mktemp(request.param), **spec)


def _megatron(hf_dir, layout, spec, adapters):
    from transformers import AutoConfig

    from megatron_rl.train.hf_weights import load_hf_weights
    from megatron_rl.train.lora_weights import load_adapter_tensors
    from megatron_rl.train.model import build_model

    chunks = build_model(AutoConfig.from_pretrained(hf_dir), layout, torch.float32, use_te=False, lora=spec)
    load_hf_weights(chunks, hf_dir)
    if adapters is not None:
        load_adapter_tensors(chunks, adapters)
    return chunks


def _spec(rank=4, alpha=8.0, targets=ALL_TARGETS):
    from megatron_rl.train.lora import LoraSpec

    return LoraSpec(rank, alpha, 0.0, tuple(targets))


def test_logprobs_and_adapter_gradients_equal_peft(tp1, tiny):
    from megatron_rl.train.logprobs import token_logprobs
    from megatron_rl.train.lora_weights import export_adapter_tensors
    from megatron_rl.train.model import forward_logits

    model, adapters = peft_model(tiny)
    chunks = _megatron(tiny, tp1, _spec(), adapters)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (3, 20), generator=g)
    weights = torch.randn(3, 19, generator=g)
    lp = token_logprobs(forward_logits(chunks[0], tokens)[:, :-1], tokens[:, 1:], None, VOCAB)
    ref = torch.log_softmax(model(tokens).logits.float()[:, :-1], -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(lp, ref, rtol=RTOL, atol=RTOL)
    (lp * weights).sum().backward()
    (ref * weights).sum().backward()
    want = peft_grads(model)
    got = dict(export_adapter_tensors(chunks, grads=True))
    assert got.keys() == want.keys() and len(got) == 2 * 7 * 2
    for name, grad in got.items():
        torch.testing.assert_close(grad, want[name], rtol=RTOL, atol=RTOL * want[name].abs().max(), msg=name)
    # the base is frozen: no gradient reaches any non-adapter parameter
    for name, p in chunks[0].named_parameters():
        assert (p.grad is not None) == ("lora_" in name), name
