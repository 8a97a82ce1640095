"""The python tool environment: Hermes tool calls parsed from the turn, run in the real bubblewrap
sandbox (per-episode workspace, limits, no network), results and failures as observations, the final
answer graded by reward.score, concurrent runs capped by ToolSlots."""
from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest

from megatron_rl.env import EnvFailure, PythonTool, StepResult, ToolSlots, outcome, parse_tool_calls
from megatron_rl.env import python_tool
from megatron_rl.reward import score
from megatron_rl.reward.code import Toolchain
from megatron_rl.reward.sandbox import available

SANDBOX = available(Toolchain().jail("python"))
needs_sandbox = pytest.mark.skipif(not SANDBOX[0], reason=f"no sandbox: {SANDBOX[1]}")

TASK = {"kind": "math", "answer": "56088", "problem": "What is 123 times 456?"}
RIGHT = "<think>The tool said 56088.</think>\nThe product is $\\boxed{56088}$."
WRONG = "<think>The tool said 56088.</think>\nThe product is $\\boxed{56078}$."


def call(code: str, name: str = "python") -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": {"code": code}}) + "\n</tool_call>"


def contents(result: StepResult) -> list[str]:
    return [m["content"] for m in result.observation]


@pytest.fixture
def env():
    # a limit far above a call's start-up in the sandbox on a loaded machine: only the timeout test's
    # own tool has a short one
    e = PythonTool(timeout_s=30.0, slots=ToolSlots(2))
    e.reset(TASK)
    yield e
    e.close()


# ------------------------------------------------------------------------------------ parsing (no sandbox)

def test_parse_tool_calls():
    assert parse_tool_calls("The answer is $\\boxed{3}$.") == []
    turn = ("<think>use the tool</think>\n" + call("print(1)") + "\ntext\n"
            + '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(2)\\"}"}</tool_call>')
    assert [(c.name, c.arguments, c.error) for c in parse_tool_calls(turn)] == [
        ("python", {"code": "print(1)"}, ""), ("python", {"code": "print(2)"}, "")]
    # raw newline inside the JSON string, and no closing tag at the end of the turn (a stop string)
    (c,) = parse_tool_calls('<tool_call>\n{"name": "python", "arguments": {"code": "x = 1\nprint(x)"}}\n')
    assert (c.name, c.arguments["code"], c.error) == ("python", "x = 1\nprint(x)", "")
    bad = parse_tool_calls('<tool_call>{"name": python}</tool_call><tool_call>[1]</tool_call>'
                           '<tool_call>{"name": "python", "arguments": 3}</tool_call>')
    assert [c.error.split(";")[0] for c in bad] == [
        "the tool call is not valid JSON (Expecting value: line 1 column 10)",
        'the tool call has no "name"', '"arguments" must be a JSON object']
    assert all('expected <tool_call>{"name": "python"' in c.error for c in bad)


def test_sandbox_unavailable_raises_at_reset(monkeypatch):
    monkeypatch.setattr(python_tool, "available", lambda jail: (False, "bwrap is not installed"))
    env = PythonTool()
    with pytest.raises(EnvFailure, match="python tool: the sandbox is unavailable: bwrap is not installed"):
        env.reset(TASK)
    env.close()  # always called by the caller, also after a failed reset
    assert env.workspace is None


def test_constructor_checks_its_limits():
    for kw in ({"timeout_s": 0}, {"memory_mb": 10}, {"max_tool_calls": 0}, {"max_output_bytes": True}):
        with pytest.raises(ValueError, match=f"PythonTool: {next(iter(kw))} must be"):
            PythonTool(**kw)


# ------------------------------------------------------------------------------------ in the sandbox

