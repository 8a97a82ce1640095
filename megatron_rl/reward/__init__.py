"""Verifiers and rewards (Magistral): format gate, math, code sandbox, overlong penalty, language.

Public entry points: ``score(task, response, config=None, num_tokens=None) -> RewardBreakdown``,
``score_batch(items, config=None)`` and ``VerifierPool`` (parallel worker processes; typed items are
``ScoreItem``s), the task schema and ``GradeStatus`` in ``megatron_rl.reward.types``. This package imports neither Megatron nor SGLang.
"""
from megatron_rl.reward.grade import score
from megatron_rl.reward.pool import PoolStats, VerifierPool, score_batch
from megatron_rl.reward.types import CodeTask, GradeStatus, MathTask, RewardBreakdown, ScoreItem, TaskError, parse_task

__all__ = ["score", "score_batch", "VerifierPool", "PoolStats", "RewardBreakdown", "GradeStatus", "ScoreItem",
           "TaskError", "MathTask", "CodeTask", "parse_task"]
