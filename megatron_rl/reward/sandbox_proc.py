"""Process plumbing for the code sandbox: the preexec step of the jailed child (mount-namespace prep,
rlimits, privilege drop), child-subreaper reaping, and output collection with a byte cap.

Linux only. Everything here runs either in the verifier process (collect, reap) or in the forked
child between fork and exec (``make_preexec``), where only async-signal-tolerant work is done:
syscalls through ctypes/os, no imports, no locks.
"""

from __future__ import annotations

import ctypes
import os
import resource
import selectors
import signal
import time
from dataclasses import dataclass

_libc = ctypes.CDLL(None, use_errno=True)

PR_SET_CHILD_SUBREAPER = 36
CLONE_NEWNS = 0x00020000
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 4096, 16384, 1 << 18


@dataclass(frozen=True)
class RLimits:
    """Resource limits set on the jailed process tree (inherited through bwrap)."""

    cpu_s: int  # RLIMIT_CPU soft; hard = soft + 1 (SIGXCPU, then SIGKILL)
    memory_mb: int  # RLIMIT_AS
    nproc: int  # RLIMIT_NPROC, counted per (user namespace, uid)
    fsize_mb: int  # RLIMIT_FSIZE: largest file the program may write
    nofile: int  # RLIMIT_NOFILE
    stack_mb: int  # RLIMIT_STACK (deep recursion in contest code needs more than 8 MB)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def hide_plan(paths: list[str], uid: int) -> dict[str, list[str]]:
    """For each path that ``uid`` cannot reach (an ancestor lacks o+x, e.g. /root is 0700), the
    top-most unreachable ancestor to cover with an empty tmpfs, mapped to the paths to re-bind
    inside it. The jailed child then reaches those paths, and nothing else of that directory."""
    plan: dict[str, list[str]] = {}
    if os.geteuid() != 0:
        return plan  # an unprivileged runner can only bind what it can already reach
    for path in paths:
        parts = os.path.abspath(path).split("/")[1:]
        for i in range(1, len(parts)):
            anc = "/" + "/".join(parts[:i])
            st = os.stat(anc)
            if not (st.st_mode & 0o001) and st.st_uid != uid:
                plan.setdefault(anc, []).append(os.path.abspath(path))
                break
    return plan


