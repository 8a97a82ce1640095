"""The bubblewrap jail that runs untrusted programs for the code verifier.

One call = one fresh sandbox::

    bwrap --unshare-all --unshare-user --disable-userns --die-with-parent --new-session
          --uid 65534 --gid 65534   (inside; outside it is an unprivileged per-runner uid)
          read-only: /usr (+ /bin, /lib* links), the interpreter prefix, optionally /box
          private: tmpfs / (then read-only), tmpfs /tmp (size-capped), /proc, /dev (read-only)
          --clearenv, minimal PATH, no network (empty net namespace: not even host loopback)

Around it: rlimits (CPU, AS, NPROC, FSIZE, NOFILE, STACK, CORE=0) set in the child before exec,
stdout/stderr read with a byte cap, a wall-clock deadline after which the outer bwrap's process group
and the namespace init are SIGKILLed (the kernel then kills every process of the PID namespace, so
daemonised children die too), and reaping of the namespace init through a child-subreaper. RLIMIT_AS
bounds each process, not their sum (a program that forks could hold NPROC x AS of the host's memory):
every sandbox_proc.WATCH_S s the resident anonymous memory of all its processes is summed
(``namespace_memory``) and a sandbox over ``rlimits.memory_mb`` is killed (``memory_exceeded``).
Memory that no process maps is refused outright by a seccomp filter (``SECCOMP_REFUSED``: SysV shared
memory and message queues, memfd_create; x86_64 and aarch64).

When the runner is root it drops to the unprivileged uid before exec'ing bwrap: root's processes are
exempt from RLIMIT_NPROC, and an unprivileged bwrap must build a real user namespace. Paths such
a uid cannot reach (the pyenv interpreter under /root, which is 0700) are made reachable in a
private mount namespace where /root is an empty tmpfs holding only that prefix (sandbox_proc).
If bwrap is missing or namespaces are refused, ``available()`` says why and nothing runs.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import platform
import shutil
import struct
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from megatron_rl.reward.sandbox_proc import (
    NamespaceInit, RLimits, become_subreaper, collect, hide_plan, make_preexec, namespace_memory,
)

SANDBOX_UID = 65534  # uid/gid the program sees (nobody)
BOX = "/box"  # where the per-call workspace is mounted inside the sandbox
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"


# Refused (EPERM) by a seccomp filter: memory that neither RLIMIT_AS nor the sum of resident memory sees.
# A SysV shared memory segment stays allocated once detached (in the sandbox's IPC namespace, whose
# limits are unbounded: one process could hold any amount), a message queue likewise, and a memfd is a
# file in RAM outside /tmp's size cap (NOFILE x FSIZE per process). Other machines run without a filter.
SECCOMP_REFUSED = ("shmget", "msgget", "memfd_create")
_ABI = {"x86_64": (0xC000003E, {"shmget": 29, "msgget": 68, "memfd_create": 319}),  # AUDIT_ARCH_*, numbers
        "aarch64": (0xC00000B7, {"shmget": 194, "msgget": 186, "memfd_create": 279})}


def seccomp_filter(machine: str | None = None) -> bytes | None:
    """The classic BPF program (struct sock_filter[]) given to ``bwrap --seccomp``: EPERM for
    SECCOMP_REFUSED and for every call of another ABI (i386 or x32 calls name them by other numbers);
    None on a machine without a table here."""
    arch, numbers = _ABI.get(machine or platform.machine(), (None, None))
    if arch is None:
        return None
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    allow, deny = 0x7FFF0000, 0x00050000 | errno.EPERM  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | EPERM
    checks = [(jge, 0x40000000)] if arch == 0xC000003E else []  # x32: __X32_SYSCALL_BIT
    checks += [(jeq, numbers[name]) for name in SECCOMP_REFUSED]
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, deny), (ld, 0, 0, 0)]  # seccomp_data.arch, .nr
    prog += [(op, len(checks) - i, 0, k) for i, (op, k) in enumerate(checks)]  # match: jump to deny
    prog += [(ret, 0, 0, allow), (ret, 0, 0, deny)]
    return b"".join(struct.pack("=HBBI", *ins) for ins in prog)


_SECCOMP = seccomp_filter()


class SandboxUnavailable(RuntimeError):
    """bwrap is missing or cannot create namespaces here."""


@dataclass
class RunOutcome:
    """What one sandboxed process did."""

    exit_code: int | None  # as bwrap reports it: 128 + signal number when killed by a signal
    stdout: bytes
    stderr: bytes  # tail only
    wall_s: float
    timed_out: bool = False  # wall-clock deadline hit (the namespace was killed)
    output_exceeded: bool = False  # stdout + stderr passed the byte cap (killed)
    setup_error: str | None = None  # the sandbox itself failed: the program never ran
    stopped: bool = False  # the caller's on_stdout watcher ended it (it had every result it needed)
    memory_exceeded: bool = False  # its processes together held more than rlimits.memory_mb (killed)

    @property
    def signal(self) -> int | None:
        if self.exit_code is not None and self.exit_code > 128:
            return self.exit_code - 128
        return None


@dataclass
class Jail:
    """Sandbox settings shared by all runs of one verifier process.

    host_uid: uid the jailed tree has on the host when the runner is root. None = a uid derived
    from this process's pid, so concurrent verifier workers do not share an RLIMIT_NPROC budget.
    ro_paths: extra host paths bound read-only at the same place (e.g. an interpreter prefix).
    """

    host_uid: int | None = None
    # bare=True: NO namespaces -- rlimits, uid drop and a private workspace only. For hosts without
    # bwrap, and only when the caller opted in explicitly (CodeLimits.allow_unsandboxed).
    bare: bool = False
    tmp_mb: int = 64
    ro_paths: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=lambda: {
        "PATH": DEFAULT_PATH, "HOME": "/tmp", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"})

    def uid(self) -> int | None:
        if os.geteuid() != 0:
            return None  # already unprivileged: bwrap maps the sandbox uid onto ours
        return self.host_uid if self.host_uid is not None else 100000 + os.getpid() % 100000

    # ------------------------------------------------------------------ argv
    def argv(self, cmd: list[str], status_fd: int, workspace: str | None, writable: bool,
             cwd: str, seccomp_fd: int | None = None) -> list[str]:
        if self.bare:  # /box paths name the workspace directly
            return [workspace + c[len(BOX):] if workspace and c.startswith(BOX + "/") else c
                    for c in cmd]
        a = [shutil.which("bwrap") or "bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
             "--new-session", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
             "--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
        for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
            if os.path.islink(top):  # merged-/usr systems: recreate the link, bind nothing
                a += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                a += ["--ro-bind", top, top]
        a += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
        for p in self.ro_paths:
            a += ["--ro-bind", p, p]
        a += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev",
              "--size", str(self.tmp_mb << 20), "--tmpfs", "/tmp"]
        if workspace is not None:
            a += ["--bind" if writable else "--ro-bind", workspace, BOX]
        a += ["--remount-ro", "/", "--clearenv"]
        for k, v in self.env.items():
            a += ["--setenv", k, v]
        if seccomp_fd is not None:
            a += ["--seccomp", str(seccomp_fd)]
        return a + ["--chdir", cwd, "--json-status-fd", str(status_fd), "--"] + cmd

    # ------------------------------------------------------------------ workspace
    @contextlib.contextmanager
    def workspace(self, base: str | None = None):
        """A private host directory (0700, owned by the jail uid) mounted at /box. Only this
        directory of the host's /tmp is ever visible inside."""
        path = tempfile.mkdtemp(prefix="mrl-sbx-", dir=base)
        try:
            uid = self.uid()
            if uid is not None:
                os.chown(path, uid, uid)
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)

    # ------------------------------------------------------------------ run
    def run(self, cmd: list[str], *, stdin: bytes = b"", rlimits: RLimits, wall_s: float,
            max_output: int, workspace: str | None = None, writable: bool = False,
            cwd: str = "/tmp", on_stdout=None) -> RunOutcome:
        """Run ``cmd`` in a fresh sandbox; never raises for anything the program does. ``on_stdout``:
        sandbox_proc.collect's watcher of stdout (fresh deadlines per result, STOP when done)."""
        ok, why = (True, "") if self.bare else available(self)
        if not ok:
            return RunOutcome(None, b"", b"", 0.0, setup_error=why)
        return self._run(cmd, stdin, rlimits, wall_s, max_output, workspace, writable, cwd, on_stdout)

    def _run(self, cmd, stdin, rlimits, wall_s, max_output, workspace, writable, cwd,
             on_stdout=None) -> RunOutcome:
        become_subreaper()
        uid = self.uid()
        preexec = make_preexec(rlimits, uid, hide_plan(list(self.ro_paths), uid or 0))
        if self.bare:
            cwd = workspace or "/"
        status_r, status_w = os.pipe()
        stdin_fd = os.memfd_create("sandbox-stdin")
        os.write(stdin_fd, stdin)
        os.lseek(stdin_fd, 0, os.SEEK_SET)
        seccomp_fd = None
        if _SECCOMP is not None and not self.bare:
            seccomp_fd = os.memfd_create("sandbox-seccomp")
            os.write(seccomp_fd, _SECCOMP)
            os.lseek(seccomp_fd, 0, os.SEEK_SET)
        try:
            proc = subprocess.Popen(
                self.argv(cmd, status_w, workspace, writable, cwd, seccomp_fd), stdin=stdin_fd,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                pass_fds=(status_w,) if seccomp_fd is None else (status_w, seccomp_fd),
                preexec_fn=preexec, start_new_session=True, cwd=cwd if self.bare else "/",
                env=dict(self.env) if self.bare else {})
        except (OSError, subprocess.SubprocessError) as e:
            os.close(status_r)
            return RunOutcome(None, b"", b"", 0.0, setup_error=f"cannot start bwrap: {e}")
        finally:
            os.close(status_w)
            os.close(stdin_fd)
            if seccomp_fd is not None:
                os.close(seccomp_fd)

        state: dict = {"init": None, "exit": None}

        def on_status(buf: bytes) -> None:
            for line in buf.decode(errors="replace").splitlines():
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                if "child-pid" in msg and state["init"] is None:
                    state["init"] = NamespaceInit(msg["child-pid"], msg.get("pid-namespace"))
                if "exit-code" in msg:
                    state["exit"] = int(msg["exit-code"])

        def kill() -> None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            if state["init"] is not None:
                state["init"].kill()

        def over_memory() -> bool:  # RLIMIT_AS bounds each process; this bounds the sandbox's sum
            init = state["init"]
            return init is not None and namespace_memory(init, host_uid) > rlimits.memory_mb << 20

        host_uid = uid if uid is not None else os.getuid()  # the sandbox's processes, seen from here
        try:
            c = collect(proc, status_r, wall_s, max_output, on_status, kill, on_stdout=on_stdout,
                        watch=None if self.bare else over_memory)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                kill()
                proc.wait()
        finally:
            os.close(status_r)
            proc.stdout.close()
            proc.stderr.close()
            if state["init"] is not None:
                state["init"].reap()
        ended_by_us = c.timed_out or c.output_exceeded or c.stopped or c.memory_exceeded
        if self.bare and proc.returncode is not None and not ended_by_us:
            rc = proc.returncode
            state["exit"] = 128 - rc if rc < 0 else rc
        out = RunOutcome(state["exit"], c.stdout, c.stderr, c.wall_s, c.timed_out, c.output_exceeded,
                         stopped=c.stopped, memory_exceeded=c.memory_exceeded)
        if out.exit_code is None and not ended_by_us:
            msg = c.stderr.decode(errors="replace").strip() or f"bwrap exited {proc.returncode}"
            out.setup_error = msg[-500:]
        return out


