"""`SGLangServer.start` launches a server that exits during start-up once more, and reports a second
exit with its log. The process is a stand-in (a tiny HTTP server answering /health, or a process that
exits with uvicorn's start-up failure code 3): the lifecycle is what is tested, not SGLang; the real
server's start is covered by every e2e test."""
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from megatron_rl.rollout.server import START_ATTEMPTS, ServerSpec, ServerStartError, SGLangServer
from megatron_rl.sync.group import free_port

pytestmark = pytest.mark.unit

STAND_IN = r'''
import http.server, sys
from pathlib import Path
failures_left = Path(sys.argv[2])
n = int(failures_left.read_text())
if n > 0:
    failures_left.write_text(str(n - 1))
    print("start-up failed", flush=True)
    sys.exit(3)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
'''


@dataclass
class StandInSpec(ServerSpec):
    script: str = ""
    failures_file: str = ""

    def command(self) -> list[str]:
        return [sys.executable, "-c", self.script, str(self.port), self.failures_file]


def _server(tmp_path: Path, failures: int) -> SGLangServer:
    counter = tmp_path / "failures_left"
    counter.write_text(str(failures))
    model = tmp_path / "model"
    model.mkdir()
    spec = StandInSpec(str(model), free_port(), log_path=str(tmp_path / "server.log"), startup_timeout_s=30,
                       script=STAND_IN, failures_file=str(counter))
    return SGLangServer(spec)


def test_a_server_that_exits_during_start_up_is_launched_again(tmp_path, capsys):
    server = _server(tmp_path, failures=1)
    try:
        server.start()
        assert server.healthy()
        assert server.incarnation == 2  # two launches, one process alive
        assert "launching it again" in capsys.readouterr().err
        log = Path(server.spec.log_path).read_text()
        assert log.count("==== launch") == 2 and "start-up failed" in log
    finally:
        server.stop()


def test_a_second_exit_is_reported_with_the_log(tmp_path):
    server = _server(tmp_path, failures=START_ATTEMPTS)
    with pytest.raises(ServerStartError, match=r"exited \(code 3\) during startup(.|\n)*start-up failed") as e:
        server.start()
    assert e.value.exited and server.incarnation == START_ATTEMPTS and not server.alive()


def test_start_up_timeout_is_derived_from_the_model_size(tmp_path):
    from megatron_rl.rollout.server import startup_timeout

    model = tmp_path / "model"
    model.mkdir()
    with open(model / "model.safetensors", "wb") as f:  # sparse: 48 GB of apparent size, Magistral Small's
        f.truncate(48 * 10**9)
    (model / "config.json").write_text("{}")
    seconds, source = startup_timeout(None, model)
    assert seconds == pytest.approx(600 + 480, abs=1)  # 10 minutes + 48 GB at 100 MB/s
    assert source.startswith("derived from the model's 48.0 GB")
    assert startup_timeout(7200.0, model) == (7200.0, "generator.startup_timeout_s")


SILENT = "import time; time.sleep(120)"  # a server that never answers /health


@pytest.mark.parametrize("configured,source", [(1.0, r"\(generator\.startup_timeout_s\)"),
                                               (None, r"\(derived from the model's 0\.0 GB.*\)")])
def test_a_start_up_timeout_says_what_to_set(tmp_path, monkeypatch, configured, source):
    import megatron_rl.rollout.server as server_mod

    monkeypatch.setattr(server_mod, "STARTUP_BASE_S", 1.0)  # the derived figure of an empty model: ~1 s
    model = tmp_path / "model"
    model.mkdir()
    server = SGLangServer(StandInSpec(str(model), free_port(), log_path=str(tmp_path / "server.log"),
                                      startup_timeout_s=configured, script=SILENT))
    with pytest.raises(ServerStartError, match=rf"not healthy after 1 s {source}; set generator\.startup_timeout_s "
                                               "to wait longer") as e:
        server.start()
    assert not e.value.exited and not server.alive()
