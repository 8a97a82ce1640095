"""SFT cold start on reasoning traces, on the RL trainer's machinery (packing, schedules, optimizer).

The loss is cross-entropy on completion tokens only, normalised over all completion tokens of the
minibatch (the same per-token normaliser as the RL loss). Records (JSONL, one per line) are either
- `{"prompt": str, "completion": str}` (prompt rendered with the tokenizer's chat template when it has
  one, as a single user turn with the generation prompt), or
- `{"messages": [{"role": ..., "content": ...}, ...]}` whose last message is the assistant's answer; a
  trace of several turns (assistant, tool or user, assistant, ...) is laid out as an episode is
  (`data.turns.ChatTurns`): each assistant message and its stop token are trained, the messages
  between them are rendered once by the chat template and carry no loss (`loss_mask` 0), or
- `{"prompt_ids": [int], "completion_ids": [int]}` (already tokenised), with an optional `"loss_mask"`
  ([0/1] per completion id: 0 on tokens the model did not write, e.g. a tool's output in a trace
  laid out as an episode, `data.synthetic.episode_trace`).
The completion ends with the tokenizer's EOS token so the model learns to stop.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from megatron_rl.data.sources import DataError, json_object_lines
from megatron_rl.records import TrainSequence


@dataclass
class SFTExample:
    prompt_ids: list[int]
    completion_ids: list[int]
    loss_mask: list[int] | None = None  # a multi-turn trace: 0 on the messages between assistant turns


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSONL trace file; DataError (a ValueError) naming the file and line on a line
    that is not UTF-8, not JSON or not a JSON object."""
    path = Path(path)
    records = [record for _, record in json_object_lines(path)]
    if not records:
        raise DataError(f"{path}: no records")
    return records


def _render_prompt(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
    return tokenizer(text)["input_ids"]


def tokenize_record(record: dict[str, Any], tokenizer=None) -> SFTExample:
    """One JSONL record -> token ids (see the module docstring for the accepted forms)."""
    if "prompt_ids" in record and "completion_ids" in record:
        return SFTExample(list(record["prompt_ids"]), list(record["completion_ids"]), _loss_mask(record))
    if tokenizer is None:
        raise ValueError("text records need a tokenizer")
    if "messages" in record:
        msgs = record["messages"]
        if not msgs or msgs[-1].get("role") != "assistant":
            raise ValueError("a `messages` record must end with the assistant's message")
        first = next(i for i, m in enumerate(msgs) if m.get("role") == "assistant")
        if first < len(msgs) - 1:
            return _episode(tokenizer, msgs, first)
        prompt, completion = _render_prompt(tokenizer, msgs[:-1]), msgs[-1]["content"]
    elif "prompt" in record and "completion" in record:
        prompt = _render_prompt(tokenizer, [{"role": "user", "content": record["prompt"]}])
        completion = record["completion"]
    else:
        raise ValueError(f"record has neither prompt/completion, messages nor *_ids: keys {sorted(record)}")
    comp = tokenizer(completion, add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        comp = comp + [tokenizer.eos_token_id]
    return SFTExample(list(prompt), list(comp))


def _loss_mask(record: dict[str, Any]) -> list[int] | None:
    mask = record.get("loss_mask")
    if mask is None:
        return None
    if not isinstance(mask, list) or len(mask) != len(record["completion_ids"]) or set(mask) - {0, 1}:
        raise ValueError(f"loss_mask must be a list of 0/1, one per completion id ({len(record['completion_ids'])})")
    return list(mask)


def _episode(tokenizer, msgs: list[dict[str, str]], first: int) -> SFTExample:
    """A trace of several assistant turns, as the turn loop builds an episode: the prompt up to the first
    assistant message, then each assistant message's ids and stop token (trained) and the ids of the
    messages after it (the template's rendering, not trained)."""
    from megatron_rl.data.prompts import get_template
    from megatron_rl.data.turns import ChatTurns

    turns = ChatTurns(tokenizer, get_template("none"))
    ids: list[int] = []
    mask: list[int] = []
    i = first
    while i < len(msgs):
        sampled = tokenizer(msgs[i]["content"], add_special_tokens=False)["input_ids"] + [turns.stop_ids[0]]
        j = i + 1
        while j < len(msgs) and msgs[j].get("role") != "assistant":
            j += 1
        between = turns.observation_ids(msgs[i + 1:j]) if j > i + 1 else []
        if j < len(msgs) and not between:
            raise ValueError(f"messages[{i}] and messages[{j}] are two assistant messages in a row")
        ids += sampled + between
        mask += [1] * len(sampled) + [0] * len(between)
        i = j
    return SFTExample(_render_prompt(tokenizer, msgs[:first]), ids, mask)


def to_sequences(examples: Iterable[SFTExample], max_tokens: int) -> tuple[list[TrainSequence], int]:
    """TrainSequences (completions truncated to fit `max_tokens`); returns (sequences, n_dropped)."""
    seqs, dropped = [], 0
    for ex in examples:
        room = max_tokens - len(ex.prompt_ids)
        if len(ex.prompt_ids) < 1 or room < 1 or not ex.completion_ids:
            dropped += 1
            continue
        comp = ex.completion_ids[:room]
        mask = None if ex.loss_mask is None else ex.loss_mask[:room]
        if mask is not None and not any(mask):
            dropped += 1
            continue
        seqs.append(TrainSequence(token_ids=ex.prompt_ids + comp, prompt_len=len(ex.prompt_ids),
                                  behaviour_logprobs=[0.0] * len(comp), advantage=0.0, loss_mask=mask))
    return seqs, dropped


def run_sft(trainer, seqs: list[TrainSequence], batch_size: int, epochs: int = 1, seed: int = 0,
            on_step: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """`epochs` passes over `seqs` in shuffled minibatches of `batch_size` (one optimizer step each;
    a last incomplete minibatch is dropped). Every rank must pass the same arguments."""
    if batch_size < 1 or batch_size > len(seqs):
        raise ValueError(f"batch_size must lie in [1, {len(seqs)}], got {batch_size}")
    rng = random.Random(seed)
    history = []
    for epoch in range(epochs):
        order = list(range(len(seqs)))
        rng.shuffle(order)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            m = trainer.train_sft([seqs[i] for i in order[start:start + batch_size]])
            m = {k: v for k, v in m.items() if k != "steps"}
            m["epoch"] = epoch
            history.append(m)
            if on_step is not None:
                on_step(m)
    return history
