"""Python face of csrc/: the fused token-normalised clipped loss (Magistral's GRPO objective).

- `fused_clipped_loss(logits, targets, behaviour_logprobs, advantages, mask, eps_low, eps_high,
  tp_group=None, *, vocab_size=None, return_logprobs=False, ...)`: from (vocab-parallel, bf16 or fp32)
  logits, without a float32 [tokens, vocab] tensor; `vocab_size` excludes Megatron's TP vocab padding,
  `return_logprobs` also hands back the detached per-token logprobs (for ratio/clip metrics), `kl`
  adds a sequence-level k2 KL term (`SequenceKL`) to the same gradient.
- `fused_linear_clipped_loss(hidden, weight, ...)`: from hidden states and the output weight, in token
  chunks, so the logits never exist in full.
- `token_logprobs(logits, targets, tp_group=None, vocab_size=None)`: the per-token logprobs alone.

Both losses equal `megatron_rl.algo.loss.clipped_token_loss` on the explicit logprobs (value and
gradient). Kernels come from csrc/ (built by setup.py with MEGATRON_RL_BUILD_EXT=1|cuda, else compiled just
in time and cached); without a compiler a PyTorch path is used after a one-time warning, unless
MEGATRON_RL_OPS_BACKEND=strict (or ext) makes that an error (`require_extension` checks it up front).
"""
from ._backend import backend_name, extension_available, extension_error, require_extension
from ._core import SequenceKL
from .fused_linear import fused_linear_clipped_loss
from .fused_loss import fused_clipped_loss, token_logprobs

__all__ = [
    "SequenceKL",
    "backend_name",
    "extension_available",
    "extension_error",
    "fused_clipped_loss",
    "fused_linear_clipped_loss",
    "require_extension",
    "token_logprobs",
]
