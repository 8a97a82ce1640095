"""fused_clipped_loss against the reference algo.loss.clipped_token_loss on explicit logprobs.

Each case builds logits, then chooses behaviour logprobs so that tokens land in every regime of the
clipped surrogate (masked; unclipped with A > 0 and A < 0 on both sides of 1; clipped high with A > 0;
clipped low with A < 0); the regimes are asserted from the reference's own statistics.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch

from megatron_rl.algo.loss import clipped_token_loss, clipped_token_loss_with_stats
from megatron_rl.ops import _backend, fused_clipped_loss, fused_linear_clipped_loss, token_logprobs
from support.tolerances import clipped_loss_error, logprob_error, per_token, rounding_to, sum_error, unit_roundoff

EPS_LOW, EPS_HIGH = 0.2, 0.28
# (advantage sign, ratio) per regime; None = masked token
REGIMES = [None, (1, 1.1), (1, 1.6), (1, 0.5), (-1, 0.5), (-1, 1.6), (-1, 0.95), (1, 0.9)]


def ext_or_skip():
    if not _backend.extension_available():
        pytest.skip(f"csrc extension unavailable (no C++ compiler?): {_backend.extension_error()}")


@pytest.fixture(params=["ext", "torch"])
def backend(request, monkeypatch):
    monkeypatch.setenv("MEGATRON_RL_OPS_BACKEND", request.param)
    if request.param == "ext":
        ext_or_skip()
    return request.param


def make_case(dtype, B=3, T=16, V=97, seed=0, per_token_adv=True):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, T, V, generator=g) * 2.0).to(dtype)
    targets = torch.randint(0, V, (B, T), generator=g)
    exact = torch.log_softmax(logits.double(), -1).gather(-1, targets[..., None])[..., 0]
    mask = torch.ones(B, T, dtype=torch.bool)
    adv = torch.empty(B, T, dtype=torch.float64)
    ratio = torch.empty(B, T, dtype=torch.float64)
    for i in range(B * T):
        b, t = divmod(i, T)
        regime = REGIMES[i % len(REGIMES)]
        if regime is None:
            mask[b, t] = False
            targets[b, t] = -100  # ignore-index style padding must be harmless when masked
            adv[b, t], ratio[b, t] = 1.0, 1.0
        else:
            adv[b, t] = regime[0] * (0.5 + torch.rand((), generator=g).item())
            ratio[b, t] = regime[1]
    if not per_token_adv:
        adv = adv[:, 0].abs() + 0.3
    behaviour = (exact - torch.log(ratio)).float()
    return logits, targets, behaviour, adv.float(), mask


def reference(logits, targets, behaviour, adv, mask, **kw):
    """log_softmax + gather (float32 at least) + the reference loss; returns (loss, d loss/d logits)."""
    z = logits.detach().clone().requires_grad_(True)
    work = z if z.dtype == torch.float64 else z.float()
    logp = torch.log_softmax(work, -1).gather(-1, targets.clamp_min(0)[..., None])[..., 0]
    loss = clipped_token_loss(logp, behaviour, adv, mask, EPS_LOW, EPS_HIGH, **kw)
    loss.backward()
    return loss.detach(), z.grad


def bounds(logits, targets, behaviour, adv, mask, logit_err: float = 0.0):
    """(loss atol, grad rtol, grad atol) between two float32 evaluations of one case, from the arithmetic
    (support/tolerances.py): each logprob is off by logprob_error(V) in each implementation; the loss
    propagates that through |A| r per token; d loss / d z_tj = c_t (1[j = y_t] - p_tj) with
    |c_t| <= |A_t| r_t / N, and p_tj and r_t carry the same relative error. `logit_err`: how far
    the two evaluations' logits may differ (moves z_y and the log-sum-exp by that much each)."""
    exact = torch.log_softmax(logits.double(), -1).gather(-1, targets.clamp_min(0)[..., None])[..., 0]
    ratio = torch.exp(exact - behaviour.double())
    lp_err = 2 * logprob_error(logits.shape[-1], exact) + 2 * logit_err
    loss_atol = clipped_loss_error(lp_err, ratio, adv, mask)
    grad_rtol = 2 * float(lp_err.max()) + 8 * unit_roundoff(torch.float32)
    c_max = float((per_token(adv.double().abs(), ratio) * ratio * mask).max() / mask.sum())
    return loss_atol, grad_rtol, grad_rtol * c_max


