"""CUDA kernels of the fused loss against the float64 reference (runs only where a GPU is present)."""
from __future__ import annotations

import pytest
import torch

from megatron_rl.algo.loss import clipped_token_loss
from megatron_rl.ops import _backend, fused_clipped_loss, fused_linear_clipped_loss

EPS_LOW, EPS_HIGH = 0.2, 0.28
pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def cuda_kernels(monkeypatch):
    monkeypatch.setenv("MEGATRON_RL_OPS_BACKEND", "ext")
    if not _backend.extension_available():
        pytest.fail(f"extension failed to build on a CUDA machine: {_backend.extension_error()}")
    assert _backend.backend_name(torch.zeros(1, 8, device="cuda")) == "ext", "CUDA kernels not registered"


def make_case(dtype, B, T, V, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, T, V, generator=g) * 3).to(dtype)
    targets = torch.randint(0, V, (B, T), generator=g)
    exact = torch.log_softmax(logits.double(), -1).gather(-1, targets[..., None])[..., 0]
    ratio = 0.4 + 1.4 * torch.rand(B, T, generator=g, dtype=torch.float64)
    behaviour = (exact - ratio.log()).float()
    adv = torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.2
    return logits, targets, behaviour, adv, mask


def reference(logits, targets, behaviour, adv, mask):
    z = logits.double().requires_grad_(True)
    logp = torch.log_softmax(z, -1).gather(-1, targets[..., None])[..., 0]
    loss = clipped_token_loss(logp, behaviour.double(), adv.double(), mask, EPS_LOW, EPS_HIGH)
    loss.backward()
    return loss.detach(), z.grad


@pytest.mark.parametrize("V", [4096, 1001])  # vector loads / scalar tail path
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inplace", [False, True])
def test_cuda_matches_reference(dtype, V, inplace):
    case = make_case(dtype, 3, 37, V)
    ref_loss, ref_grad = reference(*case)
    logits, *rest = [x.cuda() for x in case]
    leaf = logits.clone().requires_grad_(True)
    loss = fused_clipped_loss(leaf * 1, *rest, EPS_LOW, EPS_HIGH, inplace_backward=inplace)
    loss.backward()
    tol = 1e-5 if dtype == torch.float32 else (8e-3 if dtype == torch.bfloat16 else 1e-3)
    torch.testing.assert_close(loss.double().cpu(), ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(leaf.grad.double().cpu(), ref_grad, rtol=tol,
                               atol=tol * ref_grad.abs().max().item())


def test_cuda_fused_linear_matches_unfused():
    g = torch.Generator().manual_seed(1)
    B, T, H, V = 2, 300, 64, 2048
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) / H**0.5 * 3
    logits = hidden @ weight.t()
    _, targets, behaviour, adv, mask = make_case(torch.float32, B, T, V, seed=2)
    h = hidden.cuda().requires_grad_(True)
    w = weight.cuda().requires_grad_(True)
    loss = fused_linear_clipped_loss(h, w, targets.cuda(), behaviour.cuda(), adv.cuda(), mask.cuda(),
                                     EPS_LOW, EPS_HIGH, chunk_tokens=128)
    loss.backward()
    ref_loss, ref_grad = reference(logits, targets, behaviour, adv, mask)
    torch.testing.assert_close(loss.double().cpu(), ref_loss, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(h.grad.double().cpu(), (ref_grad @ weight.double()), rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(w.grad.double().cpu(), (ref_grad.reshape(-1, V).t() @ hidden.double().reshape(-1, H)),
                               rtol=1e-3, atol=1e-5)
