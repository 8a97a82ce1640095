"""Pure tensor math of the RL recipe (imports only torch): advantages, loss, KL, pass@k.

- `advantages`: group centring, the non-diverse-group filter, minibatch normalisation.
- `loss`: the token-normalised clipped surrogate (reference for the fused op in `megatron_rl.ops`).
- `kl`: optional KL penalties whose gradient is the true gradient of KL(pi_theta || pi_ref).
- `passk`: unbiased advantage estimator for pass@k / max@k training.
"""
