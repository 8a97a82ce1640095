"""Build hooks of `megatron_rl` (metadata, dependencies and extras live in pyproject.toml).

Two things pyproject.toml cannot say:
- csrc/ sits beside the package, not in it: build_py copies it to megatron_rl/ops/csrc/ so that a
  wheel carries the sources the just-in-time build compiles (megatron_rl/ops/build.py finds them).
- the C++/CUDA loss extension is compiled here only when asked: MEGATRON_RL_BUILD_EXT=1 builds it
  (CUDA kernels too when torch has CUDA and nvcc exists), MEGATRON_RL_BUILD_EXT=cuda requires the
  CUDA kernels (a CPU torch or no nvcc is an error); TORCH_CUDA_ARCH_LIST picks the GPU archs. A
  failed compile fails the install. Otherwise `megatron_rl.ops` compiles it just in time on first use.
  An extension build imports torch, so build with --no-build-isolation in the target environment.
"""
import importlib.util
import os
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
CSRC_SUFFIXES = (".cpp", ".cu", ".h", ".cuh", ".md")


class BuildPyWithCsrc(build_py):
    """Also copies csrc/ into the built package (not for editable installs: they read the repo)."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        target = Path(self.build_lib) / "megatron_rl" / "ops" / "csrc"
        for src in sorted((ROOT / "csrc").rglob("*")):
            if src.is_file() and src.suffix in CSRC_SUFFIXES:
                dst = target / src.relative_to(ROOT / "csrc")
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, dst)


def _extensions():
    """csrc/ build description lives in megatron_rl/ops/build.py (shared with the JIT build); it is
    loaded by path because the package is not importable yet while setup.py runs."""
    mode = os.environ.get("MEGATRON_RL_BUILD_EXT", "").strip().lower()
    if mode in ("", "0"):
        return {}, []
    if mode not in ("1", "cuda"):
        raise SystemExit(f"MEGATRON_RL_BUILD_EXT must be 1 or cuda, got {mode!r}")
    path = ROOT / "megatron_rl" / "ops" / "build.py"
    spec = importlib.util.spec_from_file_location("_megatron_rl_ops_build", path)
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    return build.extension_modules(require_cuda=mode == "cuda")


cmdclass, ext_modules = _extensions()
setup(ext_modules=ext_modules, cmdclass={"build_py": BuildPyWithCsrc, **cmdclass})