def make_preexec(limits: RLimits, uid: int | None, hide: dict[str, list[str]]):
    """The function run in the child after fork, before exec of bwrap.

    1. With ``hide``: a private mount namespace where each unreachable ancestor (e.g. /root) is
       replaced by an empty tmpfs holding read-only binds of only the needed paths (e.g. the pyenv
       interpreter prefix), so bwrap -- running unprivileged -- can bind them; the host home stays
       invisible.
    2. rlimits (CORE=0 too).
    3. Drop to ``uid``/``gid`` (root only): bwrap then runs unprivileged, builds its own user
       namespace, and RLIMIT_NPROC is enforced (it is not for uid 0).
    """

    def preexec() -> None:
        if hide:
            _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
            _check(_libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
            # Open the sources before covering them; fds must belong to the new namespace.
            fds = {p: os.open(p, os.O_PATH | os.O_DIRECTORY) for ps in hide.values() for p in ps}
            for anc, paths in hide.items():
                _check(_libc.mount(b"tmpfs", anc.encode(), b"tmpfs", MS_NOSUID | MS_NODEV,
                                   b"mode=0755,size=64k"), f"mount tmpfs {anc}")
                for p in paths:
                    os.makedirs(p, exist_ok=True)
                    _check(_libc.mount(f"/proc/self/fd/{fds[p]}".encode(), p.encode(), None,
                                       MS_BIND | MS_REC, None), f"bind {p}")
            for fd in fds.values():
                os.close(fd)
        rl = resource.setrlimit
        rl(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
        rl(resource.RLIMIT_AS, (limits.memory_mb << 20,) * 2)
        rl(resource.RLIMIT_FSIZE, (limits.fsize_mb << 20,) * 2)
        rl(resource.RLIMIT_NOFILE, (limits.nofile,) * 2)
        rl(resource.RLIMIT_STACK, (limits.stack_mb << 20,) * 2)
        rl(resource.RLIMIT_CORE, (0, 0))
        rl(resource.RLIMIT_NPROC, (limits.nproc,) * 2)
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)

    return preexec


_subreaper_pid: int | None = None


def become_subreaper() -> None:
    """Make this process the child subreaper (once per process): bwrap's namespace init can outlive
    the outer bwrap; it is then re-parented here, where we reap it, instead of to PID 1, which in a
    container may never reap it -- its zombie would keep counting against RLIMIT_NPROC."""
    global _subreaper_pid
    if _subreaper_pid != os.getpid():
        _check(_libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(PR_SET_CHILD_SUBREAPER)")
        _subreaper_pid = os.getpid()


class NamespaceInit:
    """Handle on the sandbox's PID-namespace init (host pid from bwrap's status), held as a pidfd so a
    recycled pid can never be signalled. Killing it kills every process in the namespace."""

    def __init__(self, pid: int, pid_ns: int | None):
        self.fd: int | None = None
        self.pid, self.pid_ns = pid, pid_ns  # pid_ns: inode of the namespace (bwrap's report, else read here)
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return  # already gone and reaped by bwrap
        try:  # pid recycled between bwrap's report and pidfd_open? then it is not in our namespace
            ns = os.stat(f"/proc/{pid}/ns/pid").st_ino
        except OSError:
            ns = None  # exited already: the pidfd still names the right (dead) process
        if pid_ns is None or ns is None or ns == pid_ns:
            self.fd, self.pid_ns = fd, pid_ns if pid_ns is not None else ns
        else:
            os.close(fd)

    def kill(self) -> None:
        if self.fd is not None:
            try:
                signal.pidfd_send_signal(self.fd, signal.SIGKILL)
            except OSError:
                pass

    def reap(self) -> None:
        """Kill and wait for it if it was re-parented to us; bwrap may have reaped it itself."""
        if self.fd is None:
            return
        self.kill()
        try:
            os.waitid(os.P_PIDFD, self.fd, os.WEXITED)
        except ChildProcessError:
            pass  # not our child: the outer bwrap waited for it
        finally:
            os.close(self.fd)
            self.fd = None


WATCH_S = 0.1  # how often a sandbox's memory is summed (collect's ``watch``)


def namespace_memory(init: NamespaceInit, uid: int) -> int:
    """Bytes of anonymous and shared memory resident in the processes of a sandbox: those of host ``uid``
    in the PID namespace of ``init`` (bwrap's init itself left out), RssAnon + RssShmem of
    /proc/<pid>/status. RLIMIT_AS bounds each process, not their sum: a program that forks could hold
    RLIMIT_NPROC x RLIMIT_AS. Pages that processes share (copy-on-write after a fork, a shared mapping)
    count in each of them: an upper bound."""
    if init.pid_ns is None:
        return 0
    total = 0
    for pid in _sandbox_pids(init):
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid or os.stat(f"/proc/{pid}/ns/pid").st_ino != init.pid_ns:
                continue
            with open(f"/proc/{pid}/status", "rb") as f:
                status = f.read()
        except OSError:
            continue  # ended meanwhile
        for line in status.splitlines():
            if line.startswith((b"RssAnon:", b"RssShmem:")):
                total += int(line.split()[1]) << 10  # kB
    return total


def _sandbox_pids(init: NamespaceInit) -> list[int]:
    """Candidate pids of the sandbox's processes: init's descendants where the kernel lists children
    (every orphan of the namespace is reparented to init, so the tree holds them all; the cost follows
    the sandbox's size), else every pid of the host (the caller filters by uid and namespace)."""
    found, todo = [], [init.pid]
    while todo:
        pid = todo.pop()
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                    kids = [int(k) for k in f.read().split()]
            except FileNotFoundError:
                if pid == init.pid:  # no CONFIG_PROC_CHILDREN
                    return [int(n) for n in os.listdir("/proc") if n.isdigit() and int(n) != init.pid]
                continue
            except OSError:
                continue
            found += kids
            todo += kids
    return found


@dataclass
class Collected:
    stdout: bytes
    stderr: bytes  # the last ``stderr_tail`` bytes
    status: bytes  # bwrap's --json-status-fd stream
    timed_out: bool
    output_exceeded: bool
    wall_s: float
    stopped: bool = False  # the watcher (on_stdout) ended the run: it had what it needed
    memory_exceeded: bool = False  # ``watch`` said the sandbox holds too much memory (killed)


STOP = -1.0  # returned by an on_stdout watcher: end the run now (not a timeout)


def collect(proc, status_r: int, wall_s: float, max_output: int, on_status, kill,
            stderr_tail: int = 4096, on_stdout=None, watch=None) -> Collected:
    """Read stdout/stderr/status until all close or a limit trips. ``on_status(bytes_so_far)`` is
    called as status data arrives; ``kill()`` is called once on wall timeout or when stdout+stderr
    exceed ``max_output`` bytes, and reading then continues to EOF (the namespace is dead).
    ``on_stdout(chunk)``, when given, sees each stdout chunk as it arrives and returns None, a new
    deadline (a time.perf_counter() value: a program reporting progress gets a fresh time limit), or
    STOP to end the run at once. ``watch()``, when given, is called every WATCH_S seconds while the run
    lasts; True kills it (``memory_exceeded``)."""
    t0 = time.perf_counter()
    deadline = t0 + wall_s
    next_watch = t0 + WATCH_S if watch is not None else float("inf")
    sel = selectors.DefaultSelector()
    bufs: dict[str, bytearray] = {"out": bytearray(), "err": bytearray(), "st": bytearray()}
    for name, f in (("out", proc.stdout.fileno()), ("err", proc.stderr.fileno()), ("st", status_r)):
        os.set_blocking(f, False)
        sel.register(f, selectors.EVENT_READ, name)
    n_out = 0
    timed_out = exceeded = killed = stopped = over_memory = False
    try:
        while sel.get_map():
            now = time.perf_counter()
            remaining = deadline - now
            if remaining <= 0 and not killed:
                timed_out = killed = True
                kill()
            if now >= next_watch and not killed:
                next_watch = now + WATCH_S
                if watch():
                    over_memory = killed = True
                    kill()
            wait = min(remaining, next_watch - now)
            for key, _ in sel.select(timeout=max(wait, 0.05) if not killed else 1.0):
                try:
                    chunk = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                name = key.data
                if name == "st":
                    bufs["st"] += chunk
                    on_status(bytes(bufs["st"]))
                    continue
                n_out += len(chunk)
                if killed:
                    continue  # drain only
                bufs[name] += chunk
                if name == "err" and len(bufs["err"]) > 2 * stderr_tail:
                    del bufs["err"][:-stderr_tail]
                if n_out > max_output:
                    exceeded = killed = True
                    kill()
                elif name == "out" and on_stdout is not None:
                    new_deadline = on_stdout(chunk)
                    if new_deadline == STOP:
                        stopped = killed = True
                        kill()
                    elif new_deadline is not None:
                        deadline = new_deadline
            if killed and time.perf_counter() > deadline + 5:
                break  # something holds a pipe open outside the namespace: give up on EOF
    finally:
        sel.close()
    return Collected(bytes(bufs["out"][:max_output]), bytes(bufs["err"][-stderr_tail:]),
                     bytes(bufs["st"]), timed_out, exceeded, time.perf_counter() - t0, stopped, over_memory)
