"""On-policy distillation: the teacher's per-token reverse-KL term in the advantage.

The student samples y; a frozen teacher (same tokenizer) scores the sampled tokens. Per sampled token t

    A_t = A_reward + coef * (log p_teacher(y_t | y_<t) - log p_student(y_t | y_<t))

where A_reward is the verifier reward's advantage after its configured normalisation (0 with
`distill_only`), and p_student is the trainer's student at the start of the update (the proximal
logprobs: the same numerics as the teacher's pass, so a teacher equal to the student adds exactly 0,
and the freshest student when samples are stale). Both are detached: no gradient flows through the
teacher nor through the term itself; the surrogate's score function carries it. Its expectation under
the student's samples is -coef times the per-token reverse KL(student || teacher), the objective of
on-policy distillation (the sampled token only, not the full distributions). The term is added after the
minibatch normalisation so that `coef` keeps its meaning in nats per token. Environment tokens of an
episode (mask 0) get no term.
"""
from __future__ import annotations

import torch
from torch import Tensor

PREFIX = "distill/"  # metric names: distill/teacher_kl, distill/advantage_abs


def teacher_term(teacher_logprobs: Tensor, student_logprobs: Tensor, mask: Tensor, coef: float) -> Tensor:
    """coef * (teacher - student) per token, 0 where `mask` is 0 (detached)."""
    if not (teacher_logprobs.shape == student_logprobs.shape == mask.shape):
        raise ValueError(f"teacher_logprobs, student_logprobs and mask must have one shape; got "
                         f"{tuple(teacher_logprobs.shape)}, {tuple(student_logprobs.shape)}, {tuple(mask.shape)}")
    f = torch.promote_types(torch.promote_types(teacher_logprobs.dtype, student_logprobs.dtype), torch.float32)
    diff = teacher_logprobs.detach().to(f) - student_logprobs.detach().to(f)  # bf16 -> fp32; fp64 stays
    return torch.where(mask.bool(), coef * diff, 0.0)


def distill_advantages(advantages: Tensor, teacher_logprobs: Tensor, student_logprobs: Tensor, mask: Tensor,
                       coef: float, only: bool = False) -> Tensor:
    """Per-token advantages `[..., T]`: the reward's (`advantages`, dropped when `only`) plus the teacher term.
    `advantages` is per token (the mask's shape) or per sequence (`[...]`, one value for each row's tokens)."""
    term = teacher_term(teacher_logprobs, student_logprobs, mask, coef)
    if advantages.dim() == mask.dim() - 1:  # per sequence: broadcast along T, not along the last dim
        advantages = advantages[..., None]
    if advantages.shape != mask.shape and advantages.shape != mask.shape[:-1] + (1,):
        raise ValueError(f"advantages must be [..., T] = {tuple(mask.shape)} or {tuple(mask.shape[:-1])}, "
                         f"got {tuple(advantages.shape)}")
    f = torch.promote_types(advantages.dtype, term.dtype)
    reward = torch.zeros_like(term) if only else torch.where(mask.bool(), advantages.detach().to(f), 0.0)
    return reward + term


def metric_sums(teacher_logprobs: Tensor, student_logprobs: Tensor, mask: Tensor, coef: float) -> Tensor:
    """float64 [tokens, sum of (student - teacher), sum of |teacher term|] of the masked tokens, to be
    summed over ranks before `metrics`."""
    m = mask.bool()
    kl = torch.where(m, student_logprobs.double() - teacher_logprobs.double(), 0.0)
    return torch.stack([m.sum().double(), kl.sum(), coef * kl.abs().sum()])


def metrics(sums: Tensor) -> dict[str, float]:
    """`distill/teacher_kl`: the per-token estimate log p_student - log p_teacher of the reverse KL, mean
    over sampled tokens; `distill/advantage_abs`: the mean |teacher term| the advantages carry."""
    n, kl, term = torch.as_tensor(sums, dtype=torch.float64).tolist()
    n = max(n, 1.0)
    return {f"{PREFIX}teacher_kl": kl / n, f"{PREFIX}advantage_abs": term / n}
