"""Response shaping: the headers a request carries each way, and reading and rewriting engines'
answers (aborts, batch items, prefill's input logprobs in front of decode's).

Pure functions over bytes and dicts: no I/O, no worker state.
"""

from __future__ import annotations

import contextlib
from typing import Any

from pdctl.router.jsonutil import dumps, loads, sse_data, sse_event
from pdctl.router.resume import Piece, asked_abort

ROUTING_KEY = "x-smg-routing-key"
FORWARDED = frozenset({"x-correlation-id", "traceparent", "tracestate", ROUTING_KEY})
"""Client headers sent on to workers (with X-Request-ID and ``x-request-id-*``), as smg does;
the rest (cookies, custom headers) stay at the router. The client's Authorization only reaches a
worker the router holds no key for (``Headers.keyless``: engines started with the clients' own
key behind a standalone router, as sglang-router and smg run); a worker with its own key
(``Worker.auth``) never learns a client's credentials."""

ABORT = b'"abort"'
"""Found with ``bytes.find`` on the request path, not ``in``: CPython 3.11's ``needle in bytes``
first tries the needle as an integer, raising and clearing a TypeError each time (twice the
cost of ``find``)."""

_HOP_HEADERS = {
    b"content-length",
    b"content-type",  # a StreamReply carries it apart
    b"transfer-encoding",
    b"connection",
    b"keep-alive",
    b"content-encoding",
    b"date",
    b"server",
}


class Headers(dict[str, str]):
    """The reply's headers (the dict itself), ``upstream``, the headers sent to workers, and
    ``keyless``, those sent to a worker the router holds no key for (``upstream`` and the
    client's Authorization, if it sent one)."""

    __slots__ = ("keyless", "upstream")

    def __init__(self, reply: dict[str, str], upstream: dict[str, str]):
        super().__init__(reply)
        self.upstream = upstream
        self.keyless = upstream

    @classmethod
    def of(cls, request_id: str, client: dict[str, str]) -> Headers:
        """``client``: the request's headers, names in lower case. Values with CR or LF are dropped."""
        if _KEPT_BACK.issuperset(client):
            upstream = {"X-Request-ID": request_id}  # the common case, found by one C call
        else:
            upstream = {}
            for name, value in client.items():
                if _forwarded(name):
                    if "\r" not in value and "\n" not in value:
                        upstream[name] = value
                elif len(_KEPT_BACK) < 256 and len(name) <= 64:  # (clients choose names: a bounded cache)
                    _KEPT_BACK.add(name)
            upstream["X-Request-ID"] = request_id
        headers = cls.__new__(cls)  # (not through __init__: a Python call less per request)
        headers["X-Request-ID"] = request_id
        headers.upstream = upstream
        auth = client.get("authorization")
        headers.keyless = (
            upstream if auth is None or "\n" in auth or "\r" in auth else {**upstream, "Authorization": auth}
        )
        return headers


_KEPT_BACK: set[str] = set()
"""Client header names seen that stay at the router (all but FORWARDED and ``x-request-id-*``)."""


def _forwarded(name: str) -> bool:
    return name in FORWARDED or name.startswith("x-request-id-")


def passed_headers(upstream: dict[bytes, bytes], headers: Headers) -> dict[str, str]:
    """A streamed reply's headers: the engine's (hop-by-hop ones dropped) and the request's."""
    out = {k.decode("latin-1"): v.decode("latin-1") for k, v in upstream.items() if k.lower() not in _HOP_HEADERS}
    out.update(headers)
    return out


def names_bootstrap(body: bytes, host: str, port: int | None) -> bool:
    """Whether a decode's error body names a prefill's bootstrap server (HOST:PORT)."""
    return port is not None and f"{host}:{port}".encode() in body


def abort_of(body: bytes) -> dict[str, Any] | None:
    """The finish_reason of an engine's 200 whose (first) item finished with an abort (SGLang's
    shape: ``{"type": "abort", "message", "status_code"}``), whole or streamed (a prefill asked to
    stream answers in events), else None."""
    if body.find(ABORT) < 0:
        return None
    try:
        if body.startswith(b"data: "):
            data = next(loads(e[6:]) for e in body.split(b"\n\n") if e.startswith(b"data: {") and b'"abort"' in e)
        else:
            data = loads(body)
    except (ValueError, StopIteration):
        return None
    item = data[0] if isinstance(data, list) and data else data
    meta = item.get("meta_info") if isinstance(item, dict) else None
    reason = meta.get("finish_reason") if isinstance(meta, dict) else None
    return reason if isinstance(reason, dict) and reason.get("type") == "abort" else None


