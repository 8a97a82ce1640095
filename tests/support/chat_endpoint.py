"""A local OpenAI-compatible chat-completions endpoint (stdlib HTTP server on 127.0.0.1): the stand-in
for an external translation service. A `reply` function chooses each answer; the server records every
request as (path, body) in `requests`."""
from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# request body -> (HTTP status, the assistant's text on 200, else the "error" field of the answer)
Reply = Callable[[dict], tuple[int, str]]


class _Handler(BaseHTTPRequestHandler):
    server: ChatEndpoint

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        s = self.server
        with s.lock:  # one request at a time through `reply`, so a stateful reply needs no lock of its own
            s.requests.append((self.path, body))
            status, text = s.reply(body)
        ok = {"choices": [{"message": {"role": "assistant", "content": text}}]}
        out = json.dumps(ok if status == 200 else {"error": text}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *a):
        pass


class ChatEndpoint(ThreadingHTTPServer):
    """Serves from a daemon thread as soon as it is built; `close()` stops it."""

    def __init__(self, reply: Reply):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.reply = reply
        self.requests: list[tuple[str, dict]] = []
        self.lock = threading.Lock()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_port}"

    def user_messages(self) -> list[str]:
        """The user message (the text to translate) of every request so far, in order."""
        return [body["messages"][1]["content"] for _, body in self.requests]

    def close(self) -> None:
        self.shutdown()
        self.server_close()
