"""Build description of the csrc/ fused-loss extension: sources, flags, setup.py and JIT builds.

Standalone on purpose (no package-relative imports, torch imported lazily): setup.py loads this file
by path before the package is installed. The extension is a plain shared library that registers
`torch.ops.megatron_rl_ops.*` with the dispatcher (TORCH_LIBRARY, no pybind11), which keeps the C++
compile short: only ATen core headers, one CPU translation unit plus the schema file.
"""
from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
# A wheel carries the sources next to this file (setup.py's build_py copies csrc/ there); a source
# checkout or an editable install reads them from the repository.
_PACKAGED_CSRC = Path(__file__).resolve().parent / "csrc"
CSRC = _PACKAGED_CSRC if _PACKAGED_CSRC.is_dir() else REPO_ROOT / "csrc"
EXT_NAME = "megatron_rl_ops"  # the TORCH_LIBRARY namespace too
PREBUILT_STEM = "_fused_loss_ext"  # file name (before the ABI suffix) of a setup.py build

CPU_SOURCES = ("ops_schema.cpp", "cpu/fused_loss_cpu.cpp")
CUDA_SOURCES = ("cuda/fused_loss_cuda.cpp", "cuda/fused_loss_kernels.cu")
CUDA_KERNEL_SOURCE = "cuda/fused_loss_kernels.cu"  # compiles with bare nvcc, no torch headers

CXX_FLAGS = ["-O3", "-fopenmp"]  # at::parallel_for expands to `omp parallel` in the header
LD_FLAGS = ["-fopenmp"]
NVCC_FLAGS = ["-O3", "-lineinfo", "--expt-relaxed-constexpr"]


def cuda_build_possible() -> bool:
    """A CUDA build needs a CUDA-enabled torch and nvcc (CUDA_HOME)."""
    return cuda_build_blocker() is None


def jit_with_cuda() -> bool:
    """The JIT build includes the CUDA sources only where they can be built and used."""
    import torch

    return cuda_build_possible() and torch.cuda.is_available()


def sources(with_cuda: bool) -> list[str]:
    names = CPU_SOURCES + (CUDA_SOURCES if with_cuda else ())
    return [str(CSRC / n) for n in names]


def cxx_defines(with_cuda: bool) -> list[str]:
    return ["-DMEGATRON_RL_WITH_CUDA"] if with_cuda else []


def cuda_build_blocker() -> str | None:
    """Why a CUDA build cannot happen here (None when it can)."""
    import torch
    from torch.utils import cpp_extension

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build (install the CUDA torch of the gpu extra)"
    if cpp_extension.CUDA_HOME is None:
        return "nvcc not found (set CUDA_HOME or put nvcc on PATH)"
    return None


def extension_modules(require_cuda: bool = False):
    """(cmdclass, ext_modules) for setup.py: CUDAExtension when possible, else CppExtension;
    require_cuda (MEGATRON_RL_BUILD_EXT=cuda) makes a missing CUDA toolchain an error instead."""
    from torch.utils import cpp_extension

    blocker = cuda_build_blocker()
    if require_cuda and blocker is not None:
        raise RuntimeError(f"MEGATRON_RL_BUILD_EXT=cuda: cannot build the CUDA kernels: {blocker}")
    with_cuda = blocker is None
    rel = [os.path.relpath(s, REPO_ROOT) for s in sources(with_cuda)]
    cls = cpp_extension.CUDAExtension if with_cuda else cpp_extension.CppExtension
    extra = {"cxx": CXX_FLAGS + cxx_defines(with_cuda)}
    if with_cuda:
        extra["nvcc"] = list(NVCC_FLAGS)
    ext = cls(
        name=f"megatron_rl.ops.{PREBUILT_STEM}",
        sources=rel,
        extra_compile_args=extra,
        extra_link_args=list(LD_FLAGS),
        py_limited_api=False,
    )
    build_ext = cpp_extension.BuildExtension.with_options(no_python_abi_suffix=False)
    return {"build_ext": build_ext}, [ext]


def prebuilt_library() -> Path | None:
    """The shared library a MEGATRON_RL_BUILD_EXT install left next to this file, if any; only one
    built for this interpreter (a source tree may be shared by venvs of several Pythons)."""
    import importlib.machinery

    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        if (here / f"{PREBUILT_STEM}{suffix}").is_file():
            return here / f"{PREBUILT_STEM}{suffix}"
    return None


def jit_build_dir(with_cuda: bool) -> Path:
    """Cache folder of the JIT build: $MEGATRON_RL_EXT_DIR or ~/.cache/megatron_rl/ext, one subfolder
    per torch version and device flavour, so CI compiles once and reuses it for the whole run."""
    import torch

    base = os.environ.get("MEGATRON_RL_EXT_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "megatron_rl", "ext"
    )
    flavour = "cuda" if with_cuda else "cpu"
    path = Path(base) / f"torch{torch.__version__.replace('+', '_')}_{flavour}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def jit_load(verbose: bool = False) -> str:
    """Compile (once; ninja reuses the cached objects) and load the extension; returns the build dir."""
    from torch.utils import cpp_extension

    missing = [s for s in sources(False) if not os.path.exists(s)]
    if missing:
        raise FileNotFoundError(f"csrc sources not found under {CSRC} (wheel built without them?): {missing}")
    with_cuda = jit_with_cuda()
    build_dir = jit_build_dir(with_cuda)
    os.environ.setdefault("MAX_JOBS", "2")
    cpp_extension.load(
        name=f"{EXT_NAME}_{'cuda' if with_cuda else 'cpu'}",
        sources=sources(with_cuda),
        # Fresh lists: torch appends its own flags to them in place, and a changed list on a second
        # call would look like new build arguments (a second library registering the same ops).
        extra_cflags=CXX_FLAGS + cxx_defines(with_cuda),
        extra_cuda_cflags=list(NVCC_FLAGS) if with_cuda else None,
        extra_ldflags=list(LD_FLAGS),
        build_directory=str(build_dir),
        with_cuda=with_cuda,
        is_python_module=False,
        verbose=verbose,
    )
    return str(build_dir)
