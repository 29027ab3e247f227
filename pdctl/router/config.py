"""Router settings: frozen, grouped (health, retry, breaker, admission, cache), each group
checking its own values. Defaults follow sglang-router 0.3.2 where it has the knob.

Every grouped setting carries its command-line flag in its field's metadata (``flag``, help
text); ``pdctl router``'s parser, its help and the planner's argv are all built from that one
table (``SETTINGS``); the top-level flags (binding, workers, policies) are ``Flag``'s
constants, used by the same two. So a flag is spelled once.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any

from pdctl.errors import RouterConfigError
from pdctl.refit import RefitMode
from pdctl.roles import Role


def setting(default: Any, flag: str, help: str) -> Any:
    """A field with a command-line flag and its help text."""
    return field(default=default, metadata={"flag": flag, "help": help})


def _check(ok: bool, flag: str, value: object, rule: str) -> None:
    if not ok:
        raise RouterConfigError(f"{flag} {value!r}: must be {rule}")


@dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    """A worker as configured (command line, state file, ``pdctl apply``): its URL, engine role, a prefill's bootstrap
    port and the key the router sends it."""

    url: str
    role: Role  # an engine role: regular, prefill or decode
    bootstrap_port: int | None = None
    api_key: str | None = field(default=None, repr=False)
    """What the router sends it as ``Authorization: Bearer`` (never logged, never answered)."""


@dataclass(frozen=True, kw_only=True)
class HealthConfig:
    """Health checks and liveness probes (pdctl.router.health); raises RouterConfigError for a value out of range."""

    interval_secs: float = setting(
        10.0, "--health-check-interval-secs", "Seconds between health checks of each worker."
    )
    startup_interval_secs: float = setting(
        0.5,
        "--worker-startup-check-interval",
        "Seconds between checks of a worker that is not up yet (sglang-router: 30; pdctl polls faster "
        "so that an engine enters rotation as soon as it is up).",
    )
    timeout_secs: float = setting(5.0, "--health-check-timeout-secs", "A health check slower than this fails.")
    failure_threshold: int = setting(
        3, "--health-failure-threshold", "Failed checks in a row that take a worker out of rotation."
    )
    success_threshold: int = setting(2, "--health-success-threshold", "Passed checks in a row that bring it back.")
    first_wait_secs: float = setting(
        0.0,
        "--health-first-wait-secs",
        "Grace after a worker is added before failed checks count (slow engine start-ups).",
    )
    disabled: bool = setting(False, "--disable-health-check", "Never check workers (they are always in rotation).")
    liveness_interval_secs: float = setting(
        1.0,
        "--liveness-interval-secs",
        "Seconds between probes (GET /model_info) of each worker in rotation: one whose port refuses "
        "connections (its process is gone) leaves rotation at once, one that comes back on another weight "
        "version meets the version rule at once (0: no probes).",
    )

    liveness_timeout_secs: float = setting(
        5.0,
        "--liveness-timeout-secs",
        "A worker in rotation that answers none of the probes for this long (it takes connections and "
        "answers nothing: a hung process, kill -STOP) leaves rotation, and the requests it runs are failed "
        "over to other workers as a dead one's are (0: never).",
    )

    def __post_init__(self) -> None:
        _check(self.interval_secs > 0, "--health-check-interval-secs", self.interval_secs, "> 0")
        _check(self.liveness_timeout_secs >= 0, "--liveness-timeout-secs", self.liveness_timeout_secs, ">= 0")
        _check(self.liveness_interval_secs >= 0, "--liveness-interval-secs", self.liveness_interval_secs, ">= 0")
        _check(self.startup_interval_secs > 0, "--worker-startup-check-interval", self.startup_interval_secs, "> 0")
        _check(self.timeout_secs > 0, "--health-check-timeout-secs", self.timeout_secs, "> 0")
        _check(self.failure_threshold >= 1, "--health-failure-threshold", self.failure_threshold, ">= 1")
        _check(self.success_threshold >= 1, "--health-success-threshold", self.success_threshold, ">= 1")
        _check(self.first_wait_secs >= 0, "--health-first-wait-secs", self.first_wait_secs, ">= 0")


@dataclass(frozen=True, kw_only=True)
class RetryConfig:
    """Retries and their backoff (pdctl.router.retry); raises RouterConfigError for a value out of range."""

    max_retries: int = setting(
        5,
        "--retry-max-retries",
        "Retries one request may spend on failures (connection errors, 5xx), across its first attempts and "
        "its stream's continuations (an engine that died mid-stream); busy answers (429, 503) do not count.",
    )
    initial_backoff_ms: float = setting(50.0, "--retry-initial-backoff-ms", "Wait before the first retry.")
    max_backoff_ms: float = setting(30000.0, "--retry-max-backoff-ms", "Longest wait between retries.")
    backoff_multiplier: float = setting(1.5, "--retry-backoff-multiplier", "Each wait is the previous times this.")
    jitter_factor: float = setting(0.2, "--retry-jitter-factor", "Random fraction added to each wait.")
    disabled: bool = setting(False, "--disable-retries", "Never retry.")

    def __post_init__(self) -> None:
        _check(self.max_retries >= 0, "--retry-max-retries", self.max_retries, ">= 0")
        _check(self.initial_backoff_ms >= 0, "--retry-initial-backoff-ms", self.initial_backoff_ms, ">= 0")
        _check(
            self.max_backoff_ms >= self.initial_backoff_ms,
            "--retry-max-backoff-ms",
            self.max_backoff_ms,
            f">= --retry-initial-backoff-ms ({self.initial_backoff_ms:g})",
        )
        _check(self.backoff_multiplier >= 1, "--retry-backoff-multiplier", self.backoff_multiplier, ">= 1")
        _check(0 <= self.jitter_factor <= 1, "--retry-jitter-factor", self.jitter_factor, "in [0, 1]")


@dataclass(frozen=True, kw_only=True)
class BreakerConfig:
    """Each worker's circuit breaker (pdctl.router.breaker); raises RouterConfigError for a value out of range."""

    failure_threshold: int = setting(
        10, "--cb-failure-threshold", "Failures within the window that open a worker's circuit breaker."
    )
    success_threshold: int = setting(3, "--cb-success-threshold", "Successes in half-open state that close it again.")
    timeout_duration_secs: float = setting(
        60.0, "--cb-timeout-duration-secs", "How long an open breaker keeps the worker out before a trial request."
    )
    window_duration_secs: float = setting(120.0, "--cb-window-duration-secs", "Failures older than this are forgotten.")
    disabled: bool = setting(False, "--disable-circuit-breaker", "No circuit breakers.")

    def __post_init__(self) -> None:
        _check(self.failure_threshold >= 1, "--cb-failure-threshold", self.failure_threshold, ">= 1")
        _check(self.success_threshold >= 1, "--cb-success-threshold", self.success_threshold, ">= 1")
        _check(self.timeout_duration_secs >= 0, "--cb-timeout-duration-secs", self.timeout_duration_secs, ">= 0")
        _check(self.window_duration_secs > 0, "--cb-window-duration-secs", self.window_duration_secs, "> 0")


