"""Problem files: JSONL and parquet (through HF datasets) under configured column names, chat-message
prompts, system prompts from text or a file, chat-template keyword arguments; errors name the file,
the row and the config key."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_rl.config import ConfigError, load_config
from megatron_rl.data import DataError, get_template, iter_problems, read_problems, render_prompt_ids

KEYS = ["data.prompt_key=question", "data.answer_key=reward_model.ground_truth", "data.tests_key=cases",
        "data.language_key=lang_code"]
ROWS = [
    {"id": "m1", "question": "What is 2+3?", "reward_model": {"ground_truth": 5}, "difficulty": "easy"},
    {"id": "c1", "question": "Echo the input.", "cases": [{"input": "hi\n", "output": "hi\n"}], "lang_code": "cpp"},
    {"id": "m2", "question": [{"role": "system", "content": "Be brief."},
                              {"role": "user", "content": "What is 7*6?"}],
     "reward_model": {"ground_truth": "42"}},
]
EXPECTED_TASKS = [  # written out by hand from ROWS and the keys above
    {"kind": "math", "problem": "What is 2+3?", "answer": "5", "meta": {"difficulty": "easy"}},
    {"kind": "code", "problem": "Echo the input.", "tests": [{"input": "hi\n", "output": "hi\n"}], "language": "cpp"},
    {"kind": "math", "problem": "What is 7*6?", "answer": "42"},
]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _parquet(path, rows):
    columns = list(dict.fromkeys(k for r in rows for k in r))  # Arrow gives a column a row lacks as null
    pq.write_table(pa.table({k: [r.get(k) for r in rows] for k in columns}), path)
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_rows_become_problems_under_the_configured_keys(tmp_path, fmt):
    if fmt == "jsonl":
        path = _jsonl(tmp_path / "set.jsonl", ROWS)
    else:  # a column holds one type: text prompts in one file, chat messages in another, read as a glob
        _parquet(tmp_path / "set-0.parquet", ROWS[:2])
        _parquet(tmp_path / "set-1.parquet", ROWS[2:])
        path = tmp_path / "set-*.parquet"
    cfg = load_config(None, [f"data.source={fmt}", f"data.path={path}", *KEYS])
    problems = list(iter_problems(cfg.data))
    assert [p.problem_id for p in problems] == ["m1", "c1", "m2"]
    assert [p.task for p in problems] == EXPECTED_TASKS
    assert [p.prompt for p in problems] == ["What is 2+3?", "Echo the input.", "What is 7*6?"]
    assert problems[2].messages == ROWS[2]["question"] and problems[0].messages is None
    # the default keys do not find these columns: the setting changes what is read
    with pytest.raises(DataError, match=r"(:1|row 0): prompt column 'prompt' \(data.prompt_key\) is missing"):
        read_problems(str(path))


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_bad_rows_name_file_row_and_key(tmp_path, fmt):
    write = _jsonl if fmt == "jsonl" else _parquet
    cfg = load_config(None, KEYS).data
    cases = [
        ([{"question": "What?", "reward_model": {"other": 1}}], r"answer column 'reward_model.ground_truth' \(data.answer_key\) is missing"),
        ([{"question": [{"role": "robot", "content": "x"}], "reward_model": {"ground_truth": 1}}], r"prompt column 'question' \(data.prompt_key\) message 0 must be"),
        ([{"question": [{"role": "system", "content": "x"}], "reward_model": {"ground_truth": 1}}], r"prompt column 'question' \(data.prompt_key\) has no user message"),
        ([{"question": 3, "reward_model": {"ground_truth": 1}}], r"prompt column 'question' \(data.prompt_key\) is not text"),
    ]
    for i, (rows, why) in enumerate(cases):
        path = write(tmp_path / f"bad{i}.{fmt}", rows)
        where = f"{path}:1" if fmt == "jsonl" else f"{path}: row 0"
        with pytest.raises(DataError, match=f"^{where}: {why}"):
            read_problems(path, cfg)
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(DataError, match="junk.parquet: cannot read as parquet"):
        read_problems(tmp_path / "junk.parquet")


CHAT_TEMPLATE = (  # the shape of Qwen3's: enable_thinking=false pre-fills an empty reasoning block
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _reference_ids(tok, messages, prefix="", **kwargs):
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    return tok(text + prefix, add_special_tokens=False).input_ids


def test_prompts_render_with_system_prompt_text_file_and_template_kwargs(tmp_path, tokenizer):
    rows = _jsonl(tmp_path / "p.jsonl", [ROWS[0], ROWS[2]])
    sys_file = tmp_path / "system.txt"
    sys_file.write_text("You are a careful mathematician.\n")
    cfg = load_config(None, [f"data.path={rows}", "data.source=jsonl", *KEYS, "data.system_prompt=short",
                             f"data.system_prompt_file={sys_file}",
                             "data.chat_template_kwargs={enable_thinking: false}"]).data
    plain, chat = iter_problems(cfg)
    template = get_template(cfg)
    ids = render_prompt_ids(tokenizer, plain, template)
    system = {"role": "system", "content": "You are a careful mathematician."}
    assert ids == _reference_ids(tokenizer, [system, {"role": "user", "content": "What is 2+3?"}], "<think>\n",
                                 enable_thinking=False)
    assert ids != render_prompt_ids(tokenizer, plain, get_template("short"))  # the kwargs and the file count
    # a problem that brings its own system message keeps it, and gets no second one
    assert render_prompt_ids(tokenizer, chat, template) == _reference_ids(tokenizer, ROWS[2]["question"], "<think>\n",
                                                                          enable_thinking=False)
    text_cfg = load_config(None, ["data.system_prompt=Answer in French, please."]).data
    assert render_prompt_ids(tokenizer, plain, get_template(text_cfg)) == _reference_ids(
        tokenizer, [{"role": "system", "content": "Answer in French, please."},
                    {"role": "user", "content": "What is 2+3?"}])


def test_prompt_settings_are_checked_at_config_load(tmp_path):
    """Values at config load; that the template exists and the file reads, at pre-flight (check_config)."""
    from megatron_rl.control.preflight import check_config

    with pytest.raises(ConfigError, match="data.system_prompt: unknown prompt template 'magistrall'"):
        check_config(load_config(None, ["data.system_prompt=magistrall"]))
    with pytest.raises(ConfigError, match="data.system_prompt_file: .*nope.txt"):
        check_config(load_config(None, [f"data.system_prompt_file={tmp_path / 'nope.txt'}"]))
    with pytest.raises(ConfigError, match="data.chat_template_kwargs: must be a mapping"):
        load_config(None, ["data.chat_template_kwargs=[1]"])
    with pytest.raises(ConfigError, match="data.path: required when source is parquet"):
        load_config(None, ["data.source=parquet"])


@pytest.mark.parametrize("key", ["data.path", "data.eval_path"])
def test_a_missing_problem_file_names_its_key_and_where_relative_paths_start(tmp_path, key):
    """`megatron-rl train` as a user runs it, from another folder: refused before any rank starts."""
    root = Path(__file__).resolve().parents[2]
    (tmp_path / "problems.jsonl").write_text('{"prompt": "What is 1+1?", "answer": "2"}\n')
    paths = {"data.path": "problems.jsonl", "data.eval_path": "problems.jsonl", key: "missing.jsonl"}
    p = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "train", str(root / "examples" / "cpu_demo.yaml"),
                        *(f"{k}={v}" for k, v in paths.items()), f"run.output_dir={tmp_path / 'run'}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert f"{key}: problem file not found: missing.jsonl (relative to {tmp_path})" in p.stderr


def test_a_missing_parquet_file_names_data_path(tmp_path):
    with pytest.raises(DataError, match=r"^data.path: problem file not found: .*missing.parquet$"):
        list(iter_problems(load_config(None, ["data.source=parquet", f"data.path={tmp_path / 'missing.parquet'}"]).data))


CALL_ROWS = [  # function-call tests in each form a row can bring them
    {"id": "f1", "question": "Add.", "cases": [{"function": "add", "args": [1, 2], "expected": 3}]},
    {"id": "f2", "question": "Add.", "cases": json.dumps([{"call": "add(1, 2)", "expected": 3},
                                                         {"call": "add('a', 'b')", "expected": "ab"}])},
    {"id": "f3", "question": "Add.", "cases": "def check(candidate):\n    assert candidate(1, 2) == 3\n", "fn": "add"},
    {"id": "f4", "question": "Add.", "cases": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]},
]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_function_call_rows_under_the_configured_keys(tmp_path, fmt):
    from megatron_rl.reward import score

    keys = [*KEYS, "data.entry_point_key=fn"]
    if fmt == "jsonl":
        path = _jsonl(tmp_path / "calls.jsonl", CALL_ROWS)
    else:  # one column holds one type: JSON text for tests whose arguments mix types, lists of strings, code
        rows = [{**r, "cases": r["cases"] if isinstance(r["cases"], str) else json.dumps(r["cases"])}
                for r in CALL_ROWS if r["id"] != "f4"]
        path = _parquet(tmp_path / "calls.parquet", rows)
    problems = list(iter_problems(load_config(None, [f"data.source={fmt}", f"data.path={path}", *keys]).data))
    assert problems[2].task["entry_point"] == "add" and "fn" not in problems[2].task.get("meta", {})
    right = "<think>Add them.</think>\n```python\ndef add(a, b):\n    return a + b\n```"
    wrong = right.replace("a + b", "a * b")
    for p in problems:  # each form grades: right passes every test, wrong fails at least one
        assert score(p.task, right).correct and not score(p.task, wrong).correct, p.problem_id
    # without the entry point key, check(candidate) cannot name its function: the setting is read
    with pytest.raises(DataError, match=r"tests column 'cases' \(data.tests_key\): .*needs the entry point"):
        list(iter_problems(load_config(None, [f"data.source={fmt}", f"data.path={path}", *KEYS]).data))


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_malformed_call_tests_name_file_row_and_key(tmp_path, fmt):
    write = _jsonl if fmt == "jsonl" else _parquet
    cfg = load_config(None, [*KEYS, "data.entry_point_key=fn"]).data
    cases = [
        (json.dumps([{"function": "add", "args": 1, "expected": 3}]), r"tests\[0\]: 'args' must be a list"),
        (json.dumps([{"function": "add", "args": [1]}]), r"tests\[0\]: 'expected' is missing"),
        ("[{\"function\": ", "holds text that starts like JSON but is not"),
        ("x = add(1, 2)\nassert x == 3", "line 1: `add` .*outside an accepted assert"),
        ("assert add(1, 2) == 3 +", "test code is not valid Python"),
    ]
    for i, (tests, why) in enumerate(cases):
        path = write(tmp_path / f"bad{i}.{fmt}", [{"question": "Add.", "cases": tests}])
        where = f"{path}:1" if fmt == "jsonl" else f"{path}: row 0"
        with pytest.raises(DataError, match=f"^{where}: tests column 'cases' \\(data.tests_key\\)(: | )[^\\n]*{why}"):
            read_problems(path, cfg)
    path = write(tmp_path / f"bad_fn.{fmt}", [{"question": "Add.", "cases": "assert add(1) == 1", "fn": "two words"}])
    with pytest.raises(DataError, match=r"entry point column 'fn' \(data.entry_point_key\): 'entry_point' must be"):
        read_problems(path, cfg)
