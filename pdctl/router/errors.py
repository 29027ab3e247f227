"""One HTTP error shape for the router: ``{"error": {"message", "type", "code"}}``.

Codes are stable snake_case constants; tests assert on them.
"""

from __future__ import annotations

from pdctl.router.reply import Reply, json_reply

NO_PREFILL = "no_prefill_servers"
NO_DECODE = "no_decode_servers"
NO_WORKERS = "no_healthy_workers"
NONE_CHOSEN = "no_worker_chosen"  # the policy chose none of the workers in rotation (a manual key naming none)
VERSION_MISMATCH = "no_matching_weight_version"
PREFILL_FAILED = "prefill_server_error"
DECODE_FAILED = "decode_server_error"
WORKER_FAILED = "worker_error"
UNAUTHORIZED = "unauthorized"
FORBIDDEN = "forbidden"
BUSY = "busy"
QUEUE_FULL = "queue_full"
QUEUE_TIMEOUT = "queue_timeout"
TIMEOUT = "request_timeout"
BAD_REQUEST = "invalid_request"
NOT_FOUND = "not_found"
HELD_TIMEOUT = "held_too_long"
ROOM_TIMEOUT = "room_timeout"  # waited past --request-timeout-secs for a prefill or decode with room (late pairing)
INTERRUPTED = "interrupted_by_weight_update"
HANDED_OFF = "handed_off"
"""An attempt that waited at a worker being drained for a role switch, taken back and sent to
another pair (pdctl.router.legs ``Legs.hand_off``): nothing had reached the client."""
CONTINUATION_FAILED = "continuation_failed"
METHOD_NOT_ALLOWED = "method_not_allowed"
TOO_LARGE = "request_too_large"
REQUEST_TIMEOUT = "request_body_timeout"
INTERNAL = "internal_error"

# The code for an error the HTTP server finds itself (before any handler runs).
_SERVER_CODES = {
    400: BAD_REQUEST,
    404: NOT_FOUND,
    405: METHOD_NOT_ALLOWED,
    413: TOO_LARGE,
    431: TOO_LARGE,
    408: REQUEST_TIMEOUT,
    503: BUSY,
}

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    431: "invalid_request_error",
    429: "rate_limit_error",
}


class RouteError(Exception):
    """A request the router answers with this error itself (no worker's answer to pass on)."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code = status, code


def error_body(status: int, code: str, message: str) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "code": code}}


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> Reply:
    return json_reply(error_body(status, code, message), status, headers)


def server_error(status: int, message: str) -> Reply:
    """The Reply for an error the HTTP server found (bad request, not found, too large, 500)."""
    return error_response(status, _SERVER_CODES.get(status, INTERNAL), message)
