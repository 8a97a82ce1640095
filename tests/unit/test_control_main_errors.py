"""The controller rank's last line of defence (control.main._run_controller): bad input met only there
is a one-line error, a bug is one line naming its traceback's file, and either way the other ranks are
stopped and RUN_DIR/failure.json tells `megatron-rl train` what happened."""
from __future__ import annotations

import json
import logging

import pytest

from megatron_rl.config import load_config
from megatron_rl.control import main as control_main
from megatron_rl.plan.layout import RankLayout
from megatron_rl.control.protocol import Tag
from support.control import PickleComm

LAYOUT = RankLayout(trainers=1, generators=1, verifiers=1)


def _run(tmp_path, problems: str, caplog) -> tuple[int, PickleComm, list[logging.LogRecord]]:
    data = tmp_path / "problems.jsonl"
    data.write_text(problems)
    cfg = load_config(None, [f"run.output_dir={tmp_path / 'run'}", "data.source=jsonl", f"data.path={data}"])
    comm = PickleComm()
    with caplog.at_level(logging.ERROR):
        code = control_main._run_controller(comm, cfg, LAYOUT, tmp_path / "run", {"resume_root": None})
    return code, comm, [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_bad_problem_file_is_one_line_naming_file_and_line_and_stops_the_ranks(tmp_path, caplog):
    code, comm, errors = _run(tmp_path, '{"prompt": "1+1?", "answer": "2"}\n{"prompt": \n', caplog)
    assert code == 1 and len(errors) == 1 and errors[0].exc_info is None
    assert f"{tmp_path / 'problems.jsonl'}:2:" in errors[0].getMessage() and "\n" not in errors[0].getMessage()
    report = json.loads((tmp_path / "run" / "failure.json").read_text())
    assert report["cause"] == "input" and report["line"] == errors[0].getMessage()
    assert not (tmp_path / "run" / "failure_traceback.txt").exists()
    stopped = sorted(dest for dest, _ in comm.take(Tag.STOP))
    assert stopped == sorted([LAYOUT.first_trainer] + LAYOUT.generator_ranks + LAYOUT.verifier_ranks)


def test_a_bug_keeps_its_traceback_in_the_run_dir_and_still_stops_the_ranks(tmp_path, caplog, monkeypatch):
    def broken(*a, **k):
        raise KeyError("a bug")
    monkeypatch.setattr("megatron_rl.data.iter_problems", broken)
    code, comm, errors = _run(tmp_path, '{"prompt": "1+1?", "answer": "2"}\n', caplog)
    trace = tmp_path / "run" / "failure_traceback.txt"
    assert code == 1 and len(errors) == 1
    assert errors[0].getMessage() == f"controller rank 0 failed: the controller loop failed: KeyError: 'a bug' " \
                                     f"(traceback in {trace})"
    assert 'raise KeyError("a bug")' in trace.read_text()
    assert json.loads((tmp_path / "run" / "failure.json").read_text())["cause"] == "crash"
    assert len(comm.take(Tag.STOP)) == LAYOUT.world_size - 1
