"""MEGATRON_RL_OPS_BACKEND=strict: an extension that cannot be built or loaded is an error naming the
cause, never the silent PyTorch fallback that `auto` takes. The failures are real builds: a compiler
that does not exist, and a build folder that cannot be created (a file in its path; chmod would not
stop root)."""
from __future__ import annotations

import warnings

import pytest
import torch

from megatron_rl.algo.loss import clipped_token_loss
from megatron_rl.ops import _backend, build, fused_clipped_loss, require_extension


@pytest.fixture
def fresh_backend(monkeypatch):
    """A backend that has not tried to load yet, and no prebuilt library, so the JIT build runs."""
    monkeypatch.setattr(_backend, "_state", {"loaded": None, "error": None, "warned": False})
    monkeypatch.setattr(build, "prebuilt_library", lambda: None)


def _case():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 4, 11, generator=g)
    targets = torch.randint(0, 11, (1, 4), generator=g)
    logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    return logits, targets, logp, torch.ones(1, 4), torch.ones(1, 4, dtype=torch.bool)


def test_strict_raises_when_the_compiler_is_missing(fresh_backend, monkeypatch, tmp_path):
    monkeypatch.setenv("MEGATRON_RL_OPS_BACKEND", "strict")
    monkeypatch.setenv("MEGATRON_RL_EXT_DIR", str(tmp_path))  # empty: nothing cached, must compile
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    with pytest.raises(RuntimeError, match=r"strict: the csrc extension failed to build or load") as err:
        fused_clipped_loss(*_case(), 0.2, 0.28)
    assert "no-such-c++" in str(err.value)  # the build's own error, not a generic message


def test_strict_raises_when_the_build_dir_cannot_be_made(fresh_backend, monkeypatch, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("MEGATRON_RL_OPS_BACKEND", "strict")
    monkeypatch.setenv("MEGATRON_RL_EXT_DIR", str(blocker / "ext"))
    with pytest.raises(RuntimeError, match=r"strict: .*(NotADirectory|FileExists)Error"):
        require_extension()


def test_auto_falls_back_with_a_warning_where_strict_raises(fresh_backend, monkeypatch, tmp_path):
    monkeypatch.setenv("MEGATRON_RL_OPS_BACKEND", "auto")
    monkeypatch.setenv("MEGATRON_RL_EXT_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    logits, targets, behaviour, adv, mask = _case()
    shifted = behaviour - 0.1  # ratios of 1.105: inside the clip range, so the loss depends on logits
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = fused_clipped_loss(logits, targets, shifted, adv, mask, 0.2, 0.28)
    assert any("no-such-c++" in str(w.message) for w in caught)
    reference = clipped_token_loss(behaviour, shifted, adv, mask, 0.2, 0.28)
    torch.testing.assert_close(loss, reference, rtol=1e-6, atol=1e-7)


def test_unknown_mode_names_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv("MEGATRON_RL_OPS_BACKEND", "strictest")
    with pytest.raises(ValueError, match=r"MEGATRON_RL_OPS_BACKEND must be one of auto, ext, strict, torch"):
        _backend.extension_available()
