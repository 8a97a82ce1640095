"""The package as a user installs it: a non-editable wheel in a fresh venv, away from the source tree.

The wheel is built offline from a copy of the sources (`pip wheel --no-deps --no-build-isolation`),
installed with pip into a new venv whose only other packages are the project's .venv ones (a .pth
line: nothing is downloaded), then, from a folder outside the repository: `megatron-rl --help`, and
the csrc/ extension compiled just in time from the sources inside the installed wheel (strict mode:
no silent fallback), its loss checked against log_softmax + the reference loss. About 40 s, most
of it the C++ compile.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = [pytest.mark.long, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("megatron_rl", "csrc", "pyproject.toml", "setup.py", "MANIFEST.in", "README.md")

CHECK = r"""
import json, sys, torch
import megatron_rl
from megatron_rl.algo.loss import clipped_token_loss
from megatron_rl.ops import build, fused_clipped_loss, require_extension
require_extension()
g = torch.Generator().manual_seed(0)
logits = torch.randn(2, 6, 50, generator=g) * 2
targets = torch.randint(0, 50, (2, 6), generator=g)
exact = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
behaviour = exact - 0.3 * torch.rand(2, 6, generator=g)
adv = torch.randn(2, 6, generator=g)
mask = torch.rand(2, 6, generator=g) > 0.2
loss = fused_clipped_loss(logits, targets, behaviour, adv, mask, 0.2, 0.28)
logp = torch.log_softmax(logits.double(), -1).gather(-1, targets[..., None])[..., 0]
ref = clipped_token_loss(logp, behaviour.double(), adv.double(), mask, 0.2, 0.28)
print(json.dumps({"package": megatron_rl.__file__, "csrc": str(build.CSRC), "loss": loss.item(),
                  "ref": ref.item(), "libs": [p.name for p in build.jit_build_dir(False).glob("*.so")]}))
"""


def _run(cmd, cwd, env=None, timeout=300):
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_wheel_installs_and_builds_csrc_outside_the_repo(tmp_path):
    src = tmp_path / "src"
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        else:
            shutil.copy2(path, src / name)
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(src),
          "-w", str(tmp_path / "dist")], cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("megatron_rl-*.whl")

    venv = tmp_path / "venv"
    _run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    py = venv / "bin" / "python"
    fresh_site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                           cwd=tmp_path).strip())
    (fresh_site / "project_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index",
          str(wheel)], cwd=tmp_path)

    work = tmp_path / "elsewhere"
    work.mkdir()
    help_text = _run([str(venv / "bin" / "megatron-rl"), "--help"], cwd=work)
    assert "train" in help_text and "plan" in help_text

    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path),
           "MEGATRON_RL_OPS_BACKEND": "strict", "MEGATRON_RL_EXT_DIR": str(tmp_path / "ext")}
    out = json.loads(_run([str(py), "-c", CHECK], cwd=work, env=env).strip().splitlines()[-1])
    assert Path(out["package"]).is_relative_to(fresh_site)
    assert Path(out["csrc"]) == fresh_site / "megatron_rl" / "ops" / "csrc"
    assert out["libs"], "the JIT build left no library"
    assert out["loss"] == pytest.approx(out["ref"], rel=1e-5, abs=1e-6)
