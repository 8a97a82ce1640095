"""Megatron DDP wrapping and the (Distributed)Optimizer for the trainer's model chunks.

- `wrap_model(chunks, tconfig)`: bf16 chunks go through Megatron's `Float16Module`, then every chunk
  is wrapped in Megatron's `DistributedDataParallel` (contiguous grad
  buffers, reduce-scatter for the DistributedOptimizer). The TransformerConfig is switched to
  `calculate_per_token_loss`: loss functions return token SUMS plus token counts, and
  `finalize_model_grads` divides the gradients by the token count all-reduced over the micro-batches
  and DP ranks — exactly the minibatch-wide token normalisation of the RL loss.
  A wrapped bf16 chunk carries `mrl_half_precision = True`: the step calls it with
  `fp32_output=False` (passed through DDP to `Float16Module.forward`), so the last stage hands its
  logits over in bf16 instead of materialising a float32 [tokens, vocab] copy.
- `build_optimizer(model, tconfig)`: Adam(W) through `get_megatron_optimizer` (fp32 main params
  for bf16 models, global-norm clipping at `grad_clip`, DistributedOptimizer when asked).
- `set_lr(optimizer, lr)`.
"""
from __future__ import annotations

import torch

from megatron_rl.config import TrainerConfig


def precision_dtype(tconfig: TrainerConfig) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[tconfig.precision]


def wrap_model(chunks: list, tconfig: TrainerConfig) -> list:
    """Float16Module (bf16) + Megatron DDP around each chunk; wires the schedule hooks."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.transformer.module import Float16Module

    if not chunks:
        raise ValueError("no model chunks to wrap")
    config = chunks[0].config
    config.calculate_per_token_loss = True
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=tconfig.distributed_optimizer,
        overlap_grad_reduce=False,  # one reduce per optimizer step, after the last micro-batch
        grad_reduce_in_fp32=True,
        check_for_nan_in_grad=False,
    )
    wrapped = []
    for i, chunk in enumerate(chunks):
        inner = Float16Module(config, chunk) if config.bf16 or config.fp16 else chunk
        ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=inner,
                                      disable_bucketing=i > 0)
        ddp.mrl_dims = chunk.mrl_dims
        ddp.mrl_half_precision = inner is not chunk  # accepts fp32_output=False (see the step)
        wrapped.append(ddp)
    config.finalize_model_grads_func = finalize_model_grads
    no_sync = [m.no_sync for m in wrapped]
    config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    return wrapped


def build_optimizer(model: list, tconfig: TrainerConfig):
    """Megatron optimizer (Adam with decoupled weight decay) over the DDP-wrapped chunks."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = model[0].config
    opt_config = OptimizerConfig(
        optimizer="adam", lr=tconfig.lr, min_lr=0.0, weight_decay=tconfig.weight_decay,
        adam_beta1=tconfig.adam_beta1, adam_beta2=tconfig.adam_beta2, adam_eps=1e-8,
        clip_grad=tconfig.grad_clip, bf16=config.bf16, fp16=config.fp16,
        params_dtype=torch.float32 if not (config.bf16 or config.fp16) else config.params_dtype,
        use_distributed_optimizer=tconfig.distributed_optimizer,
    )
    return get_megatron_optimizer(opt_config, model)


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
