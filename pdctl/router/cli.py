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
from typing import Any

from pdctl.errors import RouterConfigError
from pdctl.httputil import write_port_file
from pdctl.refit import RefitMode
from pdctl.roles import Role
from pdctl.router.app import RouterServer
from pdctl.router.auth import parse_control_keys, parse_networks
from pdctl.router.config import SETTINGS, Flag, RouterConfig, WorkerSpec, grouped
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
    p.add_argument(Flag.HOST, default=d.host, help="Address to bind (127.0.0.1 unless other machines must reach it).")
    p.add_argument(Flag.PORT, type=int, default=d.port, help="Port to bind.")
    p.add_argument(Flag.PD_DISAGGREGATION, action="store_true", help="PD mode: --prefill and --decode workers.")
    p.add_argument(
        Flag.PREFILL,
        nargs="+",
        action="append",
        default=[],
        metavar=("URL", "BOOTSTRAP_PORT"),
        help="A prefill worker and its bootstrap port (or 'none'); repeat per worker.",
    )
    p.add_argument(Flag.DECODE, action="append", default=[], metavar="URL", help="A decode worker; repeat.")
    p.add_argument(Flag.WORKER_URLS, nargs="+", default=[], metavar="URL", help="Regular (non-PD) workers.")
    p.add_argument(
        Flag.POLICY,
        choices=policies,
        default=d.policy,
        help="How a worker is chosen (both roles, unless --prefill-policy/--decode-policy).",
    )
    p.add_argument(Flag.PREFILL_POLICY, choices=policies, help="Policy for prefill workers only.")
    p.add_argument(Flag.DECODE_POLICY, choices=policies, help="Policy for decode workers only.")
    p.add_argument(
        Flag.API_KEY,
        help="The client key: inference routes require 'Authorization: Bearer KEY'; it also guards the control "
        "plane when no control-plane keys are given (prefer --api-key-env: argv is visible).",
    )
    p.add_argument(Flag.API_KEY_ENV, metavar="VAR", help="Read the client key from this environment variable.")
    p.add_argument(
        Flag.CONTROL_KEYS,
        nargs="+",
        default=[],
        metavar="ID:NAME:ROLE:KEY",
        help="Control-plane keys (sglang-router's format); ROLE admin (every control call) or user (reads: "
        "GET /workers, /pdctl/weights). With them the client key no longer reaches the control plane.",
    )
    p.add_argument(
        Flag.CONTROL_KEYS_ENV,
        metavar="VAR",
        help=f"Read {Flag.CONTROL_KEYS} entries (one per line) from this environment variable.",
    )
    p.add_argument(Flag.AUDIT, action="store_true", help="Log every control-plane call (who, what, outcome).")
    p.add_argument(
        Flag.OPEN_FROM,
        nargs="+",
        default=[],
        metavar="CIDR",
        help="Admit calls that send no key to SGLang's control routes (pause, continue, weight updates and "
        "groups, flush, abort, memory) and GET/POST /workers from these networks: RL frameworks (AReaL, slime, "
        "skyrl-train) send no header. Every such call is audited.",
    )
    p.add_argument(
        Flag.REFIT,
        choices=[m.value for m in RefitMode],
        default=RefitMode.DRAIN.value,
        help="A framework's weight update through SGLang's control routes: drain (an update sent with no pause "
        "waits for requests in flight; a framework's abort pause passes SGLang's abort on) or interrupt "
        "(requests a framework's abort pause stops are continued on the new weights once it continues).",
    )
    p.add_argument(
        Flag.MAX_STALENESS,
        type=int,
        metavar="N",
        help="With --refit interrupt: how many weight updates one request may be continued across.",
    )
    p.add_argument(
        Flag.ENGINE_KEY_ENV,
        metavar="VAR",
        help="The key the router sends to workers, read from this environment variable (default: the client "
        "key, as sglang-router does). A client's own Authorization header is never sent to a worker.",
    )
    p.add_argument(Flag.PROMETHEUS_PORT, type=int, help="Also serve /metrics on this port.")
    p.add_argument(
        Flag.STATE_FILE,
        metavar="PATH",
        help="Keep the fleet's weight version and the workers the worker API left here, so that a restarted "
        "router keeps both (pdctl up sets it).",
    )
    p.add_argument(Flag.PORT_FILE, metavar="PATH", help="Once serving, write the bound ports here as JSON.")
    for s in SETTINGS:  # the grouped settings: flag, type, default and help from one table
        if s.kind is bool:
            p.add_argument(s.flag, dest=s.dest, action="store_true", help=s.help)
        else:
            metavar = s.flag.lstrip("-").upper().replace("-", "_")
            p.add_argument(s.flag, dest=s.dest, type=s.kind, default=s.default, metavar=metavar, help=s.help)
    p.add_argument(
        Flag.LOG_LEVEL,
        choices=["debug", "info", "warn", "error"],
        default="info",
        help="Log level (routine events at info, trouble at warn).",
    )
    for action in p._actions:  # every flag with a default says it
        if action.help and action.default not in (None, False, [], argparse.SUPPRESS):
            action.help += " (default: %(default)s)"
    return p


