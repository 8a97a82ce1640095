"""`./dev gpu-check`: what a session lent one GPU runs first (docs/cluster.md, "What was and was not run").

    ./dev gpu-check --fetch   here, with network: the megatron-core wheel for Python 3.12 into .whl/
    ./dev gpu-check           on the GPU machine (no network; carry .whl/): every check, one line each

The GPU machine has Python 3.12 with torch, transformers, pytest, triton and psutil, but no network and
no megatron-core: the wheel travels in .whl/ (2.4 MB; the working tree's limit is 64 MiB) and is
installed into a folder of /tmp; the project runs from the source tree. Checks, in order of what a
first GPU run needs most, each in its own process with its own time limit, within BUDGET_S (a cold
machine's start takes 1-2 of the 8 minutes the check is sized for):

    cuda            a CUDA device (otherwise: exit 2 at once, nothing else runs)
    megatron-core   importable, else installed from .whl/
    csrc            the fused-loss extension JIT-built with CUDA kernels (reused by everything after)
    kl-reference    the RL update with the frozen KL reference model on CUDA (+ distributed_optimizer: false)
    te-less         the local spec's torch norms on the GPU; DistributedOptimizer checkpoints with torch Adam
    pytest-gpu      every other `-m gpu` test
    bench-fused-loss, bench-trainer   the two benchmarks, their ratios in the line

Exit status: 0 all passed, 1 a check failed or was skipped for time, 2 no CUDA here. Full output of
every check goes to $OUT/gpu-check.log (the device tool's folder) or /tmp/gpu-check.log.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".whl"
SITE = Path("/tmp/megatron_rl-gpu-check/site")
EXT_DIR = Path("/tmp/megatron_rl-gpu-check/ext")
MCORE = "megatron-core==0.19.2"  # pyproject's gpu extra
BUDGET_S = 360.0  # of the 8 minutes: a cold start and the transfers take the rest
SELF_TESTS = "tests/unit/test_train_gpu_without_te.py"
LOG = Path(os.environ.get("OUT") or "/tmp") / "gpu-check.log"


def fetch() -> int:
    """Download the megatron-core wheel the GPU machine lacks (pip's registry, Python 3.12, x86-64)."""
    WHEELS.mkdir(exist_ok=True)
    platforms = [a for p in ("manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "any")
                 for a in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           "3.12", "--implementation", "cp", *platforms, "-d", str(WHEELS), MCORE]
    done = subprocess.run(cmd)
    wheels = ", ".join(p.name for p in WHEELS.glob("*.whl")) or "none"
    print(f"gpu-check --fetch: {'ok' if done.returncode == 0 else 'FAILED'}: {wheels} in .whl/ "
          "(carry it to the GPU machine)")
    return done.returncode


def cuda_or_exit() -> str:
    """The device's name; exit 2 at once without CUDA (the checks would only skip or fail one by one)."""
    try:
        import torch
    except ImportError as e:
        _no_cuda(f"{sys.executable}: {e}")
    if not torch.cuda.is_available():
        _no_cuda(f"torch {torch.__version__}, CUDA build {torch.version.cuda}")
    return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__} (CUDA {torch.version.cuda})"


def _no_cuda(why: str) -> None:
    print(f"gpu-check: no CUDA device here ({why}): run ./dev gpu-check on a machine lent a GPU", file=sys.stderr)
    sys.exit(2)


def env() -> dict[str, str]:
    """The checks' environment: the installed wheel, the source tree, one JIT cache for csrc/."""
    paths = [str(SITE), str(ROOT), str(ROOT / "tests")] + [p for p in os.environ.get("PYTHONPATH", "").split(":") if p]
    return {**os.environ, "PYTHONPATH": ":".join(paths), "MEGATRON_RL_EXT_DIR": str(EXT_DIR),
            "TORCH_CUDA_ARCH_LIST": os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0"),
            "MAX_JOBS": os.environ.get("MAX_JOBS", str(os.cpu_count() or 8)), "PYTHONUNBUFFERED": "1"}


def run(name: str, cmd: list[str], limit_s: float) -> tuple[bool, str, str]:
    """(passed, elapsed note, output) of one check in its own process, killed after limit_s."""
    t0 = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=limit_s)
        ok, out = done.returncode == 0, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        ok, out = False, f"{_text(e.stdout)}{_text(e.stderr)}\nTIMED OUT after {limit_s:.0f} s"
    with LOG.open("a") as log:
        log.write(f"\n===== {name}: {' '.join(cmd)}\n{out}")
    return ok, f"{time.monotonic() - t0:.0f}s", out


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def pytest_detail(out: str) -> str:
    """pytest's closing counts ('5 passed, 1 skipped in 12.3s'), else the last line."""
    counts = re.findall(r"=+ (.*\d+ (?:passed|failed|errors?|skipped|deselected).*?) =+", out)
    return counts[-1] if counts else _last_line(out)


def fused_loss_detail(out: str) -> str:
    """'fused 12.3 ms (3.10x)' per variant of benchmarks/fused_loss.py, failed ones named."""
    rows = re.findall(r"^(\w+)\s+time\s+([\d.]+) ms\s+speedup vs eager\s+(\S+)", out, re.M)
    failed = re.findall(r"^(\w+)\s+FAILED", out, re.M)
    parts = [f"{name} {ms} ms ({speed})" for name, ms, speed in rows] + [f"{name} FAILED" for name in failed]
    return "; ".join(parts) or _last_line(out)


