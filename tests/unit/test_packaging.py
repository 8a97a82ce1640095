"""pyproject.toml's pins agree with what env/bootstrap.sh really installs (the CPU route) and with each
other (SGLang and Megatron-Core are the same versions on CPU and GPU), so the extras cannot drift."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS = PROJECT["optional-dependencies"]
PIN = re.compile(r"^([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([^\s;]+)\s*(?:;\s*(.*))?$")


def _pins(lines) -> dict[tuple[str, str], str]:
    """(normalised name, environment marker) -> pinned version, for every `name==version` line."""
    out = {}
    for line in lines:
        m = PIN.match(line.split("#")[0].strip())
        if m:
            marker = (m.group(3) or "").replace('"', "'").replace(" ", "")
            out[(m.group(1).lower().replace("_", "-"), marker)] = m.group(2)
    return out


def _file_pins(name: str) -> dict[tuple[str, str], str]:
    return _pins((ROOT / "env" / name).read_text().splitlines())


def _bootstrap_pins() -> dict[tuple[str, str], str]:
    """The pins bootstrap.sh passes to pip on its own command lines (torch first, the --no-deps set)."""
    words = re.findall(r"\b([A-Za-z0-9_.-]+==[0-9][^\s\"]*)", (ROOT / "env" / "bootstrap.sh").read_text())
    return _pins(words)


def test_cpu_extra_matches_the_bootstrap_pins():
    installed = {**_file_pins("requirements-top.txt"), **_file_pins("constraints.txt"), **_bootstrap_pins()}
    for key, version in _pins(EXTRAS["cpu"]).items():
        assert installed.get(key) == version, f"cpu extra {key[0]}=={version}, bootstrap: {installed.get(key)}"


def test_dependencies_match_the_cpu_lock_where_pinned():
    top = _file_pins("requirements-top.txt")
    for key, version in _pins(PROJECT["dependencies"]).items():
        assert top.get(key) == version, f"dependency {key[0]}=={version}, requirements-top: {top.get(key)}"


def test_gpu_extra_runs_the_same_sglang_and_megatron_as_the_cpu_route():
    gpu = {name: v for (name, _), v in _pins(EXTRAS["gpu"]).items()}
    assert gpu["sglang"] == _bootstrap_pins()[("sglang", "")]
    top = _file_pins("requirements-top.txt")
    assert gpu["megatron-core"] == top[("megatron-core", "python_version>='3.12'")]
    assert gpu["torch"] != _bootstrap_pins()[("torch", "")], "gpu torch must be SGLang's CUDA pin, not the CPU one"


def test_gpu_extra_brings_the_mpi_of_the_cpu_route():
    """mpi4py's wheels load an MPI library at run time: without the mpich wheel a single-node run from
    .venv-gpu stopped until a manual install (issue 31 item 4)."""
    cpu = {name: v for (name, _), v in _pins(EXTRAS["cpu"]).items()}
    gpu = {name: v for (name, _), v in _pins(EXTRAS["gpu"]).items()}
    assert gpu["mpich"] == cpu["mpich"]
    assert "mpi_library()" in (ROOT / "env" / "bootstrap_gpu.sh").read_text()  # its final check loads it


def test_wheel_ships_the_csrc_sources_the_jit_build_needs():
    from megatron_rl.ops import build

    suffixes = {p.suffix for p in (ROOT / "csrc").rglob("*") if p.is_file()}
    copied = re.search(r"CSRC_SUFFIXES = \(([^)]*)\)", (ROOT / "setup.py").read_text()).group(1)
    assert suffixes <= set(re.findall(r'"(\.[a-z]+)"', copied)), "setup.py's build_py would drop a csrc/ file"
    for src in build.CPU_SOURCES + build.CUDA_SOURCES:
        assert (ROOT / "csrc" / src).is_file(), src
