#!/usr/bin/env bash
# Creates/updates the GPU environment (./dev setup --gpu): Python >= 3.12, the `gpu` extra's pins of
# pyproject.toml (CUDA 13.0 torch, SGLang, Megatron-Core, Transformer Engine, the mpich wheel), then the
# package itself, installed (not editable) with csrc/ compiled for TORCH_CUDA_ARCH_LIST. Strict: a
# failed compile stops here with the compiler's error lines; the check at the end loads the extension
# with MEGATRON_RL_OPS_BACKEND=strict and the MPI library mpi4py takes (srun's plugin for it).
# Idempotent (a stamp of the pins, the sources and the arch list).
#   MEGATRON_RL_GPU_VENV    the venv (default .venv-gpu in the repository)
#   MEGATRON_RL_GPU_PYTHON  interpreter that creates it (default python3.12)
#   TORCH_CUDA_ARCH_LIST    GPU archs of the csrc/ build (default "9.0": H100/H200; e.g. "8.0;9.0")
#   MEGATRON_RL_GPU_TE=0    no Transformer Engine (its torch extension is a source build without a
#                           prebuilt wheel: long); the trainer then uses Megatron's local layer spec.
#                           All or nothing: TE's core without its torch extension breaks
#                           `import megatron.core` (it imports transformer_engine.pytorch then)
#   MEGATRON_RL_GPU_SYSTEM_SITE=1  a new venv sees the interpreter's packages (--system-site-packages):
#                           the Dockerfile reuses its base image's torch and SGLang this way
#   MAX_JOBS                parallel compile jobs (default: all cores)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MEGATRON_RL_GPU_VENV:-$ROOT/.venv-gpu}"
PY="${MEGATRON_RL_GPU_PYTHON:-python3.12}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
WITH_TE="${MEGATRON_RL_GPU_TE:-1}"
STAMP="$VENV/.megatron_rl_gpu_stamp"

log() { printf '[setup --gpu] %s\n' "$*" >&2; }
die() { printf '[setup --gpu] ERROR: %s\n' "$*" >&2; exit 1; }
T0=$(date +%s)
step_done() { log "$1 done: $(( $(date +%s) - T0 )) s so far, venv $(du -sh "$VENV" | cut -f1)"; }

stamp_of() {
  { cat "$ROOT/pyproject.toml" "$ROOT/setup.py" "$0"; echo "$TORCH_CUDA_ARCH_LIST $WITH_TE"
    (cd "$ROOT" && find megatron_rl csrc -type f \( -name '*.py' -o -name '*.cpp' -o -name '*.cu' \
      -o -name '*.h' \) -not -path '*/__pycache__/*' | LC_ALL=C sort | xargs cat); } \
    | sha256sum | cut -d' ' -f1
}
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$(stamp_of)" ]]; then exit 0; fi

if [[ ! -x "$VENV/bin/python" ]]; then
  command -v "$PY" >/dev/null || die "$PY not found: set MEGATRON_RL_GPU_PYTHON to a Python >= 3.12"
  log "creating $VENV with $PY"
  SYSTEM_SITE=(); [[ "${MEGATRON_RL_GPU_SYSTEM_SITE:-0}" == 1 ]] && SYSTEM_SITE=(--system-site-packages)
  "$PY" -m venv "${SYSTEM_SITE[@]}" "$VENV"
fi
VPY="$VENV/bin/python"
"$VPY" -c 'import sys; assert sys.version_info >= (3, 12)' \
  || die "$VENV is not Python >= 3.12 (megatron-core 0.19 needs it): remove it or set MEGATRON_RL_GPU_VENV"
PIP=("$VPY" -m pip install -q --disable-pip-version-check)

# The package's dependencies and gpu extra, split: everything but TE's torch extension (built next,
# against the installed torch), and constraints (no extras) that keep every later install on them.
"$VPY" - "$ROOT/pyproject.toml" "$VENV" "$WITH_TE" <<'PY'
import re, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
pins = project["optional-dependencies"]["gpu"]
if sys.argv[3] != "1":
    pins = [p for p in pins if not p.startswith("transformer-engine")]
def without_te_torch(req):
    m = re.fullmatch(r"(transformer-engine)\[(.*)\](.*)", req)
    if not m:
        return req
    extras = [e for e in m.group(2).split(",") if e.strip() != "pytorch"]
    return f"{m.group(1)}[{','.join(extras)}]{m.group(3)}"
plain = [re.sub(r"\[.*?\]", "", p) for p in pins]
te = [f"transformer-engine-torch=={p.split('==')[1]}" for p in plain if p.startswith("transformer-engine==")]
step1 = project["dependencies"] + [without_te_torch(p) for p in pins]
open(f"{sys.argv[2]}/gpu-pins.txt", "w").write("\n".join(step1) + "\n")
open(f"{sys.argv[2]}/gpu-constraints.txt", "w").write("\n".join(plain + te) + "\n")
PY
CONSTRAINTS="$VENV/gpu-constraints.txt"