@dataclass(frozen=True, kw_only=True)
class AdmissionConfig:
    """What the router admits and how long things may wait: concurrency, queue, body sizes, timeouts, holds and leases.
    Raises RouterConfigError for a value out of range."""

    max_concurrent_requests: int = setting(-1, "--max-concurrent-requests", "Requests served at once; -1: no limit.")
    queue_size: int = setting(
        100,
        "--queue-size",
        "Requests that may wait for a slot once --max-concurrent-requests are running; beyond: 429.",
    )
    queue_timeout_secs: float = setting(
        60.0, "--queue-timeout-secs", "How long a request may wait for a slot; beyond: 408."
    )
    max_payload_size: int = setting(512 * 1024 * 1024, "--max-payload-size", "Bytes; a larger request body gets 413.")
    max_inflight_body_bytes: int = setting(
        1024 * 1024 * 1024,
        "--max-inflight-body-bytes",
        "Bytes of request bodies the router holds at once over all connections, from their first byte "
        "until their answer; beyond: 503 (a bound on its memory whatever clients send, during holds too).",
    )
    request_timeout_secs: float = setting(
        1800.0, "--request-timeout-secs", "Limit on a worker's answer (a stream's: until its first event)."
    )
    max_n: int = setting(
        1024,
        "--max-n",
        "Most samples per prompt (n) a request may ask for; beyond: 400 (SGLang has no limit; a 70-byte body "
        "with a huge n would make an engine allocate without bound).",
    )
    max_sequences: int = setting(
        65536,
        "--max-sequences-per-request",
        "Most sequences (prompts x n) one request may ask for; beyond: 400.",
    )
    max_hold_secs: float = setting(
        600.0,
        "--max-hold-secs",
        "Longest a request waits while a weight update holds new requests before its 503.",
    )
    framework_lease_secs: float = setting(
        120.0,
        "--framework-lease-secs",
        "How long a transaction an RL framework drives through SGLang's control routes (its pause, an update, "
        "released memory) may go with no call before it ends by itself: a pause that moved nothing just ends, one "
        "that moved weights leaves only the engines it changed out of rotation (docs/frameworks.md).",
    )
    worker_wait_secs: float = setting(
        30.0,
        "--worker-wait-secs",
        "How long a request waits for a worker to come into rotation when its role has none (an engine "
        "restarting after a crash, a fleet still starting, a weight update pairing versions) before its 503; "
        "0: the 503 at once.",
    )

    prefill_room: int = setting(
        0,
        "--pd-prefill-room",
        "Late pairing: PD requests each prefill may hold at once (queued or computing); more wait in the router, "
        "first come first served, and are paired when a prefill has room, with the engines of that moment (a "
        "planner's new ones included); 0: paired on arrival, as sglang-router does (pdctl.router.pair_room).",
    )
    decode_room: int = setting(
        0,
        "--pd-decode-room",
        "Late pairing: PD requests each decode may hold at once (from their pairing to their answer's end); 0: no "
        "bound.",
    )

    def __post_init__(self) -> None:
        m = self.max_concurrent_requests
        _check(m == -1 or m >= 1, "--max-concurrent-requests", m, "-1 (no limit) or >= 1")
        _check(self.queue_size >= 0, "--queue-size", self.queue_size, ">= 0")
        _check(self.queue_timeout_secs > 0, "--queue-timeout-secs", self.queue_timeout_secs, "> 0")
        _check(self.max_payload_size >= 1, "--max-payload-size", self.max_payload_size, ">= 1")
        _check(
            self.max_inflight_body_bytes >= self.max_payload_size,
            "--max-inflight-body-bytes",
            self.max_inflight_body_bytes,
            f">= --max-payload-size ({self.max_payload_size})",
        )
        _check(self.request_timeout_secs > 0, "--request-timeout-secs", self.request_timeout_secs, "> 0")
        _check(self.max_hold_secs > 0, "--max-hold-secs", self.max_hold_secs, "> 0")
        _check(self.framework_lease_secs > 0, "--framework-lease-secs", self.framework_lease_secs, "> 0")
        _check(self.worker_wait_secs >= 0, "--worker-wait-secs", self.worker_wait_secs, ">= 0")
        _check(self.prefill_room >= 0, "--pd-prefill-room", self.prefill_room, ">= 0 (0: no late pairing)")
        _check(self.decode_room >= 0, "--pd-decode-room", self.decode_room, ">= 0 (0: no bound)")
        _check(self.max_n >= 1, "--max-n", self.max_n, ">= 1")
        _check(self.max_sequences >= 1, "--max-sequences-per-request", self.max_sequences, ">= 1")


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """The cache_aware policy's settings."""

    cache_threshold: float = setting(
        0.3, "--cache-threshold", "cache_aware: prefix-match ratio above which the matching worker is chosen."
    )
    balance_abs_threshold: int = setting(
        64, "--balance-abs-threshold", "cache_aware: load difference (requests) above which it balances instead."
    )
    balance_rel_threshold: float = setting(
        1.5, "--balance-rel-threshold", "cache_aware: load ratio above which it balances instead."
    )

    def __post_init__(self) -> None:
        _check(0 <= self.cache_threshold <= 1, "--cache-threshold", self.cache_threshold, "in [0, 1]")
        _check(self.balance_abs_threshold >= 0, "--balance-abs-threshold", self.balance_abs_threshold, ">= 0")
        _check(self.balance_rel_threshold >= 1, "--balance-rel-threshold", self.balance_rel_threshold, ">= 1")


