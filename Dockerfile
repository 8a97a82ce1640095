# GPU image of megatron_rl: SGLang + torch (CUDA 13.0) from the base image, Megatron-Core and
# Transformer Engine on top, csrc/ compiled for TORCH_CUDA_ARCH_LIST in strict mode.
#   docker build -t megatron_rl:gpu --build-arg TORCH_CUDA_ARCH_LIST="9.0" .
# NOT BUILT by the project: its machines have no docker and no registry access (docs/cluster.md).
#
# Base image: lmsysorg/sglang (SGLang's own image), not NGC PyTorch. SGLang is the hardest pin:
# sglang 0.5.23 requires torch==2.14.1, and its binary kernels (sglang-kernel, flashinfer) are built
# against that exact torch. The NGC container ships NVIDIA's own torch build (2.x.0a0+nv...), which
# does not satisfy torch==2.14.1, so pip would replace it and leave the image's TE/apex built
# against a torch that is gone. SGLang's image already holds the torch, CUDA toolkit (nvcc) and
# kernels the gpu extra pins; only Megatron-Core and Transformer Engine are added (TE's torch
# extension is compiled against the image's torch, which takes a while without a prebuilt wheel).
# The tag is the one SGLang publishes for 0.5.23 on CUDA 13 (not checked here); the first RUN
# stops the build if the image's versions are not the gpu extra's.
ARG BASE_IMAGE=lmsysorg/sglang:v0.5.23-cu130
FROM ${BASE_IMAGE}

ARG TORCH_CUDA_ARCH_LIST="9.0"
ARG MAX_JOBS=8
ENV TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST} \
    MAX_JOBS=${MAX_JOBS} \
    MEGATRON_RL_OPS_BACKEND=strict \
    PIP_ROOT_USER_ACTION=ignore

RUN python3 - <<'PY'
import sys, torch, sglang
want = {"torch": "2.14.1", "sglang": "0.5.23"}
have = {"torch": torch.__version__.split("+")[0], "sglang": sglang.__version__}
bad = [f"{k} {have[k]} (gpu extra: {v})" for k, v in want.items() if have[k] != v]
if bad or sys.version_info < (3, 12) or not torch.version.cuda:
    sys.exit(f"base image does not match pyproject's gpu extra: {bad}, Python {sys.version.split()[0]}, "
             f"CUDA {torch.version.cuda}; pass --build-arg BASE_IMAGE=<an SGLang 0.5.23 CUDA 13 image>")
PY

COPY . /opt/megatron_rl/src
# The same install path as ./dev setup --gpu, in a venv that sees the image's packages (nothing the
# image already has at the pinned version is installed again); a failed csrc/ compile fails the build.
RUN MEGATRON_RL_GPU_VENV=/opt/megatron_rl/venv MEGATRON_RL_GPU_PYTHON=python3 MEGATRON_RL_GPU_SYSTEM_SITE=1 \
        /opt/megatron_rl/src/dev setup --gpu \
    && rm -rf /root/.cache/pip

# The gpu extra's mpich: its mpiexec serves single-node runs, srun --mpi=pmi2 multi-node ones (or the
# cluster's MPI through MPI4PY_LIBMPI; docs/cluster.md).
ENV PATH=/opt/megatron_rl/venv/bin:${PATH}
WORKDIR /workspace
CMD ["megatron-rl", "--help"]
