"""Tolerances derived from the arithmetic a test checks, not from the CPU it last passed on.

Why: ATen and oneDNN pick kernels by CPU (SSE/AVX2/AVX-512/AMX: vector width, blocking, bf16 dot
products accumulated in fp32 in different orders), so two float results of one formula differ by
rounding errors whose size depends on the dtype and the reduction length, not on the machine.
`ATEN_CPU_CAPABILITY` / `ONEDNN_MAX_CPU_ISA` force another kernel path on any machine
(tests/unit/test_numerics_other_isa.py runs the numerics tests that way once per suite).

The model (Higham & Mary, "A new approach to probabilistic rounding error analysis", 2019): a sum
or dot product of n terms in unit roundoff u has relative error (to the sum of |terms|) at most
LAMBDA * sqrt(n) * u with probability >= 1 - 2 exp(-LAMBDA^2 / 2) per result (LAMBDA = 6: 3e-8),
whatever the order. Worst-case bounds (n * u) are too loose to catch anything at n = 5000.
A comparison of two implementations allows both errors (factor 2).

Each test states which quantity it bounds with these; where a result must be bit-exact (same layout,
same kernels, same order) the tests keep `torch.equal` instead.
"""
from __future__ import annotations

import math

import torch

LAMBDA = 6.0


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = 2^-p: half the distance from 1 to the next float (fp32 6.0e-8, bf16 3.9e-3)."""
    return torch.finfo(dtype).eps / 2


def sum_error(n: int, dtype: torch.dtype = torch.float32) -> float:
    """Relative error bound (to sum |terms|) of an n-term sum or dot product in `dtype`."""
    return LAMBDA * math.sqrt(max(n, 1)) * unit_roundoff(dtype)


def logprob_error(vocab: int, logprobs: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Absolute error bound of log_softmax(z)[target] computed in `dtype` over `vocab` columns.

    logp = (z_t - max) - log(sum exp(z - max)): the subtraction is exact for logits held in this or
    a narrower float; the sum of exp terms (each a few ulp off) has relative error sum_error(vocab),
    which the log turns into the same absolute error; the log and the last subtraction round once
    more, each relative to their magnitude (|logp| bounds both).
    """
    u = unit_roundoff(dtype)
    return sum_error(vocab, dtype) + 4 * u + 2 * u * logprobs.abs()


def clipped_loss_error(logprob_err: torch.Tensor, ratio: torch.Tensor, adv: torch.Tensor,
                       mask: torch.Tensor) -> float:
    """Absolute error bound of the token-normalised clipped loss given per-token logprob errors.

    loss = sum_t l_t / N with |dl_t / dlogp_t| <= |A_t| r_t (zero where clipped), plus the n-term
    sum of the l_t (|l_t| <= |A_t| max(r_t, 1 + eps)).
    """
    m = mask.to(torch.float64)
    n = max(int(mask.sum()), 1)
    adv = per_token(adv.double(), m)
    ratio = ratio.double()
    propagated = (adv.abs() * ratio * logprob_err.double() * m).sum() / n
    summed = sum_error(n) * (adv.abs() * torch.maximum(ratio, torch.ones_like(ratio)) * 1.3 * m).sum() / n
    return float(propagated + summed)


def per_token(adv: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Advantages given per sequence [B] or per token [B, T], as [B, T]."""
    return adv[:, None].expand_as(like) if adv.dim() == 1 else adv.expand_as(like)


def rounding_to(dtype: torch.dtype, reference: torch.Tensor) -> torch.Tensor:
    """Elementwise bound between two roundings to `dtype` of values near `reference`: one ulp.

    Two implementations whose fp32 values differ in the last bits can round to adjacent `dtype`
    values: |a - b| <= 2 u |x|."""
    return 2 * unit_roundoff(dtype) * reference.abs()


def adam_direction_bound(step: int, beta1: float, beta2: float) -> float:
    """Largest |m_hat / sqrt(v_hat)| of Adam at `step`, over all gradient histories.

    m_hat = sum_k w_k g_k, v_hat = sum_k s_k g_k^2 (w_k = (1-b1) b1^(t-k) / bc1, s_k likewise with b2),
    so by Cauchy-Schwarz |m_hat| <= sqrt(sum_k w_k^2 / s_k) sqrt(v_hat).
    """
    bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** step
    return math.sqrt(sum(((1 - beta1) * beta1 ** (step - k) / bc1) ** 2
                         / ((1 - beta2) * beta2 ** (step - k) / bc2) for k in range(1, step + 1)))


def adam_step_error(sqrt_v_hat: torch.Tensor, grad_err: torch.Tensor | float, lr: float, step: int,
                    beta1: float, beta2: float) -> torch.Tensor:
    """Elementwise bound on how far one Adam(W) step moves a weight when this step's gradient is off
    by at most grad_err (same weights and optimizer state before the step), given a lower bound of
    sqrt(v_hat) after the step.

    u = m_hat / (sqrt(v_hat) + eps), m = b1 m' + (1 - b1) g, v = b2 v' + (1 - b2) g^2, so
    |du/dg| <= ((1 - b1) / bc1 + |u| (1 - b2) |g| / (bc2 sqrt(v_hat))) / sqrt(v_hat)
            <= ((1 - b1) / bc1 + U sqrt((1 - b2) / bc2)) / sqrt(v_hat)
    (|u| <= U, adam_direction_bound; v_hat >= (1 - b2) g^2 / bc2). Where sqrt(v_hat) is at the noise
    level the bound is the update's whole range, 2 lr U: Adam can turn rounding noise into a sign flip.
    """
    bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** step
    cap = adam_direction_bound(step, beta1, beta2)
    slope = ((1 - beta1) / bc1 + cap * math.sqrt((1 - beta2) / bc2)) / sqrt_v_hat
    return (lr * slope * grad_err).nan_to_num(posinf=math.inf).clamp_max(2 * lr * cap)


# Cancellation allowance for the chained bound below: sum |terms| / |result| of the gradients of the
# tiny random models the tests build (hidden 64, 2 layers); measured 1.5-3 on their largest elements.
CONDITIONING = 4.0


def network_error(n_matmuls: int, reduction: int, dtype: torch.dtype = torch.float32) -> float:
    """Relative error bound of a model output or gradient computed through a chain of `n_matmuls`
    matmuls/reductions of length <= `reduction` in `dtype` (accumulation), against another evaluation
    with other kernels: independent roundings add as a random walk, LAMBDA sqrt(n_matmuls reduction) u,
    times CONDITIONING."""
    return LAMBDA * math.sqrt(n_matmuls * reduction) * unit_roundoff(dtype) * CONDITIONING


def transformer_matmuls(layers: int) -> int:
    """Matmuls a token's gradient passes through: per layer q, k, v, o, scores, scores@v, gate, up,
    down, plus the output layer; the backward pass runs two per forward matmul."""
    return 3 * (9 * layers + 1)
