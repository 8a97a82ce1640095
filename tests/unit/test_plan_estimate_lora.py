"""The estimator counts LoRA (plan/lora_memory.py): the adapter parameters are the ones the trainer and
HF PEFT create, the memory terms move from the base to the adapters as derived, the activation terms
equal what autograd keeps tensor by tensor, and `plan` accepts the shipped one-node 24B LoRA example
(which does not fit one node without LoRA) and refuses what the trainer refuses."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from megatron_rl.config import load_config
from megatron_rl.plan.estimate import Cluster, activation_memory, estimate, shapes_of
from megatron_rl.plan.lora_memory import LoraShape, adapter_params, adapter_params_per_layer

from test_train_step import make_config  # noqa: E402  (tests/unit on sys.path)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
LORA_EXAMPLE = EXAMPLES / "magistral_small_lora.yaml"
GB = 1024 ** 3
TARGET_SETS = [["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], ["linear_qkv"],
               ["linear_proj", "linear_fc2"], ["linear_fc1"]]
PEFT_NAMES = {"linear_qkv": ["q_proj", "k_proj", "v_proj"], "linear_proj": ["o_proj"],
              "linear_fc1": ["gate_proj", "up_proj"], "linear_fc2": ["down_proj"]}


def _with_lora(cfg, **lora):
    new = dataclasses.replace(cfg.trainer.lora, **lora)
    return dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, lora=new))


@pytest.mark.parametrize("targets", TARGET_SETS, ids=lambda t: "+".join(x.split("_")[1] for x in t))
def test_adapter_count_is_what_the_trainer_and_peft_create(tiny_llama_dir, targets):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from megatron_rl.train.trainer import Trainer

    cfg = make_config(tiny_llama_dir, lora={"rank": 4, "target_modules": targets}, precision="bf16")
    shapes = shapes_of(cfg)
    lora = LoraShape.from_config(cfg.trainer.lora)
    trainer = Trainer(cfg)
    trained = [p for c in trainer.model_chunks for p in c.parameters() if p.requires_grad]
    assert adapter_params(shapes, lora) == sum(p.numel() for p in trained)
    # bf16: the optimizer's fp32 main copies (and so its Adam state) are the adapters' alone
    opts = getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
    main = [p for o in opts for g in o.param_groups for p in g["params"]]
    assert {p.dtype for p in main} == {torch.float32} and sum(p.numel() for p in main) == adapter_params(shapes, lora)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    peft = get_peft_model(hf, LoraConfig(r=4, target_modules=[n for t in targets for n in PEFT_NAMES[t]]))
    assert adapter_params(shapes, lora) == sum(p.numel() for p in peft.parameters() if p.requires_grad)


def test_memory_terms_move_from_the_base_to_the_adapters(tiny_llama_dir):
    cfg = make_config(tiny_llama_dir, precision="bf16", micro_batch_tokens=4096)
    shapes, cluster = shapes_of(cfg), Cluster()
    full = estimate(cfg, cluster, shapes)
    lora = _with_lora(cfg, rank=8)
    e = estimate(lora, cluster, shapes)
    n = adapter_params(shapes, LoraShape.from_config(lora.trainer.lora))
    assert e.adapter_params == n and full.adapter_params == 0
    assert e.trainer_gb["weights"] == pytest.approx(full.trainer_gb["weights"] + 2 * n / GB)  # bf16 base + adapters
    assert e.trainer_gb["gradients"] == pytest.approx(4 * n / GB)  # fp32 grad buffer, adapters only
    assert e.trainer_gb["optimizer"] == pytest.approx(12 * n / GB)  # fp32 main copy + Adam m, v: adapters only
    assert full.trainer_gb["gradients"] == pytest.approx(4 * shapes.total / GB)
    fp32 = estimate(_with_lora(make_config(tiny_llama_dir, precision="fp32"), rank=8), cluster, shapes)
    assert fp32.trainer_gb["optimizer"] == pytest.approx(8 * n / GB)  # no main copy in fp32
    # the 24B example's shapes: TP shards B of column layers and A of row layers, the rest is whole
    big = load_config(LORA_EXAMPLE)
    s24 = shapes_of(big)
    lora24 = LoraShape.from_config(big.trainer.lora)
    per_layer = adapter_params_per_layer(s24, lora24)
    whole = sum(adapter_params_per_layer(s24, dataclasses.replace(lora24, targets=(t,)), 8)
                for t in lora24.targets)
    assert adapter_params_per_layer(s24, lora24, 8) == whole < per_layer
    dp2 = dataclasses.replace(big, trainer=dataclasses.replace(big.trainer, data_parallel=2))
    one = estimate(big, cluster, s24)
    assert estimate(dp2, cluster, s24).trainer_gb["optimizer"] == pytest.approx(one.trainer_gb["optimizer"] / 2)
    # training skips the frozen base's weight gradients: 4 FLOPs per base parameter instead of 6
    ratio = one.throughput["trainer_tokens_per_s"] / estimate(_with_lora(big, rank=0), cluster, s24).throughput[
        "trainer_tokens_per_s"]
    assert ratio == pytest.approx(6 * s24.active / (4 * s24.active + 6 * one.adapter_params))


# ---- activations: the per-layer terms against autograd's saved tensors --------------------------------

VOCAB, HIDDEN, TOKENS = 1000, 64, 512  # vocab unlike any other dimension: the logits are found by it


def _saved_bytes(layers: int, lora: dict, recompute: str = "none") -> int:
    """Distinct storages autograd keeps in one training step's forward, parameters and logits left out."""
    from transformers import LlamaConfig

    from megatron_rl.config import config_from_dict
    from megatron_rl.plan.step_memory import _sequences, bench_llama
    from megatron_rl.train.parallel import destroy_parallel
    from megatron_rl.train.step import forward_backward
    from megatron_rl.train.trainer import Trainer

    model, _ = bench_llama(HIDDEN, layers, TOKENS)
    model["vocab_size"] = VOCAB
    torch.manual_seed(0)
    config = config_from_dict({"trainer": {"model": "random", "precision": "fp32", "micro_batch_tokens": TOKENS,
                                           "recompute": recompute, "lora": lora}})
    trainer = Trainer(config, hf_config=LlamaConfig(**model), load_weights=False)
    try:
        params = {p.untyped_storage().data_ptr() for c in trainer.model_chunks for p in c.parameters()}
        seen: dict[int, torch.UntypedStorage] = {}  # held: no address is reused by a later tensor

        def pack(t):
            storage = t.untyped_storage()
            if torch._C._current_graph_task_id() == -1 and storage.data_ptr() not in params and t.shape[-1] != VOCAB:
                seen[storage.data_ptr()] = storage
            return t

        seqs = _sequences({"seq_lengths": [TOKENS // 2] * 2}, VOCAB)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            forward_backward(trainer.model, seqs, trainer.ctx)
        return sum(s.nbytes() for s in seen.values())
    finally:
        destroy_parallel()


@pytest.mark.parametrize("lora,recompute", [
    ({"rank": 4}, "none"),
    ({"rank": 4, "target_modules": ["linear_qkv"]}, "none"),
    ({"rank": 4, "target_modules": ["linear_proj", "linear_fc2"]}, "none"),
    ({"rank": 4, "target_modules": ["linear_fc1"]}, "none"),
    ({"rank": 8, "dropout": 0.1}, "none"),
    ({"rank": 4}, "selective"),
], ids=["all", "qkv", "proj+fc2", "fc1", "dropout", "selective"])
def test_lora_activation_terms_are_what_autograd_keeps(lora, recompute):
    from megatron_rl.plan.step_memory import bench_llama

    # one more layer adds one layer's tensors; LoRA minus full of that cancels what the formula leaves
    # out on purpose (norm rstd, attention log-sum-exps, the shared RoPE tables): exact equality
    def layer(cfg):
        return _saved_bytes(3, cfg, recompute) - _saved_bytes(2, cfg, recompute)

    got = layer(lora) - layer({})
    shapes = bench_llama(HIDDEN, 3, TOKENS)[1]
    spec = LoraShape(lora["rank"], tuple(lora.get("target_modules", TARGET_SETS[0])), lora.get("dropout", 0.0))
    kw = dict(recompute=recompute, elem_bytes=4, kernels="local", mask_bytes=4)  # CPU dropout: a float mask

    def estimated(**more):
        return (activation_memory(shapes, TOKENS, stage_layers=3, **kw, **more)["total"]
                - activation_memory(shapes, TOKENS, stage_layers=2, **kw, **more)["total"])

    assert got == estimated(lora=spec) - estimated(), (got, estimated(lora=spec) - estimated())


# ---- the shipped one-node example and what `plan` refuses ---------------------------------------------

def test_plan_accepts_the_one_node_lora_example_which_full_training_cannot_run(capsys):
    from megatron_rl.cli import main

    cfg = load_config(LORA_EXAMPLE)
    shapes = shapes_of(cfg)
    assert 20e9 < shapes.total < 30e9 and cfg.trainer.lora.rank > 0
    assert main(["plan", str(LORA_EXAMPLE), "--nodes", "1", "--gpus-per-node", "8"]) == 0
    out = capsys.readouterr().out
    e = estimate(cfg, Cluster(), shapes)
    assert e.fits and e.trainer_gpus + e.generator_gpus == 8 and "(1 per rank)" in out
    assert main(["plan", str(LORA_EXAMPLE), "trainer.lora.rank=0", "--nodes", "1", "--gpus-per-node", "8"]) == 3
    assert "a trainer GPU needs" in capsys.readouterr().err
    # no full-training layout that leaves a generator at least one GPU of the node fits
    full = _with_lora(cfg, rank=0)
    smallest = min(
        estimate(dataclasses.replace(full, trainer=dataclasses.replace(
            full.trainer, tensor_parallel=tp, pipeline_parallel=pp, data_parallel=dp, sequence_parallel=tp > 1)),
            Cluster(), shapes).trainer_gb["total"]
        for tp in (1, 2, 4) for pp in (1, 2, 4, 5) for dp in range(1, 8) if tp * pp * dp <= 7)
    assert smallest > Cluster().gpu_memory_gb


@pytest.mark.parametrize("override,key", [
    ("trainer.lora.rank=2048", "trainer.lora.rank: 2048 exceeds linear_qkv's k_proj (5120 -> 1024)"),
    ("trainer.lora.dropout=0.1", "trainer.lora.dropout"),
])
def test_plan_refuses_what_the_trainer_refuses(override, key, capsys):
    from megatron_rl.cli import main

    assert main(["plan", str(LORA_EXAMPLE), override, "--nodes", "1"]) == 3
    assert key in capsys.readouterr().err


def test_plan_refuses_lora_on_moe_experts_and_the_bound_is_the_trainers(tiny_llama_dir, capsys):
    from megatron_rl.cli import main
    from megatron_rl.config import ConfigError
    from megatron_rl.plan.lora_memory import problems
    from megatron_rl.train.hf_source import resolve_model
    from megatron_rl.train.lora import LoraSpec, check_model
    from megatron_rl.train.model import model_dims

    moe = EXAMPLES / "qwen3_moe_30b_a3b.yaml"
    assert main(["plan", str(moe), "trainer.lora.rank=8", "--nodes", "4"]) == 3
    assert "trainer.lora.target_modules: linear_fc1, linear_fc2 on an MoE model" in capsys.readouterr().err
    # the largest rank plan accepts on the tiny model is the largest the trainer accepts
    cfg = make_config(tiny_llama_dir)
    shapes, dims = shapes_of(cfg), model_dims(resolve_model(cfg.trainer.model).config())
    for rank in range(1, shapes.hidden + 1):
        refused = bool(problems(shapes, LoraShape(rank, tuple(TARGET_SETS[0])), "none"))
        try:
            check_model(LoraSpec(rank, 8.0), dims)
            assert not refused, rank
        except ConfigError:
            assert refused, rank
