"""Megatron on a GPU without Transformer Engine (MEGATRON_RL_GPU_TE=0, the local layer spec), issue 31
item 2: the local spec's torch norms live on the GPU; the frozen KL reference model (never DDP-wrapped)
and distributed_optimizer: false go through a whole RL update on CUDA; DistributedOptimizer checkpoints
with torch Adam (no apex/TE FusedAdam) save and load there. `./dev gpu-check` runs these first.

On a GPU with TE the Trainer takes TE's spec (its norms are TE's, its Adam is TE's FusedAdam): the
norm check builds the local spec itself, the others then check the TE path instead."""
from __future__ import annotations

import pytest
import torch

from megatron_rl.records import Batch
from support.policies import make_trainer
from support.train_models import make_tiny_hf

from test_train_step import hf_model, make_minibatch  # noqa: E402  (tests/unit on sys.path)

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _nccl_world():
    """Each test starts its own NCCL world (a gloo one left by a CPU test would be reused otherwise)."""
    import torch.distributed as dist

    from megatron_rl.train.parallel import destroy_parallel

    if dist.is_initialized():
        destroy_parallel(destroy_process_group=True)
    yield
    destroy_parallel(destroy_process_group=True)


def _on_gpu(chunks) -> list[str]:
    """Names of the parameters and buffers of `chunks` that are not on the current GPU."""
    here = torch.device("cuda", torch.cuda.current_device())
    return [n for c in chunks for n, t in [*c.named_parameters(), *c.named_buffers()] if t.device != here]


@pytest.mark.parametrize("family", ["llama", "qwen3"])  # qwen3: the q/k norms are torch norms too
def test_local_spec_torch_norms_live_on_the_gpu(tmp_path, family):
    from transformers import AutoConfig

    from megatron_rl.train.model import build_model, forward_logits
    from megatron_rl.train.parallel import ParallelLayout, init_parallel

    hf_dir = make_tiny_hf(tmp_path / family, family)
    layout = init_parallel(ParallelLayout())
    chunks = build_model(AutoConfig.from_pretrained(hf_dir), layout, torch.bfloat16, use_te=False)
    norms = [m for c in chunks for m in c.modules() if isinstance(m, torch.nn.RMSNorm)]
    assert norms and not _on_gpu(chunks)
    ids = torch.randint(0, 300, (2, 16), device="cuda")
    with torch.no_grad():  # a bare chunk (no DDP, as the KL reference): used to fail with a device mismatch
        logits = forward_logits(chunks[0], ids)
    assert logits.is_cuda and torch.isfinite(logits.float()).all()


@pytest.mark.parametrize("kl_mode,distributed_optimizer", [("reward", True), ("k2", False)])
def test_rl_update_with_the_kl_reference_on_cuda(tiny_llama_dir, kl_mode, distributed_optimizer):
    trainer = make_trainer(tiny_llama_dir, algo={"kl_mode": kl_mode, "kl_coef": 0.1}, precision="bf16",
                           distributed_optimizer=distributed_optimizer)
    assert not _on_gpu(trainer.model_chunks) and not _on_gpu(trainer.reference.chunks)
    seqs = make_minibatch(hf_model(tiny_llama_dir), n=6)
    metrics = trainer.train_on(Batch(seqs, n_mini=2, policy_version=0))
    assert trainer.version == 1 and trainer.step == 2
    assert all(torch.isfinite(torch.tensor(s["loss"])) for s in metrics["steps"]), metrics["steps"]


def _adam_states(trainer) -> list[dict]:
    optimizers = getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
    return [state for o in optimizers for state in o.optimizer.state.values()]


def test_distributed_optimizer_checkpoint_with_torch_adam_on_cuda(tiny_llama_dir, tmp_path):
    """The Adam moments come back exactly, and each parameter's step counts its own steps (a shared
    loaded `step` tensor would advance once per parameter: platform/megatron_cpu's distopt shim)."""
    from megatron_rl.train.trainer import Trainer

    hf = hf_model(tiny_llama_dir)
    batches = [Batch(make_minibatch(hf, n=4, seed=s), n_mini=2, policy_version=s) for s in range(2)]
    a = make_trainer(tiny_llama_dir, precision="bf16", distributed_optimizer=True)
    a.train_on(batches[0])
    saved = [{k: v.clone() for k, v in s.items()} for s in _adam_states(a)]
    a.save(tmp_path / "ckpt")
    b = Trainer(a.config)
    b.load(tmp_path / "ckpt")
    loaded = _adam_states(b)
    assert b.last_load.optimizer_loaded and len(loaded) == len(saved)
    for s, l in zip(saved, loaded):
        for key in ("exp_avg", "exp_avg_sq"):
            if key in s:
                assert torch.equal(s[key], l[key]), key
    b.train_on(batches[1])
    steps = {float(s["step"]) for s in _adam_states(b) if "step" in s}
    assert steps == {4.0}, steps  # 2 steps before the save, 2 after, for every parameter
