"""``pdctl router``: the embedded router as a standalone server; flags modelled on sglang-router.

    pdctl router --pd-disaggregation --prefill http://10.0.0.1:30000 8998 \\
                 --decode http://10.0.0.2:30001 --policy round_robin --port 8000
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import sys

from pdctl.roles import Role
from pdctl.router.app import RouterServer
from pdctl.router.config import RouterConfig, WorkerSpec
from pdctl.router.policies import REGISTRY
from pdctl.signals import stop_event

log = logging.getLogger("pdctl.router")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdctl router",
        description="pdctl's PD router. Binds 127.0.0.1 unless --host says otherwise.",
    )
    d = RouterConfig()
    policies = sorted(REGISTRY)
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--pd-disaggregation", action="store_true", help="PD mode: --prefill and --decode workers.")
    p.add_argument(
        "--prefill",
        nargs="+",
        action="append",
        default=[],
        metavar=("URL", "BOOTSTRAP_PORT"),
        help="A prefill worker and its bootstrap port (or 'none'); repeat per worker.",
    )
    p.add_argument("--decode", action="append", default=[], metavar="URL", help="A decode worker; repeat.")
    p.add_argument("--worker-urls", nargs="+", default=[], metavar="URL", help="Regular (non-PD) workers.")
    p.add_argument("--policy", choices=policies, default=d.policy)
    p.add_argument("--prefill-policy", choices=policies)
    p.add_argument("--decode-policy", choices=policies)
    p.add_argument("--api-key", help="Require 'Authorization: Bearer KEY' (prefer --api-key-env: argv is visible).")
    p.add_argument("--api-key-env", metavar="VAR", help="Read the API key from this environment variable.")
    p.add_argument("--prometheus-port", type=int, help="Also serve /metrics on this port.")
    p.add_argument("--request-timeout-secs", type=float, default=d.request_timeout_secs)
    p.add_argument("--max-concurrent-requests", type=int, default=d.max_concurrent_requests, help="-1: no limit.")
    p.add_argument("--queue-size", type=int, default=d.queue_size)
    p.add_argument("--queue-timeout-secs", type=float, default=d.queue_timeout_secs)
    p.add_argument("--max-payload-size", type=int, default=d.max_payload_size, help="Bytes; larger bodies get 413.")
    p.add_argument("--health-check-interval-secs", type=float, default=d.health_check_interval_secs)
    p.add_argument("--worker-startup-check-interval", type=float, default=d.worker_startup_check_interval)
    p.add_argument("--health-check-timeout-secs", type=float, default=d.health_check_timeout_secs)
    p.add_argument("--health-failure-threshold", type=int, default=d.health_failure_threshold)
    p.add_argument("--health-success-threshold", type=int, default=d.health_success_threshold)
    p.add_argument("--health-first-wait-secs", type=float, default=d.health_first_wait_secs)
    p.add_argument("--disable-health-check", action="store_true")
    p.add_argument("--retry-max-retries", type=int, default=d.retry_max_retries)
    p.add_argument("--retry-initial-backoff-ms", type=float, default=d.retry_initial_backoff_ms)
    p.add_argument("--retry-max-backoff-ms", type=float, default=d.retry_max_backoff_ms)
    p.add_argument("--retry-backoff-multiplier", type=float, default=d.retry_backoff_multiplier)
    p.add_argument("--retry-jitter-factor", type=float, default=d.retry_jitter_factor)
    p.add_argument("--disable-retries", action="store_true")
    p.add_argument("--cb-failure-threshold", type=int, default=d.cb_failure_threshold)
    p.add_argument("--cb-success-threshold", type=int, default=d.cb_success_threshold)
    p.add_argument("--cb-timeout-duration-secs", type=float, default=d.cb_timeout_duration_secs)
    p.add_argument("--cb-window-duration-secs", type=float, default=d.cb_window_duration_secs)
    p.add_argument("--disable-circuit-breaker", action="store_true")
    p.add_argument("--cache-threshold", type=float, default=d.cache_threshold)
    p.add_argument("--balance-abs-threshold", type=int, default=d.balance_abs_threshold)
    p.add_argument("--balance-rel-threshold", type=float, default=d.balance_rel_threshold)
    p.add_argument("--max-hold-secs", type=float, default=d.max_hold_secs)
    p.add_argument("--log-level", choices=["debug", "info", "warn", "error"], default="info")
    for action in p._actions:  # every flag says what it does, and its default where it has one
        if action.help is None and action.dest in HELP:
            action.help = HELP[action.dest]
        if action.help and action.default not in (None, False, [], argparse.SUPPRESS):
            action.help += " (default: %(default)s)"
    return p


HELP = {
    "host": "Address to bind (127.0.0.1 unless other machines must reach the router).",
    "port": "Port to bind.",
    "policy": "How a worker is chosen (both roles, unless --prefill-policy/--decode-policy).",
    "prefill_policy": "Policy for prefill workers only.",
    "decode_policy": "Policy for decode workers only.",
    "request_timeout_secs": "Whole-request limit, streams included.",
    "queue_size": "Requests that may wait for a slot once --max-concurrent-requests are running; beyond: 429.",
    "queue_timeout_secs": "How long a request may wait for a slot; beyond: 408.",
    "health_check_interval_secs": "Seconds between health checks of each worker.",
    "worker_startup_check_interval": "Seconds between checks of a worker that is not up yet.",
    "health_check_timeout_secs": "A health check slower than this fails.",
    "health_failure_threshold": "Failed checks in a row that take a worker out of rotation.",
    "health_success_threshold": "Passed checks in a row that bring it back.",
    "health_first_wait_secs": "Grace after a worker is added before failed checks count (slow engine start-ups).",
    "disable_health_check": "Never check workers (they are always in rotation).",
    "retry_max_retries": "Attempts after the first on a failed or refused request.",
    "retry_initial_backoff_ms": "Wait before the first retry.",
    "retry_max_backoff_ms": "Longest wait between retries.",
    "retry_backoff_multiplier": "Each wait is the previous times this.",
    "retry_jitter_factor": "Random fraction added to each wait.",
    "disable_retries": "Never retry.",
    "cb_failure_threshold": "Failures within the window that open a worker's circuit breaker.",
    "cb_success_threshold": "Successes in half-open state that close it again.",
    "cb_timeout_duration_secs": "How long an open breaker keeps the worker out before a trial request.",
    "cb_window_duration_secs": "Failures older than this are forgotten.",
    "disable_circuit_breaker": "No circuit breakers.",
    "cache_threshold": "cache_aware: prefix-match ratio above which the matching worker is chosen.",
    "balance_abs_threshold": "cache_aware: load difference (requests) above which it balances instead.",
    "balance_rel_threshold": "cache_aware: load ratio above which it balances instead.",
    "max_hold_secs": "Longest a weight push may hold new requests (/pdctl/hold) before they flow again.",
    "log_level": "Log level (routine events at info, trouble at warn).",
}


def config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> RouterConfig:
    workers: list[WorkerSpec] = []
    for spec in args.prefill:
        if len(spec) > 2:
            parser.error(f"--prefill takes URL [BOOTSTRAP_PORT], got {' '.join(spec)}")
        port = None
        if len(spec) == 2 and spec[1].lower() != "none":
            if not spec[1].isdigit():
                parser.error(f"--prefill {spec[0]}: bootstrap port must be a number or 'none', got {spec[1]!r}")
            port = int(spec[1])
        workers.append(WorkerSpec(url=spec[0], role=Role.PREFILL, bootstrap_port=port))
    workers += [WorkerSpec(url=u, role=Role.DECODE) for u in args.decode]
    workers += [WorkerSpec(url=u, role=Role.REGULAR) for u in args.worker_urls]
    for w in workers:
        if not w.url.startswith(("http://", "https://")):
            parser.error(f"worker URL must start with http:// or https://: {w.url}")
    if (args.prefill or args.decode) and not args.pd_disaggregation:
        parser.error("--prefill/--decode need --pd-disaggregation")
    if args.pd_disaggregation and args.worker_urls:
        parser.error("--worker-urls (regular workers) cannot be mixed with --pd-disaggregation")
    api_key = args.api_key
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            parser.error(f"--api-key-env {args.api_key_env}: the variable is unset or empty")
    return RouterConfig(
        host=args.host,
        port=args.port,
        prometheus_port=args.prometheus_port,
        pd_disaggregation=args.pd_disaggregation,
        workers=tuple(workers),
        policy=args.policy,
        prefill_policy=args.prefill_policy,
        decode_policy=args.decode_policy,
        api_key=api_key,
        request_timeout_secs=args.request_timeout_secs,
        max_concurrent_requests=args.max_concurrent_requests,
        queue_size=args.queue_size,
        queue_timeout_secs=args.queue_timeout_secs,
        max_payload_size=args.max_payload_size,
        health_check_interval_secs=args.health_check_interval_secs,
        worker_startup_check_interval=args.worker_startup_check_interval,
        health_check_timeout_secs=args.health_check_timeout_secs,
        health_failure_threshold=args.health_failure_threshold,
        health_success_threshold=args.health_success_threshold,
        health_first_wait_secs=args.health_first_wait_secs,
        disable_health_check=args.disable_health_check,
        retry_max_retries=args.retry_max_retries,
        retry_initial_backoff_ms=args.retry_initial_backoff_ms,
        retry_max_backoff_ms=args.retry_max_backoff_ms,
        retry_backoff_multiplier=args.retry_backoff_multiplier,
        retry_jitter_factor=args.retry_jitter_factor,
        disable_retries=args.disable_retries,
        cb_failure_threshold=args.cb_failure_threshold,
        cb_success_threshold=args.cb_success_threshold,
        cb_timeout_duration_secs=args.cb_timeout_duration_secs,
        cb_window_duration_secs=args.cb_window_duration_secs,
        disable_circuit_breaker=args.disable_circuit_breaker,
        cache_threshold=args.cache_threshold,
        balance_abs_threshold=args.balance_abs_threshold,
        balance_rel_threshold=args.balance_rel_threshold,
        max_hold_secs=args.max_hold_secs,
    )


async def serve(config: RouterConfig) -> None:
    server = RouterServer(config)
    stop = stop_event()
    await server.start()
    _tune_gc()
    roles = ", ".join(f"{w.role} {w.url}" for w in server.registry.workers.values()) or "no workers yet"
    log.info("pdctl router on %s (%s); %s", server.url, "PD" if config.pd_disaggregation else "regular", roles)
    try:
        await stop.wait()
    finally:
        await server.stop()


def _tune_gc() -> None:
    """Run the cyclic GC far less often: the router makes many short-lived objects per request,
    and with the default gen-0 threshold (700) collections were 11% of its CPU in a native
    profile. What exists after start-up (modules, config, workers) is frozen out of collections;
    the few cycles requests make are still collected."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)


def main(argv: list[str]) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = {"warn": logging.WARNING}.get(args.log_level, getattr(logging, args.log_level.upper()))
    # force: `pdctl router` comes through the CLI, which has already configured logging (at WARNING)
    logging.basicConfig(level=level, format="[%(asctime)s] %(name)s %(levelname)s %(message)s", force=True)
    config = config_from_args(args, parser)
    try:
        import uvloop  # faster event loop where installed

        uvloop.install()
    except ImportError:
        pass
    try:
        asyncio.run(serve(config))
    except OSError as exc:
        log.error("cannot start the router: %s", exc)
        sys.exit(1)
