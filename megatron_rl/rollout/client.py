"""Thin typed HTTP client for one SGLang 0.5.23 server (native endpoints only).

Every call raises `SGLangHTTPError` (status code + body) on a non-2xx answer and
`ServerUnreachable` when the server cannot be reached, so callers can tell "the server said no"
from "the server is gone" (the latter triggers the generator's restart path).

`/generate` is read as a stream: a non-streaming answer sends nothing until the completion ends, so
any read timeout would be a limit on the completion's length (16k-40k tokens take 330-1600 s on a
GPU, plus update pauses). Streamed, the limit is on silence (`idle_timeout_s`); past it,
`GenerationTimeout` names the server and the setting, and closing the stream makes SGLang abort the
request. SGLang 0.5.23 streams cumulative chunks (output_ids and output_token_logprobs so
far; weight_versions only in the last one), so the last chunk is exactly the non-streaming answer.
"""
from __future__ import annotations

import json
import math
from typing import Any, Callable, Literal

import requests
from urllib3.exceptions import ReadTimeoutError

PauseMode = Literal["in_place", "retract", "abort"]
CONNECT_TIMEOUT_S = 30.0
# Chunks per completion besides the first token and the last: each carries every token so far, so a
# completion streams ~STREAM_CHUNKS / 2 times its answer's size; fewer chunks mean longer silences.
STREAM_CHUNKS = 16
IDLE_SETTING = "generator.request_idle_timeout_s"


class SGLangHTTPError(RuntimeError):
    def __init__(self, path: str, status: int, body: Any):
        super().__init__(f"SGLang {path} -> HTTP {status}: {str(body)[:500]}")
        self.path, self.status, self.body = path, status, body


class ServerUnreachable(ConnectionError):
    """The server process is gone or not listening (connection refused/reset)."""


class GenerationTimeout(TimeoutError):
    """A /generate stream got no data for `idle_timeout_s`: the server hangs, or requests wait longer
    than that in its queue or in a weight-update pause."""


