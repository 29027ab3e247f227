"""The one synchronous JSON-over-HTTP client of pdctl's control calls, and the seam where urllib's
errors are mapped: an answer with an error status is an answer (``Answer``), not an exception; no
answer (refused, reset, timed out, a broken status line or body) is an ``OSError``.

Two calls, one underneath the other:

- ``exchange``: one request, the status and raw body of whatever answered. The control plane's
  and the trainer's client (pdctl.weights.client.JsonClient, which never raises), the node agent's
  probes (pdctl.node.agent), a supervisor's liveness probe (pdctl.node.supervise) and the sim's
  remote-instance triggers (pdctl.sim.remote_instance) are built on it;
- ``call_json``: POST a JSON body (GET without one) with a bearer key, the parsed JSON of a 2xx
  answer; an error status raises ``StatusError`` (an ``OSError`` that keeps the status and body).
  The seed relays and the receivers' supervisors (pdctl.node.peer_weights) use it.

Light on purpose (urllib, no asyncio): every supervisor and node agent imports it. The asynchronous
clients (the router, ``pdctl top``) use aiohttp; pdctl.httputil holds their helpers.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

__all__ = ["Answer", "StatusError", "call_json", "exchange"]


@dataclass(frozen=True, slots=True)
class Answer:
    """What a server answered: its HTTP status and the raw body (after redirects)."""

    status: int
    raw: bytes

    @property
    def ok(self) -> bool:
        """A 2xx status."""
        return 200 <= self.status < 300

    def json(self) -> Any:
        """The parsed body; an empty body is None. Raises ``ValueError`` for a body that is not JSON."""
        return json.loads(self.raw or b"null")

    def text(self, limit: int = 2000) -> str:
        """The body's first ``limit`` bytes as text (undecodable bytes replaced)."""
        return self.raw[:limit].decode(errors="replace")


class StatusError(OSError):
    """``call_json``'s server answered with a status other than 2xx: ``status`` and the start of its body
    (``text``). An ``OSError``, so that a caller that only cares whether a call worked catches
    one thing."""

    def __init__(self, url: str, answer: Answer):
        super().__init__(f"{url} answered {answer.status}: {answer.text(500)}")
        self.url = url
        self.status = answer.status
        self.text = answer.text()

    def error(self) -> str:
        """The ``error`` string of a JSON answer (pdctl's refusals say why there), else the status and
        body."""
        try:
            error = json.loads(self.text).get("error")
        except (ValueError, AttributeError):
            error = None
        return error if isinstance(error, str) else f"{self.status} {self.text}"


def exchange(
    method: str,
    url: str,
    body: Any = None,
    *,
    headers: dict[str, str] | None = None,
    timeout_secs: float | None = 5.0,
) -> Answer:
    """Send one request (``body`` as JSON when not None) and return the answer, whatever its status.

    Args:
        method: ``GET``, ``POST``, ...
        url: the full URL.
        body: sent as JSON; None sends no body.
        headers: sent as they are (nothing is added: a JSON body says its type only when asked).
        timeout_secs: for the connection and each read; None waits as long as it takes (a seed's transfer).

    Raises:
        OSError: no answer came (refused, reset, timed out, a broken answer).
        ValueError: ``url`` is not an http URL.
    """
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout_secs) as resp:
            return Answer(resp.status, resp.read())
    except urllib.error.HTTPError as exc:  # an answer all the same
        try:
            raw = exc.read()
        except (OSError, http.client.HTTPException):  # the error's body broke off: its status is still the answer
            raw = b""
        return Answer(exc.code, raw)
    except http.client.HTTPException as exc:  # a broken answer (BadStatusLine, IncompleteRead): no answer
        raise OSError(f"{url}: {type(exc).__name__}: {exc}") from exc


def call_json(url: str, body: Any = None, *, key: str | None = None, timeout_secs: float | None = 5.0) -> Any:
    """POST ``body`` as JSON (GET when it is None) with ``Authorization: Bearer <key>`` when there is
    a key; the parsed JSON of a 2xx answer (None for an empty one).

    Raises:
        StatusError: the server answered with a status other than 2xx (an ``OSError``).
        OSError: no answer came.
        ValueError: the answer is not JSON, or ``url`` is not an http URL.
    """
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    answer = exchange("GET" if body is None else "POST", url, body, headers=headers, timeout_secs=timeout_secs)
    if not answer.ok:
        raise StatusError(url, answer)
    return answer.json()
