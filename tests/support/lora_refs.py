"""HF PEFT references for the LoRA tests (train/lora.py): a PEFT model with random nonzero adapters."""
from __future__ import annotations

import torch

# every Megatron target and the PEFT projections it stands for
ALL_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_model(hf_dir, rank: int = 4, alpha: float = 8.0, seed: int = 0, targets=HF_TARGETS):
    """(PEFT-wrapped float32 HF model in eval mode, its adapters as adapter_model.safetensors names them).
    A and B are random (B nonzero: the adapters change the outputs and B's gradient is not A-free)."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model = get_peft_model(hf, LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(targets)))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    model.eval()
    return model, {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


def peft_grads(model) -> dict[str, torch.Tensor]:
    """Adapter gradients of `model` under adapter_model.safetensors' names."""
    return {n.replace(".default", ""): p.grad.detach().clone() for n, p in model.named_parameters()
            if "lora_" in n and p.grad is not None}


def lora_matmuls(layers: int) -> int:
    """tolerances.transformer_matmuls with the adapters: 7 projections x (A, B) more per layer."""
    return 3 * ((9 + 14) * layers + 1)
