"""Task schema and the reward breakdown: the one place that defines what `reward.score` accepts.

Task dicts (``Problem.task`` in megatron_rl.records) are validated by :func:`parse_task`:

math::

    {"kind": "math", "answer": "42", "problem": "What is 6*7?"}

    answer   (required) reference answer, a string (ints/floats are converted with ``str``);
             it is compared to the last ``\\boxed{}`` of the response by reward.math.math_equal.
code::

    {"kind": "code", "language": "python", "tests": [{"input": "1 2\\n", "output": "3\\n"}],
     "problem": "Read two integers and print their sum."}
    {"kind": "code", "tests": [{"function": "add", "args": [1, 2], "expected": 3}], "problem": "..."}
    {"kind": "code", "tests": "def check(candidate):\\n    assert candidate(1, 2) == 3\\n", "entry_point": "add"}

    language "python" (default) or "cpp"; the response must contain a fenced block in it.
    tests    (required) stdin/stdout tests: a non-empty list of {"input": stdin, "output": expected
             stdout}, both strings; or, for Python, function-call tests in the forms of
             reward.call_tests (call dicts, assert code); only the first RewardConfig.code_max_tests
             are run (all must pass for the reward).
    entry_point  (optional, Python) the function the tests' ``candidate`` stands for (HumanEval's
             ``def check(candidate)``), and the default ``function`` of call dicts.

Common optional keys: ``problem`` (the problem text, used by the language-consistency check; when
absent or empty, only thoughts and answer are compared), ``id`` and ``source`` (strings),
``meta`` (a dict, free-form, ignored by the grader). Any other key is an error, so a typo such as
``langauge`` never silently grades a C++ task as Python.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any, Literal

from megatron_rl.config import LengthStage
from megatron_rl.reward.call_tests import is_call_tests, parse_call_tests
from megatron_rl.reward.call_types import TARGET, CallSuite, TestFormError

CODE_LANGUAGES = ("python", "cpp")
_COMMON_OPTIONAL = {"problem", "id", "source", "meta"}


class TaskError(ValueError):
    """A task dict does not follow the schema documented in megatron_rl.reward.types. ``key``: the task
    key at fault when one is (the data loader names the column it came from)."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class MathTask:
    answer: str
    problem: str = ""
    kind: Literal["math"] = "math"


@dataclass(frozen=True)
class CodeTask:
    tests: tuple[dict[str, str], ...]  # stdin/stdout tests; () when the tests are function calls
    language: str = "python"
    problem: str = ""
    kind: Literal["code"] = "code"
    calls: CallSuite | None = None  # function-call tests (reward.call_tests), graded by reward.calls
    entry_point: str | None = None


Task = MathTask | CodeTask

class GradeStatus(StrEnum):
    """What became of grading one item: OK = graded (a verdict, correct or not); every other status
    names what stopped the grading, and the item has no verdict. A StrEnum: it compares equal to, and
    is written (metric keys, JSON) as, its value."""

    OK = "ok"
    TIMEOUT = "timeout"  # the verifier pool's per-item limit
    CRASH = "crash"  # the grading process died on every attempt
    ERROR = "error"  # the grading function raised
    SANDBOX_UNAVAILABLE = "sandbox_unavailable"  # score: the code sandbox could not run the program


GRADING_FAILURES = tuple(s for s in GradeStatus if s is not GradeStatus.OK)


@dataclass(frozen=True)
class ScoreItem:
    """One response for the verifier pool (`VerifierPool.map`), typed. `stage`: the length stage it was
    generated under, whose overlong-penalty window (`l_max`, `l_cache`) grades it; None: the config's
    window (reward.l_max / l_cache)."""

    task: dict[str, Any] | Task
    response: str
    num_tokens: int | None = None
    stage: LengthStage | None = None


@dataclass
class RewardBreakdown:
    """Components of one reward. ``total`` is what the trainer uses; the rest explains it.

    format_ok is False -> everything else is 0/False (nothing else was graded).
    ``language_ok`` None: the language was not checked (``reward.language_check: false``); it is then
    left out of the reward components, so no metric reads it as a failed check.
    ``status`` "ok": the item was graded, and ``correct`` / ``total`` are its verdict. Any other
    status means grading FAILED and ``total`` (0) is no reward: "sandbox_unavailable" (score: the
    code sandbox could not run, so the program never ran), or, set by the verifier pool, "timeout" /
    "crash" / "error" (grader exception). ``error`` says why; ``grading_failed`` tells the two apart.
    """

    format_ok: bool = False
    correct: bool = False
    length_penalty: float = 0.0  # <= 0
    language_ok: bool | None = False
    total: float = 0.0
    status: GradeStatus = GradeStatus.OK
    num_tokens: int = 0  # response length the length penalty used
    num_tokens_estimated: bool = False  # True when estimated from characters (no num_tokens given)
    elapsed_s: float = 0.0  # wall time spent grading this item
    error: str = ""
    details: dict[str, Any] = field(default_factory=dict)  # e.g. code status, n_passed, languages

    def __post_init__(self) -> None:
        self.status = GradeStatus(self.status)  # a plain string (a plug-in's) becomes the enum; unknown: ValueError

    @property
    def grading_failed(self) -> bool:
        """True when no verdict exists (status other than "ok"): such an item must not be trained on."""
        return self.status is not GradeStatus.OK

    def components(self) -> dict[str, float]:
        """The numeric components a rollout carries into the metrics (`reward/<name>`, `COMPONENTS`);
        an unchecked language (None) is left out."""
        return {k: float(getattr(self, k)) for k in COMPONENTS if getattr(self, k) is not None}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


