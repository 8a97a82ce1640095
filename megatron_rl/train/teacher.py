"""The frozen teacher of on-policy distillation (`algo.teacher`), on the trainer ranks.

A second model, loaded from its own HF checkpoint (any size or family the trainer builds), in the
policy's parallel layout and precision, without DDP, optimizer or gradients. Its logprobs run through
the step's packed micro-batches and pipeline schedule (`train.step.collect_logprobs`) like the KL
reference's, so the student's sampled tokens are scored where the student's logprobs are: no server,
no extra transfer of sequences. Under TP/PP/VP/EP its dimensions must split as the layout asks (heads
and vocab by TP, layers by PP x VP, experts by EP); Megatron refuses a teacher that cannot, when the
trainer starts. It is never saved: a resumed run loads it again from `algo.teacher`.

The teacher must share the student's tokenizer (the sampled ids are scored as they are): the vocabularies
are compared token by token and a difference is refused naming `algo.teacher`. Their embedding tables
may differ in padded size (Qwen2.5 0.5B vs 7B): each model's log-softmax runs over its own vocabulary.
"""
from __future__ import annotations

import dataclasses

import torch

from megatron_rl.config import ConfigError


def check_same_vocab(student_tokenizer, teacher_tokenizer, teacher: str) -> None:
    """ConfigError naming algo.teacher when a token of either tokenizer has another id (or none) in the other."""
    student, other = student_tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    differ = sorted(tok for tok in student.keys() | other.keys() if student.get(tok) != other.get(tok))
    if differ:
        raise ConfigError(f"algo.teacher: {teacher} does not share the student's tokenizer ({len(differ)} tokens "
                          f"differ, e.g. {differ[0]!r}: {student.get(differ[0])} vs {other.get(differ[0])})")


class Teacher:
    def __init__(self, name: str, student_source, layout, dtype: torch.dtype):
        from megatron_rl.train.hf_source import resolve_model
        from megatron_rl.train.hf_weights import load_hf_weights
        from megatron_rl.train.model import build_model

        source = resolve_model(name)
        check_same_vocab(student_source.tokenizer(), source.tokenizer(), name)
        self.chunks = build_model(source.config(), layout, dtype)
        load_hf_weights(self.chunks, source.tensors())
        for chunk in self.chunks:
            chunk.requires_grad_(False)
            chunk.eval()

    def context(self, ctx):
        """The step context of the teacher's pass: its own vocabulary size (the padding it excludes)."""
        return dataclasses.replace(ctx, vocab_size=self.chunks[0].mrl_dims.vocab_size)
