"""Shared pytest setup: markers by folder, GPU skips, the long tier, small offline models, free loopback
ports."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_FOLDER_MARKERS = {"unit": "unit", "multiproc": "multiproc", "e2e": "e2e"}
LONG_SKIP = "long tier (minutes of whole-system run): ./dev test --long, or name its file"


def pytest_addoption(parser):
    parser.addoption("--long", action="store_true", help="also run the tests marked long (the whole tier)")


def named_files(config) -> set[Path]:
    """Test files named on the command line: their long tests run without --long."""
    return {Path(a.split("::")[0]).resolve() for a in config.args if a.split("::")[0].endswith(".py")}


def pytest_collection_modifyitems(config, items):
    import torch

    has_cuda = torch.cuda.is_available()
    run_long = config.getoption("--long") or os.environ.get("MEGATRON_RL_LONG") == "1"
    named = named_files(config)
    for item in items:
        parts = Path(str(item.fspath)).relative_to(ROOT / "tests").parts
        if parts and parts[0] in _FOLDER_MARKERS:
            item.add_marker(getattr(pytest.mark, _FOLDER_MARKERS[parts[0]]))
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device; none on this machine"))
        if "long" in item.keywords and not run_long and Path(str(item.fspath)).resolve() not in named:
            item.add_marker(pytest.mark.skip(reason=LONG_SKIP))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A tiny random Llama (2 layers, hidden 64, GQA) with a byte-level BPE tokenizer, made offline."""
    from support.models import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture
def free_port() -> int:
    from support.net import free_port as _free_port

    return _free_port()


@pytest.fixture(scope="module")
def tp1():
    """Megatron's parallel state for one process (TP=PP=DP=1, gloo), torn down after the module."""
    import torch.distributed as dist

    from megatron_rl.train.parallel import ParallelLayout, destroy_parallel, init_parallel

    created = not dist.is_initialized()
    layout = init_parallel(ParallelLayout(), backend="gloo")
    yield layout
    destroy_parallel(destroy_process_group=created)