_probe_lock = threading.Lock()
_probe_cache: dict[tuple, tuple[tuple[bool, str], float]] = {}
# A refusal is probed again after this long: a transient failure (fork refused under load) must not
# turn every later item of a long-lived verifier worker into a grading failure.
RETRY_REFUSED_S = 30.0


def available(jail: Jail | None = None) -> tuple[bool, str]:
    """(True, "") when the jail can run here; else (False, reason). Cached per process and jail
    (a refusal for RETRY_REFUSED_S only)."""
    jail = jail or Jail()
    key = (os.getpid(), jail.uid(), jail.ro_paths, shutil.which("bwrap"))
    with _probe_lock:
        if key in _probe_cache:
            res, at = _probe_cache[key]
            if res[0] or time.monotonic() - at < RETRY_REFUSED_S:
                return res
        if not sys.platform.startswith("linux"):
            res = (False, f"the sandbox needs Linux namespaces (platform {sys.platform})")
        elif shutil.which("bwrap") is None:
            res = (False, "bubblewrap (bwrap) is not installed: refusing to run untrusted code")
        else:
            out = jail._run(["/bin/true"], b"", RLimits(5, 256, 16, 1, 32, 8), 20.0, 4096,
                            None, False, "/tmp")
            if out.setup_error is None and out.exit_code == 0:
                res = (True, "")
            else:
                why = out.setup_error or f"probe exited {out.exit_code}"
                res = (False, f"bwrap cannot build the sandbox here (user namespaces?): {why}")
        _probe_cache[key] = (res, time.monotonic())
        return res
