"""The `megatron-rl` command line: one config convention (CONFIG first), overrides anywhere after the
command, defaults in --help, --log-level / --quiet in either place, the log format, and `doctor` run
as a user runs it (a subprocess without the venv activated)."""
from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl import log as logs
from megatron_rl.cli import build_parser, parse
from megatron_rl.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("argv", [
    ["train", "run.yaml", "--resume", "run.updates=30"],  # the example: after a flag
    ["train", "run.updates=30", "run.yaml", "--resume"],  # before the config
    ["train", "--resume", "run.yaml", "run.updates=30"],
])
def test_overrides_anywhere_after_the_command(argv):
    args = parse(argv)
    assert (args.command, args.config, args.resume, args.overrides) == ("train", "run.yaml", True, ["run.updates=30"])


def test_overrides_keep_their_order_and_values_of_options_are_not_overrides():
    args = parse(["simulate", "algo.eps_high=0.3", "--lengths", "pareto:low=40,ratio=5", "run.yaml",
                  "algo.eps_high=0.2"])
    assert args.config == "run.yaml" and args.lengths == "pareto:low=40,ratio=5"
    assert args.overrides == ["algo.eps_high=0.3", "algo.eps_high=0.2"]  # the last one wins in load_config


def test_filter_difficulty_takes_an_optional_config_before_out_and_overrides_anywhere():
    args = parse(["filter", "difficulty", "--samples", "s.jsonl", "out.jsonl", "rollout.temperature=0.5"])
    assert (args.config, args.out, args.overrides) == (None, "out.jsonl", ["rollout.temperature=0.5"])
    args = parse(["filter", "difficulty", "run.yaml", "out.jsonl", "--k", "4"])
    assert (args.config, args.out, args.k) == ("run.yaml", "out.jsonl", 4)


def test_a_command_without_config_refuses_overrides(capsys):
    with pytest.raises(SystemExit) as e:
        parse(["doctor", "run.updates=3"])
    assert e.value.code == 2 and "takes no key=value overrides" in capsys.readouterr().err


