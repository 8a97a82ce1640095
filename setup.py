"""Package `megatron_rl`: asynchronous RLVR (Magistral's GRPO variant) on Megatron-Core + SGLang.

The C++/CUDA loss extension in csrc/ is built here only when MEGATRON_RL_BUILD_EXT=1 (a compiler and
the build time are then required); otherwise `megatron_rl.ops` compiles it just in time on first use
and falls back to the PyTorch reference when no compiler exists.
"""
import os

from setuptools import find_packages, setup


def _extensions():
    if os.environ.get("MEGATRON_RL_BUILD_EXT") != "1":
        return {}, []
    from megatron_rl_build import extension_modules  # noqa: F401  (csrc/ build description)

    return extension_modules()


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
