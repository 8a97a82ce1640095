"""The last line `megatron-rl train` prints after a job that ended badly (cli.train.ended_message):
it names the failing rank and role from rank 0's report, keeps bad input to one line, names a crash's
traceback file, mentions only files that exist, and advises starting again only where that can help
(a rank lost or late). tests/e2e/test_train_command.py checks it on a real failing run."""
from __future__ import annotations

import os

from megatron_rl.cli.train import ended_message
from megatron_rl.control.failure_report import clear_records, write_pid_file, write_report
from megatron_rl.control.protocol import Cause, RunFailed, WorkerFailure
from megatron_rl.rollout.server import ServerStartError
from megatron_rl.train.checkpoint_manifest import CheckpointError

RESTART = ("start it again", "--resume")


def _failure(exc: BaseException, role: str = "trainer", rank: int = 1) -> WorkerFailure:
    try:
        raise exc
    except BaseException as e:
        return WorkerFailure.of(role, rank, "LoadRequest failed", e)


def test_bad_input_is_one_line_naming_the_rank_without_a_traceback_or_a_restart(tmp_path):
    failure = _failure(CheckpointError(f"{tmp_path}/checkpoints holds checkpoints in the old layout"))
    assert failure.cause is Cause.INPUT and not failure.trace
    write_report(tmp_path, failure)
    message = ended_message(tmp_path, "run.yaml", 1)
    assert message == (f"megatron-rl train: the job ended with status 1: trainer rank 1 failed: "
                       f"{tmp_path}/checkpoints holds checkpoints in the old layout")
    assert not any(advice in message for advice in RESTART)


def test_a_crash_is_one_line_naming_its_traceback_file_and_no_restart(tmp_path):
    failure = _failure(ServerStartError("SGLang server on port 9 exited (code 1) during startup; log x:\ntail\nof it"),
                       role="generator", rank=2)
    assert failure.cause is Cause.CRASH and "tail\nof it" in failure.trace
    write_report(tmp_path, failure)
    message = ended_message(tmp_path, "run.yaml", 1)
    trace = tmp_path / "failure_traceback.txt"
    assert message == ("megatron-rl train: the job ended with status 1: generator rank 2 failed: LoadRequest failed: "
                       f"ServerStartError: SGLang server on port 9 exited (code 1) during startup; log x: "
                       f"(traceback in {trace})")
    assert "raise exc" in trace.read_text() and not any(advice in message for advice in RESTART)


def test_a_timeout_advises_resuming_from_the_last_checkpoint(tmp_path):
    write_report(tmp_path, RunFailed("no Loaded message within 600 s", Cause.LOST).failure)
    assert ended_message(tmp_path, "run.yaml", 1).endswith(
        "controller rank 0 failed: no Loaded message within 600 s; it wrote no checkpoint yet: start it again "
        "with the same command")
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("10\n")
    assert ended_message(tmp_path, "run.yaml", 1).endswith(
        "continue from its last checkpoint (iteration 10) with: megatron-rl train run.yaml --resume")
    assert not (tmp_path / "failure_traceback.txt").exists()


def test_a_killed_rank_is_mapped_to_its_role_and_resuming_is_advised(tmp_path):
    write_pid_file(tmp_path, 1, "trainer", "127.0.0.1")
    write_pid_file(tmp_path, 0, "controller", "127.0.0.1")
    message = ended_message(tmp_path, "run.yaml", 137)
    pid = os.getpid()  # write_pid_file records its own process's pid
    assert "status 137: a rank died" in message and f"({pid} controller r0, {pid} trainer r1)" in message
    assert message.endswith("start it again with the same command")


def test_a_job_that_ended_before_its_ranks_started_gets_no_advice_and_an_earlier_report_is_not_reused(tmp_path):
    write_report(tmp_path, _failure(CheckpointError("an earlier start's")))
    write_pid_file(tmp_path, 0, "controller", "127.0.0.1")
    clear_records(tmp_path)  # what `megatron-rl train` does before it starts the job
    message = ended_message(tmp_path, "run.yaml", 1)
    assert message == "megatron-rl train: the job ended with status 1 before its ranks started (the messages " \
                      "above say why)"
    assert not any(advice in message for advice in RESTART)
