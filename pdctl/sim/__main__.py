"""``python -m pdctl.sim <SGLang server flags>``: run one sim engine until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shlex
import sys

import yaml

from pdctl.errors import PdctlError
from pdctl.gpu_profiles import describe_profiles, profile_named
from pdctl.httputil import write_port_file
from pdctl.node.proc import redact
from pdctl.signals import stop_event
from pdctl.sim.args import build_parser, ignored_flags, merge_config_file, sim_options
from pdctl.sim.config import DEFAULT_BOOTSTRAP_PORT, RemoteSource, SimConfig
from pdctl.sim.multinode import FAIL_EXIT_DELAY_SECS, NodeLayout, run_peer

log = logging.getLogger("pdctl.sim")


def config_from_argv(argv: list[str]) -> SimConfig:
    """The engine's settings from SGLang's flags (and the sim's own); exits 2 on bad flags, as
    SGLang does. Changes nothing in the process: main() applies the process settings."""
    parser = build_parser()
    try:
        argv = merge_config_file(argv, parser)
    except (ValueError, OSError, yaml.YAMLError) as exc:
        parser.error(f"--config: {exc}")
    if "--list-profiles" in argv:
        print(describe_profiles())
        sys.exit(0)
    args = parser.parse_args(argv)  # exits 2 on unknown flags, like SGLang
    sim = sim_options(args)
    profile = None
    if sim.profile is not None:
        try:
            profile = profile_named(sim.profile)
        except ValueError as exc:
            parser.error(f"--sim-profile: {exc}")
        chunk = args.chunked_prefill_size
        overrides = {
            "kv_pool_tokens": args.max_total_tokens,
            "chunk_tokens": chunk if chunk and chunk > 0 else None,
            "graph_capture_secs": args.sim_graph_capture_secs,
        }
        profile = dataclasses.replace(profile, **{k: v for k, v in overrides.items() if v is not None})
    if args.sim_graph_capture_secs is not None:
        if profile is None:
            parser.error("--sim-graph-capture-secs: only a --sim-profile engine pays a graph capture")
        if args.sim_graph_capture_secs < 0:
            parser.error(f"--sim-graph-capture-secs must be >= 0, got {args.sim_graph_capture_secs}")
    for flag, value in (
        ("--tp-size", args.tp_size),
        ("--max-running-requests", args.max_running_requests),
        ("--context-length", args.context_length),
        ("--stream-interval", args.stream_interval),
        ("--sim-max-n", args.sim_max_n),
        ("--sim-max-sequences-per-request", args.sim_max_sequences_per_request),
        ("--sim-max-request-tokens", args.sim_max_request_tokens),
    ):
        if value is not None and value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    try:
        layout = NodeLayout.parse(args.dist_init_addr, args.nnodes or 1, args.node_rank or 0, args.tp_size or 1)
    except ValueError as exc:
        parser.error(str(exc))
    if sim.null:  # the null engine has no model to hook, cost or spread over nodes
        for flag, given in (("--forward-hooks", args.forward_hooks), ("--sim-profile", sim.profile),
                            ("--nnodes", (args.nnodes or 1) > 1)):  # fmt: skip
            if given:
                parser.error(f"--sim-null serves no model: {flag} needs the sim proper")
    try:
        hooks = _forward_hooks(args.forward_hooks)
    except ValueError as exc:
        parser.error(str(exc))
    server_args = tuple((k, v) for k, v in sorted(vars(args).items()) if not k.startswith("sim_") and k != "api_key")
    return SimConfig(
        model_path=args.model_path,
        host=args.host or "127.0.0.1",
        port=args.port if args.port is not None else 30000,
        served_model_name=args.served_model_name,
        tokenizer_path=args.tokenizer_path,
        tp_size=args.tp_size or 1,
        disaggregation_mode=args.disaggregation_mode or "null",
        enable_pd_role_switch=bool(args.enable_pd_role_switch),
        bootstrap_port=(  # 0: any free port (tests read it from the start-up line)
            DEFAULT_BOOTSTRAP_PORT if args.disaggregation_bootstrap_port is None else args.disaggregation_bootstrap_port
        ),
        load_format=args.load_format or "auto",
        remote_source=RemoteSource.from_args(args),
        random_seed=args.random_seed or 0,
        weight_version=args.weight_version or "default",
        enable_metrics=bool(args.enable_metrics),
        api_key=args.api_key,
        skip_server_warmup=bool(args.skip_server_warmup),
        context_length=args.context_length,
        max_running_requests=args.max_running_requests or (profile.max_running_requests if profile else 64),
        max_queued_requests=args.max_queued_requests,
        stream_interval=args.stream_interval or 1,
        prefill_ms_per_token=sim.prefill_ms_per_token,
        decode_ms_per_step=sim.decode_ms_per_step,
        weight_digest=sim.weight_digest,
        weight_group_timeout_secs=sim.weight_group_timeout_secs,
        disk_load_ms=sim.disk_load_ms,
        profile=profile,
        null=sim.null,
        prefix_cache=not args.disable_radix_cache,
        max_n=sim.max_n,
        max_sequences_per_request=sim.max_sequences_per_request,
        max_request_tokens=sim.max_request_tokens,
        layout=layout,
        dist_timeout_secs=float(args.dist_timeout or 600),
        server_args=server_args,
        launch_command=shlex.join(["python", "-m", "pdctl.sim", *redact(argv)]),
        log_level=(args.log_level or "info").upper(),
        torch_threads=sim.threads,
        ignored_flags=tuple(ignored_flags(args)),
        port_file=args.sim_port_file,
        forward_hooks=hooks,
        enable_return_hidden_states=bool(args.enable_return_hidden_states),
    )


def _forward_hooks(text: str | list | None) -> tuple:
    """``--forward-hooks`` parsed (torch is imported only when there are some)."""
    if not text:
        return ()
    from pdctl.sim.hooks import parse_hook_specs

    return parse_hook_specs(text)


async def serve_null(config: SimConfig) -> int:
    """``--sim-null``: the null engine on this engine's address, role, bootstrap port and key."""
    from pdctl.sim import null

    role = config.disaggregation_mode if config.disaggregation_mode in ("prefill", "decode") else "regular"
    await null.serve_null(
        config.host,
        config.port,
        role,
        config.bootstrap_port if role == "prefill" else None,
        config.port_file,
        api_key=config.api_key,
        weight_version=config.weight_version,
    )
    return 0


async def serve(config: SimConfig) -> int:
    """Run until SIGTERM/SIGINT (0) or until the engine fails (1); the exit code."""
    layout = config.layout
    if layout is not None and layout.node_rank > 0:
        return await run_peer(
            layout,
            config.model_path,
            config.host,
            config.port,
            enable_metrics=config.enable_metrics,
            timeout_secs=config.dist_timeout_secs,
        )
    from pdctl.sim.server import SimServer  # torch: imported once the flags are known good

    server = SimServer(config)
    stop = stop_event()
    stopped = asyncio.ensure_future(stop.wait())
    failed = asyncio.ensure_future(server.failed.wait())
    starting = asyncio.ensure_future(server.start())  # a signal may end even a long start (peers never come)
    try:
        await asyncio.wait([starting, stopped], return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            log.info("stopped while starting")
            return 0
        starting.result()
        serves_kv = config.disaggregation_mode == "prefill" or (
            config.enable_pd_role_switch and config.disaggregation_mode != "null"
        )
        log.info(
            "sim engine %s on %s (mode %s, tp %d)%s",
            config.model_path,
            server.url,
            config.disaggregation_mode,
            config.tp_size,
            f", bootstrap port {server.bootstrap_port}" if serves_kv else "",
        )
        write_port_file(config.port_file, port=server.port, bootstrap_port=server.bootstrap_port if serves_kv else None)
        await asyncio.wait([stopped, failed], return_when=asyncio.FIRST_COMPLETED)
        if failed.done():
            await asyncio.sleep(FAIL_EXIT_DELAY_SECS)  # /health answers 503 meanwhile
            return 1
        return 0
    finally:
        for task in (starting, stopped, failed):
            task.cancel()
        await server.stop()


def main(argv: list[str] | None = None) -> None:
    config = config_from_argv(sys.argv[1:] if argv is None else argv)
    level = getattr(logging, config.log_level, logging.INFO)
    logging.basicConfig(level=level, format="[%(asctime)s] %(name)s %(message)s")
    if config.ignored_flags:
        log.info("accepted but ignored on CPU: %s", " ".join(config.ignored_flags))
    if not config.null:
        from pdctl.sim.server import torch_threads

        torch_threads(config.torch_threads)
    try:
        code = asyncio.run(serve_null(config) if config.null else serve(config))
    except PdctlError as exc:
        log.error("%s", exc)
        sys.exit(1)
    except OSError as exc:
        log.error("cannot start: %s", exc)
        sys.exit(1)
    # Everything is stopped and flushed: skip the interpreter's teardown of torch and its threads
    # (about half a second per engine, paid by every stop, restart and `down`).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