def fused(logits, targets, behaviour, adv, mask, **kw):
    z = logits.detach().clone().requires_grad_(True)
    loss = fused_clipped_loss(z, targets, behaviour, adv, mask, EPS_LOW, EPS_HIGH, **kw)
    loss.backward()
    return loss.detach(), z.grad


def test_case_covers_every_regime():
    logits, targets, behaviour, adv, mask = make_case(torch.float32)
    logp = torch.log_softmax(logits, -1).gather(-1, targets.clamp_min(0)[..., None])[..., 0]
    _, stats = clipped_token_loss_with_stats(logp, behaviour, adv, mask, EPS_LOW, EPS_HIGH)
    assert 0 < stats.clip_frac_low < 1 and 0 < stats.clip_frac_high < 1
    assert (~mask).any() and (mask & (adv < 0)).any() and (mask & (adv > 0)).any()


@pytest.mark.parametrize("per_token_adv", [True, False])
def test_fp32_matches_reference(backend, per_token_adv):
    case = make_case(torch.float32, per_token_adv=per_token_adv)
    ref_loss, ref_grad = reference(*case)
    loss, grad = fused(*case)
    assert loss.dtype == torch.float32
    loss_atol, grad_rtol, grad_atol = bounds(*case)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=loss_atol)
    torch.testing.assert_close(grad, ref_grad, rtol=grad_rtol, atol=grad_atol)
    assert grad.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_within_tolerance(backend, dtype):
    logits, *rest = make_case(dtype, seed=1)
    ref_loss, ref_grad = reference(logits.float(), *rest)  # exact math on the same rounded logits
    loss, grad = fused(logits, *rest)
    assert grad.dtype == dtype
    # the half logits upcast exactly, so the loss is float32 arithmetic on both sides; the gradient
    # is then rounded once to `dtype` (one ulp apart at most from the float32 result's rounding)
    loss_atol, grad_rtol, grad_atol = bounds(logits.float(), *rest)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=loss_atol)
    diff = (grad.float() - ref_grad).abs()
    assert (diff <= rounding_to(dtype, ref_grad) + grad_rtol * ref_grad.abs() + grad_atol).all()


def test_micro_batch_accumulation_with_normalizer(backend):
    logits, targets, behaviour, adv, mask = make_case(torch.float32, B=4, seed=2)
    full_loss, full_grad = reference(logits, targets, behaviour, adv, mask)
    total = mask.sum()
    parts = [fused(logits[s], targets[s], behaviour[s], adv[s], mask[s], normalizer=total)
             for s in (slice(0, 1), slice(1, 4))]
    loss_atol, grad_rtol, grad_atol = bounds(logits, targets, behaviour, adv, mask)
    torch.testing.assert_close(parts[0][0] + parts[1][0], full_loss, rtol=0, atol=loss_atol)
    torch.testing.assert_close(torch.cat([parts[0][1], parts[1][1]]), full_grad, rtol=grad_rtol, atol=grad_atol)


def test_options_pass_through_tis_cap(backend):
    case = make_case(torch.float32, seed=3)
    ref_loss, ref_grad = reference(*case, tis_cap=1.2)
    loss, grad = fused(*case, tis_cap=1.2)
    loss_atol, grad_rtol, grad_atol = bounds(*case)  # the cap only lowers |d loss / d logp|
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=loss_atol)
    torch.testing.assert_close(grad, ref_grad, rtol=grad_rtol, atol=grad_atol)


def test_inplace_backward_writes_into_logits(backend):
    logits, *rest = make_case(torch.bfloat16, seed=4)
    _, expected = fused(logits, *rest)
    leaf = logits.clone().requires_grad_(True)
    z = leaf * 1  # non-leaf logits, as a model's output would be
    captured = {}
    z.register_hook(lambda g: captured.setdefault("g", g))
    loss = fused_clipped_loss(z, *rest, EPS_LOW, EPS_HIGH, inplace_backward=True)
    loss.backward()
    assert captured["g"].data_ptr() == z.data_ptr()
    torch.testing.assert_close(leaf.grad, expected, rtol=0, atol=0)


def test_float64_gradcheck_finite_differences(monkeypatch):
    logits, targets, behaviour, adv, mask = make_case(torch.float64, B=2, T=8, V=11, seed=5)
    z = logits.clone().requires_grad_(True)
    fn = lambda x: fused_clipped_loss(x, targets, behaviour.double(), adv.double(), mask)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (z,), eps=1e-6, atol=1e-8)