def trainer_detail(out: str) -> str:
    """benchmarks/trainer.py's tokens/s and its ratio to HF transformers + torch AdamW."""
    found = re.findall(r"megatron_rl trainer :\s+\S+ tok/s|ratio megatron_rl / HF: \S+", out)
    return "; ".join(" ".join(f.split()) for f in found) or _last_line(out)


def _last_line(out: str) -> str:
    return (out.strip().splitlines() or ["no output"])[-1][:160]


def install_megatron() -> list[str]:
    """A command that installs the carried wheel unless megatron-core imports already."""
    wheels = sorted(str(p) for p in WHEELS.glob("megatron_core-*.whl"))
    script = f"""
import importlib, subprocess, sys
try:
    import megatron.core
except ImportError:
    if not sys.argv[1:]:
        sys.exit("no megatron-core here and no .whl/megatron_core-*.whl: run ./dev gpu-check --fetch on a "
                 "machine with network and carry .whl")
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target"]
    if subprocess.call(pip + [{str(SITE)!r}] + sys.argv[1:]):
        sys.exit("pip could not install " + " ".join(sys.argv[1:]))
    sys.path_importer_cache.clear()  # the target folder did not exist when this interpreter started
    importlib.invalidate_caches()
    import megatron.core
print("megatron-core", megatron.core.__version__, "from", megatron.core.__file__)
"""
    return [sys.executable, "-c", script, *wheels]


def pytest_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", *args]


def gpu_test_files() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                  if "mark.gpu" in p.read_text() and str(p.relative_to(ROOT)) != SELF_TESTS)


def trainer_bench() -> list[str]:
    """benchmarks/trainer.py on a random SmolLM2-135M-shaped model made on the spot (no weights travel)."""
    model = "/tmp/megatron_rl-gpu-check/smollm2-shape"
    code = (f"import runpy, sys\nfrom pathlib import Path\nfrom support.train_models import make_tiny_hf\n"
            f"if not Path({model!r}, 'config.json').exists():\n"
            f"    make_tiny_hf(Path({model!r}), 'llama', layers=30, hidden=576, heads=9, kv_heads=3, "
            f"intermediate=1536, vocab=49152, tie=True)\n"
            f"sys.argv = ['benchmarks/trainer.py', '--model', {model!r}, '--precision', 'bf16', '--seqs', '32', "
            f"'--max-len', '1024', '--micro-tokens', '4096', '--steps', '3']\n"
            f"runpy.run_path('benchmarks/trainer.py', run_name='__main__')")
    return [sys.executable, "-c", code]


def megatron_detail(out: str) -> str:
    found = re.findall(r"^megatron-core .*$", out, re.M)
    return found[-1][:160] if found else _last_line(out)


# name, command, time limit (s), detail of the output, skips allowed (this machine's own tests must all run)
CHECKS = [
    ("megatron-core", install_megatron, 60, megatron_detail, False),
    ("csrc", lambda: [sys.executable, "-c", "from megatron_rl.ops import require_extension; "
                      "require_extension(cuda=True); print('extension with CUDA kernels loaded')"], 180,
     _last_line, False),
    ("kl-reference", lambda: pytest_cmd(SELF_TESTS, "-k", "kl_reference"), 90, pytest_detail, False),
    ("te-less", lambda: pytest_cmd(SELF_TESTS, "-k", "not kl_reference"), 90, pytest_detail, False),
    ("pytest-gpu", lambda: pytest_cmd(*gpu_test_files()), 150, pytest_detail, True),  # TE-only, 2-GPU tests
    ("bench-fused-loss", lambda: [sys.executable, "benchmarks/fused_loss.py", "--device", "cuda", "--tokens", "16384",
                                  "--vocab", "65536", "--hidden", "2048", "--reps", "2", "--variants", "eager",
                                  "fused", "fused_inplace", "linear_eager", "linear_fused"], 90,
     fused_loss_detail, False),
    ("bench-trainer", trainer_bench, 90, trainer_detail, False),
]


def passed(ok: bool, note: str, skips_allowed: bool) -> bool:
    """The exit status, and no failed benchmark variant (the benchmark exits 0) nor, where all must
    run, a skipped test."""
    return ok and "FAILED" not in note and (skips_allowed or "skipped" not in note)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="./dev gpu-check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fetch", action="store_true", help="download the wheels the GPU machine lacks into .whl/")
    args = p.parse_args(argv)
    if args.fetch:
        return fetch()
    t0 = time.monotonic()
    print(f"gpu-check  cuda             PASS  {cuda_or_exit()}", flush=True)
    LOG.write_text("")
    failed = 0
    for name, command, limit_s, detail, skips_allowed in CHECKS:
        left = BUDGET_S - (time.monotonic() - t0)
        if left < 20:
            print(f"gpu-check  {name:16s} SKIP  out of the {BUDGET_S:.0f} s budget", flush=True)
            failed += 1
            continue
        ok, took, out = run(name, command(), min(limit_s, left))
        note = detail(out)
        ok = passed(ok, note, skips_allowed)
        failed += not ok
        print(f"gpu-check  {name:16s} {'PASS' if ok else 'FAIL'}  {took:>5s}  {note}", flush=True)
    print(f"gpu-check: {len(CHECKS) + 1 - failed} of {len(CHECKS) + 1} passed in {time.monotonic() - t0:.0f} s; "
          f"full output: {LOG}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
