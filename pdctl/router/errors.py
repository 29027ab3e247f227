"""One HTTP error shape for the router: ``{"error": {"message", "type", "code"}}``.

Codes are stable snake_case constants; tests assert on them.
"""

from __future__ import annotations

from aiohttp import web

NO_PREFILL = "no_prefill_servers"
NO_DECODE = "no_decode_servers"
NO_WORKERS = "no_healthy_workers"
VERSION_MISMATCH = "no_matching_weight_version"
PREFILL_FAILED = "prefill_server_error"
DECODE_FAILED = "decode_server_error"
WORKER_FAILED = "worker_error"
UNAUTHORIZED = "unauthorized"
QUEUE_FULL = "queue_full"
QUEUE_TIMEOUT = "queue_timeout"
TIMEOUT = "request_timeout"
BAD_REQUEST = "invalid_request"
NOT_FOUND = "not_found"
HELD_TIMEOUT = "held_too_long"

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}


def error_body(status: int, code: str, message: str) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "code": code}}


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(error_body(status, code, message), status=status, headers=headers)
