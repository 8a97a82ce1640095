"""Thin typed HTTP client for one SGLang 0.5.23 server (native endpoints only).

Every call raises `SGLangHTTPError` (status code + body) on a non-2xx answer and
`ServerUnreachable` when the server cannot be reached, so callers can tell "the server said no"
from "the server is gone" (the latter triggers the generator's restart path).
"""
from __future__ import annotations

from typing import Any, Literal

import requests

PauseMode = Literal["in_place", "retract", "abort"]


class SGLangHTTPError(RuntimeError):
    def __init__(self, path: str, status: int, body: Any):
        super().__init__(f"SGLang {path} -> HTTP {status}: {str(body)[:500]}")
        self.path, self.status, self.body = path, status, body


class ServerUnreachable(ConnectionError):
    """The server process is gone or not listening (connection refused/reset)."""


class SGLangClient:
    def __init__(self, base_url: str, timeout_s: float = 600.0):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
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

    def weight_version(self) -> str:
        return str(self.model_info()["weight_version"])

    # ---------------------------------------------------------------- generation
    def generate(self, body: dict) -> dict:
        return self._call("POST", "/generate", body)

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

    def set_weight_version(self, version: str) -> None:
        """Record a version change for live requests too (they get a new span from here on)."""
        self._call("POST", "/update_weight_version",
                   {"new_version": version, "abort_all_requests": False}, timeout=60)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> Any:
        return self._call("POST", "/get_weights_by_name", {"name": name, "truncate_size": truncate_size},
                          timeout=60)
