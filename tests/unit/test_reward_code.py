"""run_tests end to end in the real sandbox: grading semantics, C++ and Python, hostile programs.

After every hostile program a normal program must still pass (the verifier keeps serving)."""
from __future__ import annotations

import os
import socket
import uuid

import pytest

from megatron_rl.config import RewardConfig
from megatron_rl.reward.code import (
    CodeLimits, Toolchain, normalize_output, outputs_match, run_tests,
)
from megatron_rl.reward.sandbox import available

ADD_TESTS = [{"input": f"{a} {b}\n", "output": f"{a + b}\n"}
             for a, b in [(1, 2), (5, 7), (-3, 3), (10**12, 1), (0, 0)]]
PY_ADD = "a, b = map(int, input().split())\nprint(a + b)\n"
CPP_ADD = ("#include <iostream>\nint main(){ long long a, b; std::cin >> a >> b;"
           " std::cout << a + b << '\\n'; }\n")
FAST = dict(test_timeout_s=2.0, compile_timeout_s=20.0)

pytestmark = pytest.mark.skipif(not available(Toolchain().jail())[0],
                                reason=f"no sandbox: {available(Toolchain().jail())[1]}")


def assert_still_serving():
    r = run_tests(PY_ADD, ADD_TESTS[:2])
    assert r.passed and r.status == "ok" and r.n_passed == 2, r


# ---------------------------------------------------------------- semantics

def test_output_normalisation():
    assert normalize_output("1 2  \r\n3\n\n\n") == ["1 2", "3"]
    assert outputs_match(b"3\n", "3") and outputs_match("a \nb", "a\nb\n")
    assert not outputs_match("3", "03") and not outputs_match(" 3", "3")
    assert not outputs_match("a\n\nb", "a\nb") and not outputs_match("A", "a")


def test_python_passes_and_reports_timings():
    r = run_tests(PY_ADD, ADD_TESTS)
    assert (r.passed, r.status, r.n_passed, r.n_tests, r.first_failed) == (True, "ok", 5, 5, None)
    assert len(r.test_s) == 5 and r.total_s >= sum(r.test_s)


def test_wrong_answer_at_test_3_of_5_stops_there():
    # Correct except when a == -3: the third test.
    code = "a, b = map(int, input().split())\nprint(a + b + (a == -3))\n"
    r = run_tests(code, ADD_TESTS)
    assert (r.passed, r.status, r.n_passed, r.first_failed, r.n_tests) == \
        (False, "wrong_answer", 2, 2, 5)
    assert len(r.test_s) == 3  # tests 4 and 5 never ran
    assert "expected '0\\n', got '1\\n'" in r.message


def test_cpp_passes_and_cpp_wrong_answer_at_test_3():
    r = run_tests(CPP_ADD, ADD_TESTS, "cpp", **FAST)
    assert (r.passed, r.status, r.n_passed) == (True, "ok", 5) and r.compile_s > 0
    wrong = CPP_ADD.replace("a + b", "a + b + (a == -3)")
    r = run_tests(wrong, ADD_TESTS, "c++", **FAST)
    assert (r.status, r.n_passed, r.first_failed) == ("wrong_answer", 2, 2)


def test_compile_errors():
    r = run_tests("int main() { return undeclared; }", ADD_TESTS, "cpp17", **FAST)
    assert (r.passed, r.status, r.n_passed, r.test_s) == (False, "compile_error", 0, [])
    assert "undeclared" in r.message
    r = run_tests("def f(:\n  pass\n", ADD_TESTS)
    assert r.status == "compile_error" and "SyntaxError" in r.message
    # A SyntaxError raised while running is a runtime error, not a compile error.
    r = run_tests("eval('1 +')", ADD_TESTS)
    assert r.status == "runtime_error"


