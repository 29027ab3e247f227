"""Who may call which route: a client (data-plane) key, control-plane keys with roles, and the
engine key the router itself sends to workers.

The rules follow smg 1.13.0 (sglang-router 0.3.2's successor), as observed against its binary:
- open: ``/health``, ``/liveness``, ``/readiness``, ``/metrics`` (probes and scrapes);
- data plane (inference and model info): the client key (``--api-key``), when one is set;
- control plane: with control-plane keys (``--control-plane-api-keys 'id:name:role:key'``), only
  they: ``admin`` for everything, ``user`` for reading (GET). Without any, the client key guards
  the control plane too (sglang-router's fallback), and with no key at all everything is open.
- refusals: 401 for a missing or unknown key, 403 for a key whose role is too small.

pdctl differs on purpose in two places: ``/health_generate`` (it runs a generation) needs the
client key, and a control-plane key is not a client key (it does not reach the data plane: a
leaked admin key does not also read other users' prompts' answers, and vice versa).

SGLang's control routes (pause, continue, weight updates and groups, flush, abort, memory: SGLang's
admin level), which the router answers for the whole fleet (pdctl.router.facade), are control
routes: writes need an admin key, ``GET /get_weight_version`` a reader's. RL frameworks send no
header at all: ``--control-plane-open-from CIDR`` (a topology's ``router.control_open_from``)
admits calls without one to those routes and to ``GET``/``POST /workers`` from those networks only
(a call that sends a key is still checked). Every call to them is audited, allowed or not.
The scheme of ``Authorization: Bearer KEY`` is matched in any case (RFC 7235), the key exactly.

Every decision is made from the request line and headers alone (``HttpServer.check_head``), so
a refused request's body is never read.
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pdctl.choices import Choice
from pdctl.errors import RouterConfigError
from pdctl.refit import LOAD_PATH, PUSH_PATHS
from pdctl.router import errors
from pdctl.router.reply import Reply
from pdctl.sglang import Endpoint
from pdctl.sglang.control import CONTROL_ROUTES
from pdctl.step_hint import PLANNER_PATH, STEP_PATH

log = logging.getLogger("pdctl.router")
audit_log = logging.getLogger("pdctl.router.audit")

OPEN_PATHS = frozenset({"/health", "/liveness", "/readiness", "/metrics"})


class ControlRole(Choice):
    """What a control-plane key may do: ``admin`` reads and changes, ``user`` only reads."""

    ADMIN = "admin"
    USER = "user"
    """Reads the control plane (GET /workers, /pdctl/weights); changes nothing."""


class Door(Choice):
    """What a route needs."""

    OPEN = "open"
    DATA = "data"
    CONTROL_READ = "control-read"
    CONTROL_WRITE = "control-write"


SGLANG_CONTROL = frozenset((method, endpoint.value) for method, endpoint in CONTROL_ROUTES)
"""SGLang's control routes (pdctl.router.facade): always audited."""
OPENABLE = SGLANG_CONTROL | {("GET", "/workers"), ("POST", "/workers")}
"""What ``--control-plane-open-from`` admits without a key: what RL frameworks call."""
CONTROL_READ_ROUTES = frozenset(
    {
        ("GET", "/workers"),
        ("GET", "/pdctl/weights"),
        ("GET", PLANNER_PATH),
        ("GET", Endpoint.GET_WEIGHT_VERSION.value),
    }
)
CONTROL_READ_PREFIXES = (("GET", "/workers/"),)
CONTROL_WRITE_ROUTES = frozenset(
    {
        ("POST", "/workers"),
        ("POST", "/pdctl/hold"),
        ("POST", "/pdctl/release"),
        ("POST", LOAD_PATH),
        *(("POST", path) for path in PUSH_PATHS),
        ("POST", "/pdctl/refresh"),
        ("POST", "/pdctl/cordon"),
        ("POST", STEP_PATH),
        ("POST", PLANNER_PATH),
    }
) | (SGLANG_CONTROL - {("GET", Endpoint.GET_WEIGHT_VERSION.value)})
CONTROL_WRITE_PREFIXES = (("DELETE", "/workers/"), ("PUT", "/workers/"), ("PATCH", "/workers/"))


@functools.lru_cache(maxsize=1024)  # asked on every request, of a handful of routes; bounded for odd paths
def door_of(method: str, path: str) -> Door:
    """The door a request goes through; anything that is not open or control is data plane
    (unknown paths included: they need a client key before they learn they do not exist)."""
    if path in OPEN_PATHS:
        return Door.OPEN
    if (method, path) in CONTROL_WRITE_ROUTES or any(
        method == m and path.startswith(p) for m, p in CONTROL_WRITE_PREFIXES
    ):
        return Door.CONTROL_WRITE
    read_prefix = any(method == m and path.startswith(p) for m, p in CONTROL_READ_PREFIXES)
    if (method, path) in CONTROL_READ_ROUTES or read_prefix:
        return Door.CONTROL_READ
    return Door.DATA


