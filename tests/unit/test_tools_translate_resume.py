"""`megatron-rl translate` against a real local HTTP endpoint (stdlib server on 127.0.0.1) that fails
on purpose: transient failures are retried with backoff, a failure that outlasts the retries stops the
job with what it had saved, and a rerun of the same command sends only the missing requests."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_rl.cli import main as cli_main
from megatron_rl.tools.translate import ChatClient, EndpointError, translate_one

FRENCH = "Combien de pommes reste-t-il si l'on mange trois pommes sur un panier de dix pommes ?"


class FlakyHandler(BaseHTTPRequestHandler):
    """Answers in French, except: the first `fail_first` requests get `fail_status`, and every request
    after the first `succeed_then_die` successes gets HTTP 500 (None: never)."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        s = self.server
        with s.lock:
            s.requests.append(body["messages"][1]["content"])
            n = len(s.requests)
            failing = n <= s.fail_first or (s.succeed_then_die is not None and s.ok >= s.succeed_then_die)
            if not failing:
                s.ok += 1
        status, out = (s.fail_status, b'{"error": "busy"}') if failing else (200, json.dumps(
            {"choices": [{"message": {"role": "assistant", "content": FRENCH}}]}).encode())
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *a):
        pass


@pytest.fixture
def serve():
    servers = []

    def start(fail_first=0, fail_status=503, succeed_then_die=None):
        server = ThreadingHTTPServer(("127.0.0.1", 0), FlakyHandler)
        server.requests, server.ok, server.lock = [], 0, threading.Lock()
        server.fail_first, server.fail_status, server.succeed_then_die = fail_first, fail_status, succeed_then_die
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _url(server) -> str:
    return f"http://127.0.0.1:{server.server_port}"


def test_transient_failures_are_retried_until_the_tries_are_spent(serve):
    server = serve(fail_first=2)
    assert translate_one(ChatClient(_url(server), retries=2, backoff_s=0.01), "Ten apples.", "fr") == FRENCH
    assert len(server.requests) == 3  # two failures, then the answer
    server = serve(fail_first=10)
    with pytest.raises(EndpointError, match=r"HTTP 503.*after 3 tries"):
        translate_one(ChatClient(_url(server), retries=2, backoff_s=0.01), "Ten apples.", "fr")
    assert len(server.requests) == 3
    server = serve(fail_first=10, fail_status=400)  # a bad request does not get better: no retry
    with pytest.raises(EndpointError, match="HTTP 400"):
        translate_one(ChatClient(_url(server), retries=2, backoff_s=0.01), "Ten apples.", "fr")
    assert len(server.requests) == 1


def _problem_file(tmp_path, n=6):
    path = tmp_path / "problems.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "problem": f"Ten apples, eat {i}. How many are left?",
                                        "answer": str(10 - i)}) + "\n" for i in range(n)))
    return path


def _translate(server, src, out, *extra) -> int:
    return cli_main(["translate", "--path", str(src), str(out), "--base-url", _url(server), "--fraction", "1",
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
    asked = set(healthy.requests)
    assert len(healthy.requests) == 2 and asked.isdisjoint(dying.requests[:4])  # only the missing ones
    summary = json.loads(capsys.readouterr().out)
    assert summary["accepted"] == 6 and summary["output_problems"] == 12
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in rows if r.get("lang") == "fr") == [f"p{i}-fr" for i in range(6)]
    assert not partial.exists()  # done: a later run starts afresh
