"""token_logprobs / token_entropy (single rank) vs log_softmax over the full vocab: values and
gradients, chunking, masking of TP vocab padding, input checks. TP>1 runs in the multiproc tests."""
import pytest
import torch

from megatron_rl.train.logprobs import token_entropy, token_logprobs


def _reference(logits, targets):
    logp = torch.log_softmax(logits.double(), -1)
    return logp.gather(-1, targets[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk", [None, 1, 5])
def test_values_and_gradients_match_log_softmax(chunk):
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 7, 50, generator=g)).requires_grad_()
    targets = torch.randint(0, 50, (3, 7), generator=g)
    w_lp, w_ent = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)
    lp, ent = token_logprobs(logits, targets, chunk_tokens=chunk, with_entropy=True)
    ref_lp, ref_ent = _reference(logits, targets)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=0)
    (grad,) = torch.autograd.grad((lp * w_lp).sum() + (ent * w_ent).sum(), logits)
    (ref_grad,) = torch.autograd.grad((ref_lp * w_lp).sum() + (ref_ent * w_ent).sum(), logits)
    torch.testing.assert_close(grad, ref_grad.float(), atol=1e-5, rtol=0)


def test_logprobs_only_gradient_and_bf16_logits():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 30, generator=g).bfloat16().requires_grad_()
    targets = torch.randint(0, 30, (4,), generator=g)
    lp = token_logprobs(logits, targets)
    ref, _ = _reference(logits.float(), targets)
    torch.testing.assert_close(lp.double(), ref, atol=1e-5, rtol=0)
    lp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    expected = torch.nn.functional.one_hot(targets, 30) - torch.softmax(logits.float(), -1)
    torch.testing.assert_close(logits.grad.float(), expected, atol=1e-2, rtol=0)


def test_padded_vocab_columns_are_ignored():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 23, generator=g).requires_grad_()
    padded = torch.cat([logits, torch.full((5, 3), 50.0)], dim=-1)  # TP padding columns (huge on purpose)
    targets = torch.randint(0, 23, (5,), generator=g)
    lp, ent = token_logprobs(padded, targets, vocab_size=23, with_entropy=True)
    ref_lp, ref_ent = _reference(logits, targets)
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(token_entropy(padded, vocab_size=23).double(), ref_ent, atol=1e-5, rtol=0)
    lp.sum().backward()
    assert logits.grad is not None


def test_bad_inputs_fail_clearly():
    logits = torch.randn(2, 4, 10)
    with pytest.raises(ValueError, match="disagree"):
        token_logprobs(logits, torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="lie in"):
        token_logprobs(logits, torch.full((2, 4), 10))
    with pytest.raises(ValueError, match="lie in"):
        token_logprobs(logits, torch.full((2, 4), 8), vocab_size=8)
    with pytest.raises(TypeError, match="integer"):
        token_logprobs(logits, torch.zeros(2, 4))