@dataclass(frozen=True)
class ControlKey:
    """One ``id:name:role:key`` entry of ``--control-plane-api-keys`` (sglang-router's format;
    the key may contain ':')."""

    id: str
    name: str
    role: ControlRole
    key: str

    @classmethod
    def parse(cls, entry: str) -> ControlKey:
        """The key of one ``id:name:role:key`` entry (role case-insensitive); RouterConfigError for a malformed entry or
        an unknown role."""
        parts = entry.split(":", 3)
        if len(parts) != 4 or not all(parts):
            raise RouterConfigError("--control-plane-api-keys entries are 'id:name:role:key' (none of them empty)")
        ident, name, role, key = parts
        try:
            parsed = ControlRole(role.lower())
        except ValueError:
            raise RouterConfigError(
                f"--control-plane-api-keys {ident}: role {role!r} must be one of "
                f"{', '.join(r.value for r in ControlRole)}"
            ) from None
        return cls(ident, name, parsed, key)

    def __repr__(self) -> str:  # the key is never logged
        return f"ControlKey({self.id!r}, {self.name!r}, {self.role.value})"


def parse_control_keys(entries: Iterable[str]) -> tuple[ControlKey, ...]:
    keys = tuple(ControlKey.parse(e) for e in entries if e.strip())
    ids = [k.id for k in keys]
    if len(set(ids)) != len(ids):
        raise RouterConfigError("--control-plane-api-keys: each id may appear once")
    return keys


def parse_networks(entries: Iterable[str]) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """``--control-plane-open-from`` entries (``10.0.0.0/24``, ``127.0.0.1``); RouterConfigError naming a bad one."""
    out = []
    for entry in entries:
        try:
            out.append(ipaddress.ip_network(entry.strip(), strict=False))
        except ValueError as exc:
            raise RouterConfigError(f"--control-plane-open-from {entry!r}: {exc}") from None
    return tuple(out)


class Keys:
    """Checks a request's ``Authorization`` header against the door its route needs."""

    def __init__(
        self,
        client_key: str | None,
        control: tuple[ControlKey, ...] = (),
        *,
        audit: bool = False,
        open_from: Iterable[str] = (),
    ):
        self._client = client_key.encode("latin-1") if client_key else None
        self._control = [(k.key.encode("latin-1"), k) for k in control]
        self.audit = audit
        self._open_from = parse_networks(open_from)

    @property
    def open(self) -> bool:
        """No key at all: every route is open (the router should listen on loopback only)."""
        return self._client is None and not self._control

    @property
    def head_check(self) -> Callable[[str, str, dict[str, str], str], Reply | None] | None:
        """What the server calls on every request's head: ``check``, or None when it could
        neither refuse nor log anything (no key and no audit: a call per request saved; the
        facade still audits its own calls, pdctl.router.facade)."""
        return None if self.open and not self.audit else self.check

    def check(self, method: str, path: str, headers: dict[str, str], peer: str = "") -> Reply | None:
        """None when the request may go on, else the refusal to send."""
        door = door_of(method, path)
        if door is Door.OPEN:
            return None
        header = headers.get("authorization")
        given = _token(header)
        if door is Door.DATA:
            if self._client is None or (given is not None and hmac.compare_digest(given, self._client)):
                return None
            return errors.error_response(401, errors.UNAUTHORIZED, "missing or wrong API key")
        if header is None and self._open_to(method, path, peer):
            refusal, who = None, f"network:{peer}"
        else:
            refusal, who = self._control_check(door, given)
        if self.audit or (method, path) in SGLANG_CONTROL:
            audit_log.info(
                "control_plane_audit principal=%s method=%s path=%s outcome=%s peer=%s",
                who,
                method,
                path,
                "denied" if refusal else "allowed",
                peer or "-",
            )
        return refusal

    def _open_to(self, method: str, path: str, peer: str) -> bool:
        if not self._open_from or (method, path) not in OPENABLE or not peer:
            return False
        try:
            address = ipaddress.ip_address(peer.split("%", 1)[0])
        except ValueError:
            return False
        mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:10.0.0.1 on a dual-stack socket
        return any(address in net or (mapped is not None and mapped in net) for net in self._open_from)

    def _control_check(self, door: Door, given: bytes | None) -> tuple[Reply | None, str]:
        if not self._control:  # sglang-router's fallback: the client key guards the control plane too
            if self._client is None or (given is not None and hmac.compare_digest(given, self._client)):
                return None, "api-key" if self._client else "anonymous"
            return errors.error_response(401, errors.UNAUTHORIZED, "missing or wrong API key"), "unauthenticated"
        match = None
        for key, entry in self._control:  # every entry compared: the time does not say which matched
            if hmac.compare_digest(given or b"\0", key):
                match = entry
        if match is None:
            return errors.error_response(401, errors.UNAUTHORIZED, "missing or wrong control-plane key"), (
                "unauthenticated"
            )
        if door is Door.CONTROL_WRITE and match.role is not ControlRole.ADMIN:
            return errors.error_response(403, errors.FORBIDDEN, "admin role required for this control-plane call"), (
                match.id
            )
        return None, match.id


def _token(header: str | None) -> bytes | None:
    """The key of ``Authorization: Bearer KEY`` (the scheme in any case, RFC 7235), or None."""
    if header is None:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip(" ").encode("latin-1", "replace")
