"""`cp_attention.prefix_causal_attention` (a CP rank's query chunk over its key prefix, lower-right causal)
equals SDPA with the explicit boolean mask it replaces, in values and q/k/v gradients, and saves no
[queries, keys]-sized tensor for the backward (the float32 mask CPU SDPA made of the boolean one); so
does `window_causal_attention` (sliding window: a query sees `window` keys back) against the window mask.

Reference: float64 `F.scaled_dot_product_attention` with `ones(c, s + c).tril(s)` as the mask. fp32:
rtol 1e-5 / atol 1e-6 (two kernel blocks merged by log-sum-exp vs one softmax). bf16: the error against
the float64 reference may be at most twice that of bf16 SDPA with the mask, plus 1e-3.
The CUDA cases (torch's `causal_lower_right` bias) run only where a GPU is lent. The multi-rank path
(chunks, gathered keys) is checked in tests/multiproc/test_train_context_parallel.py.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_rl.train.cp_attention import prefix_causal_attention

SCALE = 0.37
SHAPES = [  # (query heads, key groups, chunk tokens, prefix tokens)
    (8, 2, 5, 0), (8, 2, 5, 11), (4, 4, 16, 48), (8, 2, 1, 3), (2, 1, 7, 1)]


def _inputs(nq, ng, c, prefix, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    # [s, b, h, hn] permuted to [b, h, s, hn], as SegmentCausalAttention hands them over (not contiguous)
    q, k, v = (torch.randn(n, 1, h, 16, generator=g).to(device, dtype).permute(1, 2, 0, 3).requires_grad_()
               for n, h in ((c, nq), (prefix + c, ng), (prefix + c, ng)))
    return q, k, v, torch.randn(1, nq, c, 16, generator=g).to(device, dtype)


def _masked(q, k, v, grad, prefix):
    mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(prefix)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=SCALE, enable_gqa=q.shape[1] != k.shape[1])
    return (out, *torch.autograd.grad(out, (q, k, v), grad))


@pytest.mark.parametrize("nq,ng,c,prefix", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_prefix_causal_equals_masked_sdpa(nq, ng, c, prefix, dtype, device):
    """CPU: the flash kernel's blocks; CUDA: torch's causal_lower_right bias."""
    q, k, v, grad = _inputs(nq, ng, c, prefix, dtype, seed=c + prefix, device=device)
    out = prefix_causal_attention(q, k, v, SCALE)
    got = (out, *torch.autograd.grad(out, (q, k, v), grad))
    ref = _masked(*(x.detach().double().requires_grad_() for x in (q, k, v)), grad.double(), prefix)
    names = ("out", "dq", "dk", "dv")
    if dtype == torch.float32:
        for name, a, b in zip(names, got, ref):
            torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        return
    same_dtype = _masked(*(x.detach().requires_grad_() for x in (q, k, v)), grad, prefix)
    for name, a, b, r in zip(names, got, same_dtype, ref):
        ours, sdpa = float((a.double() - r).abs().max()), float((b.double() - r).abs().max())
        assert ours <= 2 * sdpa + 1e-3, (name, ours, sdpa)


def test_prefix_causal_saves_no_query_by_key_tensor():
    nq, ng, c, prefix = 8, 2, 64, 192
    q, k, v, grad = _inputs(nq, ng, c, prefix, torch.float32, seed=0)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        out = prefix_causal_attention(q, k, v, SCALE)
    out.backward(grad)
    # the masked SDPA call saves a float [c, prefix + c] mask (64 x 256 = 16384 elements); here the
    # largest saved tensors are q, k, v and the output (4096 elements each)
    scores = c * (prefix + c)
    assert saved and all(torch.Size(s).numel() < scores for s in saved), saved
    assert q.grad is not None and k.grad is not None


WINDOW_CASES = [  # (query heads, key groups, chunk tokens, first position, window)
    (8, 2, 6, 0, 3),     # a whole segment (the non-CP path): head block, then tiles of 3
    (8, 2, 5, 11, 4),    # a late chunk: tiles only, the last one shorter than the window
    (4, 4, 16, 2, 5),    # the head block reaches key 0, then full tiles
    (2, 1, 7, 20, 1),    # window of one key back: tiles of one query
    (8, 2, 9, 4, 30),    # a window larger than every position: one prefix-causal call
]


def _window_masked(q, k, v, grad, first, window):
    t = torch.arange(first, first + q.shape[2])[:, None] - torch.arange(k.shape[2])[None, :]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=(t >= 0) & (t <= window), scale=SCALE,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return (out, *torch.autograd.grad(out, (q, k, v), grad))


@pytest.mark.parametrize("nq,ng,c,first,window", WINDOW_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_causal_equals_masked_sdpa(nq, ng, c, first, window, dtype):
    """`window_causal_attention` (flash blocks: prefix, anticausal edge, unmasked middle, causal diagonal)
    equals SDPA with the explicit sliding-window mask, in values and q/k/v gradients."""
    from megatron_rl.train.cp_attention import window_causal_attention

    q, k, v, grad = _inputs(nq, ng, c, first, dtype, seed=c + first + window)
    out = window_causal_attention(q, k, v, first, window, SCALE)
    got = (out, *torch.autograd.grad(out, (q, k, v), grad))
    ref = _window_masked(*(x.detach().double().requires_grad_() for x in (q, k, v)), grad.double(), first, window)
    names = ("out", "dq", "dk", "dv")
    if dtype == torch.float32:
        for name, a, b in zip(names, got, ref):
            torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        return
    # bf16: each tile's blocks are rounded on their own, so one bf16 step (2^-7 relative) of the tensor's
    # largest value is allowed beyond twice the error of bf16 SDPA with the mask
    same_dtype = _window_masked(*(x.detach().requires_grad_() for x in (q, k, v)), grad, first, window)
    for name, a, b, r in zip(names, got, same_dtype, ref):
        ours, sdpa = float((a.double() - r).abs().max()), float((b.double() - r).abs().max())
        assert ours <= 2 * sdpa + 2 ** -7 * float(r.abs().max()), (name, ours, sdpa)
    # the window hides keys in every case but the last: plain causal attention differs there
    if window < first + c - 1:
        plain = _masked(*(x.detach().double().requires_grad_() for x in (q, k, v)), grad.double(), first)[0]
        assert float((plain - ref[0]).abs().max()) > 1e-3


def test_window_causal_saves_no_query_by_key_tensor():
    nq, ng, c, first, window = 8, 2, 64, 192, 48
    q, k, v, grad = _inputs(nq, ng, c, first, torch.float32, seed=0)
    from megatron_rl.train.cp_attention import window_causal_attention

    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        out = window_causal_attention(q, k, v, first, window, SCALE)
    out.backward(grad)
    # the masked SDPA call saves a float [c, first + c] mask (64 x 256 = 16384 elements); here the largest
    # saved tensors are q, k, v and the output (8192 elements each)
    assert saved and all(torch.Size(s).numel() < c * (first + c) for s in saved), saved
