"""Sampling k completions per problem for filtering and evaluation.

Two sources of completions, one interface (`Sampler.sample(problems, k) -> {problem_id: [Completion]}`):
- `GeneratorSampler`: a real SGLang server through `megatron_rl.rollout.Generator` (prompts rendered
  with the chat template and a system-prompt template of `megatron_rl.data.prompts`; the graded
  response is the template's assistant prefix + the completion, exactly as in training);
- `FileSampler`: completions produced elsewhere, read from JSONL lines
  `{"problem_id": ..., "response": ..., "num_tokens"?: int}` (e.g. another framework's outputs).
"""
from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from megatron_rl.data.sources import utf8_lines
from megatron_rl.progress import Progress, eta_text
from megatron_rl.records import Problem, Rollout

TICK_S = 1.0  # how often the progress line shows the tokens streamed so far


class SamplingFailed(RuntimeError):
    """The generator could not produce the samples (server start, timeout, death, refusal): one line."""


@dataclass(frozen=True)
class Completion:
    response: str  # what the verifier grades (assistant prefix + generated text)
    num_tokens: int | None = None
    finish_reason: str = "stop"


class Sampler(Protocol):
    def sample(self, problems: list[Problem], k: int) -> dict[str, list[Completion]]: ...


class FileSampler:
    def __init__(self, path: str | Path):
        self.by_problem: dict[str, list[Completion]] = defaultdict(list)
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"samples file not found: {path}")
        for lineno, line in utf8_lines(path):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                pid, response = str(row["problem_id"]), row["response"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: expected {{problem_id, response}}: {e}") from None
            if not isinstance(response, str):
                raise ValueError(f"{path}:{lineno}: response must be a string")
            self.by_problem[pid].append(Completion(response, row.get("num_tokens"), row.get("finish_reason", "stop")))

    def sample(self, problems: list[Problem], k: int) -> dict[str, list[Completion]]:
        out = {}
        for p in problems:
            got = self.by_problem.get(p.problem_id, [])
            if len(got) < k:
                raise ValueError(f"problem {p.problem_id}: {len(got)} samples in the file, {k} needed")
            out[p.problem_id] = got[:k]
        return out


class GeneratorSampler:
    """k samples per problem from a started `rollout.Generator` (all problems in flight at once).
    A request that stays silent too long fails on the server's `request_idle_timeout_s`, not here."""

    def __init__(self, generator, tokenizer, template: str = "magistral", sampling: dict | None = None,
                 progress: bool = True):
        from megatron_rl.data.prompts import get_template

        self.generator, self.tokenizer = generator, tokenizer
        self.template = get_template(template)
        self.sampling = dict(sampling or {})
        self.progress = progress

    def sample(self, problems: list[Problem], k: int) -> dict[str, list[Completion]]:
        from megatron_rl.data.prompts import render_prompt_ids
        from megatron_rl.rollout.client import GenerationTimeout, SGLangHTTPError
        from megatron_rl.rollout.generator import GeneratorDied
        from megatron_rl.rollout.outputs import MalformedOutput

        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        ids = {p.problem_id: p for p in problems}
        if len(ids) != len(problems):
            raise ValueError("problem ids must be unique")
        for p in problems:
            self.generator.submit(p.problem_id, render_prompt_ids(self.tokenizer, p, self.template),
                                  group_size=k, sampling=self.sampling)
        out: dict[str, list] = {pid: [None] * k for pid in ids}
        with Progress(k * len(problems), "sampling", unit="completion", enabled=self.progress) as bar:
            try:
                for r in self._finished(bar):
                    text = self.template.assistant_prefix + self.tokenizer.decode(r.completion_ids,
                                                                                  skip_special_tokens=True)
                    out[r.group_id][r.sample_index] = Completion(text, len(r.completion_ids), r.finish_reason)
                    bar.update(1)
            except (GenerationTimeout, GeneratorDied, SGLangHTTPError, MalformedOutput) as e:
                raise SamplingFailed(f"sampling stopped after {bar.done} of {bar.total} completions: {e}") from e
        missing = [pid for pid, cs in out.items() if any(c is None for c in cs)]
        if missing:
            raise SamplingFailed(f"{len(missing)} problems did not get {k} samples: {missing[:5]}")
        return out

    def _finished(self, bar: Progress) -> Iterator[Rollout]:
        """Finished rollouts until nothing is in flight; each tick puts the tokens streamed on `bar`, with
        the time left at most (completions end together, so an ETA from completions done means little)."""
        start, t0 = self.generator.tokens_streamed, time.monotonic()
        done = done_tokens = 0
        while True:
            busy = self.generator.in_flight  # read before get(): a rollout is queued before it leaves
            r = self.generator.get(timeout=TICK_S)
            if r is not None:
                done, done_tokens = done + 1, done_tokens + len(r.completion_ids)
            tokens, elapsed = self.generator.tokens_streamed - start, time.monotonic() - t0
            text = f"{tokens} tokens, {tokens / max(elapsed, 1e-9):.0f} tok/s"
            cap = self.sampling.get("max_new_tokens")
            if cap and tokens:  # every unfinished completion running to max_new_tokens at this pace
                left = (bar.total - done) * cap - (tokens - done_tokens)
                text += f", at most {eta_text(tokens, tokens + left, elapsed).removeprefix('ETA ')} left"
            bar.set_postfix(text)
            if r is not None:
                yield r
            elif not busy:
                return


def open_generator(model: str, port: int, rollout=None, generator=None, max_concurrency: int = 64,
                   log_path: str | None = None, threads: int | None = None):
    """A started `Generator` serving `model` (HF dir or smollm2-135m) on 127.0.0.1:`port`."""
    from megatron_rl.config import GeneratorConfig, RolloutConfig
    from megatron_rl.control.model_files import generator_model_dir
    from megatron_rl.rollout.generator import Generator
    from megatron_rl.rollout.server import ServerSpec, SGLangServer

    g = generator or GeneratorConfig()
    spec = ServerSpec(str(generator_model_dir(model)), port, max_total_tokens=g.max_total_tokens,
                      log_path=log_path, mem_fraction_static=g.mem_fraction_static,
                      startup_timeout_s=g.startup_timeout_s, request_idle_timeout_s=g.request_idle_timeout_s,
                      extra_args=list(g.extra_args), threads=threads, tp_size=g.tp_size)
    return Generator(SGLangServer(spec), rollout or RolloutConfig(), g, max_concurrency=max_concurrency).start()


def sampling_params(rollout, temperature: float | None = None, max_new_tokens: int | None = None) -> dict:
    """SGLang sampling parameters: the values given, else the config's rollout section."""
    return {"temperature": temperature if temperature is not None else rollout.temperature,
            "top_p": rollout.top_p, "max_new_tokens": max_new_tokens or rollout.max_new_tokens}


def open_server_sampler(cfg, model: str | None = None, port: int | None = None, template: str | None = None,
                        params: dict | None = None):
    """(sampler, closer): an SGLang server started for `model` (default: the config's trainer.model) on `port`
    (default generator.port_base), prompts rendered with `template` (default data.system_prompt)."""
    from megatron_rl.rollout.server import ServerStartError

    model = model or cfg.trainer.model
    try:
        gen = open_generator(model, port or cfg.generator.port_base, cfg.rollout, cfg.generator)
    except ServerStartError as e:
        raise SamplingFailed(str(e)) from e
    from megatron_rl.train.hf_source import resolve_model

    tokenizer = resolve_model(model).tokenizer()
    sampler = GeneratorSampler(gen, tokenizer, template or cfg.data.system_prompt,
                               params if params is not None else sampling_params(cfg.rollout))
    return sampler, gen.close
