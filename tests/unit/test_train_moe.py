"""MoE families (Qwen3-MoE, Mixtral) on Megatron-Core's MoE layer at TP=EP=1 (one process): logprobs and
entropy equal HF transformers' (router load-balancing loss off), gradients of the experts and router
equal HF's, and HF -> Megatron -> HF is bit-exact against the per-expert safetensors on disk."""
import pytest
import torch

from support.train_models import make_tiny_moe

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

VARIANTS = {
    "qwen3_moe_renorm": dict(family="qwen3_moe"),
    "qwen3_moe_no_renorm": dict(family="qwen3_moe", renormalize=False, topk=3, seed=1),
    "mixtral": dict(family="mixtral", seed=2),
    "qwen2_moe_shared": dict(family="qwen2_moe", renormalize=False, seed=3),  # + gated shared expert, qkv bias
}


def _disk_tensors(folder):
    from megatron_rl.train.hf_source import SafetensorsTensors

    return SafetensorsTensors(folder)


def _hf_grads_per_expert(hf) -> dict:
    """HF grads in checkpoint names: transformers >= 5 fuses experts (gate_up_proj [E, 2I, H], down_proj
    [E, H, I]) in memory and names Mixtral's block `mlp`; split and rename them as the checkpoint has them."""
    from megatron_rl.train.model import model_dims
    from megatron_rl.train.moe import expert_hf_name, router_hf_name

    moe = model_dims(hf.config).moe
    out = {}
    for name, p in hf.named_parameters():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        if name.endswith(".mlp.gate.weight"):
            out[router_hf_name(moe, layer)] = p.grad
        if ".experts." not in name and not name.endswith(".mlp.gate.weight"):
            out[name] = p.grad
        if ".experts." not in name:
            continue
        for e in range(p.shape[0]):
            if name.endswith("gate_up_proj"):
                gate, up = p.grad[e].chunk(2, dim=0)
                out[expert_hf_name(moe, layer, e, "gate")], out[expert_hf_name(moe, layer, e, "up")] = gate, up
            else:
                out[expert_hf_name(moe, layer, e, "down")] = p.grad[e]
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tiny_moe_equals_hf(tp1, tmp_path, variant):
    from transformers import AutoModelForCausalLM

    from megatron_rl.train.hf_weights import export_hf_tensors, hf_names_of_stage, load_hf_weights
    from megatron_rl.train.logprobs import token_logprobs
    from megatron_rl.train.model import build_model, forward_logits

    folder = make_tiny_moe(tmp_path / variant, **VARIANTS[variant])
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval().to(DEVICE)
    chunks = build_model(hf.config, tp1, torch.float32, use_te=False)
    load_hf_weights(chunks, folder)
    disk = _disk_tensors(folder)
    exported = dict(export_hf_tensors(chunks))
    assert sorted(exported) == sorted(disk) and sorted(hf_names_of_stage(chunks)) == sorted(disk)
    for name, tensor in exported.items():
        assert torch.equal(tensor.cpu(), disk[name]), name

    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 301, (3, 20), generator=g).to(DEVICE)
    weights = torch.randn(3, 19, generator=g).to(DEVICE)
    logits = forward_logits(chunks[0], tokens)
    lp, ent = token_logprobs(logits[:, :-1], tokens[:, 1:], None, hf.config.vocab_size, with_entropy=True)
    ref_all = torch.log_softmax(hf(tokens).logits.float()[:, :-1], -1)
    ref_lp = ref_all.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(lp, ref_lp, atol=2e-5, rtol=0)
    torch.testing.assert_close(ent, -(ref_all.exp() * ref_all).sum(-1), atol=2e-5, rtol=0)
    (lp * weights).sum().backward()
    (ref_lp * weights).sum().backward()
    got = dict(export_hf_tensors(chunks, grads=True))
    for name, ref in _hf_grads_per_expert(hf).items():
        scale = ref.abs().max().clamp_min(1e-6)
        torch.testing.assert_close(got[name] / scale, ref / scale, atol=2e-5, rtol=0, msg=name)


def test_moe_layout_errors():
    from megatron_rl.train.model import model_dims, transformer_config
    from megatron_rl.train.parallel import ParallelLayout
    from transformers import Qwen3MoeConfig

    dims = model_dims(Qwen3MoeConfig(num_experts=6, num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=16))
    with pytest.raises(ValueError, match="split evenly over trainer.expert_parallel=4"):
        transformer_config(dims, ParallelLayout(dp=4, ep=4))
    with pytest.raises(ValueError, match="sequence_parallel"):
        transformer_config(dims, ParallelLayout(tp=2, ep=2))
    # accepted: TP > 1 at EP = 1, and the aux loss with CP (tests/multiproc/test_train_moe_model_parallel.py)
    transformer_config(dims, ParallelLayout(tp=2, sequence_parallel=True))
    transformer_config(dims, ParallelLayout(cp=2), router_aux_loss=0.01)
    with pytest.raises(ValueError, match="must divide"):
        ParallelLayout(dp=3, ep=2)
