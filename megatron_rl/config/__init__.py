"""One typed config tree for every knob of a run: this package imports nothing else of megatron_rl
(but errors), so any layer may read its config.

Loaded from YAML (`load_config(path, overrides)`) with dotted CLI overrides such as
`algo.eps_high=0.26`. Unknown keys and invalid values raise `ConfigError` naming the dotted key,
so a typo never silently falls back to a default. Defaults are Magistral's recipe. One module per
section (algo, reward, rollout, generator, trainer, data, env, run); `tree` builds and coerces the typed
tree, `file` reads YAML with key line numbers, `length_stages` resolves rollout.length_schedule.
Checks that must run code (a plug-in imports, a template exists) are pre-flight's
(megatron_rl.control.preflight), not validation's.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megatron_rl.config.algo import AlgoConfig
from megatron_rl.config.data import DataConfig
from megatron_rl.config.env import EnvConfig
from megatron_rl.config.file import locate_error, read_config_file
from megatron_rl.config.generator import GeneratorConfig
from megatron_rl.config.length_stages import LengthStage, check_length_penalty, length_stages, stage_at
from megatron_rl.config.reward import RewardConfig
from megatron_rl.config.rollout import RolloutConfig
from megatron_rl.config.run import RunConfig
from megatron_rl.config.trainer import LORA_SERVER_FLAGS, TrainerConfig
from megatron_rl.config.tree import ConfigError, apply_override, build, check

__all__ = ["AlgoConfig", "Config", "ConfigError", "DataConfig", "EnvConfig", "GeneratorConfig", "LengthStage", "RewardConfig",
           "RolloutConfig", "RunConfig", "TrainerConfig", "config_from_dict", "dump_config", "length_stages",
           "load_config", "load_config_args", "stage_at"]


@dataclass
class Config:
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def validate(self, key: str = "") -> None:
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate(f.name)
        check_length_penalty(self.rollout.length_schedule, self.rollout.max_new_tokens, self.reward)  # across sections
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

        if self.trainer.lora.push == "adapter":
            given = [a.split("=")[0] for a in self.generator.extra_args if a.split("=")[0] in LORA_SERVER_FLAGS]
            check(not given, "trainer.lora.push",
                  f"adapter sets the generators' {', '.join(LORA_SERVER_FLAGS)} from trainer.lora; remove "
                  f"{', '.join(given)} from generator.extra_args")

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
    value the file set names the file and line (see megatron_rl.config.file)."""
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
