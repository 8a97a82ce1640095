"""algo.distill on constructed inputs: the per-token advantage and the metrics, written out by hand."""
from __future__ import annotations

import pytest
import torch

from megatron_rl.algo import distill

TEACHER = torch.tensor([[-0.5, -2.0, -1.0, 0.0], [-3.0, -0.25, -1.5, -4.0]])
STUDENT = torch.tensor([[-1.0, -1.0, -1.0, 0.0], [-2.0, -0.75, -0.5, -9.0]])
MASK = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 1]])  # 0: prompt / environment tokens, padding
REWARD_ADV = torch.tensor([[0.8, 0.8, 0.0, 0.0], [-0.4, 0.0, -0.4, -0.4]])


def test_advantage_is_the_reward_part_plus_coef_times_teacher_minus_student_on_sampled_tokens():
    got = distill.distill_advantages(REWARD_ADV, TEACHER, STUDENT, MASK, coef=0.5)
    want = torch.tensor([[0.8 + 0.5 * 0.5, 0.8 + 0.5 * -1.0, 0.0, 0.0],
                         [-0.4 + 0.5 * -1.0, 0.0, -0.4 + 0.5 * -1.0, -0.4 + 0.5 * 5.0]])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-7)


def test_distill_only_drops_the_reward_part():
    got = distill.distill_advantages(REWARD_ADV, TEACHER, STUDENT, MASK, coef=2.0, only=True)
    want = torch.tensor([[1.0, -2.0, 0.0, 0.0], [-2.0, 0.0, -2.0, 10.0]])
    assert torch.equal(got, want)


def test_masked_tokens_get_nothing_even_where_the_logprobs_differ():
    got = distill.distill_advantages(torch.ones(2, 4), TEACHER, STUDENT, MASK, coef=1.0)
    assert torch.equal(got[MASK == 0], torch.zeros(int((MASK == 0).sum())))


def test_no_gradient_flows_through_teacher_or_student_logprobs():
    teacher, student = TEACHER.clone().requires_grad_(), STUDENT.clone().requires_grad_()
    assert not distill.distill_advantages(REWARD_ADV, teacher, student, MASK, coef=1.0).requires_grad


def test_metrics_are_the_mean_reverse_kl_estimate_and_mean_abs_term_per_sampled_token():
    sums = distill.metric_sums(TEACHER, STUDENT, MASK, coef=0.5)
    # student - teacher on the 5 sampled tokens: -0.5, 1.0, 1.0, 1.0, -5.0
    assert distill.metrics(sums) == pytest.approx({"distill/teacher_kl": -2.5 / 5,
                                                   "distill/advantage_abs": 0.5 * 8.5 / 5})


def test_shapes_must_agree():
    with pytest.raises(ValueError, match="one shape"):
        distill.teacher_term(TEACHER, STUDENT[:, :3], MASK, 1.0)


def test_per_sequence_advantages_go_to_every_token_of_their_sequence_in_float64():
    """[B] advantages with B == T (where a plain broadcast would run along the tokens instead), float64
    kept (differences a float32 round trip would lose): A_it = A_i + coef (teacher_it - student_it)."""
    g = torch.Generator().manual_seed(0)
    teacher = -torch.rand(3, 3, generator=g, dtype=torch.float64) * 4
    student = teacher + 1e-9 * torch.randn(3, 3, generator=g, dtype=torch.float64)
    adv = torch.tensor([0.25, -1.0, 2.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 1], [1, 1, 1]])
    got = distill.distill_advantages(adv, teacher, student, mask, coef=0.5)
    want = [[(float(adv[i]) + 0.5 * (float(teacher[i, t]) - float(student[i, t]))) if mask[i, t] else 0.0
             for t in range(3)] for i in range(3)]
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-15, atol=1e-18)
    with pytest.raises(ValueError, match="advantages"):
        distill.distill_advantages(adv[:2], teacher, student, mask, coef=0.5)
