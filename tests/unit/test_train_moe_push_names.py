"""The weight push of an MoE model sends what SGLang's loader takes: the names `export_hf_tensors` yields
(what sync/trainer_push.py streams) are exactly the HF checkpoint's own safetensors keys, and every
expert tensor is routed by the installed SGLang's `FusedMoE.make_expert_params_mapping` (the mapping
its Qwen3-MoE, Qwen2-MoE and Mixtral `load_weights` use) to the right expert and shard of the fused
`experts.w13_weight` [E, 2I, H] / `experts.w2_weight` [E, H, I], with the per-expert shapes those take.
The real push into a running SGLang server (Qwen3-MoE, EP=1) is tests/e2e/test_generator_moe.py."""
import re

import pytest
import torch

from support.train_models import make_tiny_moe

# family -> SGLang's checkpoint names for (gate, down, up) and the block holding the experts
SGLANG_CKPT = {"qwen3_moe": (("gate_proj", "down_proj", "up_proj"), "mlp"),
               "qwen2_moe": (("gate_proj", "down_proj", "up_proj"), "mlp"),
               "mixtral": (("w1", "w2", "w3"), "block_sparse_moe")}
EXPERT = re.compile(r"model\.layers\.(\d+)\.(\w+)\.experts\.(\d+)\.(\w+)\.weight$")


def _sglang_expert_route(name: str, family: str, n_experts: int) -> tuple[str, int, str]:
    """(SGLang parameter name, expert id, shard id) that SGLang's expert mapping gives `name`."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    (gate, down, up), _ = SGLANG_CKPT[family]
    mapping = FusedMoE.make_expert_params_mapping(ckpt_gate_proj_name=gate, ckpt_down_proj_name=down,
                                                  ckpt_up_proj_name=up, num_experts=n_experts)
    hits = [(name.replace(weight_name, param_name), expert, shard)
            for param_name, weight_name, expert, shard in mapping if weight_name in name]
    assert len(hits) == 1, (name, hits)
    return hits[0]


@pytest.mark.parametrize("family", list(SGLANG_CKPT))
def test_pushed_moe_names_are_the_checkpoint_keys_sglang_routes(tp1, tmp_path, family):
    from safetensors import safe_open
    from transformers import AutoConfig

    from megatron_rl.train.hf_weights import export_hf_tensors, load_hf_weights
    from megatron_rl.train.model import build_model

    folder = make_tiny_moe(tmp_path / family, family=family, experts=4, topk=2, expert_ffn=40, hidden=48)
    cfg = AutoConfig.from_pretrained(folder)
    chunks = build_model(cfg, tp1, torch.float32, use_te=False)
    load_hf_weights(chunks, folder)
    pushed = list(export_hf_tensors(chunks))
    keys = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as sf:
            keys |= set(sf.keys())
    names = [n for n, _ in pushed]
    assert len(names) == len(set(names)) and set(names) == keys

    n_experts = cfg.num_local_experts if family == "mixtral" else cfg.num_experts
    ffn = cfg.intermediate_size if family == "mixtral" else cfg.moe_intermediate_size
    (gate, down, up), block = SGLANG_CKPT[family]
    want_shard = {gate: ("w1", "w13_weight", (ffn, cfg.hidden_size)), up: ("w3", "w13_weight", (ffn, cfg.hidden_size)),
                  down: ("w2", "w2_weight", (cfg.hidden_size, ffn))}
    seen = set()
    for name, tensor in pushed:
        m = EXPERT.match(name)
        if m is None:
            assert ".experts." not in name, name
            continue
        layer, name_block, expert, part = int(m[1]), m[2], int(m[3]), m[4]
        shard, fused, shape = want_shard[part]
        assert name_block == block
        assert _sglang_expert_route(name, family, n_experts) == (f"model.layers.{layer}.{block}.experts.{fused}",
                                                                 expert, shard)
        assert tuple(tensor.shape) == shape, name
        seen.add((layer, expert, shard))
    assert seen == {(layer, e, s) for layer in range(cfg.num_hidden_layers) for e in range(n_experts)
                    for s in ("w1", "w2", "w3")}
    for layer in range(cfg.num_hidden_layers):  # the router: SGLang's ReplicatedLinear `gate` of the block
        router = dict(pushed)[f"model.layers.{layer}.{block}.gate.weight"]
        assert tuple(router.shape) == (n_experts, cfg.hidden_size)
