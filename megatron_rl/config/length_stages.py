"""Length stages of `rollout.length_schedule`: which generation cap and overlong-penalty window apply
from which update on (`length_stages`, `stage_at`), and the check that caps and penalty windows agree
(see RolloutConfig). The one home of the schedule: the controller issues requests under `stage_at`,
placement sizes the KV cache from the longest stage."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.config.reward import RewardConfig
from megatron_rl.config.tree import ConfigError, check


@dataclass(frozen=True)
class LengthStage:
    """One resolved stage of rollout.length_schedule: from update `start` on, requests get
    `max_new_tokens` and their rollouts are graded with the overlong window (`l_max`, `l_cache`)."""

    start: int
    max_new_tokens: int
    l_max: int
    l_cache: int


def parse_length_entry(entry: str) -> tuple[int, int, int | None, int | None]:
    """"UPDATE:TOKENS[:L_MAX:L_CACHE]" -> (update, tokens, l_max | None, l_cache | None); ValueError if bad."""
    parts = entry.split(":") if isinstance(entry, str) else []
    if len(parts) not in (2, 4) or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"expected UPDATE:TOKENS or UPDATE:TOKENS:L_MAX:L_CACHE (integers >= 0), got {entry!r}")
    update, tokens, *window = (int(p) for p in parts)
    if tokens < 1:
        raise ValueError(f"TOKENS must be >= 1, got {entry!r}")
    if not window:
        return update, tokens, None, None
    l_max, l_cache = window
    if l_max < 1:
        raise ValueError(f"L_MAX must be >= 1, got {entry!r}")
    if l_cache > l_max:
        raise ValueError(f"L_CACHE ({l_cache}) must not exceed L_MAX ({l_max}) in {entry!r}")
    return update, tokens, l_max, l_cache


def _length_stages_with_keys(entries: list[str], max_new_tokens: int, reward: RewardConfig,
                             key: str) -> list[tuple[str, LengthStage, bool]]:
    """(config key, stage, window inherited from reward) per stage, sorted by start."""
    raw: dict[int, tuple[str, int, int | None, int | None]] = {}
    for i, entry in enumerate(entries):
        k = f"{key}.length_schedule[{i}]"
        try:
            start, tokens, l_max, l_cache = parse_length_entry(entry)
        except ValueError as e:
            raise ConfigError(f"{k}: {e}") from None
        check(start not in raw, k, f"a stage already starts at update {start}")
        raw[start] = (k, tokens, l_max, l_cache)
    if 0 not in raw:  # before the first stage: the plain cap
        raw[0] = (f"{key}.max_new_tokens", max_new_tokens, None, None)
    out = []
    for start in sorted(raw):
        k, tokens, l_max, l_cache = raw[start]
        inherited = l_max is None
        if inherited:
            l_max = tokens if reward.l_max is None else reward.l_max
            l_cache = min(reward.l_cache, l_max)
        out.append((k, LengthStage(start, tokens, l_max, l_cache), inherited))  # type: ignore[arg-type]
    return out


def length_stages(entries: list[str], max_new_tokens: int, reward: RewardConfig,
                  key: str = "rollout") -> list[LengthStage]:
    """Resolve a length schedule (see RolloutConfig.length_schedule) into stages sorted by start; the
    first starts at update 0 (`max_new_tokens` when no entry starts there). Stages without their own
    L_MAX:L_CACHE take `reward`'s window (reward.l_max null: the stage's cap). Raises ConfigError naming
    the entry on a malformed one; the agreement of caps and windows is `check_length_penalty`'s."""
    return [stage for _, stage, _ in _length_stages_with_keys(list(entries), max_new_tokens, reward, key)]


def stage_at(stages: list[LengthStage], update: int) -> LengthStage:
    """The stage in force at `update` (the last one starting at or before it)."""
    if not stages or stages[0].start != 0:
        raise ValueError("a length schedule needs a first stage starting at update 0")
    current = stages[0]
    for stage in stages:
        if stage.start <= update:
            current = stage
    return current


def check_length_penalty(schedule: list[str], max_new_tokens: int, reward: RewardConfig) -> None:
    """Each stage's cap must end inside its penalty ramp (l_max - l_cache < cap <= l_max): the cap and
    the penalty agree. Skipped without a schedule and with a fixed reward.l_max (the plain setting of
    both keys is the user's), and when the penalty is 0."""
    if reward.overlong_penalty == 0 or (not schedule and reward.l_max is not None):
        return
    for k, s, inherited in _length_stages_with_keys(schedule, max_new_tokens, reward, "rollout"):
        window = (f"reward.l_max={reward.l_max}, reward.l_cache={reward.l_cache}" if inherited and
                  reward.l_max is not None else f"l_max={s.l_max}, l_cache={s.l_cache}")
        fix = ("set reward.l_max: null (the window follows each stage's cap) or give the stage its own "
               "UPDATE:TOKENS:L_MAX:L_CACHE")
        if s.l_max - s.l_cache >= s.max_new_tokens:
            where = "reward.l_cache" if inherited and reward.l_max is None else k
            raise ConfigError(f"{where}: the stage from update {s.start} caps generation at {s.max_new_tokens} "
                              f"tokens but its overlong penalty ({window}) starts after {s.l_max - s.l_cache} "
                              f"tokens, so it never applies; {fix}")
        check(s.max_new_tokens <= s.l_max, k,
               f"the stage from update {s.start} caps generation at {s.max_new_tokens} tokens but its overlong "
               f"penalty ({window}) ends at {s.l_max}: every answer longer than that gets the full penalty; "
               f"{fix}")
