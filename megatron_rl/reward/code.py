"""Code verifier: compile (C++) and run (Python, C++) a program on stdin/stdout tests in the sandbox.

``run_tests(code, tests, language)`` -> ``CodeResult``. All tests must pass (no partial credit);
grading stops at the first failing test. (Python function-call tests -- calls with expected results,
assert code -- are graded by reward.calls, into the same CodeResult.) Every test runs in a fresh sandbox (megatron_rl.reward
.sandbox); C++ is compiled once in its own sandbox with a writable /box, then /box is read-only.

Output comparison (``outputs_match``): both sides are decoded as UTF-8 (bad bytes replaced), CRLF
becomes LF, trailing whitespace at the end of every line is ignored, and trailing empty lines are
ignored. Leading and inner whitespace, blank lines in the middle, and letter case are significant.

Statuses: ok, compile_error, compile_timeout, wrong_answer, timeout (wall or CPU limit, or the
program's total_timeout_s spent), runtime_error, memory (MemoryError / std::bad_alloc under the
address-space limit, or the sandbox's processes together over memory_mb), output_limit,
unsupported_language, and sandbox_unavailable: bwrap missing, user namespaces refused, the sandbox
setup failed, or no compiler. The program never ran, so that status is a grading FAILURE, not a
wrong answer (``CodeResult.graded`` is False; reward.score reports it as its own status).
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field

from megatron_rl.reward.sandbox import BOX, Jail, RunOutcome, available
from megatron_rl.reward.sandbox_proc import RLimits

SANDBOX_UNAVAILABLE = "sandbox_unavailable"
TOTAL_SHARE = 0.75  # CodeLimits.from_config: share of the verifier's per-item deadline for one program
PYTHON_TAGS = {"python", "python3", "py", "py3"}
CPP_TAGS = {"cpp": "c++17", "c++": "c++17", "cxx": "c++17", "cc": "c++17", "cpp11": "c++11",
            "cpp14": "c++14", "cpp17": "c++17", "cpp20": "c++20", "c++11": "c++11",
            "c++14": "c++14", "c++17": "c++17", "c++20": "c++20"}


@dataclass(frozen=True)
class CodeLimits:
    """Limits of one ``run_tests`` call (defaults = RewardConfig's)."""

    compile_timeout_s: float = 10.0
    test_timeout_s: float = 4.0  # wall clock and CPU, per test
    max_tests: int = 20
    memory_mb: int = 1024  # address space of the program
    max_output_bytes: int = 1 << 20  # stdout + stderr per test
    compile_memory_mb: int = 2048  # cc1plus needs more than a contest program
    nproc: int = 64
    fsize_mb: int = 16
    # Without bwrap/user namespaces the answer is sandbox_unavailable. True = run anyway with rlimits and
    # a uid drop only (no filesystem/network isolation); the result then says sandboxed=False.
    allow_unsandboxed: bool = False
    # Wall clock for grading one program in all (compile, every test; function calls: test code expanded
    # too), None = no bound. Past it the test in flight is "timeout" and no later test runs: a verdict,
    # where a verifier pool's per-item deadline would leave none. from_config: TOTAL_SHARE of that deadline.
    total_timeout_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("compile_timeout_s", "test_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"CodeLimits.{name} must be > 0, got {getattr(self, name)!r}")
        if self.total_timeout_s is not None and not self.total_timeout_s > 0:
            raise ValueError(f"CodeLimits.total_timeout_s must be > 0 or None, got {self.total_timeout_s!r}")
        for name, lo in (("max_tests", 1), ("memory_mb", 16), ("max_output_bytes", 1),
                         ("compile_memory_mb", 64), ("nproc", 4), ("fsize_mb", 1)):
            if int(getattr(self, name)) < lo:
                raise ValueError(f"CodeLimits.{name} must be >= {lo}, got {getattr(self, name)!r}")

    @classmethod
    def from_config(cls, cfg, **overrides) -> "CodeLimits":
        """From a ``megatron_rl.config.RewardConfig`` (values passed in, no global state). Grading one
        program gets TOTAL_SHARE of reward.verifier_item_timeout_s: 20 tests x 4 s would outlast the
        pool's 60 s, and an item past that deadline has no verdict (its group is dropped), so a slow
        wrong program would escape its zero."""
        return cls(**{"compile_timeout_s": cfg.code_compile_timeout_s, "test_timeout_s": cfg.code_test_timeout_s,
                      "max_tests": cfg.code_max_tests, "memory_mb": cfg.code_memory_mb,
                      "max_output_bytes": cfg.code_max_output_bytes,
                      "total_timeout_s": TOTAL_SHARE * cfg.verifier_item_timeout_s, **overrides})

    def deadline(self, t0: float) -> float:
        """The time.perf_counter() by which grading that started at ``t0`` must end (inf: none)."""
        return math.inf if self.total_timeout_s is None else t0 + self.total_timeout_s


def wall_left(limit_s: float, end: float) -> float:
    """Wall clock for the next run: its own limit, or what is left before the grading deadline ``end``
    (0 once it has passed)."""
    return max(0.0, min(limit_s, end - time.perf_counter()))


@dataclass
class CodeResult:
    passed: bool
    n_passed: int
    n_tests: int  # tests considered (at most max_tests)
    status: str
    language: str = ""
    first_failed: int | None = None  # index of the first failing test
    message: str = ""  # compiler output / stderr tail / expected vs got (truncated)
    compile_s: float = 0.0
    test_s: list[float] = field(default_factory=list)  # wall time of each test run
    total_s: float = 0.0
    sandboxed: bool = True  # False only with allow_unsandboxed=True on a host without a sandbox
    test_statuses: list[str] = field(default_factory=list)  # function-call tests: the status of each test

    @property
    def graded(self) -> bool:
        """False when the program could not be run at all: ``passed`` is then no verdict."""
        return self.status != SANDBOX_UNAVAILABLE


@dataclass(frozen=True)
class Toolchain:
    """Interpreters/compilers used inside the sandbox. The Python default is the project's own
    base interpreter (the venv's python is a symlink into a pyenv prefix, which is bound read-only)."""

    python: str = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    python_prefix: str = sys.base_prefix
    gxx: str | None = shutil.which("g++")

    def jail(self, language: str = "python") -> Jail:
        """C++ needs only /usr; Python also its prefix (binding one under an unreachable home costs
        a private mount namespace per run, ~15 ms, so C++ runs skip it)."""
        prefix = os.path.realpath(self.python_prefix)
        if language not in PYTHON_TAGS or prefix.startswith("/usr/"):
            return Jail()
        return Jail(ro_paths=(prefix,))


_JAILS: dict[tuple[Toolchain, str], Jail] = {}


def limits_with(limits: CodeLimits | None, overrides: dict) -> CodeLimits:
    """``limits`` (default CodeLimits()) with some fields replaced (TypeError for an unknown one)."""
    lim = limits or CodeLimits()
    return CodeLimits(**{**lim.__dict__, **overrides}) if overrides else lim


def sandbox_for(tc: Toolchain, kind: str, lim: CodeLimits) -> tuple[Jail | None, bool, str]:
    """(jail, sandboxed, why) for running ``kind`` ("python" / "cpp") programs: jail None and the reason
    when no sandbox runs here; a bare jail (sandboxed False) only with lim.allow_unsandboxed."""
    jail = _JAILS.setdefault((tc, kind), tc.jail(kind))
    ok, why = available(jail)
    if ok:
        return jail, True, ""
    if not lim.allow_unsandboxed:
        return None, True, why
    return Jail(bare=True, ro_paths=jail.ro_paths), False, ""


def normalize_output(text: str | bytes) -> list[str]:
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    lines = [ln.rstrip() for ln in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def outputs_match(got: str | bytes, expected: str | bytes) -> bool:
    return normalize_output(got) == normalize_output(expected)


def _check_tests(tests) -> list[tuple[bytes, str | bytes]]:
    if not isinstance(tests, (list, tuple)) or not tests:
        raise ValueError("tests must be a non-empty list of {'input': ..., 'output': ...}")
    out = []
    for i, t in enumerate(tests):
        if not isinstance(t, dict) or "input" not in t or "output" not in t:
            raise ValueError(f"tests[{i}] must be a dict with 'input' and 'output', got {t!r:.80}")
        inp, exp = t["input"], t["output"]
        if not isinstance(inp, (str, bytes)) or not isinstance(exp, (str, bytes)):
            raise ValueError(f"tests[{i}]: 'input' and 'output' must be str or bytes")
        out.append((inp.encode() if isinstance(inp, str) else inp, exp))
    return out


def _tail(b: bytes, n: int = 600) -> str:
    return b.decode("utf-8", errors="replace")[-n:]


def rlimits(lim: CodeLimits, timeout_s: float, memory_mb: int, fsize_mb: int) -> RLimits:
    return RLimits(cpu_s=max(1, math.ceil(timeout_s)), memory_mb=memory_mb, nproc=lim.nproc,
                   fsize_mb=fsize_mb, nofile=64, stack_mb=min(256, memory_mb // 2))


def _is_memory_failure(out: RunOutcome) -> bool:
    err = out.stderr.decode("utf-8", errors="replace")
    return any(s in err for s in ("MemoryError", "std::bad_alloc", "Cannot allocate memory",
                                  "out of memory"))


def _is_python_syntax_error(out: RunOutcome) -> bool:
    # A SyntaxError of the script itself is printed without a traceback header; one raised at run
    # time (eval, compile) has "Traceback (most recent call last)".
    err = out.stderr.decode("utf-8", errors="replace")
    last = err.strip().splitlines()[-1] if err.strip() else ""
    return (out.exit_code == 1 and "Traceback (most recent call last)" not in err
            and last.split(":")[0] in ("SyntaxError", "IndentationError", "TabError"))


def classify(out: RunOutcome) -> str:
    """Status of one test run that did not pass for a sandbox/limit/crash reason, or "" if the
    program exited 0 (the output still has to be compared)."""
    if out.setup_error is not None:
        return SANDBOX_UNAVAILABLE
    if out.output_exceeded:
        return "output_limit"
    if out.memory_exceeded:
        return "memory"
    if out.timed_out or out.signal == signal.SIGXCPU:
        return "timeout"
    if out.exit_code != 0:
        return "memory" if _is_memory_failure(out) else "runtime_error"
    return ""


def run_tests(code: str, tests: list[dict], language: str = "python",
              limits: CodeLimits | None = None, toolchain: Toolchain | None = None,
              **overrides) -> CodeResult:
    """Grade ``code`` on ``tests``; ``overrides`` are CodeLimits fields (e.g. test_timeout_s=2)."""
    t0 = time.perf_counter()
    if not isinstance(code, str):
        raise ValueError(f"code must be str, got {type(code).__name__}")
    checked = _check_tests(tests)
    lim = limits_with(limits, overrides)
    tc = toolchain or Toolchain()
    end = lim.deadline(t0)
    checked = checked[: lim.max_tests]
    n = len(checked)
    tag = language.strip().lower() if isinstance(language, str) else str(language)

    sandboxed = True

    def done(status: str, **kw) -> CodeResult:
        return CodeResult(passed=status == "ok", n_tests=n, status=status, language=tag,
                          total_s=time.perf_counter() - t0, sandboxed=sandboxed, **kw)

    if tag not in PYTHON_TAGS and tag not in CPP_TAGS:
        return done("unsupported_language", n_passed=0, message=f"language {language!r}")
    jail, sandboxed, why = sandbox_for(tc, "python" if tag in PYTHON_TAGS else "cpp", lim)
    if jail is None:
        return done(SANDBOX_UNAVAILABLE, n_passed=0, message=why)

    compile_s = 0.0
    with jail.workspace() as ws:
        if tag in PYTHON_TAGS:
            write_file(ws, "main.py", code)
            cmd = [tc.python, "-I", f"{BOX}/main.py"]
        else:
            if tc.gxx is None:
                return done(SANDBOX_UNAVAILABLE, n_passed=0, message="g++ not found")
            write_file(ws, "main.cpp", code)
            comp = jail.run([tc.gxx, f"-std={CPP_TAGS[tag]}", "-O2", "-pipe", "-o", f"{BOX}/prog",
                             f"{BOX}/main.cpp"], rlimits=rlimits(lim, lim.compile_timeout_s,
                            lim.compile_memory_mb, 256), wall_s=wall_left(lim.compile_timeout_s, end),
                            max_output=64 << 10, workspace=ws, writable=True, cwd=BOX)
            compile_s = comp.wall_s
            bad = classify(comp)
            if bad:
                status = {"timeout": "compile_timeout", SANDBOX_UNAVAILABLE: SANDBOX_UNAVAILABLE}.get(
                    bad, "compile_error")
                return done(status, n_passed=0, compile_s=compile_s,
                            message=comp.setup_error or _tail(comp.stderr))
            cmd = [f"{BOX}/prog"]

        rl = rlimits(lim, lim.test_timeout_s, lim.memory_mb, lim.fsize_mb)
        times: list[float] = []
        for i, (inp, expected) in enumerate(checked):
            wall_s = wall_left(lim.test_timeout_s, end)
            if wall_s <= 0:
                return done("timeout", n_passed=i, first_failed=i, compile_s=compile_s, test_s=times,
                            message=f"grading time spent (total_timeout_s={lim.total_timeout_s})")
            out = jail.run(cmd, stdin=inp, rlimits=rl, wall_s=wall_s,
                           max_output=lim.max_output_bytes, workspace=ws, writable=False)
            times.append(out.wall_s)
            status = classify(out)
            if status == "runtime_error" and tag in PYTHON_TAGS and i == 0 and \
                    _is_python_syntax_error(out):
                status = "compile_error"
            if not status and not outputs_match(out.stdout, expected):
                status = "wrong_answer"
                msg = f"expected {_short(expected)!r}, got {_short(out.stdout)!r}"
            else:
                msg = out.setup_error or _tail(out.stderr)
            if status:
                return done(status, n_passed=i, first_failed=i, message=msg, compile_s=compile_s,
                            test_s=times)
    return done("ok", n_passed=n, compile_s=compile_s, test_s=times)


def _short(s: str | bytes, n: int = 120) -> str:
    s = s.decode("utf-8", errors="replace") if isinstance(s, bytes) else s
    return s if len(s) <= n else s[:n] + "..."


def write_file(ws: str, name: str, text: str) -> None:
    """A file of the workspace, readable by the sandbox uid. UTF-8; a lone surrogate (a str that is no
    valid Unicode text, e.g. from a JSON "\\ud800" escape) is written as its 3 bytes, which no UTF-8
    decoder accepts: the toolchain rejects that source as it would any invalid UTF-8 (Python: a
    SyntaxError, compile_error), instead of the verifier raising UnicodeEncodeError."""
    path = os.path.join(ws, name)
    with open(path, "w", encoding="utf-8", errors="surrogatepass") as f:
        f.write(text)
    os.chmod(path, 0o644)


# A program whose right answer cannot come from anything but running it on this stdin.
_PROBES = {"python": "import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))\n",
           "cpp": "#include <iostream>\nint main(){ long s = 0, x; while (std::cin >> x) s += x;"
                  " std::cout << s << '\\n'; }\n"}


def sandbox_probe(language: str = "python") -> tuple[bool, str]:
    """Grade a tiny program exactly as training would (same sandbox, same toolchain): (True, "") when
    it ran and printed the right answer, else (False, why) with the sandbox's own error on one line.
    "python" needs no compiler; "cpp" also checks that g++ works inside the sandbox."""
    if language not in _PROBES:
        raise ValueError(f"sandbox_probe: language must be one of {sorted(_PROBES)}, got {language!r}")
    r = run_tests(_PROBES[language], [{"input": "20 15 7\n", "output": "42\n"}], language)
    if r.status == "ok":
        return True, ""
    why = " ".join(r.message.split())
    return False, f"{language} sandbox probe: {r.status}: {why[:400]}"
