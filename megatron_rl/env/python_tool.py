"""The ``python`` tool environment: the model runs Python code in the bubblewrap sandbox between turns.

**Tool-call format** (one format: Hermes, the one Qwen chat templates describe and Qwen models emit)::

    <tool_call>
    {"name": "python", "arguments": {"code": "print(123 * 456)"}}
    </tool_call>

Every ``<tool_call>`` block of a turn is one call, run in order; each gets one observation message
``{"role": "tool", "content": <what the run printed, then a bracketed note if it failed>}``. The JSON
is read leniently where models commonly slip: raw newlines inside strings, ``arguments`` given as a
JSON-encoded string (OpenAI style), a missing ``</tool_call>`` at the very end of the turn (a stop
string cut it), and code wrapped in a ``` fence inside the string. A block that still cannot be read,
another tool name or a missing ``code`` is an observation saying so (status ``invalid``), not an
exception. A turn without ``<tool_call>`` is the final answer: the episode ends (``done``,
``reward=None``), and that turn is graded by ``megatron_rl.reward.score(task, turn)``.

**State across calls**: each call is a fresh Python process (``python -u -E -s -``, the program on
stdin) in the episode's own workspace, mounted writable at ``/box`` and used as the working
directory. *Files* written there persist across the calls of the episode (and ``/box`` is on
``sys.path``, so a module written there can be imported); *variables, imports and processes* do not:
a later call that needs a value recomputes it or reads it from a file. The tool's description
(:data:`PYTHON_TOOL`, for ``apply_chat_template(tools=...)``) tells the model so. Chosen over replaying
earlier cells (notebook-like variables) because a replay re-runs side effects (a file appended to
twice), redraws randomness and the clock, so the state the model saw could silently differ from the
replayed one, and its cost grows with the square of the number of calls; over a long-lived
interpreter because the sandbox runs each program in a fresh namespace and kills it whole at its
deadline. ``close()`` deletes the workspace. When a resumed run continues an episode, a new workspace
is rebuilt by replaying the episode's calls (``megatron_rl.rollout.episode``); a call whose output
depends on randomness or the clock answers differently then, and the episode starts over.

**Limits** (constructor parameters): ``timeout_s`` wall clock and CPU per call; ``memory_mb`` address
space; ``max_output_bytes`` of stdout + stderr (merged, in order) -- past it the program is stopped and
the observation says so; ``fsize_mb`` per file; ``workspace_mb`` for the workspace as a whole (checked
after each call: past it, the files are deleted and the observation says so); ``max_tool_calls`` runs
per episode (calls that could not be read do not count; a turn that calls a tool after the limit ends
the episode, ``info["stop"] == "max_tool_calls"``, and is graded as its final answer; calls of a turn
beyond the limit are not run and say so). No network: the sandbox has an empty network namespace (not even loopback to the host).
At most ``slots.limit`` calls run at once in the process (:mod:`megatron_rl.env.slots`; the ``slots``
parameter, default the process-wide :func:`~megatron_rl.env.slots.shared_slots`).

What the model sees: a timeout, an exception (the traceback), a non-zero exit, a signal, the output
or workspace cap. What raises (:class:`~megatron_rl.env.base.EnvFailure`, the episode fails): the
sandbox being unavailable at ``reset`` (bwrap missing, namespaces refused) or failing to start a run.

``info`` of each step: ``tool_calls`` (calls in the turn), ``tool_statuses`` (per call: ok, error,
timeout, output_limit, invalid, over_limit), ``tool_errors`` (not ok, timeouts excepted),
``tool_timeouts``, ``tool_s`` (sandbox wall time), ``tool_wait_s`` (waiting for a slot), and when done
``stop`` ("answer" or "max_tool_calls") and ``tool_calls_total``.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
from dataclasses import dataclass, field
from typing import Any

from megatron_rl.env.base import Environment, EnvFailure, Message, StepResult
from megatron_rl.env.slots import ToolSlots, shared_slots
from megatron_rl.reward.code import Toolchain
from megatron_rl.reward.sandbox import BOX, RunOutcome, available
from megatron_rl.reward.sandbox_proc import RLimits

TOOL_NAME = "python"
OPEN, CLOSE = "<tool_call>", "</tool_call>"

PYTHON_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": (
            "Run Python 3 code in a sandbox and return what it prints (stdout and stderr). Each call is "
            "a new process: variables do not persist between calls, but files written in the working "
            "directory do. No network. Print the values you need to see."),
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The Python code to run."}},
            "required": ["code"],
        },
    },
}


@dataclass(frozen=True)
class ToolCall:
    """One ``<tool_call>`` block of a turn: its name and arguments, or why it could not be read."""

    name: str | None
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str = ""  # "" = well-formed


def _read_call(body: str) -> ToolCall:
    expected = f'expected {OPEN}{{"name": "{TOOL_NAME}", "arguments": {{"code": "..."}}}}{CLOSE}'
    try:
        obj = json.loads(body.strip(), strict=False)  # strict=False: raw newlines in strings
    except json.JSONDecodeError as e:
        return ToolCall(None, error=f"the tool call is not valid JSON ({e.msg}: line {e.lineno} "
                                    f"column {e.colno}); {expected}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall(None, error=f"the tool call has no \"name\"; {expected}")
    args = obj.get("arguments", {})
    if isinstance(args, str):  # OpenAI style: arguments as a JSON-encoded string
        try:
            args = json.loads(args, strict=False)
        except json.JSONDecodeError:
            pass
    if not isinstance(args, dict):
        return ToolCall(obj["name"], error=f"\"arguments\" must be a JSON object; {expected}")
    return ToolCall(obj["name"], args)


def parse_tool_calls(turn: str) -> list[ToolCall]:
    """Every ``<tool_call>...</tool_call>`` block of ``turn`` in order ([] = no tool call: an answer).
    A last block without ``</tool_call>`` runs to the end of the turn."""
    calls: list[ToolCall] = []
    pos = 0
    while (start := turn.find(OPEN, pos)) != -1:
        end = turn.find(CLOSE, start + len(OPEN))
        calls.append(_read_call(turn[start + len(OPEN): end if end != -1 else len(turn)]))
        if end == -1:
            break
        pos = end + len(CLOSE)
    return calls


def _strip_fence(code: str) -> str:
    """Code sent as a fenced block inside the JSON string: the fence is dropped."""
    s = code.strip()
    if s.startswith("```") and s.endswith("```") and s.count("\n") >= 1:
        return s[s.index("\n") + 1: -3]
    return code


class PythonTool(Environment):
    """Runs the model's Python tool calls in the sandbox; the final answer is graded by reward.score.
    See the module docstring for the format, the state rule and the limits."""

    tools = [PYTHON_TOOL]

    def __init__(self, *, timeout_s: float = 5.0, memory_mb: int = 1024, max_output_bytes: int = 4096,
                 max_tool_calls: int = 8, fsize_mb: int = 16, workspace_mb: int = 64, nproc: int = 32,
                 slots: ToolSlots | None = None, toolchain: Toolchain | None = None,
                 workspace_dir: str | None = None):
        if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"PythonTool: timeout_s must be > 0, got {timeout_s!r}")
        for name, value, lo in (("memory_mb", memory_mb, 64), ("max_output_bytes", max_output_bytes, 1),
                                ("max_tool_calls", max_tool_calls, 1), ("fsize_mb", fsize_mb, 1),
                                ("workspace_mb", workspace_mb, 1), ("nproc", nproc, 4)):
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ValueError(f"PythonTool: {name} must be an int >= {lo}, got {value!r}")
        self.timeout_s, self.max_output_bytes, self.max_tool_calls = float(timeout_s), max_output_bytes, max_tool_calls
        self.workspace_mb = workspace_mb
        self.rlimits = RLimits(cpu_s=max(1, math.ceil(timeout_s)), memory_mb=memory_mb, nproc=nproc,
                               fsize_mb=fsize_mb, nofile=64, stack_mb=min(64, memory_mb // 4))
        self.slots = slots if slots is not None else shared_slots()
        self.toolchain = toolchain or Toolchain()
        self.jail = self.toolchain.jail("python")
        self.workspace_dir = workspace_dir
        self.workspace: str | None = None  # host path of the episode's /box, from reset to close
        self.calls = 0  # tool calls run so far in the episode
        self._stack = contextlib.ExitStack()
        self._state = "new"

    # ------------------------------------------------------------------ contract
    def reset(self, task: dict[str, Any]) -> list[Message]:
        if self._state != "new":
            raise RuntimeError(f"PythonTool.reset: one episode per environment (this one is {self._state})")
        ok, why = available(self.jail)
        if not ok:
            raise EnvFailure(f"python tool: the sandbox is unavailable: {why}")
        self.workspace = self._stack.enter_context(self.jail.workspace(self.workspace_dir))
        self._state = "running"
        return []

    def step(self, turn: str) -> StepResult:
        if self._state != "running":
            raise RuntimeError(f"PythonTool.step: the episode is {self._state}")
        calls = parse_tool_calls(turn)
        if not calls or self.calls >= self.max_tool_calls:
            self._state = "done"
            return StepResult(done=True, info={
                "stop": "answer" if not calls else "max_tool_calls", "tool_calls": 0,
                "tool_calls_total": self.calls})
        observation: list[Message] = []
        statuses: list[str] = []
        tool_s = wait_s = 0.0
        for call in calls:
            names = [t["function"]["name"] for t in self.tools]
            if call.error:
                content, status = f"[error: {call.error}]", "invalid"
            elif call.name not in names:
                content, status = f"[error: unknown tool {call.name!r}; the tools are {', '.join(map(repr, names))}]", "invalid"
            elif not isinstance(call.arguments.get("code"), str):
                content, status = f'[error: the {call.name} tool needs "arguments": {{"code": "<python source>"}}]', "invalid"
            elif self.calls >= self.max_tool_calls:
                content, status = (f"[not run: the limit of {self.max_tool_calls} tool calls per episode "
                                   "is reached; answer without calling tools]"), "over_limit"
            else:
                self.calls += 1
                content, status, run_s, waited = self._call(call.name, _strip_fence(call.arguments["code"]))
                tool_s, wait_s = tool_s + run_s, wait_s + waited
            observation.append({"role": "tool", "content": content})
            statuses.append(status)
        return StepResult(observation, info={
            "tool_calls": len(calls), "tool_statuses": statuses,
            "tool_errors": sum(s not in ("ok", "timeout") for s in statuses),
            "tool_timeouts": statuses.count("timeout"), "tool_s": tool_s, "tool_wait_s": wait_s})

    def close(self) -> None:
        self._stack.close()  # deletes the workspace (once; a second close does nothing)
        self.workspace = None
        self._state = "closed"

    # ------------------------------------------------------------------ one call
    def _call(self, name: str, code: str) -> tuple[str, str, float, float]:
        """(observation text, status, sandbox wall s, slot wait s) of one well-formed call of tool `name`."""
        out, waited = self._run(code)
        content, status = self._render(out)
        return content, status, out.wall_s, waited

    def _run(self, code: str) -> tuple[RunOutcome, float]:
        # sh only merges stderr into stdout (in order, with python -u) before exec'ing python.
        cmd = ["/bin/sh", "-c", 'exec "$0" -u -E -s - 2>&1', self.toolchain.python]
        with self.slots.hold() as waited:
            out = self.jail.run(cmd, stdin=code.encode("utf-8", errors="replace"), rlimits=self.rlimits,
                                wall_s=self.timeout_s, max_output=self.max_output_bytes,
                                workspace=self.workspace, writable=True, cwd=BOX)
        if out.setup_error is not None:
            raise EnvFailure(f"python tool: the sandbox failed to run the call: {out.setup_error}")
        return out, waited

    def _render(self, out: RunOutcome) -> tuple[str, str]:
        """(observation text, status) of one run: what it printed, then what stopped it."""
        text = out.stdout.decode("utf-8", errors="replace").rstrip("\n")
        status = "ok"
        if out.output_exceeded:
            status, note = "output_limit", (f"[output truncated: the program printed more than "
                                            f"{self.max_output_bytes} bytes and was stopped]")
        elif out.timed_out or out.signal == signal.SIGXCPU:
            status, note = "timeout", f"[timeout: the program ran past the {self.timeout_s:g} s limit and was stopped]"
        elif out.signal is not None:
            status, note = "error", f"[killed by signal {_signal_name(out.signal)}]"
        elif out.exit_code != 0:
            status, note = "error", f"[exit status {out.exit_code}]"
        else:
            note = "" if text else "[no output]"
        if self._workspace_bytes() > self.workspace_mb << 20:
            self._clear_workspace()
            note = (note + "\n" if note else "") + \
                f"[the workspace passed {self.workspace_mb} MB: its files were deleted]"
        return "\n".join(p for p in (text, note) if p), status

    def _workspace_bytes(self) -> int:
        total = 0
        for root, _, files in os.walk(self.workspace):
            for name in files:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(root, name)).st_size
        return total

    def _clear_workspace(self) -> None:
        for entry in os.scandir(self.workspace):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)
