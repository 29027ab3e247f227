"""A small synchronous JSON client for engines and the router, and concurrent fan-outs.

The trainer side stays synchronous (a training loop calls ``push`` between steps); calls that
must overlap (every engine's ``/init_weights_update_group`` with the trainer's rendezvous, one
update body per engine with the broadcast) run on a thread pool. Each failure is kept as a
``CallFailure`` that says whether the engine was unreachable (``transport``) or answered with
an error, because the two mean different things for who is at fault.
"""

from __future__ import annotations

import http.client
import json
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from pdctl.jsonhttp import exchange


@dataclass(frozen=True)
class CallFailure:
    """An HTTP call that did not succeed: ``transport`` when no answer came (refused, reset,
    timed out), else the engine's status and message."""

    url: str
    message: str
    transport: bool
    status: int | None = None
    body: Any = None
    """The parsed answer, when one came (the router's names what failed on which engine)."""

    def __str__(self) -> str:
        return f"{self.message} (HTTP {self.status})" if self.status else self.message


class JsonClient:
    """POST/GET JSON with a timeout and an optional bearer key; never raises for HTTP errors.

    ``api_key`` goes to every server but those in ``keys`` (``"http://host:port"`` -> its own
    key): the engines get the engine key, the router its control-plane key."""

    def __init__(self, api_key: str | None = None, timeout_secs: float = 120.0, keys: dict[str, str] | None = None):
        self.api_key = api_key
        self.keys = {origin.rstrip("/"): key for origin, key in (keys or {}).items()}
        self.timeout_secs = timeout_secs
        self.extra: dict[str, dict[str, str]] = {}
        """``"http://host:port"`` -> more headers for every call to that server (a push's
        ``X-Pdctl-Txn`` on its calls to the router while it is open)."""
        self.pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="pdctl-weights-http")

    def call(self, method: str, url: str, body: Any = None, timeout_secs: float | None = None) -> Any:
        """The parsed JSON (or text) of a 2xx answer whose ``success`` is not false, else a CallFailure
        (through pdctl.jsonhttp, the one synchronous client)."""
        try:
            answer = exchange(
                method, url, body, headers=self._headers(url), timeout_secs=timeout_secs or self.timeout_secs
            )
        except OSError as exc:  # refused, reset, timed out (urllib's URLError says why in ``reason``)
            reason = getattr(exc, "reason", exc)
            return CallFailure(url, f"no answer from {url}: {reason}", transport=True)
        return _answer(url, answer.raw, answer.status)

    def headers_for(self, url: str) -> dict[str, str]:
        """The headers a call to ``url`` carries: JSON, and the key for its server."""
        return self._headers(url)

    def _headers(self, url: str) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        parts = urlsplit(url)
        origin = f"{parts.scheme}://{parts.netloc}"
        key = self.keys.get(origin, self.api_key)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        headers.update(self.extra.get(origin, {}))
        return headers

    def post(self, url: str, body: Any = None, timeout_secs: float | None = None) -> Any:
        """``call`` with POST; a None body is sent as ``{}``."""
        return self.call("POST", url, body if body is not None else {}, timeout_secs)

    def get(self, url: str, timeout_secs: float | None = None) -> Any:
        """``call`` with GET."""
        return self.call("GET", url, None, timeout_secs)

    def connect(self, url: str) -> http.client.HTTPConnection | CallFailure:
        """A new connection to ``url``'s server, already connected: a dead engine refuses here."""
        parts = urlsplit(url)
        conn = http.client.HTTPConnection(parts.hostname or "", parts.port or 80, timeout=self.timeout_secs)
        try:
            conn.connect()
        except OSError as exc:
            return CallFailure(url, f"no answer from {url}: {exc}", transport=True)
        return conn

    def send(self, conn: http.client.HTTPConnection, url: str, body: Any) -> Any:
        """POST ``body`` on a connection from ``connect``; answers as ``call`` does. Closes it."""
        try:
            conn.request("POST", urlsplit(url).path, body=json.dumps(body).encode(), headers=self._headers(url))
            resp = conn.getresponse()
            raw, status = resp.read(), resp.status
        except (OSError, http.client.HTTPException) as exc:
            return CallFailure(url, f"no answer from {url}: {exc}", transport=True)
        finally:
            conn.close()
        return _answer(url, raw, status)

    def submit(self, method: str, url: str, body: Any = None, timeout_secs: float | None = None) -> Future:
        """``call`` on the client's thread pool; a Future of what it returns."""
        return self.pool.submit(self.call, method, url, body, timeout_secs)

    def close(self) -> None:
        """Shut the thread pool down without waiting; calls not yet started are cancelled."""
        self.pool.shutdown(wait=False, cancel_futures=True)


def _answer(url: str, raw: bytes, status: int) -> Any:
    """The parsed body of a successful answer, else a CallFailure with the engine's message."""
    parsed = _parse(raw)
    if status >= 400 or (isinstance(parsed, dict) and parsed.get("success") is False):
        return CallFailure(url, f"{url} answered: {_message(parsed)}", transport=False, status=status, body=parsed)
    return parsed


def _parse(raw: bytes) -> Any:
    text = raw.decode("utf-8", errors="replace")
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _message(parsed: Any) -> str:
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict):
            return str(error.get("message", error))
        return str(parsed.get("message") or error or parsed)
    return str(parsed).strip()[:500]
