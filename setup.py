"""Package `megatron_rl`: asynchronous RLVR (Magistral's GRPO variant) on Megatron-Core + SGLang.

The C++/CUDA loss extension in csrc/ is built here only when MEGATRON_RL_BUILD_EXT=1 (a compiler and
the build time are then required); otherwise `megatron_rl.ops` compiles it just in time on first use
and falls back to the PyTorch reference when no compiler exists.
"""
import os

from setuptools import find_packages, setup


def _extensions():
    """csrc/ build description lives in megatron_rl/ops/build.py (shared with the JIT build); it is
    loaded by path because the package is not importable yet while setup.py runs."""
    if os.environ.get("MEGATRON_RL_BUILD_EXT") != "1":
        return {}, []
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_rl", "ops", "build.py")
    spec = importlib.util.spec_from_file_location("_megatron_rl_ops_build", path)
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    return build.extension_modules()


cmdclass, ext_modules = _extensions()

setup(
    name="megatron_rl",
    version="0.1.0",
    description="Asynchronous RL with verifiable rewards on Megatron-Core and SGLang (Magistral recipe)",
    packages=find_packages(include=["megatron_rl", "megatron_rl.*"]),
    python_requires=">=3.10",
    package_data={"megatron_rl": ["platform/sgl_kernel_stub/sgl_kernel/*.py"]},
    entry_points={"console_scripts": ["megatron-rl=megatron_rl.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
