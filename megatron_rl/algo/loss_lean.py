"""Memory-lean clipped token loss: same value and gradient as `loss.clipped_token_loss`, one saved tensor.

The eager reference keeps every intermediate of the surrogate (ratio, clamp, both products, the min
selection, masks) alive until backward. The gradient has a closed form, so this version computes it in
the forward pass and saves only it ([B, T] in the logprobs' dtype):

    d loss / d logp_t = -A_t * r_t * w_t / N   where the unclipped branch is the minimum (r_t A_t <=
                                                clip(r_t) A_t) and the token is unmasked, else 0,

with w_t the detached importance weight of the TIS options and N the normaliser (token level) or
len_i * N (sequence level). Gradients flow to `logprobs` only (advantages, behaviour and proximal
logprobs are data); double backward is not supported. Use it inside the trainer when activation memory
is tight; `clipped_token_loss` stays the readable reference the tests and the fused op compare against.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .loss import Level, Normalizer, _check_inputs


class _LeanClippedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logprobs: Tensor, behaviour: Tensor, adv: Tensor, mask: Tensor, eps_low: float,
                eps_high: float, denom: Tensor, level: str, proximal: Tensor | None,
                tis_cap: float | None) -> Tensor:
        f = torch.promote_types(logprobs.dtype, torch.float32)
        m = mask.bool()
        anchor = behaviour if proximal is None else proximal
        ratio = torch.exp(torch.where(m, logprobs.to(f) - anchor.to(f), 0.0))
        a = adv.to(f)
        a = a[:, None] if a.dim() == 1 else a
        ra = ratio * a
        ca = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * a
        unclipped = ra <= ca
        per_token = -torch.minimum(ra, ca)
        del ca
        if proximal is not None:
            w = torch.exp(torch.where(m, proximal.to(f) - behaviour.to(f), 0.0))
            if tis_cap is not None:
                w = w.clamp_max(tis_cap)
        elif tis_cap is not None:
            w = (tis_cap / ratio).clamp_max(1.0)
        else:
            w = None
        if w is not None:
            per_token = per_token * w
            ra = ra * w
        scale = denom.to(f)
        if level == "sequence":  # each token weighs 1 / (len_i * N)
            scale = m.sum(dim=1, keepdim=True).clamp_min(1).to(f) * scale
        per_token = torch.where(m, per_token, 0.0) / scale
        grad = torch.where(m & unclipped, -ra / scale, 0.0).to(logprobs.dtype)
        ctx.save_for_backward(grad)
        return per_token.sum()

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        (grad,) = ctx.saved_tensors
        return (grad * grad_out.to(grad.dtype),) + (None,) * 9


def clipped_token_loss_lean(logprobs: Tensor, behaviour_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                            eps_low: float = 0.2, eps_high: float = 0.28, *,
                            normalizer: Normalizer = None, level: Level = "token",
                            proximal_logprobs: Tensor | None = None,
                            tis_cap: float | None = None) -> Tensor:
    """Drop-in for `clipped_token_loss` (same arguments and semantics), saving one tensor for backward."""
    _check_inputs(logprobs, behaviour_logprobs, advantages, mask, eps_low, eps_high)
    if tis_cap is not None and tis_cap < 1.0:
        raise ValueError(f"tis_cap must be >= 1, got {tis_cap}")
    if level not in ("token", "sequence"):
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    m = mask.bool()
    if normalizer is None:
        count = m.sum() if level == "token" else m.any(dim=1).sum()
        denom = count.clamp_min(1)
    elif isinstance(normalizer, Tensor):
        if normalizer.numel() != 1:
            raise ValueError(f"normalizer must be a scalar, got shape {tuple(normalizer.shape)}")
        denom = normalizer.detach().reshape(())
    else:
        if not normalizer > 0:
            raise ValueError(f"normalizer must be > 0, got {normalizer}")
        denom = torch.tensor(float(normalizer), device=logprobs.device)
    prox = None if proximal_logprobs is None else proximal_logprobs.detach()
    return _LeanClippedLoss.apply(logprobs, behaviour_logprobs.detach(), advantages.detach(), m, eps_low,
                                  eps_high, denom, level, prox, tis_cap)
