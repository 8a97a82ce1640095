"""`megatron-rl translate` against a real local HTTP endpoint (stdlib server on 127.0.0.1) that fails
on purpose: transient failures are retried with backoff, a failure that outlasts the retries stops the
job with what it had saved, and a rerun of the same command sends only the missing requests."""
from __future__ import annotations

import json

import pytest

from megatron_rl.cli import main as cli_main
from megatron_rl.data.translate import ChatClient, EndpointError, translate_one
from support.chat_endpoint import ChatEndpoint

FRENCH = "Combien de pommes reste-t-il si l'on mange trois pommes sur un panier de dix pommes ?"


class Flaky:
    """Answers in French, except: the first `fail_first` requests get `fail_status`, and every request
    after the first `succeed_then_die` successes gets HTTP 500 (None: never)."""

    def __init__(self, fail_first: int, fail_status: int, succeed_then_die: int | None):
        self.fail_first, self.fail_status, self.succeed_then_die = fail_first, fail_status, succeed_then_die
        self.seen = self.ok = 0

    def __call__(self, body: dict) -> tuple[int, str]:
        self.seen += 1
        failing = self.seen <= self.fail_first or (self.succeed_then_die is not None
                                                   and self.ok >= self.succeed_then_die)
        if failing:
            return self.fail_status, "busy"
        self.ok += 1
        return 200, FRENCH


@pytest.fixture
def serve():
    servers = []

    def start(fail_first=0, fail_status=503, succeed_then_die=None) -> ChatEndpoint:
        servers.append(ChatEndpoint(Flaky(fail_first, fail_status, succeed_then_die)))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def test_transient_failures_are_retried_until_the_tries_are_spent(serve):
    server = serve(fail_first=2)
    assert translate_one(ChatClient(server.url, retries=2, backoff_s=0.01), "Ten apples.", "fr") == FRENCH
    assert len(server.requests) == 3  # two failures, then the answer
    server = serve(fail_first=10)
    with pytest.raises(EndpointError, match=r"HTTP 503.*after 3 tries"):
        translate_one(ChatClient(server.url, retries=2, backoff_s=0.01), "Ten apples.", "fr")
    assert len(server.requests) == 3
    server = serve(fail_first=10, fail_status=400)  # a bad request does not get better: no retry
    with pytest.raises(EndpointError, match="HTTP 400"):
        translate_one(ChatClient(server.url, retries=2, backoff_s=0.01), "Ten apples.", "fr")
    assert len(server.requests) == 1


def _problem_file(tmp_path, n=6):
    path = tmp_path / "problems.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "problem": f"Ten apples, eat {i}. How many are left?",
                                        "answer": str(10 - i)}) + "\n" for i in range(n)))
    return path


def _translate(server, src, out, *extra) -> int:
    return cli_main(["translate", "--path", str(src), str(out), "--base-url", server.url, "--fraction", "1",
                     "--languages", "fr", "--parallel", "1", "--backoff", "0.01", *extra])


def test_a_rerun_resumes_from_the_partial_output(serve, tmp_path, capsys):
    src, out = _problem_file(tmp_path), tmp_path / "out" / "translated.jsonl"
    partial = out.with_name(out.name + ".partial.jsonl")
    dying = serve(succeed_then_die=4)  # four answers, then HTTP 500 for good
    assert _translate(dying, src, out, "--retries", "1") == 1
    assert "run the same command again to resume" in capsys.readouterr().err
    saved = [json.loads(line) for line in partial.read_text().splitlines()]
    assert len(saved) == 4 and not out.exists()
    healthy = serve()
    assert _translate(healthy, src, out) == 0
    asked = set(healthy.user_messages())
    assert len(healthy.requests) == 2 and asked.isdisjoint(dying.user_messages()[:4])  # only the missing ones
    summary = json.loads(capsys.readouterr().out)
    assert summary["accepted"] == 6 and summary["output_problems"] == 12
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in rows if r.get("lang") == "fr") == [f"p{i}-fr" for i in range(6)]
    assert not partial.exists()  # done: a later run starts afresh