GROUPS: dict[str, type] = {
    "health": HealthConfig,
    "retry": RetryConfig,
    "breaker": BreakerConfig,
    "admission": AdmissionConfig,
    "cache": CacheConfig,
}
"""RouterConfig's setting groups, by attribute name."""


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    """Every setting of one router: binding, workers, policies, keys, weight-update behaviour, files, and the setting
    groups (``GROUPS``). Frozen; raises RouterConfigError for a port or bound out of range."""

    host: str = "127.0.0.1"
    port: int = 30000
    prometheus_port: int | None = None
    pd_disaggregation: bool = False
    workers: tuple[WorkerSpec, ...] = ()
    policy: str = "round_robin"
    prefill_policy: str | None = None
    decode_policy: str | None = None
    api_key: str | None = field(default=None, repr=False)
    """The client (data-plane) key; never logged (repr=False)."""
    control_keys: tuple[Any, ...] = field(default=(), repr=False)
    """``pdctl.router.auth.ControlKey``s: the control plane's keys, with roles."""
    engine_api_key: str | None = field(default=None, repr=False)
    """What the router sends to workers as ``Authorization: Bearer``; None: the client key (as
    sglang-router does). A client's own Authorization is never sent on."""
    audit: bool = False
    """Log every control-plane call (who, what, allowed or denied) at INFO to pdctl.router.audit."""
    control_open_from: tuple[str, ...] = ()
    """Networks (CIDR) whose calls to SGLang's control routes and ``/workers`` need no key (RL
    frameworks send none); audited. Empty: every control call needs its key."""
    refit: RefitMode = RefitMode.DRAIN
    """A framework's weight update through SGLang's control routes (pdctl.router.facade): how one
    sent with no pause first treats requests in flight, and whether its ``abort`` pause lets the
    router continue what it stopped (``interrupt``) or pass SGLang's abort on (``drain``)."""
    max_staleness: int | None = None
    """``interrupt``: how many updates one request may be continued across (pdctl.refit)."""
    state_file: str | None = None
    """What the router keeps across its restarts (pdctl.router.state_file)."""
    port_file: str | None = None
    """Where the bound ports are written once it serves (``--port 0`` picks any)."""
    health: HealthConfig = field(default_factory=HealthConfig)
    retry: RetryConfig = field(default_factory=RetryConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)

    @property
    def worker_key(self) -> str | None:
        """The key command-line workers get: the engine key, else the client key (sglang-router's rule)."""
        return self.engine_api_key or self.api_key

    def __post_init__(self) -> None:
        # A port past 65535 is not refused by the socket layer: it binds the port modulo 65536.
        _check(0 <= self.port <= 65535, Flag.PORT, self.port, "a port number, 0 to 65535 (0: any free port)")
        if self.prometheus_port is not None:
            _check(0 <= self.prometheus_port <= 65535, Flag.PROMETHEUS_PORT, self.prometheus_port, "0 to 65535")
        if self.max_staleness is not None:
            _check(self.max_staleness >= 0, Flag.MAX_STALENESS, self.max_staleness, ">= 0")
        for w in self.workers:
            if w.bootstrap_port is not None:
                _check(1 <= w.bootstrap_port <= 65535, f"{Flag.PREFILL} {w.url}", w.bootstrap_port, "1 to 65535")
        if self.admission.prefill_room or self.admission.decode_room:
            # Late pairing chooses among the engines with room: a sticky policy would lose its
            # stickiness, and a hash ring would be built again for each new subset.
            sticky = sorted({p for p in (self.policy, self.prefill_policy, self.decode_policy) if p in STICKY_POLICIES})
            _check(
                not sticky,
                "--pd-prefill-room/--pd-decode-room",
                self.admission.prefill_room or self.admission.decode_room,
                f"0 with the {', '.join(sticky)} policy (late pairing works with random, round_robin, power_of_two "
                "and cache_aware)",
            )


