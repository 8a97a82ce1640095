"""The memory-lean loss gives the value and gradient of the reference, and passes finite differences."""
from __future__ import annotations

import pytest
import torch

from megatron_rl.algo.loss import clipped_token_loss
from megatron_rl.algo.loss_lean import clipped_token_loss_lean


def _batch(seed, B=6, T=11, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (B,), generator=g)  # includes an empty sequence sometimes
    mask = torch.arange(T)[None, :] < lengths[:, None]
    behaviour = -torch.rand(B, T, generator=g, dtype=dtype) * 3
    behaviour[~mask] = float("nan")  # padding garbage must not leak
    logprobs = behaviour.nan_to_num(-1.0) + 0.6 * torch.randn(B, T, generator=g, dtype=dtype)
    adv = torch.randn(B, generator=g, dtype=dtype)
    prox = behaviour.nan_to_num(-1.0) + 0.5 * torch.randn(B, T, generator=g, dtype=dtype)
    return logprobs, behaviour, adv, mask, prox


CASES = [
    dict(),
    dict(level="sequence"),
    dict(normalizer=37.0),
    dict(normalizer=torch.tensor(5)),
    dict(tis_cap=1.3),
    dict(proximal=True, tis_cap=1.5),
    dict(proximal=True),
    dict(token_adv=True, level="sequence", eps_high=0.26),
]


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_lean_matches_reference_value_and_gradient(case):
    case = dict(case)
    lp, b, adv, mask, prox = _batch(seed=len(str(case)))
    if case.pop("token_adv", False):
        adv = adv[:, None] + torch.randn(lp.shape, dtype=lp.dtype)
    if case.pop("proximal", False):
        case["proximal_logprobs"] = prox
    outs = []
    for fn in (clipped_token_loss, clipped_token_loss_lean):
        x = lp.clone().requires_grad_(True)
        val = fn(x, b, adv, mask, **case)
        (g,) = torch.autograd.grad(val * 3.0, x)  # non-unit upstream gradient
        outs.append((val.detach(), g))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-12, atol=1e-14)
    assert outs[0][1].abs().sum() > 0


def test_lean_gradient_matches_finite_differences():
    lp, b, adv, mask, _ = _batch(seed=11)
    b = b.nan_to_num(0.0)
    x = lp.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda y: clipped_token_loss_lean(y, b, adv, mask), (x,), eps=1e-6, atol=1e-8)


def test_lean_bf16_logprobs_get_bf16_gradients():
    lp, b, adv, mask, _ = _batch(seed=12, dtype=torch.float32)
    x = lp.bfloat16().requires_grad_(True)
    out = clipped_token_loss_lean(x, b, adv, mask)
    out.backward()
    assert out.dtype == torch.float32 and x.grad.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="normalizer"):
        clipped_token_loss_lean(x, b, adv, mask, normalizer=-1)
