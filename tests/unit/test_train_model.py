"""Megatron GPT from HF configs at TP=1 (one process): logprobs, entropy and gradients equal HF
transformers'; HF -> Megatron -> HF export is bit-exact; unsupported configs fail clearly."""
import pytest
import torch

from support.train_models import make_tiny_hf, smollm2_fp32_dir

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # Megatron puts params on the GPU when one exists


def _megatron(hf_dir_or_model, layout, tensors=None, use_te=False):
    from transformers import AutoModelForCausalLM

    from megatron_rl.train.hf_weights import load_hf_weights
    from megatron_rl.train.model import build_model

    hf = hf_dir_or_model
    if not isinstance(hf, torch.nn.Module):
        hf = AutoModelForCausalLM.from_pretrained(hf_dir_or_model, dtype=torch.float32).eval()
    hf = hf.to(DEVICE)
    chunks = build_model(hf.config, layout, torch.float32, use_te=use_te)
    load_hf_weights(chunks, tensors if tensors is not None else hf_dir_or_model)
    return hf, chunks


def _compare(hf, chunks, tokens, tol, weights=None):
    """Logprobs/entropy equal HF's; with weights, grads of sum(logp * w) too (in HF names)."""
    from megatron_rl.train.hf_weights import export_hf_tensors
    from megatron_rl.train.logprobs import token_logprobs
    from megatron_rl.train.model import forward_logits

    tokens = tokens.to(DEVICE)
    weights = None if weights is None else weights.to(DEVICE)
    logits = forward_logits(chunks[0], tokens)
    lp, ent = token_logprobs(logits[:, :-1], tokens[:, 1:], None, hf.config.vocab_size, with_entropy=True)
    ref_all = torch.log_softmax(hf(tokens).logits.float()[:, :-1], -1)
    ref_lp = ref_all.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(lp, ref_lp, atol=tol, rtol=0)
    torch.testing.assert_close(ent, -(ref_all.exp() * ref_all).sum(-1), atol=tol, rtol=0)
    if weights is not None:
        (lp * weights).sum().backward()
        (ref_lp * weights).sum().backward()
        got = dict(export_hf_tensors(chunks, grads=True))
        for name, p in hf.named_parameters():
            scale = p.grad.abs().max().clamp_min(1e-6)
            torch.testing.assert_close(got[name] / scale, p.grad / scale, atol=2e-5, rtol=0, msg=name)


def _export_bit_exact(hf, chunks):
    from megatron_rl.train.hf_weights import export_hf_tensors, hf_names_of_stage

    ref = dict(hf.named_parameters())
    names = []
    for name, tensor in export_hf_tensors(chunks):
        names.append(name)
        assert torch.equal(tensor, ref[name].detach()), name
    assert sorted(names) == sorted(ref) and names == hf_names_of_stage(chunks)


def test_smollm2_gguf_logprobs_equal_hf_tp1(tp1, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from megatron_rl.train.hf_source import resolve_model

    folder = smollm2_fp32_dir(tmp_path_factory.getbasetemp())  # dequantised via resolve_model's GGUF path
    gguf_config = resolve_model("smollm2-135m").config()
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert (gguf_config.num_hidden_layers, gguf_config.vocab_size) == (30, 49152) and gguf_config.tie_word_embeddings
    hf, chunks = _megatron(hf, tp1, tensors=folder)
    tokens = torch.randint(0, 49152, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _compare(hf, chunks, tokens, tol=2e-4)
    _export_bit_exact(hf, chunks)


TINY = {
    "llama_gqa": dict(family="llama"),
    "llama_mha_tied": dict(family="llama", heads=4, kv_heads=4, hidden=32, tie=True),
    "qwen2_bias_tied": dict(family="qwen2", tie=True),
    "mistral_sliding": dict(family="mistral", sliding_window=8),
    "qwen3_qk_norm": dict(family="qwen3"),  # q/k RMSNorm per head, no attention bias
    "qwen3_wide_heads_tied": dict(family="qwen3", head_dim=12, tie=True),  # head_dim != hidden / heads
    "llama3_rope": dict(family="llama", rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192)),
    "linear_rope": dict(family="llama", rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0)),
    "yarn_rope": dict(family="qwen2", rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128)),
}


