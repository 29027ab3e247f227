"""The hold/release protocol between a weight transaction (trainer or ``pdctl weights load``) and
the router, typed once and used by both sides; and the refit modes. No torch, no asyncio here.

A transaction sends ``POST /pdctl/hold`` (a ``Hold``) before it pauses the engines and repeats
it every ``lease_secs / 3`` to renew its lease; ``POST /pdctl/release`` (a ``Release``) ends it.
The router answers a hold with a ``HoldAnswer``.

Refit modes (``weights.refit`` in the topology):

- ``drain``: the router stops admitting and waits for every in-flight request before it
  answers the hold: each response comes from one weight version; a push costs the longest
  rollout in flight.
- ``interrupt``: the router stops admitting and answers at once; the transaction then pauses
  the engines in SGLang's ``abort`` mode, so in-flight requests end at a token boundary with
  their tokens so far. The router keeps each such request open, and once the update is
  released continues it on the new weights (prompt plus the tokens so far, for the remaining
  budget) as one response whose ``meta_info`` says which tokens came from which version.
  ``max_staleness`` caps how many updates one request may be continued across. What can be
  continued is pdctl.router.resume's to say (``/generate``; not the OpenAI routes, streamed
  batches or streams on a regular router, which end with SGLang's abort).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pdctl.choices import Choice, parse_choice

HOLD_PATH = "/pdctl/hold"
RELEASE_PATH = "/pdctl/release"
LOAD_PATH = "/pdctl/load"
"""``pdctl weights load``, run by the router itself (pdctl.router.transaction.routes)."""
TXN_HEADER = "X-Pdctl-Txn"
"""The header a push's driver sends on its calls to SGLang's routes on the router: while a push
holds the fleet, only calls that name it may act on the fleet."""
PUSH_OPEN_PATH = "/pdctl/push/open"
PUSH_RENEW_PATH = "/pdctl/push/renew"
PUSH_REDO_PATH = "/pdctl/push/redo"
PUSH_COMMIT_PATH = "/pdctl/push/commit"
PUSH_ABORT_PATH = "/pdctl/push/abort"
"""A trainer's push, run by the router as its fleet transaction (pdctl.router.transaction.routes):
open (hold and pause), the update calls through SGLang's own routes on the router, then commit
(verify, version, continue, release) or abort; redo starts the update again on the survivors."""
PUSH_PATHS = (PUSH_OPEN_PATH, PUSH_RENEW_PATH, PUSH_REDO_PATH, PUSH_COMMIT_PATH, PUSH_ABORT_PATH)
DEFAULT_LEASE_SECS = 30.0
"""How long the router waits for a silent transaction (its trainer died) before it gives up on it."""
DEFAULT_HOLD_TIMEOUT_SECS = 300.0
"""How long a drain may take before the hold answers 504."""
DEFAULT_BUCKET_MB = 1024
"""The one home of ``weights.bucket_mb``'s default (bytes per update call, in MiB): the topology
(pdctl.topology.model, its schema) and ``pdctl.weights`` read it from here."""

UPDATING_LABEL = "pdctl:updating:"
"""The weight version label an engine carries while a fleet transaction moves its weights
(followed by the transaction's id): no fleet ever holds it, so the router keeps the engine out of
rotation after a restart, and no restarting engine takes its weights as a seed."""
PARTIAL_LABEL = "pdctl:partial:"
"""The label of an engine that holds part of an update that did not finish (followed by the
transaction's id), until a whole update reaches it."""


def in_flux(version: object) -> bool:
    """Whether a weight version label says the engine's weights are moving or incomplete (pdctl's
    own ``pdctl:`` labels: an update under way or failed, a transfer from a peer)."""
    return isinstance(version, str) and version.startswith("pdctl:")


class VerifyMode(Choice):
    """How the engines' checksums of updated tensors are checked after a push."""

    AUTO = "auto"
    """Every engine that answers per-tensor checksums (pdctl's sim) against the source's; SGLang
    engines are not compared (their ``/weights_checker`` hashes each TP rank's shard)."""
    SAMPLE = "sample"
    """Every engine, hashing the shape and evenly spaced elements of each tensor."""
    FULL = "full"
    """Every engine, hashing every element."""
    OFF = "off"


class RefitMode(Choice):
    """Words for ``weights.refit``: how a weight update treats requests in flight (module docstring)."""

    DRAIN = "drain"
    INTERRUPT = "interrupt"

    @classmethod
    def parse(cls, value: str | RefitMode | None, what: str = "refit") -> RefitMode:
        """``value`` as a mode (None is ``drain``); ValueError naming ``what`` and the choices."""
        return cls.DRAIN if value is None else parse_choice(cls, value, what)


def parse_staleness(value: Any, what: str = "max_staleness") -> int | None:
    """None (unbounded) or an int >= 0; ValueError naming ``what`` otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be a whole number >= 0 or null, not {value!r}")
    return value


MAX_SECS = 24 * 3600.0
"""Longest lease or drain timeout a hold may ask for (a larger number is a mistake, not a plan)."""


def _number(body: Mapping[str, Any], key: str, default: float) -> float:
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_SECS:
        raise ValueError(f"{key} must be a number of seconds from 0 to {MAX_SECS:.0f}, not {value!r:.40}")
    return float(value)


def _text(body: Mapping[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{key} must be a string or null, not {type(value).__name__}")
    return value


def _urls(value: Any, key: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(u, str) for u in value):
        raise ValueError(f"{key} must be a list of worker URLs")
    return tuple(u.rstrip("/") for u in value)


@dataclass(frozen=True)
class Hold:
    """``POST /pdctl/hold``. ``txn`` None: a bare hold (tests, operators); every hold, bare or
    not, ends when its lease runs out unless renewed."""

    txn: str | None = None
    version: str | None = None
    engines: tuple[str, ...] = ()
    lease_secs: float = DEFAULT_LEASE_SECS
    timeout_secs: float = DEFAULT_HOLD_TIMEOUT_SECS
    refit: RefitMode = RefitMode.DRAIN
    max_staleness: int | None = None
    group: Mapping[str, Any] | None = None
    source: str | None = None
    """A load from disk: the checkpoint path (read on each engine's node), which the router loads
    into an engine that comes back later (pdctl.router.fleet_weights); None for a push."""
    moved: bool = False
    """Weights have begun to move (a renewal says so once the transfer starts): a transaction
    whose lease runs out before then just ends, its engines continued and left in rotation."""

    def to_json(self) -> dict[str, Any]:
        """The request body, which ``from_json`` reads back; ``txn``, ``group`` and ``moved`` only when set."""
        body: dict[str, Any] = {
            "version": self.version,
            "source": self.source,
            "engines": list(self.engines),
            "lease_secs": self.lease_secs,
            "timeout_secs": self.timeout_secs,
            "refit": self.refit.value,
            "max_staleness": self.max_staleness,
        }
        if self.txn is not None:
            body["txn"] = self.txn
        if self.group is not None:
            body["group"] = dict(self.group)
        if self.moved:
            body["moved"] = True
        return body

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> Hold:
        """Raises ValueError naming the field that is wrong."""
        group = body.get("group")
        if group is not None and not isinstance(group, dict):
            raise ValueError("group must be an object or null")
        lease = _number(body, "lease_secs", DEFAULT_LEASE_SECS)
        if lease <= 0:
            raise ValueError("lease_secs must be > 0: every hold expires")
        return cls(
            txn=_text(body, "txn"),
            version=_text(body, "version"),
            engines=_urls(body.get("engines") or [], "engines"),
            lease_secs=lease,
            timeout_secs=_number(body, "timeout_secs", DEFAULT_HOLD_TIMEOUT_SECS),
            refit=RefitMode.parse(body.get("refit")),
            max_staleness=parse_staleness(body.get("max_staleness")),
            group=group,
            source=_text(body, "source"),
            moved=_flag(body, "moved"),
        )

    def renewal(self, moved: bool = False) -> Hold:
        """The same hold as a lease renewal: answered at once (no drain wait); ``moved`` once
        weights have begun to move."""
        return Hold(
            txn=self.txn,
            version=self.version,
            engines=self.engines,
            lease_secs=self.lease_secs,
            timeout_secs=0.0,
            refit=self.refit,
            max_staleness=self.max_staleness,
            group=self.group,
            source=self.source,
            moved=moved or self.moved,
        )


def _flag(body: Mapping[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false")
    return value


@dataclass(frozen=True)
class HoldAnswer:
    """The router's answer: ``ready`` once the transaction may pause the engines (drained, or
    at once in interrupt mode); ``in_flight`` requests still running (drain timed out), or
    left to be interrupted."""

    held: bool
    ready: bool
    in_flight: int
    refit: RefitMode

    def to_json(self) -> dict[str, Any]:
        """The answer body; ``ready`` goes as ``drained``, the field's name for older trainers."""
        # "drained" is the field's name since the first protocol; kept for older trainers.
        return {"held": self.held, "drained": self.ready, "in_flight": self.in_flight, "refit": self.refit.value}

    @classmethod
    def from_json(cls, body: Any) -> HoldAnswer:
        """Parse the router's answer; ValueError when it is not a JSON object."""
        if not isinstance(body, dict):
            raise ValueError(f"the router's hold answer is not a JSON object: {body!r}")
        return cls(
            held=bool(body.get("held")),
            ready=bool(body.get("drained")),
            in_flight=int(body.get("in_flight") or 0),
            refit=RefitMode.parse(body.get("refit")),
        )


@dataclass(frozen=True)
class Release:
    """``POST /pdctl/release``: ``complete`` engines hold the version (back into rotation);
    ``failed`` maps the others to why (out of rotation until a later push)."""

    txn: str | None = None
    complete: tuple[str, ...] = ()
    failed: Mapping[str, str] = field(default_factory=dict)
    phases: Mapping[str, float] = field(default_factory=dict)
    """Seconds per phase of the transaction before its release (``pdctl.weights.phase``), for the
    router's refit metrics; optional (older trainers send none)."""
    moved: bool = True
    """False: the transaction ended before any weights moved (interrupted early): nothing leaves
    rotation, and the push record says it was cancelled."""

    def to_json(self) -> dict[str, Any]:
        """The request body, which ``from_json`` reads back; optional fields only when set."""
        body: dict[str, Any] = {"complete": list(self.complete), "failed": dict(self.failed)}
        if self.txn is not None:
            body["txn"] = self.txn
        if not self.moved:
            body["moved"] = False
        if self.phases:
            body["phases"] = dict(self.phases)
        return body

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> Release:
        """Raises ValueError naming the field that is wrong."""
        failed = body.get("failed") or {}
        if not isinstance(failed, dict) or not all(isinstance(v, str) for v in failed.values()):
            raise ValueError("failed must map worker URLs to reasons (strings)")
        phases = body.get("phases") or {}
        if not isinstance(phases, dict) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < float("inf") for v in phases.values()
        ):
            raise ValueError("phases must map phase names to seconds (numbers >= 0)")
        moved = body.get("moved", True)
        if not isinstance(moved, bool):
            raise ValueError("moved must be true or false")
        return cls(
            moved=moved,
            txn=_text(body, "txn"),
            complete=_urls(body.get("complete") or [], "complete"),
            failed={u.rstrip("/"): why for u, why in failed.items()},
            phases={str(k): float(v) for k, v in phases.items()},
        )