def test_limits_cap_and_inputs_validated():
    tests = ADD_TESTS * 5  # 25 > max_tests
    r = run_tests(PY_ADD, tests, max_tests=3)
    assert r.passed and r.n_tests == 3 and r.n_passed == 3
    lim = CodeLimits.from_config(RewardConfig(code_max_tests=4, code_test_timeout_s=3.0))
    assert (lim.max_tests, lim.test_timeout_s, lim.compile_timeout_s) == (4, 3.0, 10.0)
    assert run_tests(PY_ADD, tests, limits=lim).n_tests == 4
    for bad in ([], [{"input": "1"}], ["x"], [{"input": 1, "output": "1"}]):
        with pytest.raises(ValueError):
            run_tests(PY_ADD, bad)
    with pytest.raises(ValueError):
        CodeLimits(test_timeout_s=0)
    with pytest.raises(TypeError):
        run_tests(PY_ADD, ADD_TESTS, no_such_limit=1)
    assert run_tests("x", ADD_TESTS, "java").status == "unsupported_language"


def test_runtime_error_and_exit_code():
    assert run_tests("import sys; sys.exit(3)", ADD_TESTS).status == "runtime_error"
    r = run_tests("int main(){ int *p = nullptr; return *p; }", ADD_TESTS, "cpp", **FAST)
    assert r.status == "runtime_error"


# ---------------------------------------------------------------- hostile programs

def test_fork_bomb_contained():
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    r = run_tests(code, ADD_TESTS, **FAST)
    assert not r.passed and r.status in ("timeout", "runtime_error"), r
    assert_still_serving()


def test_memory_bombs():
    r = run_tests("x = bytearray(8 << 30)\nprint(len(x))", ADD_TESTS, memory_mb=256)
    assert r.status == "memory", r
    cpp = ("#include <vector>\nint main(){ std::vector<std::vector<char>> v;"
           " while (true) v.emplace_back(1 << 24, 1); }")
    r = run_tests(cpp, ADD_TESTS, "cpp", memory_mb=256, compile_timeout_s=20, test_timeout_s=10)
    assert r.status == "memory", r
    # Filling the private /tmp (a size-capped tmpfs) or one big file hits a limit, not the host.
    fill = ("import itertools\nfor i in itertools.count():\n"
            "    open(f'/tmp/f{i}', 'wb').write(b'x' * (8 << 20))\n")
    r = run_tests(fill, ADD_TESTS, **FAST)
    assert r.status == "runtime_error" and ("No space left" in r.message or "File size" in r.message
                                            or "Errno" in r.message), r
    assert_still_serving()


def test_stdout_flood_and_infinite_loop():
    r = run_tests("while True:\n    print('x' * 4096)", ADD_TESTS, max_output_bytes=1 << 16)
    assert r.status == "output_limit", r
    r = run_tests("while True:\n    pass", ADD_TESTS, test_timeout_s=1.5)
    assert r.status == "timeout" and r.test_s[0] < 10, r
    r = run_tests("import time\ntime.sleep(60)", ADD_TESTS, test_timeout_s=1.0)
    assert r.status == "timeout", r
    assert_still_serving()


def test_daemonised_children_dead_after_call():
    token = "mrl-code-daemon-" + uuid.uuid4().hex
    code = ("import os, sys\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(99)', {token!r}])\n"
            "    os._exit(0)\n" + PY_ADD)
    r = run_tests(code, ADD_TESTS[:2])
    assert r.passed, r
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                assert token.encode() not in f.read(), f"daemon {pid} survived"
        except OSError:
            pass
    assert_still_serving()


