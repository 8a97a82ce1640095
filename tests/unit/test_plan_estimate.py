"""Estimator: parameter counts vs HF transformers (meta device), the scale examples fit, and the
memory terms move the way sharding says they must."""
import dataclasses
from pathlib import Path

import pytest
import torch

from megatron_rl.config import load_config
from megatron_rl.plan.estimate import Cluster, Shapes, estimate, shapes_of

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SCALES = [("magistral_small", 20e9, 30e9), ("magistral_medium", 100e9, 140e9)]


def _hf_param_count(config_dir) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(config_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name,lo,hi", SCALES)
def test_scale_examples_fit_and_count_parameters_like_hf(name, lo, hi, capsys):
    from megatron_rl.cli import main

    cfg = load_config(EXAMPLES / f"{name}.yaml")
    shapes = shapes_of(cfg)
    assert shapes.total == _hf_param_count(cfg.trainer.model)
    assert lo < shapes.total < hi
    rc = main(["estimate", str(EXAMPLES / f"{name}.yaml"), "--cluster", str(EXAMPLES / f"{name}.cluster.yaml")])
    out = capsys.readouterr().out
    assert rc == 0 and "fits" in out and "trainer:" in out and "generators:" in out
    e = estimate(cfg, Cluster.load(EXAMPLES / f"{name}.cluster.yaml"), shapes)
    assert e.fits and e.trainer_gpus == 32 * (1 if name == "magistral_small" else 8)
    assert cfg.trainer.sequence_parallel and cfg.trainer.recompute == "full"


def test_tied_embeddings_counted_once(tiny_llama_dir):
    cfg = load_config(None, [f"trainer.model={tiny_llama_dir}"])
    assert shapes_of(cfg).total == _hf_param_count(tiny_llama_dir)


def test_memory_terms_follow_sharding():
    cfg = load_config(EXAMPLES / "magistral_small.yaml")
    shapes, cluster = shapes_of(cfg), Cluster()

    def with_trainer(**kw):
        c = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, **kw))
        return estimate(c, cluster, shapes)

    base = with_trainer()
    dp8 = with_trainer(data_parallel=8)
    assert dp8.trainer_gb["optimizer"] == pytest.approx(base.trainer_gb["optimizer"] / 2)
    assert dp8.trainer_gb["weights"] == base.trainer_gb["weights"]
    tp4 = with_trainer(tensor_parallel=4)
    assert tp4.trainer_gb["weights"] == pytest.approx(2 * base.trainer_gb["weights"])
    no_zero = with_trainer(distributed_optimizer=False)
    assert no_zero.trainer_gb["optimizer"] == pytest.approx(4 * base.trainer_gb["optimizer"])
    fp32 = with_trainer(precision="fp32")
    assert fp32.trainer_gb["weights"] == pytest.approx(2 * base.trainer_gb["weights"])
    # 24B on one GPU per trainer does not fit: the command says so with exit status 3
    lone = with_trainer(tensor_parallel=1, data_parallel=1, distributed_optimizer=False)
    assert not lone.fits and lone.trainer_gb["total"] > 16 * 23


def test_cli_exit_status_when_it_does_not_fit(capsys):
    from megatron_rl.cli import main

    rc = main(["estimate", str(EXAMPLES / "magistral_small.yaml"), "trainer.tensor_parallel=1", "trainer.sequence_parallel=false",
               "trainer.data_parallel=1", "--json"])
    assert rc == 3
    assert main(["estimate", str(EXAMPLES / "missing.yaml")]) == 1


