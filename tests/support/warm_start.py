"""A format-aware tiny policy for end-to-end RL tests: a brief SFT cold start of the tiny Llama.

A random tiny model never emits `<think>...</think> \\boxed{}`, so every group would be non-diverse
and RL would have nothing to learn from. Like Magistral Small (SFT, then RL), we first fine-tune on a
few formatted traces, stopping early so that the format is produced only part of the time: RL then
has diverse groups and a reward to raise.
"""
from __future__ import annotations

import random
from pathlib import Path


def addition_problems(path: Path, n: int, seed: int = 0) -> Path:
    """Single-digit sums in a terse prompt the tiny tokenizer handles in few tokens."""
    from megatron_rl.data.synthetic import addition_problems as write

    return write(path, n, max_operand=4, seed=seed, prompt_format="{a} + {b} =")


def sft_tiny_policy(model_dir: Path, out_dir: Path, problems: Path, steps: int, template: str = "short",
                    lr: float = 3e-3, seed: int = 0) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_rl.data import get_template, read_jsonl, render_prompt_ids

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tpl = get_template(template)
    rows = read_jsonl(problems)
    examples = []
    for p in rows:
        prompt = render_prompt_ids(tok, p, tpl)
        completion = tok(f"{p.prompt} {p.task['answer']} </think> \\boxed{{{p.task['answer']}}}",
                         add_special_tokens=False).input_ids + [tok.eos_token_id]
        examples.append((prompt, completion))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(seed)
    model.train()
    for _ in range(steps):
        batch = rng.sample(examples, 16)
        width = max(len(p) + len(c) for p, c in batch)
        ids = torch.full((len(batch), width), tok.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        for i, (p, c) in enumerate(batch):
            seq = p + c
            ids[i, :len(seq)] = torch.tensor(seq)
            labels[i, len(p):len(seq)] = torch.tensor(c)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    return out_dir