@pytest.mark.parametrize("variant", list(TINY))
def test_tiny_variants_equal_hf(tp1, tmp_path, variant):
    hf, chunks = _megatron(make_tiny_hf(tmp_path / variant, **TINY[variant]), tp1)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 301, (3, 20), generator=g)
    _compare(hf, chunks, tokens, tol=2e-5, weights=torch.randn(3, 19, generator=g))
    _export_bit_exact(hf, chunks)


@pytest.mark.gpu
def test_transformer_engine_spec_equals_hf_on_gpu(tp1, tmp_path):
    pytest.importorskip("transformer_engine")
    hf, chunks = _megatron(make_tiny_hf(tmp_path / "te", family="qwen2", tie=True), tp1, use_te=True)
    names = {n for n, _ in chunks[0].named_parameters()}
    assert any(n.endswith("linear_qkv.layer_norm_weight") for n in names)  # TE fuses the norms
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 301, (2, 16), generator=g)
    _compare(hf, chunks, tokens, tol=1e-4, weights=torch.randn(2, 15, generator=g))
    _export_bit_exact(hf, chunks)


def test_model_dims_pad_for_tp():
    from transformers import LlamaConfig

    from megatron_rl.train.model import model_dims

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3)
    d = model_dims(cfg, tp=2)
    assert (d.padded_num_kv_heads, d.padded_num_heads, d.heads_per_group) == (4, 12, 3)
    assert (d.padded_vocab_size, d.padded_ffn_size) == (49152, 1536)
    d4 = model_dims(LlamaConfig(vocab_size=301, intermediate_size=97, num_attention_heads=8,
                                num_key_value_heads=8, hidden_size=64), tp=4)
    assert (d4.padded_vocab_size, d4.padded_ffn_size, d4.padded_num_kv_heads) == (304, 100, 8)


@pytest.mark.parametrize("change, message", [
    (dict(model_type="gpt2"), "model_type"),
    (dict(hidden_act="gelu"), "SwiGLU"),
    (dict(rope_parameters=dict(rope_type="dynamic", rope_theta=1e4, factor=2.0)), "dynamic"),
    (dict(rope_parameters=dict(rope_type="llama3", rope_theta=1e4, factor=8.0, low_freq_factor=2.0,
                               high_freq_factor=4.0, original_max_position_embeddings=8192)), "low_freq_factor"),
])
def test_unsupported_configs_fail_clearly(change, message):
    from transformers import LlamaConfig

    from megatron_rl.train.model import UnsupportedModelError, model_dims

    cfg = LlamaConfig(num_attention_heads=4, num_key_value_heads=2, hidden_size=64)
    for key, value in change.items():
        setattr(cfg, key, value)
    with pytest.raises(UnsupportedModelError, match=message):
        model_dims(cfg)


def test_layers_must_split_over_stages():
    from transformers import LlamaConfig

    from megatron_rl.train.model import model_dims, transformer_config
    from megatron_rl.train.parallel import ParallelLayout

    dims = model_dims(LlamaConfig(num_hidden_layers=3, num_attention_heads=4, hidden_size=64))
    with pytest.raises(ValueError, match="split evenly"):
        transformer_config(dims, ParallelLayout(pp=2))


def test_resolve_model_errors(tmp_path):
    from megatron_rl.train.hf_source import resolve_model

    with pytest.raises(FileNotFoundError, match="HF directory"):
        resolve_model(tmp_path / "nope")


def test_fp32_under_transformer_engine_is_refused_before_any_rank_starts(monkeypatch):
    """TE has no fp32 flash/fused attention for packed (THD) micro-batches: refused by the launcher's
    preflight and by the Trainer before init_parallel, naming trainer.precision; bf16 and the local
    spec (a GPU without TE, the CPU) pass."""
    from megatron_rl.config import Config, ConfigError
    from megatron_rl.control.preflight import check_model
    from megatron_rl.train import model, trainer
    from megatron_rl.train.trainer import Trainer

    model.check_precision("fp32", use_te=False)
    model.check_precision("bf16", use_te=True)
    monkeypatch.setattr(model, "te_available", lambda: True)  # the one machine fact: TE's spec is used

    def no_world(*args, **kwargs):
        raise AssertionError("the trainer world was started before the refusal")

    monkeypatch.setattr(trainer, "init_parallel", no_world)
    cfg = Config()
    cfg.trainer.precision = "fp32"
    for refuse in (check_model, Trainer):
        with pytest.raises(ConfigError, match=r"^trainer\.precision: fp32 with Transformer Engine.*bf16"):
            refuse(cfg)