def test_extension_equals_torch_path_on_large_vocab(monkeypatch):
    """bf16 logits over 5000 columns: the extension and the torch path each stay within the float32
    rounding bound of the exact (float64) loss on the same logits. The kernels they use depend on the
    CPU (vector width, AMX/AVX-512 paths), so they may differ from each other in the last bits, which
    this bound allows; the bugs it guards against do not fit in it (controls below)."""
    ext_or_skip()
    case = make_case(torch.bfloat16, B=2, T=8, V=5000, seed=6)
    exact_loss, exact_grad = reference(case[0].double(), *case[1:])
    loss_atol, grad_rtol, grad_atol = bounds(case[0].float(), *case[1:])
    grad_bound = rounding_to(torch.bfloat16, exact_grad) + grad_rtol * exact_grad.abs() + grad_atol
    for name in ("ext", "torch"):
        monkeypatch.setenv("MEGATRON_RL_OPS_BACKEND", name)
        loss, grad = fused(*case)
        assert abs(loss.double() - exact_loss).item() <= loss_atol, name
        assert ((grad.double() - exact_grad).abs() <= grad_bound).all(), name
    # controls: a log-softmax summed in bf16, and masked tokens counted in the normaliser
    bf16_logp = torch.log_softmax(case[0], -1).gather(-1, case[1].clamp_min(0)[..., None])[..., 0]
    bf16_loss = clipped_token_loss(bf16_logp.double(), *(t.double() for t in case[2:4]), case[4], EPS_LOW, EPS_HIGH)
    assert abs(bf16_loss - exact_loss).item() > 10 * loss_atol
    padded_norm = exact_loss * case[4].sum() / case[4].numel()
    assert abs(padded_norm - exact_loss).item() > 10 * loss_atol


def test_token_logprobs(backend):
    logits, targets, *_ = make_case(torch.float32, seed=7)
    targets = targets.clamp_min(0)
    expected = torch.log_softmax(logits.double(), -1).gather(-1, targets[..., None])[..., 0]
    got = token_logprobs(logits, targets).double()
    assert ((got - expected).abs() <= logprob_error(logits.shape[-1], expected)).all()


def test_all_masked_gives_zero_loss_and_gradient(backend):
    logits, targets, behaviour, adv, mask = make_case(torch.float32, seed=8)
    loss, grad = fused(logits, targets, behaviour, adv, torch.zeros_like(mask))
    assert loss.item() == 0.0 and torch.count_nonzero(grad) == 0


def test_bad_inputs_raise_clear_errors():
    logits, targets, behaviour, adv, mask = make_case(torch.float32, B=2, T=4, V=7)
    with pytest.raises(ValueError, match="logits must be"):
        fused_clipped_loss(logits[0], targets, behaviour, adv, mask)
    with pytest.raises(ValueError, match="targets must be"):
        fused_clipped_loss(logits, targets[:, :3], behaviour, adv, mask)
    with pytest.raises(ValueError, match="advantages must be"):
        fused_clipped_loss(logits, targets, behaviour, adv[:, :2], mask)
    bad = targets.clone()
    bad[mask] = 7
    with pytest.raises(ValueError, match=r"in \[0, 7\)"):
        fused_clipped_loss(logits, bad, behaviour, adv, mask)
    with pytest.raises(TypeError, match="floating point"):
        fused_clipped_loss(logits.long(), targets, behaviour, adv, mask)


