"""fused_linear_clipped_loss (token chunks, logits never stored) equals the unfused computation."""
from __future__ import annotations

import pytest
import torch

from megatron_rl.algo.loss import clipped_token_loss
from megatron_rl.ops import fused_linear_clipped_loss

EPS_LOW, EPS_HIGH = 0.2, 0.28


def make_case(dtype, B=2, T=9, H=16, V=61, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) / H**0.5 * 3).to(dtype)
    targets = torch.randint(0, V, (B, T), generator=g)
    exact = torch.log_softmax(hidden.double() @ weight.double().t(), -1).gather(-1, targets[..., None])[..., 0]
    # ratios spread over [0.4, 1.8] so both clip sides and the unclipped band are hit
    ratio = 0.4 + 1.4 * torch.rand(B, T, generator=g, dtype=torch.float64)
    behaviour = (exact - ratio.log()).float()
    adv = torch.randn(B, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.2
    return hidden, weight, targets, behaviour, adv, mask


def unfused(hidden, weight, targets, behaviour, adv, mask, normalizer=None):
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    logits = (h.float() @ w.float().t())
    logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    loss = clipped_token_loss(logp, behaviour, adv, mask, EPS_LOW, EPS_HIGH, normalizer=normalizer)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def fused(hidden, weight, targets, behaviour, adv, mask, **kw):
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    loss = fused_linear_clipped_loss(h, w, targets, behaviour, adv, mask, EPS_LOW, EPS_HIGH, **kw)
    (2.5 * loss).backward()  # a non-unit upstream gradient must scale the stored gradients
    return loss.detach(), h.grad / 2.5, w.grad / 2.5


@pytest.mark.parametrize("chunk", [1, 4, 7, 1000])
def test_fp32_chunked_equals_unfused(backend, chunk):
    case = make_case(torch.float32)
    ref = unfused(*case)
    got = fused(*case, chunk_tokens=chunk)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[2], ref[2], rtol=1e-5, atol=1e-6)
    assert got[1].abs().sum() > 0 and got[2].abs().sum() > 0


def test_bf16_within_tolerance(backend):
    case = make_case(torch.bfloat16, seed=1)
    ref = unfused(*case)
    got = fused(*case, chunk_tokens=5)
    torch.testing.assert_close(got[0], ref[0], rtol=2e-2, atol=2e-3)
    for g, r in zip(got[1:], ref[1:]):
        assert g.dtype == torch.bfloat16
        r = r.float()
        torch.testing.assert_close(g.float(), r, rtol=5e-2, atol=3e-2 * r.abs().max().item())


def test_normalizer_and_frozen_weight(backend):
    case = make_case(torch.float32, seed=2)
    ref = unfused(*case, normalizer=40)
    hidden, weight, *rest = case
    h = hidden.clone().requires_grad_(True)
    loss = fused_linear_clipped_loss(h, weight, *rest, EPS_LOW, EPS_HIGH, normalizer=40, chunk_tokens=3)
    loss.backward()
    assert weight.grad is None
    torch.testing.assert_close(loss.detach(), ref[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(h.grad, ref[1], rtol=1e-5, atol=1e-6)


def test_no_grad_forward_only(backend):
    case = make_case(torch.float32, seed=3)
    with torch.no_grad():
        loss = fused_linear_clipped_loss(*case, EPS_LOW, EPS_HIGH, chunk_tokens=4)
    torch.testing.assert_close(loss, unfused(*case)[0], rtol=1e-6, atol=1e-7)


def test_bad_inputs():
    hidden, weight, *rest = make_case(torch.float32)
    with pytest.raises(ValueError, match="weight must be"):
        fused_linear_clipped_loss(hidden, weight[:, :3], *rest)
    with pytest.raises(TypeError, match="share dtype"):
        fused_linear_clipped_loss(hidden, weight.double(), *rest)
    with pytest.raises(ValueError, match="chunk_tokens"):
        fused_linear_clipped_loss(hidden, weight, *rest, chunk_tokens=0)
