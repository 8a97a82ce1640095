"""Estimator and context parallel: each CP rank holds 1/CP of every bin's tokens (activations and
logits per GPU divided by CP, against `activation_memory` of the smaller token count), the distributed
optimizer shards over DP x CP, and the trainer GPUs are TP x CP x PP x DP."""
import pytest

from megatron_rl.config import config_from_dict
from megatron_rl.plan.estimate import GB, Cluster, Shapes, activation_memory, estimate

SHAPES = Shapes(vocab=32000, hidden=1024, layers=8, heads=16, kv_heads=4, head_dim=64, ffn=4096, tied=False)


def _estimate(cp: int):
    cfg = config_from_dict({"trainer": {"tensor_parallel": 2, "data_parallel": 2, "context_parallel": cp,
                                        "micro_batch_tokens": 32768, "precision": "bf16"}})
    return estimate(cfg, Cluster(), SHAPES)


def test_context_parallel_divides_activations_and_logits_per_gpu():
    one, two = _estimate(1), _estimate(2)
    assert two.trainer_gpus == 2 * one.trainer_gpus == 8
    act = activation_memory(SHAPES, 32768 // 2, tp=2, elem_bytes=2)["total"] / GB
    assert two.trainer_gb["activations"] == pytest.approx(act)
    assert two.trainer_gb["activations"] == pytest.approx(one.trainer_gb["activations"] / 2)
    assert two.trainer_gb["logits"] == pytest.approx(one.trainer_gb["logits"] / 2)
    assert two.trainer_gb["optimizer"] == pytest.approx(one.trainer_gb["optimizer"] / 2)
    assert two.trainer_gb["weights"] == one.trainer_gb["weights"]