def test_missing_extension_warns_once_and_falls_back(monkeypatch):
    monkeypatch.setenv("MEGATRON_RL_OPS_BACKEND", "auto")
    monkeypatch.setattr(_backend, "_state", {"loaded": False, "error": "no compiler", "warned": False})
    case = make_case(torch.float32, B=1, T=8, V=13)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss_a, _ = fused(*case)
        loss_b, _ = fused(*case)
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1 and "no compiler" in msgs[0]
    assert math.isfinite(loss_a.item()) and loss_a.item() == loss_b.item()
    monkeypatch.setenv("MEGATRON_RL_OPS_BACKEND", "ext")
    with pytest.raises(RuntimeError, match="no compiler"):
        fused(*case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocab_padding_columns_are_excluded(backend, dtype):
    """TP vocab padding: columns >= vocab_size leave the softmax and get zero gradient. They hold
    large logits here, so including any of them would change the loss visibly."""
    vocab, pad = 97, 5
    logits, targets, behaviour, adv, mask = make_case(torch.float32, V=vocab, seed=9)
    padded = torch.cat([logits, torch.full(logits.shape[:2] + (pad,), 6.0)], -1).to(dtype)
    ref_loss, ref_grad = reference(padded[..., :vocab].float(), targets, behaviour, adv, mask)
    z = padded.clone().requires_grad_(True)
    loss, logp = fused_clipped_loss(z, targets, behaviour, adv, mask, EPS_LOW, EPS_HIGH, vocab_size=vocab,
                                    return_logprobs=True)
    loss.backward()
    loss_atol, grad_rtol, grad_atol = bounds(padded[..., :vocab].float(), targets, behaviour, adv, mask)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=loss_atol)
    diff = (z.grad[..., :vocab].float() - ref_grad).abs()
    assert (diff <= rounding_to(dtype, ref_grad) * (dtype != torch.float32) + grad_rtol * ref_grad.abs() + grad_atol).all()
    assert torch.count_nonzero(z.grad[..., vocab:]) == 0 and z.grad.dtype == dtype
    exact = torch.log_softmax(padded[..., :vocab].double(), -1).gather(-1, targets.clamp_min(0)[..., None])[..., 0]
    assert not logp.requires_grad and logp.dtype == torch.float32
    bound = logprob_error(vocab, exact)[mask]
    assert ((logp[mask].double() - exact[mask]).abs() <= bound).all()
    logp = token_logprobs(padded, targets.clamp_min(0), vocab_size=vocab)[mask].double()
    assert ((logp - exact[mask]).abs() <= bound).all()


def test_vocab_padding_gradcheck_and_bad_vocab_size():
    logits, targets, behaviour, adv, mask = make_case(torch.float64, B=2, T=6, V=9, seed=10)
    z = torch.cat([logits, torch.randn(2, 6, 3, dtype=torch.float64)], -1).requires_grad_(True)
    fn = lambda x: fused_clipped_loss(x, targets, behaviour.double(), adv.double(), mask,  # noqa: E731
                                      vocab_size=9)
    assert torch.autograd.gradcheck(fn, (z,), eps=1e-6, atol=1e-8)
    with pytest.raises(ValueError, match="vocab_size=13 does not fit"):
        fused_clipped_loss(z, targets, behaviour, adv, mask, vocab_size=13)
    bad = targets.clone()
    bad[mask] = 10  # a padding column is not a token
    with pytest.raises(ValueError, match=r"in \[0, 9\)"):
        fused_clipped_loss(z, bad, behaviour, adv, mask, vocab_size=9)


def test_fused_linear_vocab_padding_rows(backend):
    """The fused-linear loss with zero-initialised padding rows of the output weight (Megatron's TP
    padding) equals the unpadded loss; the padding rows get zero gradient."""
    vocab, pad, hidden = 97, 3, 16
    logits, targets, behaviour, adv, mask = make_case(torch.float32, V=vocab, seed=11)
    g = torch.Generator().manual_seed(12)
    h = torch.randn(*targets.shape, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) / hidden**0.5
    ref_h, ref_w = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    ref_loss = fused_linear_clipped_loss(ref_h, ref_w, targets, behaviour, adv, mask, EPS_LOW, EPS_HIGH)
    ref_loss.backward()
    ph = h.clone().requires_grad_(True)
    pw = torch.cat([w, torch.zeros(pad, hidden)]).requires_grad_(True)
    loss = fused_linear_clipped_loss(ph, pw, targets, behaviour, adv, mask, EPS_LOW, EPS_HIGH,
                                     vocab_size=vocab, chunk_tokens=7)
    loss.backward()
    # the two logits come from float32 matmuls over `hidden` in possibly other orders; the gradients
    # are then sums over the vocabulary (d h) and over the tokens (d w) of the logit gradients
    logits = h @ w.T
    logit_err = 2 * sum_error(hidden) * float((h.abs() @ w.abs().T).max())
    loss_atol, grad_rtol, grad_atol = bounds(logits, targets, behaviour, adv, mask, logit_err)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=loss_atol)
    rtol_h, rtol_w = grad_rtol + sum_error(vocab), grad_rtol + sum_error(targets.numel())
    torch.testing.assert_close(ph.grad, ref_h.grad, rtol=rtol_h, atol=rtol_h * float(w.abs().sum(0).max()) * grad_atol / grad_rtol)
    torch.testing.assert_close(pw.grad[:vocab], ref_w.grad, rtol=rtol_w,
                               atol=rtol_w * float(h.abs().sum((0, 1)).max()) * grad_atol / grad_rtol)
    assert torch.count_nonzero(pw.grad[vocab:]) == 0
