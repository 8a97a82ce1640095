"""HF models and references for the Megatron model tests (train/model, hf_weights, logprobs)."""
from __future__ import annotations

from pathlib import Path

import torch


def make_tiny_hf(out: Path, family: str = "llama", layers: int = 2, hidden: int = 48, heads: int = 6,
                 kv_heads: int = 3, intermediate: int = 97, vocab: int = 301, tie: bool = False,
                 rope_parameters: dict | None = None, seed: int = 0, sliding_window: int | None = None,
                 head_dim: int | None = None) -> Path:
    """Random tiny HF model (config + safetensors, no tokenizer). Odd sizes exercise TP padding;
    `head_dim` (Qwen3's default is 128) may differ from hidden / heads."""
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                              Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "mistral": (MistralConfig, MistralForCausalLM),
               "qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
    cfg_cls, model_cls = classes[family]
    kwargs = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=512, tie_word_embeddings=tie, rms_norm_eps=1e-5)
    if rope_parameters:
        kwargs["rope_parameters"] = rope_parameters
    if family == "mistral":
        kwargs["sliding_window"] = sliding_window
    kwargs["head_dim"] = head_dim or hidden // heads
    cfg = cfg_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(cfg).float()
    with torch.no_grad():  # HF inits norms to 1 and biases to 0: randomise so their mapping is tested
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    out = Path(out)
    model.save_pretrained(out, safe_serialization=True)
    return out


def make_tiny_moe(out: Path, family: str = "qwen3_moe", layers: int = 2, hidden: int = 48, heads: int = 6,
                  kv_heads: int = 3, head_dim: int = 12, experts: int = 4, topk: int = 2, expert_ffn: int = 40,
                  vocab: int = 301, renormalize: bool = True, seed: int = 0, shared_ffn: int = 56) -> Path:
    """Random tiny MoE HF model (per-expert safetensors, as HF checkpoints store them)."""
    from transformers import (MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=512,
                  num_experts_per_tok=topk, rms_norm_eps=1e-5, tie_word_embeddings=False)
    if family == "qwen3_moe":
        cfg = Qwen3MoeConfig(num_experts=experts, moe_intermediate_size=expert_ffn, intermediate_size=3 * expert_ffn,
                             norm_topk_prob=renormalize, **common)
        model_cls = Qwen3MoeForCausalLM
    elif family == "qwen2_moe":  # + q/k/v bias and a sigmoid-gated shared expert
        cfg = Qwen2MoeConfig(num_experts=experts, moe_intermediate_size=expert_ffn, intermediate_size=3 * expert_ffn,
                             shared_expert_intermediate_size=shared_ffn, norm_topk_prob=renormalize, **common)
        model_cls = Qwen2MoeForCausalLM
    else:
        cfg = MixtralConfig(num_local_experts=experts, intermediate_size=expert_ffn, **common)
        model_cls = MixtralForCausalLM
    torch.manual_seed(seed)
    model = model_cls(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):  # a spread-out router: no near-ties in the top-k
                p.normal_(0.0, 0.5)
    out = Path(out)
    model.save_pretrained(out, safe_serialization=True)
    return out


def make_served_tiny_moe(out: Path, tokenizer_dir: Path, **moe) -> Path:
    """`make_tiny_moe` (hidden 64, 4 heads of 16, 2 KV heads, plus `moe`) with the tokenizer of the tiny
    Llama in `tokenizer_dir` and its vocabulary size: an SGLang server needs a tokenizer."""
    import json
    import shutil

    vocab = json.loads((Path(tokenizer_dir) / "config.json").read_text())["vocab_size"]
    out = make_tiny_moe(out, hidden=64, heads=4, kv_heads=2, head_dim=16, vocab=vocab, **moe)
    for f in Path(tokenizer_dir).glob("tokenizer*"):
        shutil.copy(f, out / f.name)
    return out


def smollm2_fp32_dir(root: Path) -> Path:
    """SmolLM2-135M dequantised from the GGUF into an fp32 HF dir under `root` (the generators' copy,
    control.model_files), made once per pytest session so multi-process workers load safetensors."""
    from megatron_rl.control.model_files import generator_model_dir

    return generator_model_dir("smollm2-135m", "fp32", cache=root)


def hf_logprobs(model, tokens: torch.Tensor) -> torch.Tensor:
    """Reference: log_softmax over the full vocab of HF logits, gathered at the next tokens."""
    with torch.no_grad():
        logits = model(tokens).logits.float()
    return torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
