"""The `env` section: the environment every episode plays (megatron_rl.env) and the caps of the turn
loop (megatron_rl.rollout.episode). The default is the single-turn task: one model turn, graded by
the verifiers, on the same path as a multi-turn episode."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron_rl.config.tree import check


@dataclass
class EnvConfig:
    """Episodes: environment and turn-loop limits (megatron_rl.env, megatron_rl.rollout.episode)."""

    # Environment of each episode: a built-in (single_turn, python, python_tests, echo), "module:Class", "file.py:Class" or an entry point of group megatron_rl.environments
    name: str = "single_turn"
    args: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the environment's constructor
    max_turns: int = 8  # model turns per episode; an episode still running after them ends, graded on its last turn
    # Tokens one model turn may sample (null: the length stage's cap); the stage's cap bounds the whole episode after the prompt (model and environment tokens)
    max_turn_tokens: int | None = None
    # An observation message longer than this many tokens is cut, with a note saying so (the model sees the cut)
    max_observation_tokens: int = 1024
    # Wall time of one episode after which no further turn starts (it is graded on its last turn); null: none
    episode_timeout_s: float | None = None
    # Tool runs at once on a generator rank (the environments' shared ToolSlots); null: half its CPUs
    tool_concurrency: int | None = None
    # Episodes started beyond rollout.n_async while others wait on their environment (a tool run): new ones
    # start while fewer than n_async samples are outside an environment step and at most n_async + this many
    # are in flight, so the generators keep decoding while tools run. 0: n_async counts every episode
    extra_in_flight: int = 0
    # Episodes whose environment failed, in a row, that stop the run (each failed episode drops its group)
    max_consecutive_failures: int = 8

    @property
    def multi_turn(self) -> bool:
        """The environment may answer a turn: anything but the built-in single-turn task."""
        return self.name != "single_turn"

    def validate(self, key: str) -> None:
        check(bool(self.name.strip()), f"{key}.name", "must name an environment (single_turn for one turn)")
        check(self.max_turns >= 1, f"{key}.max_turns", "must be >= 1")
        check(self.max_turn_tokens is None or self.max_turn_tokens >= 1, f"{key}.max_turn_tokens",
              "must be >= 1 or null (the stage's cap)")
        check(self.max_observation_tokens >= 16, f"{key}.max_observation_tokens", "must be >= 16")
        check(self.episode_timeout_s is None or self.episode_timeout_s > 0, f"{key}.episode_timeout_s",
              "must be > 0 or null (no deadline)")
        check(self.tool_concurrency is None or self.tool_concurrency >= 1, f"{key}.tool_concurrency",
              "must be >= 1 or null")
        check(self.extra_in_flight >= 0, f"{key}.extra_in_flight", "must be >= 0")
        check(self.extra_in_flight == 0 or self.multi_turn, f"{key}.extra_in_flight",
              "only applies to multi-turn environments (the single-turn task never waits on one); set env.name")
        check(self.max_consecutive_failures >= 1, f"{key}.max_consecutive_failures", "must be >= 1")
        check("reward_config" not in self.args, f"{key}.args.reward_config",
              "is given by the run (its reward section) to an environment that takes it; set the reward keys instead")
        # the environment loads (a plug-in's import runs code): pre-flight (control.preflight.check_config)
