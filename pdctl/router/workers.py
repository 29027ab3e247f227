"""Workers and their registry: membership (and its persistence across a router restart), what
puts a worker in or out of rotation (health, quarantine, cordon, its circuit), and the waits
for one to come back.

A worker is routable when it is healthy, its circuit is not open (pdctl.router.breaker), it is
neither quarantined nor cordoned, and (for PD) on the weight version being paired. Health is
watched by pdctl.router.health; the fleet's weight version is enforced by pdctl.router.versions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

from pdctl.roles import Role, engine_role
from pdctl.router.config import RouterConfig, WorkerSpec
from pdctl.router.fleet_weights import STALE, FleetWeights
from pdctl.router.state_file import RouterState

log = logging.getLogger("pdctl.router")
_NONE: list[Any] = []


_ROTATION_CHANGES = [0]
"""Bumped by every change of a field that decides rotation or pairing (``_InRotation``): a
registry's routable lists are computed again only after one (selection reads them per request,
and a scan of 1024 workers per request cost 3x the request's own work)."""


class _InRotation:
    """A Worker field that decides whether the worker is in rotation or whom it pairs with:
    setting it to another value counts as a change (``_ROTATION_CHANGES``); health checks that
    write the same value again do not."""

    def __init__(self, default: Any):
        self.default = default

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = "_" + name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self.default  # what the dataclass takes as the field's default
        return obj.__dict__[self.slot]

    def __set__(self, obj: Any, value: Any) -> None:
        held = obj.__dict__
        if self.slot not in held or held[self.slot] != value:
            held[self.slot] = value
            _ROTATION_CHANGES[0] += 1


@dataclass(eq=False)
class Worker:
    """One engine the router sends requests to, and everything the router knows of it: its role, load, health, circuit,
    weight version and why it may be out of rotation. Fields marked ``_InRotation`` count as a rotation change when they
    take another value."""

    url: str
    role: Role
    bootstrap_port: int | None = None
    id: str = field(default_factory=lambda: str(uuid.uuid4()))
    healthy: bool = _InRotation(False)  # type: ignore[assignment]
    """A worker enters rotation at its first passed health check (then thresholds apply)."""
    activated: bool = False
    load: int = 0
    weight_version: str | None = _InRotation(None)  # type: ignore[assignment]
    registered_at: float = field(default_factory=time.monotonic)
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    # circuit breaker
    cb_failures: int = 0
    cb_successes: int = 0
    cb_open_until: float = _InRotation(0.0)  # type: ignore[assignment]
    cb_half_open: bool = False
    cb_window_start: float = 0.0
    cb_opens: int = 0
    cb_by_answers: bool = False
    """Its circuit opened on answers (5xx from a live worker), not on failed connections: a request
    does not wait for it (that is what the breaker is for), where it waits for a worker restarting."""
    restarts: int = 0
    """Times its process went away (``gone``) and a new one passed a health check."""
    last_answer: float = field(default_factory=time.monotonic)
    """When it last answered a request, a probe or a health check (monotonic): a hung process
    stops answering."""
    silent_since: float = 0.0
    """When the first liveness probe it left unanswered (since its last answer) was sent; 0: none."""
    checked_at: float = -math.inf
    """When its last health check was begun (monotonic; -inf: never)."""
    probed_at: float = -math.inf
    """When its last liveness probe was sent (monotonic; -inf: never)."""
    quarantined: str | None = _InRotation(None)  # type: ignore[assignment]
    """Why the worker is out of rotation for its weights (a weight push it did not complete)."""
    cordoned: str | None = _InRotation(None)  # type: ignore[assignment]
    """Why an operator took it out of rotation (``pdctl restart``, ``pdctl apply``): no new
    requests; those in flight finish (``drained`` is set when the last one does)."""
    drained: asyncio.Event | None = None
    gone: bool = False
    """Its process went away (a refused connection): a new one is back at its first passed check."""
    auth: dict[str, str] = field(default_factory=dict, repr=False)
    """Headers for every call the router makes to it: its key, never a client's."""
    bootstrap_host: str = field(init=False, repr=False)
    """The prefill's host as the decode reaches it: the URL's host, IPv6 in brackets (a field, not
    a cached property: it is read on every PD request)."""

    def __post_init__(self) -> None:
        host = urlsplit(self.url).hostname or ""
        self.bootstrap_host = f"[{host}]" if ":" in host else host

    # A request counts in ``load`` from ``took()`` to ``gave_back()``, once each, however it ends:
    # each leg's ``Claim`` (pdctl.router.legs) calls them, once each.
    def took(self) -> None:
        """A request to this worker began."""
        self.load += 1

    def gave_back(self) -> None:
        """A request to this worker ended (answered, failed or cancelled)."""
        self.load -= 1
        if self.drained is not None and self.load == 0:
            self.drained.set()

    def to_dict(self) -> dict:
        """The worker as the worker API lists it (SGLang router's field names, plus pdctl's ``weight_version``,
        ``circuit_open``, ``quarantined`` and ``cordoned``)."""
        return {
            "id": self.id,
            "url": self.url,
            "worker_type": self.role,
            "is_healthy": self.healthy,
            "activated": self.activated,
            "load": self.load,
            "bootstrap_port": self.bootstrap_port,
            "weight_version": self.weight_version,
            "circuit_open": self.cb_open_until > time.monotonic(),
            "quarantined": self.quarantined,
            "cordoned": self.cordoned,
            "connection_mode": "HTTP",
        }


