"""Lifecycle of one SGLang server process: launch, wait healthy, detect death, restart, shut down.

The server listens on `ServerSpec.host` only: its node's address in a run (control/node.py), 127.0.0.1
by default (one host). It runs in its own session (process group) so shutdown can
kill SGLang's scheduler/detokenizer children with it; its output goes to a log file. On a machine
without CUDA it gets `megatron_rl.platform.sglang_cpu_env()` and `--device cpu`. `--sleep-on-idle`
is always passed (an idle server otherwise busy-polls a core that trainers need) and
`--max-total-tokens` always set (SGLang's default KV cache is sized for a GPU).
"""
from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_rl.platform import has_cuda, move_processes, process_group, sglang_cpu_env
from megatron_rl.rollout.client import SGLangClient

HOST = "127.0.0.1"  # the single-host default
START_ATTEMPTS = 2  # launches of a server that exits during start-up (SGLangServer.start)
# A first start on a cluster reads the whole model from shared storage beside the trainers (48-246 GB
# for the Magistral examples), then captures CUDA graphs and compiles kernels on a cold cache: the
# derived start-up timeout allows the weights at 100 MB/s plus 10 minutes.
STARTUP_BASE_S = 600.0
STARTUP_READ_BYTES_PER_S = 100e6


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy in time; the message quotes its log tail."""

    def __init__(self, msg: str, exited: bool = False):
        super().__init__(msg)
        self.exited = exited  # the process ended during start-up (not a timeout)


SCHEDULER_TITLE = "sglang::scheduler"  # the process title of SGLang's scheduler processes


@dataclass
class ServerSpec:
    model_path: str
    port: int
    max_total_tokens: int = 8192
    log_path: str | None = None  # default: <tmp>/sglang-<port>.log
    initial_version: int = 0  # weight version of the weights on disk
    mem_fraction_static: float | None = None
    startup_timeout_s: float | None = None  # None: derived from the model's size (startup_timeout)
    request_idle_timeout_s: float | None = 3600.0  # longest silence of one /generate stream (None: no limit)
    extra_args: list[str] = field(default_factory=list)
    threads: int | None = None  # OMP_NUM_THREADS for the server process (None: inherit)
    # SGLang's overlap scheduler keeps one forward pass in flight across an in_place pause; its token
    # (computed by the old weights) is then tagged with the new version. Off by default so that
    # per-token versions are exact; turn on for throughput when off-by-one tags are acceptable.
    overlap_schedule: bool = False
    host: str = HOST  # the address to listen on and to be reached at (never a wildcard: see node.py)
    # What the server computes in (float32, bfloat16, float16); None: the checkpoint's own dtype. Always
    # passed as --dtype, because SGLang's default ("auto") serves a float32 checkpoint in float16:
    # logits ~1e-2 off fp32, which the lag-0 mismatch then reports as trainer/generator disagreement.
    dtype: str | None = None
    tp_size: int = 1  # tensor-parallel degree of the server (--tp-size); the weight push group is 1 + tp_size
    gpu_ids: tuple[int, ...] = ()  # its node-local GPUs, consecutive, one per TP rank (--base-gpu-id); () = SGLang's
    # CPU cores: the server starts on `shared_cores` (its three processes import torch and SGLang, then
    # load the weights: ~1 min of one core for a small model), and once healthy its schedulers, which
    # compute, move to `cpu_cores`, while its HTTP front end and detokenizer, which mostly wait, stay.
    # (): the launcher's cores. `run.cpu_placement: split` gives a generator its host's cores as shared
    # ones (at start-up the trainers have nothing to train yet) and its share as cpu_cores.
    shared_cores: tuple[int, ...] = ()
    cpu_cores: tuple[int, ...] = ()

    def __post_init__(self):
        ids = tuple(self.gpu_ids)
        if ids and ids != tuple(range(ids[0], ids[0] + self.tp_size)):
            raise ValueError(f"a server with tp_size {self.tp_size} needs {self.tp_size} consecutive GPU ids, got {ids}")

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(self.model_path),
               "--host", self.host, "--port", str(self.port),
               "--max-total-tokens", str(self.max_total_tokens), "--sleep-on-idle",
               "--weight-version", str(self.initial_version), "--skip-server-warmup",
               "--log-level", "warning"]
        if not has_cuda():
            cmd += ["--device", "cpu"]
        elif self.gpu_ids:
            cmd += ["--base-gpu-id", str(self.gpu_ids[0])]
        if not self.overlap_schedule:
            cmd += ["--disable-overlap-schedule"]
        if not sets_flag(self.extra_args, "--dtype"):
            cmd += ["--dtype", self.dtype or checkpoint_dtype(self.model_path)]
        if self.mem_fraction_static is not None:
            cmd += ["--mem-fraction-static", str(self.mem_fraction_static)]
        if self.tp_size > 1:
            cmd += ["--tp-size", str(self.tp_size)]
        return cmd + list(self.extra_args)


def sets_flag(args, flag: str) -> bool:
    """Whether command-line `args` give `flag`, as `--flag value` or `--flag=value` (the user's choice)."""
    return any(a == flag or a.startswith(flag + "=") for a in args)


def checkpoint_dtype(model_path: str | Path) -> str:
    """The dtype an HF model directory's config.json names (`dtype`, or the older `torch_dtype`);
    float32 when it names none, as SGLang and transformers assume."""
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return "float32"
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or (cfg.get("text_config") or {}).get("dtype") or "float32"
    return str(dtype).removeprefix("torch.")


def model_bytes(model_path: str | Path) -> int:
    """Bytes of the files of an HF model directory (links followed: a cache snapshot's files are links)."""
    return sum(p.stat().st_size for p in Path(model_path).rglob("*") if p.is_file())


def startup_timeout(configured: float | None, model_path: str | Path) -> tuple[float, str]:
    """Seconds a server may take to become healthy, and where that figure comes from (for the error):
    `configured` (generator.startup_timeout_s) when set, else derived from the model's size."""
    if configured is not None:
        return configured, "generator.startup_timeout_s"
    size = model_bytes(model_path)
    return (STARTUP_BASE_S + size / STARTUP_READ_BYTES_PER_S,
            f"derived from the model's {size / 1e9:.1f} GB: {STARTUP_BASE_S:.0f} s + its weights at "
            f"{STARTUP_READ_BYTES_PER_S / 1e6:.0f} MB/s")


def _prepare_child(cores: tuple[int, ...]) -> None:
    """In the server child before exec: die with its owner; on `cores` while it starts, when given."""
    _terminate_with_parent()
    if cores:
        os.sched_setaffinity(0, cores)


def _terminate_with_parent() -> None:
    """In the server child before exec: SIGKILL it if its owner dies (e.g. an MPI rank killed by
    mpiexec), so no server outlives the job. Not SIGTERM: SGLang's launcher catches it and, with its
    scheduler busy, lived on (tests/e2e/test_hard_kill.py); its scheduler and detokenizer die with it
    (SGLang sets their PR_SET_PDEATHSIG to SIGKILL), its resource tracker on the closed pipe."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _log_tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "<no log>"


class SGLangServer:
    """Owns one server process. Not thread-safe: one owner (the Generator) drives it."""

    def __init__(self, spec: ServerSpec):
        if not Path(spec.model_path).exists():
            raise FileNotFoundError(f"model path does not exist: {spec.model_path}")
        self.spec = spec
        host = f"[{spec.host}]" if ":" in spec.host else spec.host
        self.url = f"http://{host}:{spec.port}"
        self.client = SGLangClient(self.url, idle_timeout_s=spec.request_idle_timeout_s)
        self.log_path = Path(spec.log_path or Path(os.environ.get("TMPDIR", "/tmp")) / f"sglang-{spec.port}.log")
        self.proc: subprocess.Popen | None = None
        self.incarnation = 0  # bumps on every (re)start: update groups must be re-created after one
        self.restarts = 0

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> "SGLangServer":
        """Launch and wait until healthy. A server that exits during start-up is launched once more:
        on a loaded machine SGLang's HTTP front end can fail its own start-up (uvicorn's exit code 3),
        and one lost generator would end the whole job; a second exit is reported."""
        if self.alive():
            return self
        if self.client.healthy(timeout=1.0):
            raise ServerStartError(f"port {self.spec.port} already serves another SGLang server")
        for attempt in range(START_ATTEMPTS):
            try:
                return self._launch()
            except ServerStartError as e:
                if not e.exited or attempt + 1 == START_ATTEMPTS:
                    raise
                print(f"SGLang server on port {self.spec.port} exited during start-up; launching it again "
                      f"(log {self.log_path})", file=sys.stderr, flush=True)
        raise AssertionError("unreachable")

    def _launch(self) -> "SGLangServer":
        env = sglang_cpu_env(tp_size=self.spec.tp_size)
        if self.spec.threads is not None:
            env["OMP_NUM_THREADS"] = str(self.spec.threads)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        log.write(f"\n==== launch {' '.join(self.spec.command())}\n".encode())
        log.flush()
        # own session: the whole tree (scheduler, detokenizer) is one process group to kill
        self.proc = subprocess.Popen(self.spec.command(), env=env, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=functools.partial(_prepare_child, self.spec.shared_cores))
        log.close()
        self.incarnation += 1
        try:
            self.wait_healthy(*startup_timeout(self.spec.startup_timeout_s, self.spec.model_path))
            if self.spec.cpu_cores:  # SGLang titles them sglang::scheduler (sglang::scheduler_TP<i> under TP)
                schedulers = process_group(self.proc.pid, SCHEDULER_TITLE)
                if not schedulers:
                    print(f"SGLang server on port {self.spec.port}: no process titled {SCHEDULER_TITLE}; it keeps "
                          f"computing on cores {self.spec.shared_cores or 'of its launcher'}", file=sys.stderr,
                          flush=True)
                move_processes(schedulers, self.spec.cpu_cores)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_healthy(self, timeout_s: float, source: str) -> None:
        """Until /health answers; ServerStartError when the process exits or after `timeout_s` (whose
        origin, `source`, the error names with the setting that changes it)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise ServerStartError(f"SGLang server on port {self.spec.port} exited (code {code}) "
                                       f"during startup; log {self.log_path}:\n{_log_tail(self.log_path)}",
                                       exited=True)
            if self.client.healthy(timeout=2.0):
                return
            time.sleep(0.5)
        raise ServerStartError(f"SGLang server on port {self.spec.port} not healthy after {timeout_s:.0f} s "
                               f"({source}); set generator.startup_timeout_s to wait longer; "
                               f"log {self.log_path}:\n{_log_tail(self.log_path)}")

    def alive(self) -> bool:
        """The process runs (cheap; does not ask the server)."""
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        return self.alive() and self.client.healthy()

    def restart(self) -> None:
        """Kill whatever is left and launch again (fresh weights from `model_path`, empty cache)."""
        self.stop()
        self.restarts += 1
        self.start()

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM the process group, SIGKILL what survives `grace_s`, reap the leader."""
        proc = self.proc  # a local reference: close() and a recovering worker may both stop it
        if proc is None:
            return
        pgid = proc.pid  # session leader: pgid == pid
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            if self._group_gone(pgid, wait):
                break
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        if self.proc is proc:
            self.proc = None

    def _group_gone(self, pgid: int, wait_s: float) -> bool:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.proc is not None:
                self.proc.poll()  # reap the leader so it does not linger as a zombie
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return True
            if self.proc is not None and self.proc.returncode is not None and not _has_live_members(pgid):
                return True
            time.sleep(0.1)
        return False

    def kill_for_test(self) -> None:
        """SIGKILL the whole group without cleanup, as a crash would (used by recovery tests)."""
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGKILL)

    def __enter__(self) -> "SGLangServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _has_live_members(pgid: int) -> bool:
    """Whether any non-zombie process is left in the group (Linux /proc)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False
