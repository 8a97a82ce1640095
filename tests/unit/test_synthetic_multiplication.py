"""The tool demo's data (data/synthetic.py, examples/tool_demo_data.py): products checked against Python's
arithmetic, traces laid out token for token as the turn loop lays out an episode (the tool's output and the
template's prefix masked), the tool call one the python environment runs, the final turns full marks."""
from __future__ import annotations

import json

import pytest

from megatron_rl.data.prompts import get_template
from megatron_rl.data.synthetic import (episode_trace, multiplication_pairs, multiplication_problem,
                                        multiplication_traces, multiplication_turns, worked_product,
                                        write_multiplication_problems)
from megatron_rl.data.turns import ChatTurns
from megatron_rl.env import parse_tool_calls
from megatron_rl.reward import score
from megatron_rl.train.sft import read_jsonl, to_sequences, tokenize_record

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tok():
    from megatron_rl.train.hf_source import resolve_model

    return resolve_model("smollm2-135m").tokenizer()


def test_problems_are_distinct_three_digit_products(tmp_path):
    pairs = multiplication_pairs(500, seed=3)
    assert len(set(pairs)) == 500 and all(100 <= x <= 999 for p in pairs for x in p)
    assert multiplication_pairs(500, seed=3) == pairs != multiplication_pairs(500, seed=4)
    rows = [json.loads(line) for line in write_multiplication_problems(tmp_path / "p.jsonl", pairs, 7).read_text().splitlines()]
    for (a, b), row in zip(pairs, rows):
        assert row["prompt"] == f"What is {a} * {b}?" and int(row["answer"]) == a * b
    assert rows[0]["id"] == "mul-7"
    with pytest.raises(ValueError, match="distinct pairs"):
        multiplication_pairs(5, low=1, high=2)


@pytest.mark.parametrize("a, b", [(123, 456), (123, 405), (123, 500), (999, 999), (100, 101)])
def test_the_worked_product_adds_up(a, b):
    text = worked_product(a, b)
    left, *steps = text.split(" = ")
    assert left == f"{a} * {b}" and steps[-1] == str(a * b)
    for step in steps:  # every step is a true equation of Python arithmetic
        assert eval(step) == a * b  # noqa: S307 - digits, + and * only, written by the test's own inputs


@pytest.mark.parametrize("tool", [True, False])
def test_a_solved_trace_gets_full_marks(tool):
    a, b = 829, 654
    task = multiplication_problem(0, a, b).task
    turns, observations = multiplication_turns(a, b, tool)
    if tool:  # the call is one the python environment reads and runs as written
        (call,) = parse_tool_calls(turns[0])
        assert (call.name, call.arguments, call.error) == ("python", {"code": f"print({a} * {b})"}, "")
        assert observations == [[{"role": "tool", "content": str(a * b)}]]
    prefix = get_template("short_python" if tool else "short").assistant_prefix
    assert score(task, prefix + turns[-1]).total == pytest.approx(1.1)  # format, correct, language


def test_the_tool_trace_is_the_episode_the_turn_loop_builds(tok):
    """Prompt = the rollout's rendering; then the call and its stop token (trained), the tool message and
    the next generation prompt with the `<think>` prefix as ChatTurns renders them (not trained), then
    the answer and its stop token (trained). The whole equals the chat template's rendering of the
    conversation, with the prefix in both assistant turns."""
    template = get_template("short_python")
    problem = multiplication_problem(0, 829, 654)
    turns, observations = multiplication_turns(829, 654, tool=True)
    record = episode_trace(tok, template, problem, turns, observations)
    ex = tokenize_record(json.loads(json.dumps(record)))  # the ids form, as `megatron-rl sft` reads it
    end = tok.convert_tokens_to_ids("<|im_end|>")
    trained = [t for t, m in zip(ex.completion_ids, ex.loss_mask) if m]
    assert trained == tok(turns[0], add_special_tokens=False).input_ids + [end] + \
        tok(turns[1], add_special_tokens=False).input_ids + [end]
    masked = [t for t, m in zip(ex.completion_ids, ex.loss_mask) if not m]
    assert masked == ChatTurns(tok, template).observation_ids(observations[0])
    assert "542166" in tok.decode(masked) and "542166" not in tok.decode(trained[:len(trained) // 2])
    messages = [{"role": "system", "content": template.system}, {"role": "user", "content": problem.prompt},
                {"role": "assistant", "content": "<think>\n" + turns[0]}, observations[0][0],
                {"role": "assistant", "content": "<think>\n" + turns[1]}]
    whole = tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False).input_ids
    assert ex.prompt_ids + ex.completion_ids == whole[:-1]  # the template's newline after the last stop token
    (seq,), _ = to_sequences([ex], max_tokens=4096)
    assert seq.n_loss_tokens == len(trained)


def test_both_cold_starts_cover_the_same_problems(tmp_path, tok):
    pairs = multiplication_pairs(3, seed=1)
    tool = read_jsonl(multiplication_traces(tmp_path / "t.jsonl", tok, get_template("short_python"), pairs, tool=True))
    direct = read_jsonl(multiplication_traces(tmp_path / "d.jsonl", tok, get_template("short"), pairs, tool=False))
    for (a, b), t, d in zip(pairs, tool, direct):
        assert f"What is {a} * {b}?" in tok.decode(t["prompt_ids"]) and f"What is {a} * {b}?" in tok.decode(d["prompt_ids"])
        assert "<tool_call>" in tok.decode(t["completion_ids"]) and 0 in t["loss_mask"]
        assert "<tool_call>" not in tok.decode(d["completion_ids"]) and set(d["loss_mask"]) == {1}
        assert tok.decode(d["completion_ids"]).endswith(f"\\boxed{{{a * b}}}.<|im_end|>")
