"""`score`: one response graded by the built-in reward (compose.builtin_score) or, with
``reward.custom`` set, by the plug-in it names (custom.custom_score). Its own module, above both, so
that the plug-in context can offer the built-in reward without compose importing custom back."""
from __future__ import annotations

import time
from dataclasses import asdict

from megatron_rl.config import LengthStage, RewardConfig
from megatron_rl.reward.compose import builtin_score, check_response_args, penalty_window
from megatron_rl.reward.custom import RewardContext, custom_score
from megatron_rl.reward.length import estimate_tokens
from megatron_rl.reward.types import RewardBreakdown, Task, parse_task


def score(task: dict | Task, response: str, config: RewardConfig | None = None,
          num_tokens: int | None = None, *, l_max: int | None = None,
          l_cache: int | None = None, stage: LengthStage | None = None) -> RewardBreakdown:
    """Grade one response. ``num_tokens`` is the completion length in tokens for the overlong
    penalty; when None it is estimated from the text (megatron_rl.reward.length.estimate_tokens).
    ``l_max`` / ``l_cache`` override the config's penalty window for this response (the length stage
    it was generated under); ``stage`` gives that window as the length stage itself (the training
    loop's grade items); the config itself is never modified. With ``reward.custom`` set, the
    plug-in it names grades instead of the built-in reward (megatron_rl.reward.custom).

    Raises TaskError on a task dict that does not follow megatron_rl.reward.types.
    """
    cfg = config if config is not None else RewardConfig()
    if not cfg.custom:
        return builtin_score(task, response, cfg, num_tokens, l_max=l_max, l_cache=l_cache, stage=stage)
    start = time.perf_counter()
    window = penalty_window(cfg, l_max, l_cache, stage=stage)
    parsed = parse_task(task)
    check_response_args(response, num_tokens)
    task_dict = dict(task) if isinstance(task, dict) else asdict(parsed)
    n_tok = estimate_tokens(response) if num_tokens is None else num_tokens
    ctx = RewardContext(cfg, n_tok, num_tokens is None, window[0], window[1], task_dict)
    out = custom_score(cfg.custom, task_dict, response, ctx)
    out.elapsed_s = time.perf_counter() - start
    return out
