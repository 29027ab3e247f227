"""Router settings (frozen). Defaults follow sglang-router 0.3.2 where it has the knob."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdctl.roles import Role


@dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    url: str
    role: Role  # an engine role: regular, prefill or decode
    bootstrap_port: int | None = None


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 30000
    prometheus_port: int | None = None
    pd_disaggregation: bool = False
    workers: tuple[WorkerSpec, ...] = ()
    policy: str = "round_robin"
    prefill_policy: str | None = None
    decode_policy: str | None = None
    api_key: str | None = field(default=None, repr=False)
    """Never logged (repr=False)."""
    request_timeout_secs: float = 1800.0
    max_concurrent_requests: int = -1
    queue_size: int = 100
    queue_timeout_secs: float = 60.0
    max_payload_size: int = 512 * 1024 * 1024
    """Bytes; a larger request body is answered 413 (sglang-router's and smg's default)."""
    health_check_interval_secs: float = 10.0
    worker_startup_check_interval: float = 0.5
    """Seconds between checks while a worker has never answered (sglang-router: 30; pdctl polls
    faster so that an engine enters rotation as soon as it is up)."""
    health_check_timeout_secs: float = 5.0
    health_failure_threshold: int = 3
    health_success_threshold: int = 2
    health_first_wait_secs: float = 0.0
    """Failures during this long after a worker registers are not counted (cold starts)."""
    disable_health_check: bool = False
    retry_max_retries: int = 5
    retry_initial_backoff_ms: float = 50.0
    retry_max_backoff_ms: float = 30000.0
    retry_backoff_multiplier: float = 1.5
    retry_jitter_factor: float = 0.2
    disable_retries: bool = False
    cb_failure_threshold: int = 10
    cb_success_threshold: int = 3
    cb_timeout_duration_secs: float = 60.0
    cb_window_duration_secs: float = 120.0
    """Failures are counted in windows of this length from the first one; older ones are forgotten."""
    disable_circuit_breaker: bool = False
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_hold_secs: float = 600.0
    """How long requests may wait while the router is held for a weight update."""