def config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> RouterConfig:
    workers: list[WorkerSpec] = []
    for spec in args.prefill:
        if len(spec) > 2:
            parser.error(f"{Flag.PREFILL} takes URL [BOOTSTRAP_PORT], got {' '.join(spec)}")
        port = None
        if len(spec) == 2 and spec[1].lower() != "none":
            if not spec[1].isdigit():
                parser.error(f"{Flag.PREFILL} {spec[0]}: bootstrap port must be a number or 'none', got {spec[1]!r}")
            port = int(spec[1])
        workers.append(WorkerSpec(url=spec[0], role=Role.PREFILL, bootstrap_port=port))
    workers += [WorkerSpec(url=u, role=Role.DECODE) for u in args.decode]
    workers += [WorkerSpec(url=u, role=Role.REGULAR) for u in args.worker_urls]
    for w in workers:
        if not w.url.startswith(("http://", "https://")):
            parser.error(f"worker URL must start with http:// or https://: {w.url}")
    if (args.prefill or args.decode) and not args.pd_disaggregation:
        parser.error(f"{Flag.PREFILL}/{Flag.DECODE} need {Flag.PD_DISAGGREGATION}")
    if args.pd_disaggregation and args.worker_urls:
        parser.error(f"{Flag.WORKER_URLS} (regular workers) cannot be mixed with {Flag.PD_DISAGGREGATION}")
    api_key = args.api_key
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            parser.error(f"{Flag.API_KEY_ENV} {args.api_key_env}: the variable is unset or empty")
    entries = list(args.control_plane_api_keys)
    if args.control_plane_api_keys_env:
        raw = os.environ.get(args.control_plane_api_keys_env)
        if not raw:
            parser.error(f"{Flag.CONTROL_KEYS_ENV} {args.control_plane_api_keys_env}: the variable is unset or empty")
        entries += raw.splitlines()
    engine_key = None
    if args.engine_api_key_env:
        engine_key = os.environ.get(args.engine_api_key_env)
        if not engine_key:
            parser.error(f"{Flag.ENGINE_KEY_ENV} {args.engine_api_key_env}: the variable is unset or empty")
    values: dict[str, dict[str, Any]] = {}
    for s in SETTINGS:
        values.setdefault(s.group, {})[s.name] = getattr(args, s.dest)
    try:
        control_keys = parse_control_keys(entries)
        parse_networks(args.control_plane_open_from)
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
            control_keys=control_keys,
            engine_api_key=engine_key,
            audit=args.control_plane_audit_enabled,
            control_open_from=tuple(args.control_plane_open_from),
            refit=RefitMode(args.refit),
            max_staleness=args.max_staleness,
            state_file=args.state_file,
            port_file=args.port_file,
            **grouped(values),
        )
    except RouterConfigError as exc:
        parser.error(str(exc))


async def serve(config: RouterConfig) -> None:
    server = RouterServer(config)
    stop = stop_event()
    await server.start()
    _tune_gc()
    roles = ", ".join(f"{w.role} {w.url}" for w in server.registry.workers.values()) or "no workers yet"
    mode = "PD" if config.pd_disaggregation else "regular"
    log.info("pdctl router on %s (%s); %s", server.url, mode, roles)
    write_port_file(config.port_file, port=server.port, prometheus_port=server.prometheus_port)
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