def test_deprecated_config_option_still_works_and_warns(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("algo:\n  eps_high: 0.3\n")
    assert cli_main(["config", str(path), "algo.eps_low=0.1"]) == 0
    positional = capsys.readouterr().out
    args = parse(["reward", "--config", str(path), "--task", "t.json", "--response", "r.txt"])
    assert args.config_option == str(path) and args.config is None
    with pytest.raises(SystemExit):  # both spellings at once is ambiguous
        cli_main(["reward", str(path), "--config", str(path), "--task", "t", "--response", "r"])
    assert "eps_high: 0.3" in positional and "eps_low: 0.1" in positional


def _help_of(*path: str) -> str:
    parser = build_parser()
    for name in path:
        parser = next(a for a in parser._actions if a.dest in ("command", "direction", "kind")).choices[name]
    return parser.format_help()


def test_help_shows_defaults_and_never_none():
    plan = " ".join(_help_of("plan").split())
    assert "(default: 8)" in plan and "(default: 80.0)" in plan
    translate = " ".join(_help_of("translate").split())
    assert "(default: 0.1)" in translate and "(default: fr,es,it,de,zh,ru)" in translate
    for path in (("train",), ("convert", "to-hf"), ("filter", "difficulty"), ("simulate",), ("reward",)):
        text = _help_of(*path)
        assert "default: None" not in text and "default: False" not in text, path
        assert "--log-level" in text and "--quiet" in text, path


def _value_options(parser, path=()):
    """(subcommand path, option) for every optional option that takes a value, over the whole command tree."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _value_options(sub, (*path, name))
        elif action.option_strings and action.nargs != 0 and not action.required and action.help != argparse.SUPPRESS:
            yield path, action


def test_every_option_that_takes_a_value_shows_its_default():
    """The docs promise `--help` shows each flag's default: a None default must be named in the help
    (evaluate's --max-new-tokens showed nothing, though it meant rollout.max_new_tokens, 4096)."""
    from megatron_rl.cli.common import _shows

    hidden = [(" ".join(path), a.option_strings[-1]) for path, a in _value_options(build_parser())
              if not _shows(a.default) and "default" not in (a.help or "").lower()]
    assert hidden == []
    evaluate = " ".join(_help_of("evaluate").split())
    assert "--max-new-tokens MAX_NEW_TOKENS longest completion (default: rollout.max_new_tokens, 4096)" in evaluate
    assert "(default: rollout.temperature, 1)" in evaluate and "keep it small: --limit 4" in evaluate


def test_help_prints_nothing_on_stderr():
    p = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0 and p.stderr == "" and "train" in p.stdout


def test_log_line_carries_time_role_rank_and_level(monkeypatch):
    monkeypatch.delenv(logs.LEVEL_ENV, raising=False)
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    logs.setup("controller", 0)
    logs.get_logger("megatron_rl.control.example").info("run directory %s", "runs/x")
    logs.get_logger("megatron_rl.control.example").debug("not shown at INFO")
    assert re.fullmatch(r"\d\d:\d\d:\d\d \[controller r0\] INFO run directory runs/x\n", err.getvalue()), err.getvalue()
    assert os.environ[logs.LEVEL_ENV] == "INFO"  # ranks started from here inherit it


def test_log_level_from_the_environment_and_the_flag(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(logs.LEVEL_ENV, "warning")
    logs.setup("train")
    assert logging.getLogger("megatron_rl").level == logging.WARNING
    with pytest.raises(ValueError, match="MEGATRON_RL_LOG_LEVEL"):
        logs.setup("train", level="LOUD")
    # the flag wins over the environment, before or after the command
    for argv in (["--log-level", "debug", "config"], ["config", "--log-level", "DEBUG"]):
        assert cli_main(argv) == 0
        assert logging.getLogger("megatron_rl").level == logging.DEBUG
    capsys.readouterr()


def test_doctor_finds_the_venv_tools_without_activation_and_prints_no_warning():
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env["PATH"] = "/usr/bin:/bin"  # not the venv's bin/: as a user who did not activate it
    p = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "doctor"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    assert "Warning" not in p.stderr and "warn" not in p.stderr.lower(), p.stderr
    lines = dict(line.split(None, 1) if " " in line else (line, "") for line in
                 (re.sub(r"^(cuda devices|megatron shims|code sandbox|c\+\+ sandbox)", lambda m: m[0].replace(" ", "_"),
                         line) for line in p.stdout.splitlines()))
    local = Path(sys.executable).parent / "mpiexec"
    assert lines["mpiexec"].strip() == (str(local) if local.exists() else "MISSING")
    from megatron_rl.reward.code import sandbox_probe  # the same real probe, run here

    assert (lines["code_sandbox"].strip() == "ok") == sandbox_probe("python")[0]
    import torch

    assert ("nccl" in lines) == torch.cuda.is_available()  # GPU library lines only with a GPU


def test_simulate_reads_the_pipeline_shape_from_the_run_yaml(tmp_path, capsys):
    import json

    import yaml

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"generator": {"num_generators": 3},
                                    "rollout": {"group_size": 4, "n_async": 24, "n_batch": 8, "n_mini": 2,
                                                "max_staleness": 1}}))
    out = tmp_path / "sim.json"
    assert cli_main(["simulate", str(path), "--updates", "6", "--warmup", "1", "--json", str(out),
                     "rollout.n_async=16", "--n-mini", "4"]) == 0
    params = json.loads(out.read_text())["params"]
    written = yaml.safe_load(path.read_text())
    assert params["generators"] == written["generator"]["num_generators"] and params["group"] == 4
    assert params["n_batch"] == 8 and params["max_staleness"] == 1
    assert params["n_async"] == 16 and params["n_mini"] == 4  # the override and the flag win over the file
    capsys.readouterr()
