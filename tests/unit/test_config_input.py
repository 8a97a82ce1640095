"""Config input a user may get wrong (file encoding, duplicate keys, inf/nan, empty or non-mapping
files, bad overrides): the real command line answers with exit status != 0 and one line on stderr
that names the file (and line) and the key, never a traceback; valid files load as before."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_rl.cli import main as cli_main
from megatron_rl.config import config_from_dict, load_config

ROOT = Path(__file__).resolve().parents[2]


def _one_line_error(argv: list[str], capsys) -> str:
    rc = cli_main(argv)
    out = capsys.readouterr()
    assert rc != 0 and "Traceback" not in out.err, out.err
    lines = out.err.strip().splitlines()
    assert len(lines) == 1, out.err
    return lines[0]


def _write(tmp_path: Path, text: str | bytes, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


# (file bytes, line of the fault, key named, words of the message)
BAD_FILES = {
    "latin-1 byte": (b"run:\n  updates: 3\ntrainer:\n  model: caf\xe9\n", 4, "trainer.model", "UTF-8"),
    "duplicate section": ("run:\n  updates: 3\nalgo:\n  eps_low: 0.1\nrun:\n  log_every: 2\n", 5, "run",
                          "duplicate key"),
    "duplicate nested key": ("algo:\n  eps_high: 0.26\n  eps_low: 0.1\n  eps_high: 0.3\n", 4, "algo.eps_high",
                             "duplicate key"),
    "duplicate in a list item": ("generator:\n  extra_args:\n    - {a: 1, a: 2}\n", 3, "generator.extra_args[0].a",
                                 "duplicate key"),
    "duplicate flow key": ("trainer: {lr: 1.0e-6, lr: 2.0e-6}\n", 1, "trainer.lr", "duplicate key"),
    "lr .inf": ("trainer:\n  model: x\n  lr: .inf\n", 3, "trainer.lr", "finite"),
    "lr -.inf": ("trainer:\n  lr: -.Inf\n", 2, "trainer.lr", "finite"),
    "eps .nan": ("algo:\n  eps_high: .nan\n", 2, "algo.eps_high", "finite"),
    "overflowing float": ("reward:\n  math_timeout_s: 1.0e999\n", 2, "reward.math_timeout_s", "finite"),
    "inf as text": ("data:\n  drop_solved_above: inf\n", 2, "data.drop_solved_above", "finite"),
    "optional float nan": ("algo:\n  tis_cap: .NaN\n", 2, "algo.tis_cap", "finite"),
    "integer beyond floats": ("trainer:\n  lr: 1" + "0" * 400 + "\n", 2, "trainer.lr", "finite"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_bad_file_names_the_file_line_and_key(case, tmp_path, capsys):
    text, line, key, words = BAD_FILES[case]
    path = _write(tmp_path, text)
    msg = _one_line_error(["config", str(path)], capsys)
    assert f"{path}:{line}: {key}:" in msg and words in msg, msg


@pytest.mark.parametrize("text, words", [
    ("", "empty config file"),
    ("# only a comment\n\n", "empty config file"),
    ("- algo\n- run\n", "got list"),
    ("42\n", "got int"),
    ("just text\n", "got str"),
    ("algo: [1, 2\n", "invalid YAML"),
    ("run:\n  updates: 3\n  \x01: 2\n", "invalid YAML"),
])
def test_an_unusable_file_names_the_file(text, words, tmp_path, capsys):
    path = _write(tmp_path, text)
    msg = _one_line_error(["config", str(path)], capsys)
    assert str(path) in msg and words in msg, msg


@pytest.mark.parametrize("override, key, words", [
    ("trainer.lr=.inf", "trainer.lr", "finite"),
    ("trainer.lr=inf", "trainer.lr", "finite"),
    ("algo.tis_cap=.nan", "algo.tis_cap", "finite"),
    ("rollout.temperature=-.inf", "rollout.temperature", "finite"),
    ("trainer.lrr=1e-6", "trainer.lrr", "unknown key in override 'trainer.lrr=1e-6'"),
    ("traner.lr=1e-6", "traner", "unknown key in override 'traner.lr=1e-6'"),  # a section typo: not the file's
    ("trainer.lr=fast", "trainer.lr", "must be a number"),
    ("rollout.group_size=4.5", "rollout.group_size", "must be an integer"),
    ("trainer.lr=[1", "trainer.lr", "cannot parse"),
])
@pytest.mark.parametrize("with_file", [False, True])
def test_a_bad_override_names_the_key(override, key, words, with_file, tmp_path, capsys):
    argv = ["config", str(_write(tmp_path, "trainer:\n  lr: 1.0e-6\n")), override] if with_file else ["config", override]
    msg = _one_line_error(argv, capsys)
    assert f"[config] ERROR config error: {key}:" in msg and words in msg, msg  # the key typed, not the file


def test_a_value_error_of_a_valid_file_names_its_line(tmp_path, capsys):
    path = _write(tmp_path, "rollout:\n  group_size: 4\n  n_async: 8\n  n_batch: 8\n  n_mini: 3\n")
    msg = _one_line_error(["config", str(path)], capsys)
    assert f"{path}:5: rollout.n_mini:" in msg, msg


@pytest.mark.parametrize("command", [["estimate"], ["plan", "--nodes", "1"], ["train"]])
def test_every_command_that_reads_a_config_gives_the_same_one_line(command, tmp_path, capsys):
    path = _write(tmp_path, "algo:\n  eps_high: 0.26\n  eps_high: 0.3\n")
    msg = _one_line_error([*command, str(path)], capsys)
    assert msg.count(str(path)) == 1 and f"{path}:3: algo.eps_high: duplicate key" in msg, msg


@pytest.mark.parametrize("text", [
    # the same leaf name in several sections is no duplicate
    "trainer:\n  seed: 7\n  lr: 3.0e-6\ndata:\n  seed: 7\nrun:\n  updates: 5\n",
    # a byte-order mark and non-ASCII text in UTF-8
    "\ufeffdata:\n  system_prompt: magistral\n  task: café\n",
    # a merge key: the mapping's own key wins over the merged one, as in YAML
    "rollout:\n  <<: {temperature: 0.9, top_p: 0.95}\n  temperature: 0.7\n",
    # huge but finite numbers and null optional floats stay accepted
    "trainer:\n  lr: 1.0e+300\nalgo:\n  tis_cap: null\n",
])
def test_valid_files_load_as_plain_yaml_reads_them(text, tmp_path):
    path = _write(tmp_path, text)
    assert load_config(path) == config_from_dict(yaml.safe_load(text.lstrip("\ufeff")))


@pytest.mark.parametrize("text, fault", [
    (b"trainer:\n  model: \xff\xfe\n", "not UTF-8"),
    ("run:\n  updates: 2\n  updates: 3\n", "duplicate key"),
    ("", "empty config file"),
])
def test_the_installed_entry_point_prints_no_traceback(text, fault, tmp_path):
    path = _write(tmp_path, text)
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "config", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and proc.stdout == "" and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and str(path) in proc.stderr and fault in proc.stderr


GOOD_ROW = '{"id": "p1", "prompt": "What is 1+1?", "answer": "2"}\n'
LATIN1_ROW = b'{"id": "p2", "prompt": "caf\xe9 count?", "answer": "3"}\n'


@pytest.mark.parametrize("second_line, words", [(LATIN1_ROW, ("not UTF-8",)),
                                                 (b'{"id": "p2", "prompt": \n', ("invalid JSON", "expected {"))])
@pytest.mark.parametrize("command", ["train", "evaluate", "evaluate --samples", "filter format"])
def test_a_bad_line_of_a_jsonl_file_names_the_file_and_line(command, second_line, words, tmp_path, capsys):
    sample_row = '{"problem_id": "p1", "response": "2"}\n'
    first_line = sample_row if command == "evaluate --samples" else GOOD_ROW
    bad = _write(tmp_path, first_line.encode() + second_line, "bad.jsonl")
    good = _write(tmp_path, GOOD_ROW, "good.jsonl")
    samples = _write(tmp_path, sample_row, "samples.jsonl")
    argv = {"train": ["train", str(_write(tmp_path, f"data:\n  source: jsonl\n  path: {bad}\n"))],
            "evaluate": ["evaluate", "--source", "jsonl", "--path", str(bad), "--samples", str(samples)],
            "evaluate --samples": ["evaluate", "--source", "jsonl", "--path", str(good), "--samples", str(bad)],
            "filter format": ["filter", "format", str(bad), str(tmp_path / "out.jsonl")]}[command]
    msg = _one_line_error(argv, capsys)
    assert f"{bad}:2:" in msg and any(w in msg for w in words), msg


@pytest.mark.parametrize("text, line, key, words", [
    ("gpu_memory_gb: 80\ngpus_per_node: 8\ngpu_memory_gb: 40\n", 3, "gpu_memory_gb", "duplicate key"),
    ("gpu_memory_gb: .inf\n", 1, "gpu_memory_gb", "finite"),
    ("mfu: .nan\n", 1, "mfu", "finite"),
    ("gpus_per_node: eight\n", 1, "gpus_per_node", "must be an integer"),
    (b"gpu_memory_gb: 80 # \xb5\n", 1, "gpu_memory_gb", "not UTF-8"),
])
def test_a_bad_cluster_file_of_estimate_names_the_file_line_and_key(text, line, key, words, tmp_path, capsys):
    cluster = _write(tmp_path, text, "cluster.yaml")
    run = _write(tmp_path, "trainer:\n  model: smollm2-135m\n")
    msg = _one_line_error(["estimate", str(run), "--cluster", str(cluster)], capsys)
    assert f"{cluster}:{line}: {key}:" in msg and words in msg, msg