def aborted(body: bytes) -> bool:
    return abort_of(body) is not None


def server_abort(block: bytes) -> int | None:
    """The status of a stream's first event when it ends its request with a server-side failure,
    else None (``block``: one or more whole events; the first is read).

    SGLang 0.5.23 streams an abort as an output whose finish_reason is an abort with its
    ``status_code`` (a decode that lost its prefill's KV: 500, "Lost connection with prefill
    instance (bootstrap_addr: HOST:PORT)"), and an error as ``{"error": {"code": ...}}``. A 4xx
    is the client's answer and is not reported here."""
    end = block.find(b"\n\n")
    event = block if end < 0 else block[: end + 2]
    reason = abort_of(event)
    if reason is not None:
        code = reason.get("status_code")
    elif event.find(b'"error"') >= 0 and event.startswith(b"data: {"):
        data = sse_data(event)
        error = data.get("error") if data is not None else None
        code = error.get("code") if isinstance(error, dict) else None
    else:
        return None
    return code if isinstance(code, int) and 500 <= code < 600 else None


def interrupted_answer(body: bytes) -> bool:
    """Whether a /generate answer or an OpenAI completion has an item that an asked-for abort
    ended (SGLang's OpenAI routes give such a choice finish_reason "abort")."""
    if b'"abort"' not in body:
        return False
    try:
        parsed = loads(body)
    except ValueError:
        return False
    if isinstance(parsed, dict) and isinstance(parsed.get("choices"), list):
        return any(isinstance(c, dict) and c.get("finish_reason") == "abort" for c in parsed["choices"])
    items = [parsed] if isinstance(parsed, dict) else parsed
    return isinstance(items, list) and any(asked_abort(item) for item in items)


def items(body: bytes, count: int) -> list[Any] | None:
    """A /generate answer's items (a list, or one object as a list of one) when there are ``count``."""
    try:
        parsed = loads(body)
    except ValueError:
        return None
    out = [parsed] if isinstance(parsed, dict) else parsed
    return out if isinstance(out, list) and len(out) == count else None


def merged_logprobs(prefill_body: bytes, decode_body: bytes) -> bytes:
    """Decode's answer with prefill's meta_info.input_token_logprobs in front of its own (per
    item for batches); decode's as it is when either is not JSON."""
    try:
        p, d = loads(prefill_body), loads(decode_body)
    except ValueError:
        return decode_body
    pairs = zip(p, d, strict=False) if isinstance(p, list) and isinstance(d, list) else [(p, d)]
    for p_item, d_item in pairs:
        if isinstance(p_item, dict) and isinstance(d_item, dict) and "meta_info" in d_item:
            head = p_item.get("meta_info", {}).get("input_token_logprobs") or []
            d_item["meta_info"]["input_token_logprobs"] = head + (d_item["meta_info"].get("input_token_logprobs") or [])
    return dumps(d)


def first_input_logprobs(prefill_body: bytes) -> list:
    """The input logprobs in a prefill's streamed answer (its first data event)."""
    for line in prefill_body.split(b"\n"):
        if line.startswith(b"data: {"):
            with contextlib.suppress(ValueError):
                return loads(line[6:]).get("meta_info", {}).get("input_token_logprobs") or []
    return []


def with_input_logprobs(done: Piece, prefix: list | None) -> Piece:
    """``done`` with the prefill's input logprobs in front, as the client got them."""
    if prefix is not None:
        done.meta["input_token_logprobs"] = prefix + (done.meta.get("input_token_logprobs") or [])
    return done


def prepend_logprobs(event: bytes, prefix: list) -> bytes:
    """A decode's stream event with the prefill's input logprobs in front of its own."""
    chunk = sse_data(event)
    meta = chunk.get("meta_info") if chunk is not None else None
    if not isinstance(meta, dict):
        return event
    meta["input_token_logprobs"] = prefix + (meta.get("input_token_logprobs") or [])
    return sse_event(chunk)
