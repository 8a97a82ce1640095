"""torchrun --nproc_per_node=2: a GPT with TP=2 must give the logits and gradients of the same GPT at TP=1.

Every rank also builds the TP=1 model from the gathered TP=2 weights (a data-parallel pair of
replicas), so each rank compares its own sharded run against a dense reference.
"""
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_rl.platform import ensure_megatron_shims

ensure_megatron_shims()
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

VOCAB, SEQ, BATCH = 128, 16, 4


def build(tp: int) -> GPTModel:
    cfg = TransformerConfig(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        tensor_model_parallel_size=tp, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False)
    return GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=VOCAB,
                    max_sequence_length=SEQ, position_embedding_type="rope",
                    share_embeddings_and_output_weights=False)


def gather_full(model: GPTModel, tp: int) -> dict[str, torch.Tensor]:
    """Dense TP=1 state from TP shards (fc1 holds [gate_i; up_i] per rank)."""
    group = ps.get_tensor_model_parallel_group()
    full = {}
    for name, p in model.named_parameters():
        t = p.detach().contiguous()
        if getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t, group=group)
            if name.endswith("linear_fc1.weight"):
                halves = [x.chunk(2, dim=0) for x in parts]
                full[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
            else:
                full[name] = torch.cat(parts, dim=p.partition_dim)
        else:
            full[name] = t.clone()
    return full


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    model_parallel_cuda_manual_seed(7)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.roll(tokens, -1, 1)
    pos = torch.arange(SEQ).expand(BATCH, SEQ)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1).view(1, 1, SEQ, SEQ)

    model = build(2)
    logits_tp2 = model(tokens, pos, mask, runtime_gather_output=True).detach()
    model(tokens, pos, mask, labels=labels).mean().backward()  # vocab-parallel cross entropy
    weights = gather_full(model, 2)
    shard = model.decoder.layers[0].mlp.linear_fc2.weight.grad.contiguous()  # row-parallel: split on dim 1
    parts = [torch.empty_like(shard) for _ in range(2)]
    dist.all_gather(parts, shard, group=ps.get_tensor_model_parallel_group())
    fc2_grad_tp2 = torch.cat(parts, dim=1)

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    model_parallel_cuda_manual_seed(7)
    dense = build(1)
    result = dense.load_state_dict(weights, strict=False)
    assert not result.missing_keys and not result.unexpected_keys, result
    logits_tp1 = dense(tokens, pos, mask).detach()
    dense(tokens, pos, mask, labels=labels).mean().backward()
    fc2_grad_tp1 = dense.decoder.layers[0].mlp.linear_fc2.weight.grad

    dlogits = (logits_tp1 - logits_tp2).abs().max().item()
    dgrad = (fc2_grad_tp1 - fc2_grad_tp2).abs().max().item()
    print(f"rank{dist.get_rank()} max|dlogits|={dlogits:.2e} max|dgrad|={dgrad:.2e}", flush=True)
    ok = dlogits < 1e-5 and dgrad < 1e-6 and fc2_grad_tp1.abs().max().item() > 0
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
