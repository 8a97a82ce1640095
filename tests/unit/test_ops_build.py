"""Build of csrc/: setup.py description, cached JIT build, and compile-only checks of the CUDA sources
(this machine has nvcc but no GPU and a CPU-only torch)."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from megatron_rl.ops import _backend, build


def _load_build_by_path():
    """Exactly how setup.py loads the description (the package is not importable at that point)."""
    spec = importlib.util.spec_from_file_location("_build_by_path", build.__file__)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_setup_extension_description():
    mod = _load_build_by_path()
    cmdclass, exts = mod.extension_modules()
    assert "build_ext" in cmdclass and len(exts) == 1
    ext = exts[0]
    assert ext.name == "megatron_rl.ops._fused_loss_ext"
    for src in ext.sources:
        assert (build.REPO_ROOT / src).is_file(), src
    expect_cuda = mod.cuda_build_possible()
    assert any(s.endswith(".cu") for s in ext.sources) == expect_cuda


def test_jit_build_is_cached():
    if not _backend.extension_available():
        pytest.skip(f"csrc extension unavailable: {_backend.extension_error()}")
    out = Path(build.jit_build_dir(with_cuda=build.jit_with_cuda()))
    libs = list(out.glob("*.so"))
    assert libs, f"no library in {out}"
    before = {p: p.stat().st_mtime_ns for p in libs}
    build.jit_load()  # sources unchanged: ninja must not relink
    assert {p: p.stat().st_mtime_ns for p in libs} == before
    assert torch._C._dispatch_has_kernel_for_dispatch_key("megatron_rl_ops::lse_stats", "CPU")


def _nvcc():
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found: CUDA sources not compile-checked on this machine")
    return nvcc


def test_cuda_kernels_compile_with_nvcc(tmp_path):
    nvcc = _nvcc()
    src = build.CSRC / build.CUDA_KERNEL_SOURCE
    cmd = [nvcc, "-c", "-std=c++17", "-O3", "-arch=sm_80", str(src), "-o", str(tmp_path / "k.o")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "k.o").stat().st_size > 0


def test_cuda_binding_type_checks(tmp_path):
    """The ATen binding of the CUDA kernels, type-checked against this torch's headers.

    The CPU wheel ships c10/cuda headers but not their generated cmake-macros header: an empty stand-in
    is enough for a syntax/type check (no object code is produced or used)."""
    nvcc = _nvcc()
    cxx = shutil.which(os.environ.get("CXX", "c++"))
    if cxx is None:
        pytest.skip("no C++ compiler")
    from torch.utils import cpp_extension

    cuda_include = Path(nvcc).resolve().parent.parent / "include"
    if not (cuda_include / "cuda_runtime_api.h").exists():
        cuda_include = Path("/usr/local/cuda/include")
    stub = tmp_path / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    incs = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{cuda_include}", f"-I{tmp_path}"]
    src = build.CSRC / "cuda" / "fused_loss_cuda.cpp"
    proc = subprocess.run([cxx, "-std=c++20", "-fsyntax-only", *incs, str(src)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