@needs_sandbox
def test_a_call_returns_its_output_and_the_answer_ends_the_episode(env):
    result = env.step("<think>I should compute it.</think>\n" + call("print(123 * 456)"))
    assert result.observation == [{"role": "tool", "content": "56088"}]
    assert not result.done and result.reward is None
    assert (result.info["tool_calls"], result.info["tool_statuses"], result.info["tool_errors"]) == (1, ["ok"], 0)
    assert result.info["tool_s"] > 0
    assert contents(env.step(call("x = 1"))) == ["[no output]"]
    last = env.step(RIGHT)  # no tool call: the final answer
    assert last == StepResult(done=True, info={"stop": "answer", "tool_calls": 0, "tool_calls_total": 2})
    for answer in (RIGHT, WRONG):  # graded by reward.score with the task
        graded, ref = outcome(TASK, last, answer), score(TASK, answer)
        assert (graded.status, graded.correct, graded.total) == (ref.status, answer is RIGHT, ref.total)
    with pytest.raises(RuntimeError, match="the episode is done"):
        env.step(call("print(1)"))


@needs_sandbox
def test_files_persist_across_calls_variables_do_not(env):
    first = env.step(call("total = 6 * 7\nopen('state.txt', 'w').write(str(total))\n"
                          "open('helper.py', 'w').write('def twice(v):\\n    return 2 * v\\n')\n"
                          "import os\nprint(os.getcwd(), sorted(os.listdir()))"))
    assert contents(first) == ["/box ['helper.py', 'state.txt']"]
    second = env.step(call("import helper\nprint(helper.twice(int(open('state.txt').read())))"))
    assert contents(second) == ["84"]  # files (and modules written there) persist
    third = env.step(call("print(total)"))  # variables do not: each call is a fresh process
    assert "NameError: name 'total' is not defined" in contents(third)[0]
    assert third.info["tool_statuses"] == ["error"]


@needs_sandbox
def test_timeout_and_exception_are_observations(env):
    with PythonTool(timeout_s=4.0, slots=ToolSlots(1)) as short:
        short.reset(TASK)
        slow = short.step(call("print('started', flush=True)\nwhile True:\n    pass"))
        (text,) = contents(slow)
        assert text.startswith("started\n") and "[timeout: the program ran past the 4 s limit and was stopped]" in text
        assert not slow.done and slow.info["tool_statuses"] == ["timeout"] and slow.info["tool_timeouts"] == 1
        asleep = short.step(call("import time\ntime.sleep(60)"))  # wall clock, not CPU
        assert contents(asleep) == ["[timeout: the program ran past the 4 s limit and was stopped]"]
        assert asleep.info["tool_s"] < 30
    boom = env.step(call("print('before')\n1 / 0"))
    (text,) = contents(boom)
    assert text.startswith("before\nTraceback (most recent call last):")
    assert "ZeroDivisionError: division by zero" in text and text.endswith("[exit status 1]")
    assert boom.info["tool_statuses"] == ["error"] and boom.info["tool_errors"] == 1
    assert contents(env.step(call("import sys\nsys.exit(3)"))) == ["[exit status 3]"]
    assert "MemoryError" in contents(env.step(call("x = bytearray(8 * 1024 ** 3)")))[0]
    assert contents(env.step(call("print(1 + 1)"))) == ["2"]  # the episode goes on


@needs_sandbox
def test_output_cap():
    with PythonTool(max_output_bytes=1000, slots=ToolSlots(1)) as env:
        env.reset(TASK)
        fits = env.step(call("print('y' * 900)"))
        assert contents(fits) == ["y" * 900]
        flood = env.step(call("import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 1000)\n"
                              "print('never')"))
        (text,) = contents(flood)
        body, note = text.rsplit("\n", 1)
        assert set(body) == {"x"} and len(body) <= 1000
        assert note == "[output truncated: the program printed more than 1000 bytes and was stopped]"
        assert flood.info["tool_statuses"] == ["output_limit"]


@needs_sandbox
def test_no_network(env):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    try:
        result = env.step(call("import socket\ns = socket.socket()\ns.settimeout(1)\n"
                               f"s.connect(('127.0.0.1', {port}))\nprint('connected')"))
        (text,) = contents(result)
        assert "connected" not in text.splitlines() and "Error" in text, text
        with pytest.raises(socket.timeout):
            listener.accept()  # nothing reached the host's loopback
    finally:
        listener.close()


