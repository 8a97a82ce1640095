"""One Adam step compared across parallel layouts: the step's gradient, and the per-element tolerance
it implies (tests/multiproc/test_train_checkpoint_reshard.py, test_train_moe_checkpoint_reshard.py).

Two layouts that start a step from bit-equal weights and optimizer state see gradients that differ
by float32 reduction order; Adam maps that difference to weight differences that are tiny where the
gradient stands above the noise and as large as a sign flip of the update where it does not
(tests/support/tolerances.py).
"""
from __future__ import annotations

import torch

from support.tolerances import adam_step_error, sum_error, unit_roundoff


def step_gradients(trainer, batch) -> tuple[dict[str, torch.Tensor], float]:
    """Run `trainer.train_on(batch)` (one minibatch) and return the step's gradient under HF names
    (before clipping; every rank must hold full gradients: no distributed optimizer at DP > 1) and
    the global grad norm the optimizer clipped with."""
    from megatron_rl.train.hf_weights import export_hf_tensors

    step, captured = trainer.optimizer.step, {}

    def capturing_step():
        captured["grads"] = {n: g.clone() for n, g in export_hf_tensors(trainer.model_chunks, grads=True)}
        ok, norm, zeros = step()
        captured["grad_norm"] = float(norm)
        return ok, norm, zeros

    trainer.optimizer.step = capturing_step
    try:
        trainer.train_on(batch)
    finally:
        trainer.optimizer.step = step
    return captured["grads"], captured["grad_norm"]


def step_tolerance(grads: dict, grad_norm: float, weights: dict, *, lr: float, betas: tuple[float, float],
                   step: int, grad_clip: float, n_terms: int,
                   exp_avg_sq: dict | None = None) -> dict[str, torch.Tensor]:
    """Per element: how far the weight after Adam step `step` at one layout may be from another's.

    Gradient error: sum_error(n_terms) of the sum of |terms| each element adds over tokens and ranks;
    that sum is not recorded, so the tensor's largest |gradient| stands for it (an element that cancels
    to near zero is the one Adam amplifies); an exact zero sums no terms in any layout. Clipping by the
    global norm (off by sum_error over all elements) scales every gradient alike. sqrt(v_hat) after the
    step is at least sqrt((1 - b2) / bc2) |g'| for g' within the error of g, and, with the state before
    the step (`exp_avg_sq`, HF names), sqrt(b2 v / bc2). Plus two float32 roundings of the update.
    """
    b1, b2 = betas
    bc2 = 1 - b2 ** step
    scale = min(1.0, grad_clip / grad_norm)
    numel = sum(g.numel() for g in grads.values())
    tol = {}
    for name, g in grads.items():
        g = g.double() * scale
        err = (sum_error(n_terms) * g.abs().max() + sum_error(numel) * g.abs()) * (g != 0)
        sqrt_v_hat = ((1 - b2) / bc2) ** 0.5 * (g.abs() - err).clamp_min(0)
        if exp_avg_sq is not None:
            sqrt_v_hat = torch.maximum(sqrt_v_hat, (b2 * exp_avg_sq[name].double() / bc2).sqrt())
        tol[name] = (adam_step_error(sqrt_v_hat, err, lr, step, b1, b2)
                     + 2 * unit_roundoff(torch.float32) * weights[name].double().abs())
    return tol


def misses(got: dict, want: dict, tol: dict) -> dict[str, int]:
    """Elements of `got` farther from `want` than their tolerance, per tensor (those with any)."""
    out = {n: int(((got[n].double() - t.double()).abs() > tol[n]).sum()) for n, t in want.items()}
    return {n: k for n, k in out.items() if k}
