"""Pure tensor math of the RL recipe (imports only torch and the standard library).

- `advantages`: group centring (`group_advantages`), the non-diverse-group filter, minibatch
  normalisation (`normalize`, token- or sequence-weighted), `compute_group_advantages(rewards, cfg)`.
- `loss`: the token-normalised clipped surrogate `clipped_token_loss` (the reference the fused op in
  `megatron_rl.ops` is checked against), per-token terms and clip/ratio statistics.
- `kl`: optional KL whose gradient is the true grad KL(pi_theta || pi_ref) (k2 at the sequence level,
  or KL in the reward); its docstring explains why differentiating k1/k3 estimates is wrong.
- `passk`: unbiased advantage estimator for pass@k / max@k training.
- `correction`: importance-sampling corrections of the trainer/generator mismatch (`ISCorrection`:
  token-level truncated, masked outside a band, sequence-level geometric mean).
- `mismatch`: trainer vs generator logprob statistics by weight-version lag (the `mismatch/...` metrics).

Trainer usage for one optimizer minibatch split into micro-batches and data-parallel ranks:

    adv = normalize(minibatch_adv, minibatch_mask, mode=cfg.adv_norm, weighting=cfg.adv_norm_weighting)
    n_tok = total unmasked tokens of the minibatch, summed over micro-batches AND DP ranks
    for micro in my_micro_batches:
        loss, stats = clipped_token_loss_with_stats(logp, behav, adv_micro, mask_micro,
                                                    cfg.eps_low, cfg.eps_high, normalizer=n_tok)
        loss.backward()      # grads accumulate; then the DP all-reduce must SUM
The summed micro-batch losses / gradients then equal the full-minibatch ones exactly. If the DP
reduction averages instead (Megatron-Core DDP's default scales by 1 / dp_size), multiply each loss by
dp_size, or use Megatron's per-token-loss mode: return the un-normalised sum (normalizer=1.0) with
the token count and let Megatron divide by the global count.
"""