@needs_sandbox
def test_workspaces_are_private_and_close_removes_them():
    slots = ToolSlots(2)
    a, b = PythonTool(timeout_s=30.0, slots=slots), PythonTool(timeout_s=30.0, slots=slots)
    a.reset(TASK)
    b.reset(TASK)
    try:
        assert a.workspace != b.workspace and os.path.isdir(a.workspace)
        a.step(call("open('secret.txt', 'w').write('episode A')"))
        assert open(os.path.join(a.workspace, "secret.txt")).read() == "episode A"
        seen = b.step(call(
            "import os\nprint(sorted(os.listdir('/box')), sorted(os.listdir('/tmp')))\n"
            f"for p in ['/box/secret.txt', {a.workspace + '/secret.txt'!r}]:\n"
            "    try:\n        print(open(p).read())\n    except OSError as e:\n        print(type(e).__name__)"))
        assert contents(seen) == ["[] []\nFileNotFoundError\nFileNotFoundError"]
        assert contents(a.step(call("print(open('secret.txt').read())"))) == ["episode A"]
    finally:
        where = a.workspace
        a.close()
        b.close()
    assert not os.path.exists(where) and a.workspace is None
    a.close()  # a second close does nothing


@needs_sandbox
def test_invalid_calls_and_the_call_limit():
    with PythonTool(max_tool_calls=2, slots=ToolSlots(1)) as env:
        env.reset(TASK)
        bad = env.step('<tool_call>{"name": "python", "arguments": {"code": </tool_call>'
                       + call("print(1)", name="bash") + '<tool_call>{"name": "python", "arguments": {}}</tool_call>')
        assert [t.split(":")[0] for t in contents(bad)] == ["[error"] * 3
        assert "not valid JSON" in contents(bad)[0] and "unknown tool 'bash'" in contents(bad)[1]
        assert 'needs "arguments": {"code"' in contents(bad)[2]
        assert bad.info["tool_statuses"] == ["invalid"] * 3 and env.calls == 0  # nothing ran
        three = env.step(call("print(1)") + call("```python\nprint(2)\n```") + call("print(3)"))
        assert contents(three)[:2] == ["1", "2"]  # a fence inside the code string is dropped
        assert contents(three)[2].startswith("[not run: the limit of 2 tool calls per episode is reached")
        assert three.info["tool_statuses"] == ["ok", "ok", "over_limit"] and not three.done
        over = env.step(call("print(4)"))  # calling again past the limit ends the episode
        assert over == StepResult(done=True, info={"stop": "max_tool_calls", "tool_calls": 0,
                                                   "tool_calls_total": 2})


@needs_sandbox
@pytest.mark.parametrize("limit", [1, 2])
def test_concurrent_runs_are_capped_by_the_shared_slots(limit):
    slots = ToolSlots(limit)
    envs = [PythonTool(timeout_s=30.0, slots=slots) for _ in range(2)]
    results: list[StepResult] = []
    start = threading.Barrier(2)

    def episode(env):
        env.reset(TASK)
        try:
            start.wait()
            results.append(env.step(call("import time\ntime.sleep(0.8)\nprint('slept')")))
        finally:
            env.close()

    threads = [threading.Thread(target=episode, args=(e,)) for e in envs]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.perf_counter() - t0
    assert [contents(r) for r in results] == [["slept"], ["slept"]]
    assert slots.peak == limit and slots.active == 0
    waits = sorted(r.info["tool_wait_s"] for r in results)
    if limit == 1:
        assert waits[1] > 0.7 and took > 1.6  # the second run waited for the first
    else:  # both ran at once (peak 2) and neither waited for a slot; no bound on `took`: a loaded machine
        assert waits[1] < 0.5