COMPONENTS = ("format_ok", "correct", "length_penalty", "language_ok")


def _str_field(task: dict, key: str, default: str = "") -> str:
    value = task.get(key, default)
    if value is None:
        return default
    if not isinstance(value, str):
        raise TaskError(f"task[{key!r}] must be a string, got {type(value).__name__}")
    return value


def _check_keys(task: dict, allowed: set[str], kind: str) -> None:
    unknown = sorted(set(task) - allowed - _COMMON_OPTIONAL - {"kind"})
    if unknown:
        raise TaskError(f"{kind} task: unknown key(s) {unknown} (allowed: "
                        f"{sorted(allowed | _COMMON_OPTIONAL | {'kind'})}; put free-form data under 'meta')")
    if "meta" in task and not isinstance(task["meta"], dict):
        raise TaskError(f"task['meta'] must be a dict, got {type(task['meta']).__name__}")
    for key in ("id", "source"):
        if key in task and task[key] is not None and not isinstance(task[key], (str, int)):
            raise TaskError(f"task[{key!r}] must be a string, got {type(task[key]).__name__}")


def _parse_tests(tests: Any) -> tuple[dict[str, str], ...]:
    if not isinstance(tests, (list, tuple)) or not tests:
        raise TaskError("code task: 'tests' must be a non-empty list of {'input': ..., 'output': ...} (or, for "
                        "Python, function-call tests: reward.call_tests)", "tests")
    out = []
    for i, t in enumerate(tests):
        if not isinstance(t, dict) or set(t) != {"input", "output"}:
            got = sorted(t) if isinstance(t, dict) else type(t).__name__
            raise TaskError(f"code task: tests[{i}] must be a dict with exactly 'input' and 'output', got {got}",
                            "tests")
        for key in ("input", "output"):
            if not isinstance(t[key], str):
                raise TaskError(f"code task: tests[{i}][{key!r}] must be a string, "
                                f"got {type(t[key]).__name__}", "tests")
        out.append({"input": t["input"], "output": t["output"]})
    return tuple(out)


def _parse_code_task(task: dict) -> CodeTask:
    _check_keys(task, {"language", "tests", "entry_point"}, "code")
    language = _str_field(task, "language", "python")
    if language not in CODE_LANGUAGES:
        raise TaskError(f"code task: 'language' must be one of {list(CODE_LANGUAGES)}, got {language!r}", "language")
    entry = task.get("entry_point")
    if entry is not None and not (isinstance(entry, str) and TARGET.fullmatch(entry)):
        raise TaskError(f"code task: 'entry_point' must be a function name or Class.method, got {entry!r:.80}",
                        "entry_point")
    if "tests" not in task:
        raise TaskError("code task: missing 'tests'", "tests")
    problem = _str_field(task, "problem")
    if not is_call_tests(task["tests"]):
        return CodeTask(tests=_parse_tests(task["tests"]), language=language, problem=problem)
    if language != "python":
        raise TaskError(f"code task: function-call tests are graded for Python only, not {language!r}", "tests")
    try:
        suite = parse_call_tests(task["tests"], entry)
    except TestFormError as e:
        raise TaskError(f"code task: {'' if str(e).startswith('tests[') else 'tests: '}{e}", "tests") from None
    return CodeTask(tests=(), language=language, problem=problem, calls=suite, entry_point=entry)


def parse_task(task: Any) -> Task:
    """Validate a task dict and return its typed form; raises TaskError with the offending key."""
    if isinstance(task, (MathTask, CodeTask)):
        return task
    if not isinstance(task, dict):
        raise TaskError(f"task must be a dict, got {type(task).__name__}")
    kind = task.get("kind")
    if kind == "math":
        _check_keys(task, {"answer"}, "math")
        if "answer" not in task or task["answer"] is None:
            raise TaskError("math task: missing 'answer'")
        answer = task["answer"]
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise TaskError(f"math task: 'answer' must be a string or number, got {type(answer).__name__}")
        answer = str(answer).strip()
        if not answer:
            raise TaskError("math task: 'answer' is empty")
        return MathTask(answer=answer, problem=_str_field(task, "problem"))
    if kind == "code":
        return _parse_code_task(task)
    raise TaskError(f"task['kind'] must be 'math' or 'code', got {kind!r}")
