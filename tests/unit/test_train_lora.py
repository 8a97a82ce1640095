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
    torch.testing.assert_close(lp, ref, rtol=RTOL, atol=RTOL)  # measured: 1e-6 (adapters move them by 0.4)
    with torch.no_grad(), model.disable_adapter():
        base = torch.log_softmax(model(tokens).logits.float()[:, :-1], -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    assert (ref - base).abs().max() > 100 * RTOL  # the adapters matter: the comparison is not of the base
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


def test_weight_push_sends_the_merged_weights_peft_merges(tp1, tiny, monkeypatch):
    """The generators get W + alpha/r B A under HF names (sync/trainer_push.py through
    hf_weights.export_hf_tensors): a plain model, as PEFT's merge_and_unload gives, no adapter tensor."""
    from megatron_rl.sync import trainer_push
    from megatron_rl.sync.sender import SendReport
    from support.tolerances import sum_error

    sent = {}

    class CapturingSender:  # stands for the generators' bucket stream
        def __init__(self, stage, targets, bucket_mb, address):
            pass

        def send(self, tensors):
            sent.update((n, t.clone()) for n, t in tensors)
            return SendReport(0, names=list(sent), bytes=sum(t.numel() * 4 for t in sent.values()))

    monkeypatch.setattr(trainer_push, "WeightSender", CapturingSender)
    model, adapters = peft_model(tiny)
    chunks = _megatron(tiny, tp1, _spec(), adapters)
    report = trainer_push.TrainerPush(chunks, bucket_mb=1.0, node_addr="127.0.0.1").push(1, [])
    merged = {n: p.detach() for n, p in model.merge_and_unload().named_parameters()}
    assert sent.keys() == merged.keys() and report.tensors == len(merged)
    for name, t in sent.items():
        # fp32: the same rank-4 products added to W, in another order (PEFT: (B A) s, here s (B A))
        tol = sum_error(4) * (merged[name].abs().max() + 1)
        torch.testing.assert_close(t, merged[name], rtol=0, atol=tol, msg=name)


def test_dropout_only_in_gradient_passes(tp1, tiny):
    from megatron_rl.train.lora import LoraSpec
    from megatron_rl.train.model import forward_logits

    _, adapters = peft_model(tiny)
    plain = _megatron(tiny, tp1, _spec(), adapters)
    dropped = _megatron(tiny, tp1, LoraSpec(4, 8.0, 0.5, ALL_TARGETS), adapters)
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # logprob passes (proximal, reference, evaluation): no mask
        assert torch.equal(forward_logits(dropped[0], tokens), forward_logits(plain[0], tokens))
    assert not torch.allclose(forward_logits(dropped[0], tokens), forward_logits(plain[0], tokens))


def _one_line_error(fn, match):
    from megatron_rl.config import ConfigError

    with pytest.raises(ConfigError, match=match) as e:
        fn()
    assert "\n" not in str(e.value)


def test_bad_lora_input_gives_one_line_naming_the_key(tiny, tmp_path):
    from transformers import AutoConfig

    from megatron_rl.config import config_from_dict
    from megatron_rl.train.lora import LoraSpec, check_model
    from megatron_rl.train.model import model_dims
    from support.train_models import make_tiny_moe

    def cfg(**lora):
        return lambda: config_from_dict({"trainer": {"lora": {"rank": 4, **lora}}})

    _one_line_error(cfg(target_modules=["linear_qkv", "q_proj"]),
                    r"^trainer.lora.target_modules\[1\]: 'q_proj' matches no module \(known: linear_qkv, ")
    _one_line_error(cfg(target_modules=[]), r"^trainer.lora.target_modules: must name at least one")
    _one_line_error(cfg(alpha=0), r"^trainer.lora.alpha: must be > 0")
    _one_line_error(cfg(dropout=1.0), r"^trainer.lora.dropout: must lie in")
    _one_line_error(lambda: config_from_dict({"trainer": {"lora": {"rank": -1}}}), r"^trainer.lora.rank: must be >= 0")
    _one_line_error(lambda: config_from_dict({"trainer": {"lora": {"rnak": 4}}}), r"^trainer.lora.rnak: unknown key")
    assert config_from_dict({}, ["trainer.lora.rank=8"]).trainer.lora.rank == 8  # a dotted override reaches it

    dims = model_dims(AutoConfig.from_pretrained(tiny))  # hidden 48, 3 KV heads of 8: k_proj 48 -> 24
    _one_line_error(lambda: check_model(LoraSpec(25, 8.0), dims),
                    r"^trainer.lora.rank: 25 exceeds linear_qkv's k_proj \(48 -> 24\): the rank must be <= 24$")
    check_model(LoraSpec(24, 8.0), dims)
    check_model(LoraSpec(25, 8.0, targets=("linear_fc1",)), dims)  # gate/up 48 -> 97: 25 fits
    _one_line_error(lambda: check_model(LoraSpec(4, 8.0), dims, use_te=True),
                    r"^trainer.lora: LoRA on the Transformer Engine layer spec")
    _one_line_error(lambda: check_model(LoraSpec(4, 8.0, 0.1), dims, recompute="full"),
                    r"^trainer.lora.dropout: > 0 with trainer.recompute: full is not supported")
    check_model(LoraSpec(4, 8.0, 0.1), dims, recompute="selective")
    moe = model_dims(AutoConfig.from_pretrained(make_tiny_moe(tmp_path / "moe")))
    _one_line_error(lambda: check_model(LoraSpec(4, 8.0), moe),
                    r"^trainer.lora.target_modules: linear_fc1, linear_fc2 on an MoE model \(qwen3_moe\)")
    check_model(LoraSpec(4, 8.0, targets=("linear_qkv", "linear_proj")), moe)


def test_preflight_refuses_lora_the_model_cannot_take_before_any_rank_starts(tiny):
    from megatron_rl.config import config_from_dict
    from megatron_rl.control.preflight import check_model

    def cfg(rank):
        return config_from_dict({"trainer": {"model": str(tiny), "precision": "fp32", "lora": {"rank": rank}}})

    _one_line_error(lambda: check_model(cfg(25)), r"^trainer.lora.rank: 25 exceeds linear_qkv's k_proj")
    check_model(cfg(4))