def test_host_secrets_unreadable_and_writes_outside_tmp_fail(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("S3CRET")
    proj = os.path.join(os.getcwd(), f".sandbox_secret_{uuid.uuid4().hex}")
    with open(proj, "w") as f:
        f.write("S3CRET")
    try:
        reads = [str(secret), proj, "/etc/shadow", "/root/.bashrc", "/root/.ssh/id_rsa"]
        writes = ["/x", "/usr/bin/x", str(tmp_path / "w"), "/box/x", os.path.join(os.getcwd(), "w")]
        code = ("import sys\nfor p in %r:\n    try: print(open(p).read())\n"
                "    except OSError: print('no')\nfor p in %r:\n"
                "    try: open(p, 'w').write('x'); print('wrote')\n    except OSError: print('no')\n"
                % (reads, writes))
        r = run_tests(code, [{"input": "", "output": "no\n" * (len(reads) + len(writes))}])
        assert r.passed, r  # every read and every write was refused
        assert not (tmp_path / "w").exists() and not os.path.exists(os.path.join(os.getcwd(), "w"))
    finally:
        os.remove(proj)
    assert_still_serving()


def test_loopback_listener_unreachable():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.setblocking(False)
    try:
        code = ("import socket\ntry:\n"
                f"    socket.create_connection(('127.0.0.1', {srv.getsockname()[1]}), timeout=2)\n"
                "    print('connected')\nexcept OSError:\n    print('no network')\n")
        r = run_tests(code, [{"input": "", "output": "no network\n"}])
        assert r.passed, r
        with pytest.raises(BlockingIOError):
            srv.accept()
    finally:
        srv.close()
    assert_still_serving()


def test_killing_parent_and_everything():
    me = os.getpid()
    r = run_tests(f"import os\nos.kill(os.getppid(), 9)\ntry:\n    os.kill({me}, 9)\n"
                  "except OSError:\n    pass\n" + PY_ADD, ADD_TESTS[:2])
    assert r.passed, r  # signals to the sandbox init are ignored; the host pid does not exist there
    r = run_tests("import os, time\nif os.fork() == 0:\n    time.sleep(30)\ntime.sleep(0.3)\n"
                  "os.kill(-1, 9)\n" + PY_ADD, ADD_TESTS[:2])
    assert r.passed, r
    r = run_tests('#include <csignal>\n#include <unistd.h>\nint main(){ kill(getppid(), 9);'
                  ' kill(-1, 9); return 0; }', ADD_TESTS[:1], "cpp", **FAST)
    assert r.status == "wrong_answer", r  # it ran, printed nothing, and harmed no one
    assert_still_serving()


def test_template_bomb_hits_compile_timeout():
    bomb = ("template <int N> struct Spin { static constexpr long f(long s) {\n"
            "  for (long i = 0; i < 200000; ++i) for (long j = 0; j < 200000; ++j) s += i ^ j;\n"
            "  return s; } };\nconstexpr long v = Spin<0>::f(1);\n"
            "template <int A, int B> struct P { static constexpr long x = P<A-1,B>::x + P<A,B-1>::x; };\n"
            "template <int B> struct P<0, B> { static constexpr long x = 1; };\n"
            "template <int A> struct P<A, 0> { static constexpr long x = 1; };\n"
            "int main() { return (int)(v + P<300, 300>::x) & 1; }\n")
    r = run_tests(bomb, ADD_TESTS, "cpp", compile_timeout_s=2.0)
    assert (r.status, r.n_passed, r.test_s) == ("compile_timeout", 0, []), r
    assert_still_serving()


def test_missing_bwrap_is_sandbox_unavailable_not_a_verdict(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap anywhere
    r = run_tests(PY_ADD, ADD_TESTS)
    assert (r.passed, r.status, r.graded) == (False, "sandbox_unavailable", False) and "bwrap" in r.message
    assert r.sandboxed  # nothing ran at all
    # Explicit opt-in: runs with rlimits + uid drop only, and says so.
    r = run_tests(PY_ADD, ADD_TESTS[:2], allow_unsandboxed=True)
    assert (r.passed, r.status, r.sandboxed) == (True, "ok", False), r
    r = run_tests("while True:\n    pass", ADD_TESTS[:1], allow_unsandboxed=True, test_timeout_s=1)
    assert (r.status, r.sandboxed) == ("timeout", False), r


FORK_HOLD = ("import os, time\nkids = []\nfor _ in range(6):\n    pid = os.fork()\n    if pid == 0:\n"
             "        held = b'\\x01' * ({mb} << 20)  # written: resident\n        time.sleep(3)\n        os._exit(0)\n"
             "    kids.append(pid)\nfor pid in kids:\n    os.waitpid(pid, 0)\n" + PY_ADD)


def test_forked_processes_share_one_memory_limit():
    # RLIMIT_AS bounds each process: six children of 120 MB each stay under 256 MB apiece, 720 MB in all
    # (with nproc 64 x 1 GB such a program could hold 64 GB of the host). The sandbox's sum is bounded too.
    r = run_tests(FORK_HOLD.format(mb=120), ADD_TESTS[:1], memory_mb=256, test_timeout_s=8)
    assert (r.passed, r.status) == (False, "memory") and r.test_s[0] < 3, r
    r = run_tests(FORK_HOLD.format(mb=8), ADD_TESTS[:1], memory_mb=256, test_timeout_s=8)
    assert r.passed, r  # forking itself is fine: 6 x 8 MB fit
    assert_still_serving()


def test_code_that_is_not_unicode_text_is_a_compile_error_not_a_verifier_crash():
    # A lone surrogate (a JSON "\ud800" escape in a tool call decodes to one) has no UTF-8 form: the file
    # holds its 3 bytes and Python rejects the source, as it rejects any invalid UTF-8.
    r = run_tests("s = '\ud800'\n" + PY_ADD, ADD_TESTS[:2])
    assert (r.passed, r.status) == (False, "compile_error") and "UTF-8" in r.message, r
    r = run_tests("// \ud800\n" + CPP_ADD, ADD_TESTS[:2], "cpp", **FAST)  # g++ reads a comment's bytes as such
    assert r.passed, r


def test_grading_one_program_has_a_total_time_budget():
    # Each test is within its own limit, but 10 of them outlast the budget: graded (timeout at the test in
    # flight) instead of running past a verifier pool's per-item deadline, which leaves no verdict at all.
    slow = "import time\ntime.sleep(0.6)\n" + PY_ADD
    r = run_tests(slow, ADD_TESTS * 2, max_tests=10, test_timeout_s=1.5, total_timeout_s=2.5)
    assert (r.passed, r.status, r.first_failed) == (False, "timeout", r.n_passed) and 1 <= r.n_passed <= 3, r
    assert r.total_s < 4, r
    assert run_tests(slow, ADD_TESTS[:2], test_timeout_s=1.5, total_timeout_s=20).passed
    assert CodeLimits().total_timeout_s is None  # the API alone: no budget unless asked
    lim = CodeLimits.from_config(RewardConfig(verifier_item_timeout_s=60.0))
    assert lim.total_timeout_s == 45.0 < lim.test_timeout_s * lim.max_tests  # 3/4 of the pool's deadline
    with pytest.raises(ValueError):
        CodeLimits(total_timeout_s=0)


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the i386 ABI of an x86_64 process")
def test_refused_calls_stay_refused_through_the_32_bit_abi():
    # int 0x80 names SysV IPC by other numbers (ipc(SHMGET, ...)): the filter refuses any other ABI.
    cpp = ("#include <cstdio>\n#include <sys/shm.h>\nint main() { long r;\n"
           "  asm volatile(\"int $0x80\" : \"=a\"(r) : \"a\"(117L), \"b\"(23L), \"c\"(0L), \"d\"(1L << 20),"
           " \"S\"(01600L) : \"memory\");\n"
           "  std::printf(\"%ld %d\\n\", r, shmget(IPC_PRIVATE, 1 << 20, IPC_CREAT | 0600)); }\n")
    r = run_tests(cpp, [{"input": "", "output": "-1 -1\n"}], "cpp", **FAST)  # -EPERM both ways
    assert r.passed, r