STICKY_POLICIES = frozenset({"manual", "consistent_hashing", "prefix_hash"})
"""Policies that keep a request's key on one engine (refused with late pairing)."""


class Flag:
    """The router's top-level flags (binding, workers, policies, key, metrics), spelled here once
    for its parser (pdctl.router.cli) and the planner's argv (pdctl.plan.argv); the grouped
    settings carry theirs in ``SETTINGS``."""

    HOST = "--host"
    PORT = "--port"
    PD_DISAGGREGATION = "--pd-disaggregation"
    PREFILL = "--prefill"
    DECODE = "--decode"
    WORKER_URLS = "--worker-urls"
    POLICY = "--policy"
    PREFILL_POLICY = "--prefill-policy"
    DECODE_POLICY = "--decode-policy"
    API_KEY = "--api-key"
    API_KEY_ENV = "--api-key-env"
    CONTROL_KEYS = "--control-plane-api-keys"
    CONTROL_KEYS_ENV = "--control-plane-api-keys-env"
    AUDIT = "--control-plane-audit-enabled"
    OPEN_FROM = "--control-plane-open-from"
    REFIT = "--refit"
    MAX_STALENESS = "--max-staleness"
    ENGINE_KEY_ENV = "--engine-api-key-env"
    PROMETHEUS_PORT = "--prometheus-port"
    LOG_LEVEL = "--log-level"
    STATE_FILE = "--state-file"
    PORT_FILE = "--port-file"


@dataclass(frozen=True)
class Setting:
    """One row of the table: a group's field and its flag."""

    group: str
    name: str
    flag: str
    help: str
    default: Any
    kind: type

    @property
    def dest(self) -> str:
        """The argparse destination of the setting's flag: ``group.name``."""
        return f"{self.group}.{self.name}"


def _settings() -> Iterator[Setting]:
    for group, cls in GROUPS.items():
        for f in fields(cls):
            kind = {"int": int, "float": float, "bool": bool}[str(f.type)]
            yield Setting(group, f.name, f.metadata["flag"], f.metadata["help"], f.default, kind)


SETTINGS: tuple[Setting, ...] = tuple(_settings())
"""Every grouped setting with its flag: the one place flags are spelled."""


def flag_of(group: str, name: str) -> str:
    """The command-line flag of ``group.name`` (e.g. ``health``, ``interval_secs``)."""
    for s in SETTINGS:
        if s.group == group and s.name == name:
            return s.flag
    raise KeyError(f"no router setting {group}.{name}")


def grouped(values: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Group configs from ``{group: {name: value}}`` (missing ones keep their defaults);
    RouterConfigError for a value a group refuses."""
    return {group: cls(**values.get(group, {})) for group, cls in GROUPS.items()}
