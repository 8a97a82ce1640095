"""Fixtures shared by the unit tests."""
from __future__ import annotations

import pytest


@pytest.fixture(params=["ext", "torch"])
def backend(request, monkeypatch):
    """Each loss-op test once through the csrc extension and once through the PyTorch reference."""
    from megatron_rl.ops import _backend

    monkeypatch.setenv("MEGATRON_RL_OPS_BACKEND", request.param)
    if request.param == "ext" and not _backend.extension_available():
        pytest.skip(f"csrc extension unavailable: {_backend.extension_error()}")
    return request.param