log "installing the dependencies and gpu pins ($(grep -c . "$VENV/gpu-pins.txt") requirements)"
"${PIP[@]}" -U pip
"${PIP[@]}" -c "$CONSTRAINTS" "setuptools>=64" wheel ninja -r "$VENV/gpu-pins.txt"
"$VPY" -c 'import torch, sys; sys.exit(0 if torch.version.cuda else f"torch {torch.__version__} has no CUDA")'
step_done "pins"

if [[ "$WITH_TE" != 1 ]]; then
  "$VPY" -m pip uninstall -q -y transformer-engine transformer-engine-cu12 transformer-engine-cu13 \
    transformer-engine-torch 2>/dev/null || true
  # pip leaves TE's empty folders behind; they import as a namespace package, and megatron.core
  # then takes its TE path and fails.
  rm -rf "$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/transformer_engine"
else
  # Built against the torch above (an isolated build would fetch another torch: wrong ABI). TE first
  # looks for a prebuilt wheel on GitHub, else compiles for NVTE_CUDA_ARCHS ("9.0;10.0" -> "90;100").
  log "installing transformer-engine-torch (a source build without a prebuilt wheel: long)"
  # NCCL and some math-library headers are not in every CUDA toolkit (nccl.h, cusparse.h were missing
  # on the machine that checked this); the nvidia-* wheels under torch ship them. Searched after the
  # toolkit's own include folder (CPATH comes after -I).
  NV="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/nvidia"
  NV_INC=$(ls -d "$NV"/*/include 2>/dev/null | paste -sd: - || true)
  NV_LIB=$(ls -d "$NV"/*/lib 2>/dev/null | paste -sd: - || true)
  TE_ARCHS="$(echo "$TORCH_CUDA_ARCH_LIST" | tr -d '.' | sed 's/+PTX//g')"
  CPATH="${CPATH:+$CPATH:}$NV_INC" LIBRARY_PATH="${LIBRARY_PATH:+$LIBRARY_PATH:}$NV_LIB" \
    NVTE_FRAMEWORK=pytorch NVTE_CUDA_ARCHS="$TE_ARCHS" \
    "${PIP[@]}" --no-build-isolation -c "$CONSTRAINTS" transformer-engine-torch
  step_done "transformer-engine-torch"
fi

log "installing megatron_rl with csrc/ compiled for TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST (strict)"
BUILD_LOG="$VENV/megatron_rl-build.log"
# pip builds in the source tree: compiled objects in build/temp.* are reused, but build/lib* would
# carry files deleted from the sources into the wheel.
rm -rf "$ROOT"/build/lib "$ROOT"/build/lib.*
if ! MEGATRON_RL_BUILD_EXT=cuda "$VPY" -m pip install -v --disable-pip-version-check --no-build-isolation \
    --force-reinstall --no-deps "$ROOT" > "$BUILD_LOG" 2>&1; then
  grep -E 'error|Error|ERROR' "$BUILD_LOG" | grep -v 'warning' | head -20 >&2 || true
  die "csrc/ build failed (compiler output above; full log: $BUILD_LOG)"
fi
step_done "megatron_rl + csrc/"

# From outside the repository, so the installed package (not the source tree) is imported.
CHECK_FAILED="the check of the installed stack failed (above)"
(cd "$VENV" && MEGATRON_RL_OPS_BACKEND=strict "$VPY" - "$WITH_TE" <<'PY') || die "$CHECK_FAILED"
import importlib, sys
import torch
mods = ["megatron.core", "sglang"] + (["transformer_engine.pytorch"] if sys.argv[1] == "1" else [])
for m in mods:
    importlib.import_module(m)
import megatron_rl
from megatron_rl.plan.srun import mpi_library, pmi_plugin
from megatron_rl.ops import build, require_extension
require_extension(cuda=True)
library = mpi_library()  # the gpu extra's mpich, unless MPI4PY_LIBMPI names the site's
if library is None:
    sys.exit("mpi4py loads no MPI library: the gpu extra's mpich is missing")
print(f"[setup --gpu] ok: torch {torch.__version__} (CUDA {torch.version.cuda}), {', '.join(mods)} import; "
      f"csrc extension with CUDA kernels loads from {build.prebuilt_library()}; MPI: {library} "
      f"(srun --mpi={pmi_plugin(library)[0]})", file=sys.stderr)
PY
stamp_of > "$STAMP"
log "GPU environment ready in $VENV: $(( $(date +%s) - T0 )) s, $(du -sh "$VENV" | cut -f1)"
