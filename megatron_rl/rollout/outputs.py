"""One SGLang /generate answer as a model `Turn`: tokens, behaviour logprobs, versions per token,
why it ended, prompt and cached tokens, and the routed experts when asked for (routing replay)
(megatron_rl.rollout.episode strings turns into an episode)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from megatron_rl.records import FinishReason
from megatron_rl.rollout.routing import MissingRoutes, RoutingShape


class MalformedOutput(ValueError):
    """SGLang's answer lacks a field the trainer needs or its lengths disagree."""


def parse_version(v: Any) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        raise MalformedOutput(f"weight version {v!r} is not an integer; launch servers with "
                              "--weight-version <int> and send integer versions") from None


def expand_version_spans(spans: list | None, n_tokens: int, fallback: Any) -> list[int]:
    """Per-token versions from SGLang's `meta_info.weight_versions` spans.

    Spans are {"version", "start", "end"} over output-token indices (half-open). SGLang omits them
    when no version was recorded; then every token carries `fallback` (meta_info.weight_version).
    Gaps or overlaps are an error: a token without a known version must never reach the loss.
    """
    if not spans:
        return [parse_version(fallback)] * n_tokens
    out: list[int] = []
    for s in spans:
        if isinstance(s, dict):
            v, start, end = s["version"], int(s["start"]), int(s["end"])
        else:  # msgspec array_like form: [version, start, end]
            v, start, end = s[0], int(s[1]), int(s[2])
        if start != len(out) or end < start:
            raise MalformedOutput(f"weight-version spans not contiguous at token {len(out)}: {spans}")
        out.extend([parse_version(v)] * (end - start))
    if len(out) != n_tokens:
        raise MalformedOutput(f"weight-version spans cover {len(out)} tokens, output has {n_tokens}: {spans}")
    return out


def finish_reason(meta: dict) -> FinishReason:
    fr = meta.get("finish_reason")
    kind = fr.get("type") if isinstance(fr, dict) else fr
    if kind in ("stop", "length", "abort"):
        return kind
    raise MalformedOutput(f"unknown finish_reason {fr!r}")


@dataclass
class Turn:
    """One model turn as /generate answered it: sampled ids (a matched stop token included), their
    behaviour logprobs and weight versions, why it ended, and the request's prompt / cached tokens."""

    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason
    text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # [rows, layers, topk] expert ids of the positions from the request's routed_experts_start_len to
    # the last but one token of input + output (routing.py); None: not asked for, or an aborted turn's
    routes: np.ndarray | None = None

    @classmethod
    def of(cls, out: dict, routing: RoutingShape | None = None, routes_from: int = 0) -> "Turn":
        """Parse an answer; MalformedOutput when its ids, logprobs and versions do not agree, or when the
        routes asked for (`routing`, from position `routes_from`) are missing from a turn not aborted."""
        meta = out.get("meta_info") or {}
        ids = out.get("output_ids")
        if ids is None:
            raise MalformedOutput(f"no output_ids in SGLang answer: {str(out)[:300]}")
        lps = meta.get("output_token_logprobs")
        if lps is None:
            raise MalformedOutput("no output_token_logprobs (request must set return_logprob)")
        if len(lps) != len(ids):
            raise MalformedOutput(f"{len(lps)} logprobs for {len(ids)} output tokens")
        for (lp, tok, *_), t in zip(lps, ids):
            if tok != t:
                raise MalformedOutput(f"logprob entry for token {tok} where output has {t}")
        versions = expand_version_spans(meta.get("weight_versions"), len(ids), meta.get("weight_version"))
        prompt_tokens, reason = int(meta.get("prompt_tokens") or 0), finish_reason(meta)
        routes = None
        if routing is not None:
            try:
                routes = routing.decode(meta, prompt_tokens + len(ids) - 1 - routes_from)
            except MissingRoutes as e:
                if reason != "abort":  # an aborted request is never collected: it has none
                    raise MalformedOutput(str(e)) from None
        return cls(list(ids), [float(x[0]) for x in lps], versions, reason, out.get("text", ""),
                   prompt_tokens, int(meta.get("cached_tokens") or 0), routes)


def scoring_temperature(sampling: dict) -> float:
    """The T of log_softmax(logits / T) that SGLang's reported logprobs are of, for these sampling
    params: the sampling temperature, except greedy (T = 0), whose logprobs are of the raw logits."""
    t = float(sampling.get("temperature", 1.0))
    return t if t > 0 else 1.0