class WorkerRegistry:
    """The router's workers by URL, and what decides which of them are in rotation: health, quarantine, cordons,
    circuits and the fleet's weight version. Membership, the fleet's version and an open transaction are kept in the
    router's state file across a restart."""

    def __init__(self, config: RouterConfig):
        self.config = config
        self.workers: dict[str, Worker] = {}
        self._of_role: dict[Role, list[Worker]] = {}  # the same workers, by role (selection reads them)
        self.on_rotation: list[Callable[[], None]] = []
        """Told at every ``rotation_changed()`` (late pairing's queue: pdctl.router.pair_room)."""
        self.quarantine: dict[str, str] = {}
        """URL -> reason: workers whose weights a push left partial or stale (kept for workers re-added later)."""
        self.kept = RouterState.read(config.state_file, config.worker_key)
        self.fleet: FleetWeights | None = self.kept.fleet
        """The fleet's weight version (pdctl.router.fleet_weights); None until an update completes."""
        self.updating = False
        """A weight update runs: engines' versions change under it, the version rule waits."""
        self.loading: dict[str, asyncio.Task] = {}
        """Workers being loaded with the fleet's weights (pdctl.router.versions)."""
        self.wake = asyncio.Event()
        """Set when a worker leaves rotation: the health loop (pdctl.router.health) then checks at
        the fast interval."""

        self._rotation: asyncio.Future[None] | None = None
        """Made by a request that waits for a worker (``wait_for_rotation``), done when one may have come."""
        self.on_hung: list[Callable[[Worker, str], None]] = []
        """Told when a worker in rotation stopped answering (the router fails over what it runs)."""
        self._routable: dict[Role, list[Worker]] = {}
        self._routable_at = -1  # the _ROTATION_CHANGES they were computed at
        self._reopens_at = 0.0  # the first time an open circuit lets its worker back (0: none open)
        self.relabels = 0
        """How many times a weight update set engines' version labels (``relabelled``): a probe of a
        version sent before the latest is stale (its answer may predate the label)."""

    # -- rotation ----------------------------------------------------------------------------
    def relabelled(self, workers: Iterable[Worker], version: str) -> None:
        """A weight update set ``version`` as the label of ``workers`` (each answered): the
        registry holds it at once, for all of them together, so that selection never sees half
        of a relabel, and probes sent before it cannot put an older label back."""
        for worker in workers:
            worker.weight_version = version
        self.relabels += 1
        self.rotation_changed()

    def rotation_changed(self) -> None:
        """A worker may have come into rotation (healthy again, added, out of quarantine or a
        cordon, its circuit closed, its version changed): wake the requests waiting for one."""
        waiting, self._rotation = self._rotation, None
        if waiting is not None and not waiting.done():
            waiting.set_result(None)
        for told in self.on_rotation:
            told()

    def may_return(self, role: Role) -> bool:
        """Whether a worker of ``role`` out of rotation may come back by itself, so that a request
        may wait for it: one restarting (health checks bring it back), cordoned, behind an open
        circuit, or being loaded with the fleet's weights; not one quarantined for weights that
        only a later push brings (a push that stopped half way), nor one that left with health
        checks off (nothing would bring it back)."""
        checks = not self.config.health.disabled
        now = time.monotonic()
        return any(
            w.role == role
            and (not w.quarantined or w.url in self.loading or self._reloadable(w))
            and (w.healthy or checks)
            and not (w.cb_by_answers and w.cb_open_until > now and w.healthy and not w.cordoned)
            for w in self.workers.values()
        )

    def _reloadable(self, worker: Worker) -> bool:
        """Out of rotation on stale weights that the router loads into it itself once it answers
        (the fleet's version came from disk)."""
        fleet = self.fleet
        return bool(fleet and fleet.source and worker.quarantined and worker.quarantined.startswith(STALE))

    async def wait_for_rotation(self, timeout: float) -> None:
        """Until ``rotation_changed()``, an open circuit's timeout (a trial request may then go),
        or ``timeout`` seconds, whichever comes first. The caller selects again."""
        now = time.monotonic()
        reopening = [w.cb_open_until - now for w in self.workers.values() if w.cb_open_until > now]
        if reopening and not self.config.breaker.disabled:
            timeout = min(timeout, min(reopening))
        if self._rotation is None:
            self._rotation = asyncio.get_running_loop().create_future()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._rotation), timeout)

    # -- membership --------------------------------------------------------------------------
    def add(
        self,
        url: str,
        role: object,
        bootstrap_port: int | None = None,
        *,
        healthy: bool = False,
        api_key: str | None = None,
    ) -> Worker:
        """Register a worker (``api_key``: what the router sends it); ValueError for a role that
        is not an engine's (from a client's body)."""
        role = engine_role(role)
        url = url.rstrip("/")
        if url in self.workers:
            raise ValueError(f"worker {url} is already registered")
        worker = Worker(url=url, role=role, bootstrap_port=bootstrap_port, healthy=healthy, activated=healthy)
        if api_key:
            worker.auth = {"Authorization": f"Bearer {api_key}"}
        worker.quarantined = self.quarantine.get(url)
        self.workers[url] = worker
        self._of_role.setdefault(role, []).append(worker)
        _ROTATION_CHANGES[0] += 1
        log.info("registered %s worker %s", role, url)
        if healthy:
            self.rotation_changed()
        return worker

    def keep_workers(self) -> None:
        """The worker set changed at run time (the worker API, ``pdctl apply``): keep it, so that
        a restarted router comes back with it rather than its command line's."""
        self.kept.workers = tuple(
            WorkerSpec(url=w.url, role=w.role, bootstrap_port=w.bootstrap_port, api_key=_key_of(w))
            for w in self.workers.values()
        )
        self.kept.write(self.config.state_file, self.config.worker_key)

    def keep_transaction(self, record: dict[str, Any] | None) -> None:
        """The router's own open transaction (pdctl.router.transaction), or None once it ended:
        kept so that a restarted router ends what this one leaves."""
        if record != self.kept.transaction:
            self.kept.transaction = record
            self.kept.write(self.config.state_file, self.config.worker_key)

    def find(self, key: str) -> Worker | None:
        """A worker by id or URL (percent-encoded or not)."""
        key = unquote(key).rstrip("/")
        return next((w for url, w in self.workers.items() if key in (w.id, url)), None)

    def remove(self, key: str) -> Worker | None:
        """Unregister the worker with id or URL ``key``; the worker removed, or None when none matched."""
        worker = self.find(key)
        if worker is not None:
            del self.workers[worker.url]
            self._of_role[worker.role].remove(worker)
            _ROTATION_CHANGES[0] += 1
            log.info("removed %s worker %s", worker.role, worker.url)
        return worker

    def of_role(self, role: Role) -> list[Worker]:
        """Every registered worker of ``role``, in or out of rotation (a new list)."""
        return [w for w in self.workers.values() if w.role == role]

    def set_quarantine(self, url: str, reason: str | None) -> None:
        """Take a worker out of rotation for its weights (``reason``), or back in (None)."""
        url = url.rstrip("/")
        if reason is None:
            self.quarantine.pop(url, None)
        else:
            self.quarantine[url] = reason
        worker = self.workers.get(url)
        if worker is not None and worker.quarantined != reason:
            worker.quarantined = reason
            if reason is None:
                log.info("worker %s is back in rotation (it holds the pushed weights)", url)
                self.rotation_changed()
            else:
                log.warning("worker %s is out of rotation: %s", url, reason)

    def set_fleet(self, fleet: FleetWeights) -> None:
        """An update completed: ``fleet`` is the version engines must hold to (re)join."""
        if fleet != self.fleet:
            self.fleet = self.kept.fleet = fleet
            self.kept.write(self.config.state_file, self.config.worker_key)

    def routable(self, role: Role) -> list[Worker]:
        """The workers of ``role`` in rotation: healthy, not quarantined or cordoned, circuit not
        open. Computed again only after a change (``_InRotation``, membership) or when an open
        circuit's time is up; the caller must not change the list."""
        if self._routable_at != _ROTATION_CHANGES[0] or (self._reopens_at and time.monotonic() >= self._reopens_at):
            self._compute_routable()
        return self._routable.get(role, _NONE)

    def reopens_in(self) -> float | None:
        """Seconds until the first open circuit lets its worker back into rotation (None: none is
        open, or the breaker is off); a circuit's time passing calls nothing by itself."""
        self.routable(Role.PREFILL)  # (brings ``_reopens_at`` up to date)
        if not self._reopens_at:
            return None
        return max(0.0, self._reopens_at - time.monotonic())

    def _compute_routable(self) -> None:
        self._routable_at = _ROTATION_CHANGES[0]
        now = time.monotonic()
        breaker = not self.config.breaker.disabled
        reopens = 0.0
        routable: dict[Role, list[Worker]] = {}
        for role, workers in self._of_role.items():
            out = routable[role] = []
            for w in workers:
                if not w.healthy or w.quarantined or w.cordoned:
                    continue
                if breaker and w.cb_open_until > now:
                    reopens = min(reopens or w.cb_open_until, w.cb_open_until)
                    continue
                out.append(w)
        self._routable, self._reopens_at = routable, reopens

    # -- what health checks and requests learn of a worker (pdctl.router.health, pdctl.router.legs) --
    def hung(self, worker: Worker, silent_secs: float) -> None:
        """``worker`` takes connections and answers nothing: out of rotation now, and what it runs
        failed over (``on_hung``); back after a passed check (its supervisor may restart it)."""
        why = f"it has answered nothing for {silent_secs:.0f}s (hung?)"
        self.lost(worker, why)
        for told in list(self.on_hung):
            told(worker, why)

    def lost(self, worker: Worker, why: str) -> None:
        """``worker``'s process is gone: out of rotation now; back after ``success_threshold`` checks."""
        worker.healthy, worker.gone = False, True
        worker.consecutive_successes = 0
        worker.consecutive_failures = max(worker.consecutive_failures, self.config.health.failure_threshold)
        self.wake.set()
        # (the same words as a failed health check's: either way /workers says is_healthy false)
        log.warning("worker %s is unhealthy (out of rotation: %s)", worker.url, why)

    def observe_health(self, worker: Worker, ok: bool) -> None:
        """Count one health check's outcome for ``worker``: a first pass puts it in rotation, a process back after going
        away returns at once, otherwise ``success_threshold`` passes or ``failure_threshold`` failures move it in or
        out. Does nothing with health checks off; failures during the cold-start grace (``first_wait_secs``) do not
        count."""
        c = self.config
        if c.health.disabled:
            return  # always in rotation: nothing would bring it back
        if ok:
            worker.last_answer, worker.silent_since = time.monotonic(), 0.0
            worker.consecutive_failures = 0
            worker.consecutive_successes += 1
            if not worker.activated:
                worker.activated = worker.healthy = True
                log.info("worker %s is up (%s, weight version %s)", worker.url, worker.role, worker.weight_version)
                self.rotation_changed()
            elif not worker.healthy and (worker.gone or worker.consecutive_successes >= c.health.success_threshold):
                # A process that went away and answers again is a new one: no flapping to sit out.
                if worker.gone:
                    worker.restarts += 1
                worker.healthy, worker.gone = True, False
                if worker.cb_open_until > 0:
                    # Its circuit opened on the failures that took it out (a crashed engine fails
                    # every request it held at once): back, it is on trial now (half-open), not
                    # after the breaker's timeout, which kept a restarted only decode out of
                    # rotation for a minute.
                    worker.cb_open_until, worker.cb_half_open = 0.0, True
                    worker.cb_failures = worker.cb_successes = 0
                log.info("worker %s is healthy again", worker.url)
                self.rotation_changed()
            return
        if not worker.activated or time.monotonic() - worker.registered_at < c.health.first_wait_secs:
            return  # still starting, or in the cold-start grace: compiling engines answer late
        worker.consecutive_successes = 0
        worker.consecutive_failures += 1
        if worker.healthy and worker.consecutive_failures >= c.health.failure_threshold:
            worker.healthy = False
            self.wake.set()  # the health loop checks it at the fast interval from now (not after its slow one)
            log.warning("worker %s is unhealthy (%d failed checks)", worker.url, worker.consecutive_failures)

    def mark_failed(self, worker: Worker, error: BaseException | None = None) -> None:
        """A request could not even connect: a refused connection (the process is gone) takes
        the worker out of rotation at once; another failure counts as a failed health check."""
        refused = isinstance(error, ConnectionRefusedError) or isinstance(
            getattr(error, "__cause__", None), ConnectionRefusedError
        )
        if refused and worker.healthy:
            self.lost(worker, "its port refuses connections")
            return
        self.observe_health(worker, False)


def _key_of(worker: Worker) -> str | None:
    value = worker.auth.get("Authorization", "")
    return value[len("Bearer ") :] if value else None