class SGLangClient:
    def __init__(self, base_url: str, timeout_s: float = 600.0, idle_timeout_s: float | None = 3600.0):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s  # every call but /generate
        self.idle_timeout_s = idle_timeout_s  # longest silence of a /generate stream; None: no limit
        self._session = requests.Session()

    def _call(self, method: str, path: str, body: dict | None = None, timeout: float | None = None,
              ok_statuses: tuple[int, ...] = ()) -> Any:
        try:
            r = self._session.request(method, self.base_url + path, json=body,
                                      timeout=timeout or self.timeout_s)
        except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as e:
            raise ServerUnreachable(f"{self.base_url}{path}: {e}") from e
        try:
            out = r.json()
        except ValueError:
            out = r.text
        if r.status_code >= 300 and r.status_code not in ok_statuses:
            raise SGLangHTTPError(path, r.status_code, out)
        return out

    # ---------------------------------------------------------------- liveness / info
    def healthy(self, timeout: float = 5.0) -> bool:
        """GET /health: 200 once the server finished starting (does not run a generation)."""
        try:
            r = self._session.get(self.base_url + "/health", timeout=timeout)
            return r.status_code == 200
        except requests.RequestException:
            return False

    def model_info(self) -> dict:
        return self._call("GET", "/model_info", timeout=30)

    def loaded_adapters(self) -> set[str]:
        """Names of the LoRA adapters the server holds (GET /v1/models lists them after the base)."""
        return {m["id"] for m in self._call("GET", "/v1/models", timeout=30).get("data", []) if m.get("parent")}

    def weight_version(self) -> str:
        return str(self.model_info()["weight_version"])

    # ---------------------------------------------------------------- generation
    def generate(self, body: dict, on_tokens: Callable[[int], None] | None = None) -> dict:
        """POST /generate streamed; returns the final answer (as without streaming). `on_tokens` gets
        the number of output tokens so far after each chunk."""
        sampling = {"stream_interval": stream_interval(body.get("sampling_params") or {}),
                    **(body.get("sampling_params") or {})}
        try:
            with self._session.post(self.base_url + "/generate", json={**body, "sampling_params": sampling,
                                                                       "stream": True},
                                    stream=True, timeout=(CONNECT_TIMEOUT_S, self.idle_timeout_s)) as r:
                if r.status_code >= 300:
                    raise SGLangHTTPError("/generate", r.status_code, r.text)
                return self._last_chunk(r, on_tokens)
        except requests.ReadTimeout as e:  # no response headers in time
            raise self._idle_timeout(body) from e
        except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as e:
            if e.args and isinstance(e.args[0], ReadTimeoutError):  # requests reports a silent stream so
                raise self._idle_timeout(body) from e
            raise ServerUnreachable(f"{self.base_url}/generate: {e}") from e

    def _last_chunk(self, r: requests.Response, on_tokens: Callable[[int], None] | None) -> dict:
        last = None
        # chunk_size None: one read per SSE event (a fixed size re-joins a long event quadratically)
        for line in r.iter_lines(chunk_size=None):
            if not line.startswith(b"data: "):
                continue
            if line == b"data: [DONE]":
                if last is None:
                    raise SGLangHTTPError("/generate", r.status_code, "stream ended without an answer")
                return last
            last = json.loads(line[6:])
            if "error" in last:
                raise SGLangHTTPError("/generate", int(last["error"].get("code", 400)), last["error"])
            if on_tokens is not None:
                on_tokens(len(last.get("output_ids") or ()))
        raise ServerUnreachable(f"{self.base_url}/generate: stream closed before [DONE]")

    def _idle_timeout(self, body: dict) -> GenerationTimeout:
        return GenerationTimeout(
            f"SGLang server {self.base_url} sent nothing on request {body.get('rid', '?')} for "
            f"{self.idle_timeout_s:g} s: it hangs (see its log), or requests wait longer than that in its "
            f"queue or a weight-update pause; raise {IDLE_SETTING} (null: no limit)")

    def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        self._call("POST", "/abort_request", {"rid": rid or "", "abort_all": abort_all}, timeout=30)

    def flush_cache(self) -> bool:
        """True if the radix cache was flushed; False if SGLang refused (requests running/queued)."""
        try:
            self._call("POST", "/flush_cache", timeout=60)
            return True
        except SGLangHTTPError as e:
            if e.status == 400:
                return False
            raise

    def pause(self, mode: PauseMode) -> None:
        self._call("POST", "/pause_generation", {"mode": mode}, timeout=120)

    def resume(self) -> None:
        self._call("POST", "/continue_generation", {}, timeout=120)

    # ---------------------------------------------------------------- weight updates
    def _checked(self, path: str, body: dict, timeout: float | None = None) -> dict:
        out = self._call("POST", path, body, timeout=timeout, ok_statuses=(400,))
        if not isinstance(out, dict) or not out.get("success", False):
            raise SGLangHTTPError(path, 400, out)
        return out

    def begin_weight_update(self) -> None:
        self._checked("/begin_weight_update", {})

    def end_weight_update(self) -> None:
        self._checked("/end_weight_update", {})

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str, backend: str) -> None:
        self._checked("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend})

    def destroy_weights_update_group(self, group_name: str) -> None:
        self._checked("/destroy_weights_update_group", {"group_name": group_name}, timeout=60)

    def update_weights_from_distributed(self, manifest: dict, group_name: str,
                                        weight_version: str | None = None) -> dict:
        """Post one bucket's manifest; SGLang then joins a broadcast on `group_name` to receive it.

        flush_cache is always False: SGLang refuses it (HTTP 400, update reported failed) while
        requests are paused in place; the prefix-cache policy lives in the generator instead.
        Returns the raw answer; `success` False means the bucket did not load.
        """
        body = {**manifest, "group_name": group_name, "flush_cache": False,
                "load_format": "flattened_bucket", "weight_version": weight_version}
        return self._call("POST", "/update_weights_from_distributed", body, ok_statuses=(400,))

    def load_lora_adapter_from_tensors(self, body: dict, timeout: float | None = None) -> dict:
        """POST /load_lora_adapter_from_tensors (body: sync/adapter_push.load_body); raises unless loaded."""
        return self._checked("/load_lora_adapter_from_tensors", body, timeout=timeout)

    def unload_lora_adapter(self, name: str) -> dict:
        """POST /unload_lora_adapter: SGLang waits for the requests that use it, then frees it."""
        return self._checked("/unload_lora_adapter", {"lora_name": name})

    def set_weight_version(self, version: str) -> None:
        """Record a version change for live requests too (they get a new span from here on)."""
        self._call("POST", "/update_weight_version",
                   {"new_version": version, "abort_all_requests": False}, timeout=60)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> Any:
        return self._call("POST", "/get_weights_by_name", {"name": name, "truncate_size": truncate_size},
                          timeout=60)


def stream_interval(sampling: dict) -> int:
    """Tokens between two stream chunks: STREAM_CHUNKS chunks over max_new_tokens (SGLang's default 128)."""
    return max(1, math.ceil(int(sampling.get("max_new_tokens") or 128) / STREAM_CHUNKS))