def test_unknown_cluster_key_is_rejected(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("gpu_memroy_gb: 80\n")
    with pytest.raises(ValueError, match="gpu_memroy_gb"):
        Cluster.load(p)


def test_pipeline_must_split_layers():
    cfg = load_config(EXAMPLES / "magistral_small.yaml", ["trainer.pipeline_parallel=3"])
    with pytest.raises(ValueError):
        estimate(cfg, Cluster(), Shapes(100, 8, 40, 2, 2, 4, 16, False))


def test_sequence_parallel_and_recompute_shrink_activations_as_the_formula_says():
    from megatron_rl.plan.estimate import activation_memory

    shapes = Shapes(32000, 1024, 8, 16, 4, 64, 2816, False)
    base = activation_memory(shapes, 8192, tp=4)
    sp = activation_memory(shapes, 8192, tp=4, sequence_parallel=True)
    # SP divides only the norm / projection-input part (4h per token and layer) by TP
    assert base["total"] - sp["total"] == pytest.approx(8192 * 2 * (4 * 1024 * 8 + 2 * 1024) * (1 - 1 / 4))
    # flash attention keeps nothing selective recompute could drop; the local spec's SDPA copy goes
    assert activation_memory(shapes, 8192, tp=4, recompute="selective")["total"] == base["total"]
    local = activation_memory(shapes, 8192, kernels="local")
    sel = activation_memory(shapes, 8192, kernels="local", recompute="selective")
    assert local["total"] - sel["total"] == pytest.approx(8192 * 2 * 16 * 64 * 8)
    full = activation_memory(shapes, 8192, tp=4, recompute="full")
    # full: the 8 layer inputs and the final norm input/output, h each, plus one layer re-run
    assert full["working"] == base["per_layer"] and full["stored"] == 8192 * 2 * (8 + 2) * 1024
    block = activation_memory(shapes, 8192, tp=4, recompute="full", recompute_method="block", recompute_num_layers=3)
    assert block["stored"] > full["stored"] and block["working"] == base["per_layer"]
    # every micro-batch the 1F1B schedule keeps in flight holds its own activations, the working set once
    two = activation_memory(shapes, 8192, tp=4, recompute="full", in_flight=2)
    assert two["stored"] == pytest.approx(2 * full["stored"]) and two["working"] == full["working"]


def test_generator_tp_comes_from_the_config(tmp_path, capsys):
    from megatron_rl.cli import main
    from megatron_rl.config.tree import ConfigError

    cfg = load_config(EXAMPLES / "magistral_small.yaml")
    shapes = shapes_of(cfg)
    e = estimate(cfg, Cluster(), shapes)
    wider = estimate(load_config(EXAMPLES / "magistral_small.yaml", ["generator.tp_size=4"]), Cluster(), shapes)
    assert wider.generator_gb["weights"] == pytest.approx(e.generator_gb["weights"] / 2)
    assert estimate(cfg, Cluster(generator_tp=cfg.generator.tp_size), shapes).generator_gb == e.generator_gb
    with pytest.raises(ConfigError, match="generator_tp=8 disagrees with generator.tp_size=2"):
        estimate(cfg, Cluster(generator_tp=8), shapes)
    cluster = tmp_path / "c.yaml"
    cluster.write_text("gpu_memory_gb: 80\ngenerator_tp: 8\n")
    assert main(["estimate", str(EXAMPLES / "magistral_small.yaml"), "--cluster", str(cluster)]) == 1
    assert "disagrees with generator.tp_size" in capsys.readouterr().err


def test_moe_example_fits_with_expert_parallel_and_counts_like_hf(capsys):
    from megatron_rl.cli import main

    name = "qwen3_moe_30b_a3b"
    cfg = load_config(EXAMPLES / f"{name}.yaml")
    shapes = shapes_of(cfg)
    assert shapes.total == _hf_param_count(cfg.trainer.model) and 29e9 < shapes.total < 32e9
    assert 3e9 < shapes.active < 3.6e9  # "A3B": top-8 of 128 experts
    rc = main(["estimate", str(EXAMPLES / f"{name}.yaml"), "--cluster", str(EXAMPLES / f"{name}.cluster.yaml")])
    assert rc == 0 and "EP=8" in capsys.readouterr().out
    e = estimate(cfg, Cluster.load(EXAMPLES / f"{name}.cluster.yaml"), shapes)
    assert e.fits and cfg.trainer.expert_parallel == 8

    def with_ep(ep):
        return estimate(dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, expert_parallel=ep)),
                        Cluster(), shapes)

    # the experts (95% of the weights) are split over EP, the rest over TP
    experts = shapes.layers * shapes.per_layer_experts
    dense = shapes.total - experts
    tp = cfg.trainer.tensor_parallel
    for ep in (1, 4, 8):
        want = 2 * (dense / tp + experts / ep) / 1024 ** 3
        assert with_ep(ep).trainer_gb["weights"] == pytest.approx(want)
    with pytest.raises(ValueError, match="do not split over expert_parallel=3"):
        with_ep(3)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_moe_shapes_count_parameters_like_hf(tmp_path, family):
    from support.train_models import make_tiny_moe

    folder = make_tiny_moe(tmp_path / family, family=family)
    cfg = load_config(None, [f"trainer.model={folder}"])
    assert shapes_of(cfg).total == _hf_param_count(folder)
