"""The bubblewrap jail on its own: isolation properties observed from inside and from the host."""
from __future__ import annotations

import os
import socket
import sys
import time
import uuid

import pytest

from megatron_rl.reward.code import Toolchain
from megatron_rl.reward.sandbox import SANDBOX_UID, Jail, available
from megatron_rl.reward.sandbox_proc import RLimits

TC = Toolchain()
JAIL = TC.jail()
LIM = RLimits(cpu_s=5, memory_mb=1024, nproc=32, fsize_mb=4, nofile=64, stack_mb=64)
pytestmark = pytest.mark.skipif(not available(JAIL)[0], reason=f"no sandbox: {available(JAIL)[1]}")


def run_py(src: str, stdin: bytes = b"", wall_s: float = 8.0, rlimits: RLimits = LIM, **kw):
    return JAIL.run([TC.python, "-I", "-c", src], stdin=stdin, rlimits=rlimits, wall_s=wall_s,
                    max_output=1 << 16, **kw)


def our_zombies() -> list[int]:
    """Zombie processes whose parent is this (subreaper) process."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == "Z" and int(fields[1]) == os.getpid():
            out.append(int(pid))
    return out


def test_identity_env_and_filesystem_view(monkeypatch):
    monkeypatch.setenv("MRL_HOST_SECRET", "do-not-leak")
    out = run_py("import os, json; print(json.dumps([os.getuid(), os.getgid(), dict(os.environ),"
                 " sorted(os.listdir('/')), os.path.exists('/work'), os.getpid()]))")
    assert out.exit_code == 0, out
    import json
    uid, gid, env, root, has_work, pid = json.loads(out.stdout)
    assert (uid, gid) == (SANDBOX_UID, SANDBOX_UID)
    assert "MRL_HOST_SECRET" not in env and env["PATH"].startswith("/usr/local/bin")
    assert not has_work and "home" not in root and "work" not in root
    assert pid == 2  # own PID namespace: bwrap's init is 1


def test_host_files_unreadable(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET-" + uuid.uuid4().hex)
    proj_secret = os.path.join(os.getcwd(), f".sandbox_secret_{uuid.uuid4().hex}")
    with open(proj_secret, "w") as f:
        f.write("PROJSECRET")
    try:
        targets = [str(secret), proj_secret, "/etc/shadow", "/etc/passwd", "/root/.bashrc",
                   os.path.join(sys.prefix, "pyvenv.cfg")]
        src = ("import sys\nfor p in sys.stdin.read().split():\n"
               "    try: print('READ', p, open(p).read()[:40])\n"
               "    except OSError as e: print('blocked', p, type(e).__name__)\n"
               "import os; print('root-home', sorted(os.listdir('/root')))")
        out = run_py(src, stdin="\n".join(targets).encode())
        text = out.stdout.decode()
        assert out.exit_code == 0, out
        assert "READ" not in text and "SECRET" not in text, text
        assert text.count("blocked") == len(targets)
        # Only the interpreter prefix is re-created under /root, nothing of the real home.
        assert "root-home ['.pyenv']" in text or "root-home []" in text or \
            not TC.python_prefix.startswith("/root"), text
    finally:
        os.remove(proj_secret)


def test_writes_outside_tmp_fail_and_tmp_is_private(tmp_path):
    host_probe = tmp_path / "from_sandbox"
    src = ("import sys\nfor p in sys.stdin.read().split():\n"
           "    try: open(p, 'w').write('x'); print('WROTE', p)\n"
           "    except OSError as e: print('ro', p)\n"
           "open('/tmp/ok', 'w').write('y'); print('tmp', open('/tmp/ok').read())")
    targets = ["/x", "/usr/x", "/etc/x", "/dev/shm/x", str(host_probe), "/box/x"]
    with JAIL.workspace() as ws:
        out = run_py(src, stdin="\n".join(targets).encode(), workspace=ws)
        assert os.listdir(ws) == []
    text = out.stdout.decode()
    assert "WROTE" not in text and text.count("ro ") == len(targets) and "tmp y" in text, text
    assert not host_probe.exists()
    assert not os.path.exists("/tmp/ok") or open("/tmp/ok").read() != "y"


def test_loopback_listener_unreachable():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.setblocking(False)
    port = srv.getsockname()[1]
    try:
        src = ("import socket\ntry:\n    socket.create_connection(('127.0.0.1', %d), timeout=2)\n"
               "    print('CONNECTED')\nexcept OSError as e:\n    print('blocked', e)" % port)
        out = run_py(src)
        assert out.exit_code == 0 and b"blocked" in out.stdout, out
        with pytest.raises(BlockingIOError):
            srv.accept()  # nothing ever reached the host listener
    finally:
        srv.close()


def test_nproc_limit_enforced_and_no_zombies_left():
    # Earlier tests' orphans may already sit here as zombies (run_tests made this process a
    # subreaper): only zombies that appear during this test are the sandbox's.
    zombies_before = set(our_zombies())
    # Fork children that stay alive until the limit bites; the count must stop below nproc.
    src = ("import os\nn = 0\nwhile n < 500:\n    try: pid = os.fork()\n    except OSError: break\n"
           "    if pid == 0:\n        import time; time.sleep(30); os._exit(0)\n    n += 1\nprint(n)")
    out = run_py(src, wall_s=15)
    assert out.exit_code == 0, out
    assert 1 <= int(out.stdout) < LIM.nproc
    for _ in range(3):
        assert run_py("print(7)").stdout == b"7\n"  # NPROC budget is back: nothing lingers
    assert set(our_zombies()) - zombies_before == set()


def test_daemonised_children_die_with_the_sandbox():
    token = "mrl-daemon-" + uuid.uuid4().hex
    src = ("import os, sys\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
           "        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(120)',"
           " %r])\n    os._exit(0)\n"
           # Wait (inside) until the daemon has exec'd, so the host-side check is not vacuous.
           "import time\nfor _ in range(200):\n"
           "    if any(%r.encode() in open('/proc/%%s/cmdline' %% p, 'rb').read()\n"
           "           for p in os.listdir('/proc') if p.isdigit()):\n"
           "        print('daemon up'); break\n    time.sleep(0.02)" % (token, token))
    out = run_py(src)
    assert out.exit_code == 0 and out.stdout == b"daemon up\n", out

    def alive() -> list[str]:
        hits = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if token.encode() in f.read():
                        hits.append(pid)
            except OSError:
                pass
        return hits

    assert alive() == []
    # Positive control: the same scan does see such a process outside the sandbox.
    import subprocess
    ctl = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", token])
    try:
        for _ in range(250):  # until it has exec'd
            if alive():
                break
            time.sleep(0.02)
        assert alive() == [str(ctl.pid)]
    finally:
        ctl.kill()
        ctl.wait()


def test_killing_parents_is_contained():
    me = os.getpid()
    src = ("import os, signal, sys\nfor pid in (os.getppid(), int(sys.stdin.read())):\n"
           "    try: os.kill(pid, 9); print('sent', pid)\n"
           "    except OSError as e: print('denied', pid, type(e).__name__)\n"
           "import time\nif os.fork() == 0:\n    time.sleep(30)\n    os._exit(0)\n"
           "time.sleep(0.3)\nos.kill(-1, 9)\nprint('survived kill -9 -1')\n")
    out = run_py(src, stdin=str(me).encode())
    assert out.setup_error is None
    assert b"denied %d" % me in out.stdout  # the host pid is not even visible
    # kill(-1) reaches only the sandbox's own processes (the caller and ns init are exempt).
    assert out.exit_code == 0 and b"survived kill -9 -1" in out.stdout, out
    assert run_py("print('still serving')").stdout == b"still serving\n"


def test_missing_bwrap_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    ok, why = available(Jail(ro_paths=JAIL.ro_paths))
    assert not ok and "bwrap" in why
    out = Jail(ro_paths=JAIL.ro_paths).run(["/bin/true"], rlimits=LIM, wall_s=5, max_output=10)
    assert out.exit_code is None and "bwrap" in out.setup_error


def test_memory_limit_bounds_the_sum_of_the_sandboxs_processes():
    # One process holding most of the limit runs; four forked ones of 100 MB (each under RLIMIT_AS) are killed.
    lim = RLimits(cpu_s=10, memory_mb=192, nproc=32, fsize_mb=4, nofile=64, stack_mb=64)
    one = run_py("import time\nheld = b'x' * (140 << 20)\ntime.sleep(0.5)\nprint('held')", rlimits=lim)
    assert (one.exit_code, one.stdout, one.memory_exceeded) == (0, b"held\n", False), one
    forked = run_py("import os, time\nfor _ in range(4):\n    if os.fork() == 0:\n        held = b'x' * (100 << 20)\n"
                    "        time.sleep(5)\n        os._exit(0)\ntime.sleep(5)\nprint('held')", rlimits=lim)
    assert forked.memory_exceeded and not forked.timed_out and forked.stdout == b"" and forked.wall_s < 4, forked
    shared = run_py("import ctypes, mmap, os, time\nfor _ in range(4):\n    if os.fork() == 0:\n"
                    "        m = mmap.mmap(-1, 100 << 20, flags=mmap.MAP_SHARED)  # shmem, not anonymous\n"
                    "        ctypes.memset(ctypes.addressof(ctypes.c_char.from_buffer(m)), 1, len(m))\n"
                    "        time.sleep(5)\n        os._exit(0)\ntime.sleep(5)\nprint('held')", rlimits=lim)
    assert shared.memory_exceeded and shared.stdout == b"" and shared.wall_s < 4, shared
    assert run_py("print('still serving')").stdout == b"still serving\n"


def test_memory_outside_every_limit_is_refused():
    # A detached SysV segment stays allocated, unmapped, in the sandbox's IPC namespace (whose limits are
    # unbounded): six of 64 MB under a 128 MB limit would go unseen by RLIMIT_AS and by the resident sum.
    # A memfd is a file in RAM outside /tmp's cap. Both are refused; threads, fork and exec are not.
    lim = RLimits(cpu_s=10, memory_mb=128, nproc=32, fsize_mb=64, nofile=64, stack_mb=64)
    src = ("import ctypes, os, subprocess, threading\nlibc = ctypes.CDLL(None, use_errno=True)\n"
           "libc.shmat.restype = ctypes.c_void_p\nheld = 0\nfor _ in range(6):\n"
           "    sid = libc.shmget(0, ctypes.c_size_t(64 << 20), 0o1600)\n    if sid < 0:\n"
           "        print('shmget', os.strerror(ctypes.get_errno()))\n        break\n"
           "    p = libc.shmat(sid, None, 0)\n    ctypes.memset(p, 1, 64 << 20)\n    libc.shmdt(ctypes.c_void_p(p))\n"
           "    held += 64\nprint('held', held)\nprint('msgget', libc.msgget(0, 0o1600))\n"
           "try:\n    os.memfd_create('x')\nexcept OSError as e:\n    print('memfd', e.strerror)\n"
           "t = threading.Thread(target=print, args=('thread',))\nt.start()\nt.join()\n"
           "print(subprocess.run(['/bin/echo', 'exec'], capture_output=True).stdout.decode().strip())\n")
    out = run_py(src, rlimits=lim)
    assert out.exit_code == 0 and out.stdout.decode().split("\n") == [
        "shmget Operation not permitted", "held 0", "msgget -1", "memfd Operation not permitted", "thread",
        "exec", ""], out
    from megatron_rl.reward.sandbox import seccomp_filter

    assert seccomp_filter("sparc64") is None and len(seccomp_filter("x86_64")) % 8 == 0
