"""`Trainer`: the facade the controller drives (build, train on a Batch, save/load).

    trainer = Trainer(config)                # Megatron model from config.trainer.model, HF weights
    metrics = trainer.train_on(batch)        # n_mini optimizer steps; trainer.version += 1
    trainer.save(root, extra={"data": ...})  # atomic dist_checkpointing checkpoint under root
    extra = trainer.load(root)               # resume (latest complete checkpoint under root)

Every trainer rank must call these collectively with the same arguments (the same whole Batch: the
step splits it over DP ranks itself). `version` counts updates (`train_on` calls): it is the policy
version the generators receive with the weights; `step` counts optimizer steps.
With `algo.kl_mode` set, the trainer also holds the frozen reference policy (`train.reference`), with
`algo.teacher` the frozen distillation teacher (`train.teacher`); an RL update runs the logprob passes
they need before its optimizer steps (`train.update`).
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Sequence

import torch

from megatron_rl.algo import mismatch
from megatron_rl.config import Config
from megatron_rl.records import Batch, TrainSequence
from megatron_rl.train import checkpoint as ckpt
from megatron_rl.train.device import model_device
from megatron_rl.train.lora import LoraSpec
from megatron_rl.train.optimizer import build_optimizer, precision_dtype, set_lr, wrap_model
from megatron_rl.train.parallel import ParallelLayout, init_parallel
from megatron_rl.train.reference import ReferencePolicy
from megatron_rl.train.step import StepContext, run_minibatch
from megatron_rl.train.teacher import Teacher
from megatron_rl.train.update import distill_metrics, prepare_update, split_minibatches

log = logging.getLogger(__name__)
_STATE_KEY = "_trainer"  # reserved key in the checkpoint's extra state


def _unwrap(module):
    while hasattr(module, "module"):
        module = module.module
    return module


class Trainer:
    """Megatron-Core policy trainer (TP x PP x DP) for the RL step and SFT."""

    def __init__(self, config: Config, *, hf_config=None, load_weights: bool = True,
                 keep_checkpoints: int | None = None, backend: str | None = None):
        from megatron_rl.train.hf_source import resolve_model
        from megatron_rl.train.model import Recompute, build_model, check_precision, te_available

        self.config = config
        t = config.trainer
        check_precision(t.precision)  # before any process group: the whole trainer world would wait on it
        self.layout = init_parallel(ParallelLayout(t.tensor_parallel, t.pipeline_parallel, t.data_parallel,
                                                   t.virtual_pipeline, t.sequence_parallel,
                                                   cp=t.context_parallel, ep=t.expert_parallel),
                                    backend=backend, seed=t.seed)
        source = None
        if hf_config is None or load_weights:
            source = resolve_model(t.model)
            hf_config = hf_config or source.config()
        self.hf_config = hf_config
        # trainer.lora: frozen base, adapters the only trainable parameters (train/lora.py), so DDP and
        # the optimizer below hold gradients and Adam state for the adapters alone
        chunks = build_model(hf_config, self.layout, precision_dtype(t), recompute=Recompute.from_trainer(t),
                             router_aux_loss=t.moe_aux_loss_coef, per_token_loss=True,
                             routing_replay=config.algo.routing_replay,
                             lora=LoraSpec.from_config(t.lora), lora_seed=t.seed)
        if load_weights:
            from megatron_rl.train.hf_weights import load_hf_weights

            load_hf_weights(chunks, source.tensors())
        self.dims = chunks[0].mrl_dims
        self.reference = (ReferencePolicy(chunks, hf_config, self.layout, precision_dtype(t))
                          if config.algo.kl_mode != "none" else None)
        self.teacher = (Teacher(config.algo.teacher, source or resolve_model(t.model), self.layout,
                                precision_dtype(t)) if config.algo.teacher is not None else None)
        self.model = wrap_model(chunks, t)
        self.optimizer = build_optimizer(self.model, t)
        # checkpoints kept by save() (0: all); the run's run.keep_checkpoints unless the caller says
        self.keep_checkpoints = (config.run.keep_checkpoints if keep_checkpoints is None else keep_checkpoints) or 0
        self.ctx = StepContext(algo=config.algo, trainer=t, layout=self.layout,
                               vocab_size=self.dims.vocab_size, use_thd=te_available())
        self.version = 0
        self.step = 0

    # ------------------------------------------------------------ model access
    @property
    def model_chunks(self) -> list:
        """The bare GPTModel chunks (for weight export / sync)."""
        return [_unwrap(m) for m in self.model]

    # ------------------------------------------------------------ training
    def _run(self, seqs: Sequence[TrainSequence], n_mini: int, objective: str) -> dict[str, Any]:
        steps, distilled = [], {}
        minibatches = split_minibatches(seqs, n_mini)
        if objective == "rl":  # trainer-side logprobs of the update start, KL in the reward, the teacher's
            minibatches = prepare_update(self.model, self.reference, minibatches, self.ctx, self.teacher)
            if self.teacher is not None:  # of the update start's weights, before the steps move them
                distilled = distill_metrics(minibatches, self.ctx, model_device(self.model))
        for i, mb in enumerate(minibatches):
            set_lr(self.optimizer, self.config.trainer.lr)
            # before the first step the weights are those of self.version (mismatch metrics, step.py)
            ctx = dataclasses.replace(self.ctx, policy_version=self.version, weights_at_version=i == 0)
            m = run_minibatch(self.model, self.optimizer, mb, ctx, objective=objective)
            self.step += 1
            m["step"] = float(self.step)
            steps.append(m)
        self.version += 1
        if self.reference is not None:
            self.reference.maybe_refresh(self.model_chunks, self.version, self.config.algo.kl_ref_refresh_every)
        # mismatch metrics: measured on some minibatches only, combined token-weighted
        keys = [k for k in steps[0] if k != "step" and not k.startswith(mismatch.PREFIX)]
        summary: dict[str, Any] = {k: sum(s[k] for s in steps) / len(steps) for k in keys}
        summary.update(mismatch.merge(steps))
        summary.update(distilled)
        summary["tokens_per_s"] = sum(s["tokens"] for s in steps) / sum(s["step_time_s"] for s in steps)
        summary["loss_tokens"] = sum(s["n_loss_tokens"] for s in steps)  # the update's, over its minibatches
        summary.update(version=self.version, step=self.step, steps=steps)
        return summary

    def train_on(self, batch: Batch) -> dict[str, Any]:
        """One trainer update: `batch.n_mini` optimizer steps. Returns the mean metrics over the
        steps plus `steps` (the per-step metrics), `version` and `step`."""
        if not isinstance(batch, Batch):
            raise TypeError(f"train_on expects a records.Batch, got {type(batch).__name__}")
        return self._run(batch.sequences, batch.n_mini, "rl")

    def train_sft(self, seqs: Sequence[TrainSequence], n_mini: int = 1) -> dict[str, Any]:
        """SFT update: cross-entropy on completion tokens, `n_mini` optimizer steps."""
        if not seqs or len(seqs) % n_mini:
            raise ValueError(f"{len(seqs)} sequences cannot be split into {n_mini} minibatches")
        return self._run(seqs, n_mini, "sft")

    @torch.no_grad()
    def evaluate(self, seqs: Sequence[TrainSequence], objective: str = "rl") -> dict[str, float]:
        """Loss/metrics of `seqs` under the current weights (no update)."""
        if objective == "rl":
            (seqs,) = prepare_update(self.model, self.reference, [list(seqs)], self.ctx, self.teacher)
        ctx = dataclasses.replace(self.ctx, policy_version=self.version, weights_at_version=True)
        return run_minibatch(self.model, self.optimizer, seqs, ctx, objective=objective, forward_only=True)

    # ------------------------------------------------------------ checkpoints
    def save(self, root: str | Path, extra: dict[str, Any] | None = None) -> Path:
        """Collective: atomic checkpoint `root/iter_<version>` (Megatron-LM's layout), keeping the newest
        `keep_checkpoints`; `extra` must be JSON-serialisable."""
        own = {"version": self.version, "step": self.step}
        if self._saved_reference() is not None:
            own["reference_version"] = self.reference.version
        state = {_STATE_KEY: own, "user": extra or {}}
        return ckpt.save_checkpoint(root, self.model, self.optimizer, self.layout, self.version, state,
                                    keep_last=self.keep_checkpoints,
                                    optimizer_format=self.config.trainer.checkpoint_optimizer,
                                    reference=self._saved_reference())

    def _saved_reference(self) -> list | None:
        """The reference chunks when they can differ from the initial weights (refreshing), else None:
        a fixed reference is the model the run starts from, rebuilt on resume."""
        if self.reference is None or self.config.algo.kl_ref_refresh_every == 0:
            return None
        return self.reference.chunks

    def load(self, path: str | Path, load_optimizer: bool = True) -> dict[str, Any]:
        """Collective: resume from a checkpoint (a root -> the iteration its tracker file names),
        resharded into this layout, after checking its files against its manifest
        (`trainer.checkpoint_verify`; CheckpointError names a damaged file). Returns the `extra` saved; `last_load` says what was restored."""
        result = ckpt.load_checkpoint(path, self.model, self.optimizer, self.layout, load_optimizer,
                                      reference=self._saved_reference(),
                                      verify=self.config.trainer.checkpoint_verify)
        own = result.extra.get(_STATE_KEY, {})
        self.version = int(own.get("version", result.step))
        self.step = int(own.get("step", 0))
        if self._saved_reference() is not None:
            if not result.reference_loaded:
                raise ckpt.CheckpointError(
                    f"{result.path} holds no KL reference policy, but algo.kl_ref_refresh_every="
                    f"{self.config.algo.kl_ref_refresh_every} needs the one it had refreshed to")
            self.reference.version = int(own.get("reference_version", 0))
        self.last_load = result
        return dict(result.extra.get("user", {}))
