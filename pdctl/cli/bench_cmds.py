"""``pdctl bench``: load-test a pdctl cluster or any SGLang-compatible URL; ``pdctl bench compare``."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from pdctl.bench import report as bench_report
from pdctl.bench.client import APIS
from pdctl.bench.metrics import Slo
from pdctl.bench.runner import BenchConfig, BenchError, LoadPoint, Reloader, run_bench
from pdctl.bench.workloads import (
    BenchRequest,
    fixed_workload,
    jsonl_workload,
    random_workload,
    shared_prefix_workload,
    sharegpt_workload,
)
from pdctl.cli.tables import print_table
from pdctl.cluster import StateStore
from pdctl.cluster.inspect import load_state
from pdctl.refit import RefitMode

DATASETS = ("random", "fixed", "shared-prefix", "sharegpt", "jsonl")


def _sweep(value: str | None) -> tuple[str, list[str]] | None:
    if value is None:
        return None
    kind, sep, values = value.partition("=")
    if not sep or kind not in ("rate", "concurrency") or not values:
        raise click.BadParameter("use rate=R1,R2,... or concurrency=C1,C2,...", param_hint="--sweep")
    return kind, [v.strip() for v in values.split(",") if v.strip()]


def _rate(text: str) -> float:
    try:
        rate = math.inf if text == "inf" else float(text)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a number or inf", param_hint="--request-rate") from None
    if not rate > 0:
        raise click.BadParameter(f"must be > 0, got {text}", param_hint="--request-rate")
    return rate


def _concurrency(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise click.BadParameter(f"must be a positive integer, got {text!r}", param_hint="--max-concurrency")
    return int(text)


class BenchGroup(click.Group):
    """``pdctl bench run ...`` and ``pdctl bench compare A.json B.json``; anything else after
    ``bench`` (a NAME, options) is ``run``'s, so ``pdctl bench NAME --sweep ...`` keeps working."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        """Arguments that do not start with a subcommand (or help) are parsed as ``run``'s."""
        if not args or (args[0] not in self.commands and args[0] not in ("-h", "--help")):
            args = ["run", *args]
        return super().parse_args(ctx, args)


@click.group(cls=BenchGroup)
def bench() -> None:
    """Load-test a cluster or any SGLang-compatible server (`run`, the default), or compare two
    reports (`compare`). `pdctl bench NAME [options]` is `pdctl bench run NAME [options]`."""


@bench.command("compare")
@click.argument("a", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("b", type=click.Path(exists=True, dir_okay=False, path_type=Path))
def compare(a: Path, b: Path) -> None:
    """Each run of report A beside B's run at the same load, with B/A for every metric."""
    print_table(
        Console(width=None if sys.stdout.isatty() else 160),
        bench_report.compare(bench_report.load(a), bench_report.load(b), (a.name, b.name)),
    )


@bench.command("run")
@click.argument("name", required=False)
@click.option("--url", help="Any SGLang-compatible server or router instead of a pdctl cluster.")
@click.option(
    "--api",
    type=click.Choice(APIS),
    default="generate",
    show_default=True,
    help="/generate, /v1/completions or /v1/chat/completions.",
)
@click.option("--model", help="Model name for the OpenAI APIs (default: the server's).")
@click.option("--api-key-env", help="Environment variable holding the API key (default: the cluster's).")
@click.option("--dataset", type=click.Choice(DATASETS), default="random", show_default=True)
@click.option("--dataset-path", type=click.Path(path_type=Path), help="ShareGPT JSON or JSONL file.")
@click.option("--num-prompts", type=int, default=200, show_default=True, help="Requests per load point.")
@click.option("--input-len", type=int, default=256, show_default=True, help="Prompt tokens (random, fixed).")
@click.option(
    "--output-len",
    type=int,
    default=64,
    show_default=True,
    help="Output tokens (every dataset; sharegpt/jsonl: when the file gives none).",
)
@click.option(
    "--range-ratio",
    type=float,
    default=0.0,
    show_default=True,
    help="random: lengths uniform in [len * ratio, len], as bench_serving.",
)
@click.option("--prefix-groups", type=int, default=8, show_default=True, help="shared-prefix: system prompts.")
@click.option("--prefix-len", type=int, default=512, show_default=True, help="shared-prefix: system prompt tokens.")
@click.option("--question-len", type=int, default=64, show_default=True, help="shared-prefix: question tokens.")
@click.option("--request-rate", default="inf", show_default=True, help="Poisson arrivals per second, or inf.")
@click.option("--max-concurrency", default=None, help="Requests in flight at most (closed loop).")
@click.option("--sweep", help="Several load points in one run: rate=1,2,4 or concurrency=1,8,32.")
@click.option("--warmup-requests", type=int, default=0, show_default=True, help="Unmeasured requests first.")
@click.option("--seed", type=int, default=1, show_default=True, help="Seeds the prompts and the arrivals.")
@click.option("--slo-ttft-ms", type=float, help="Goodput: TTFT at most this.")
@click.option("--slo-tpot-ms", type=float, help="Goodput: TPOT at most this.")
@click.option("--slo-e2e-ms", type=float, help="Goodput: end-to-end latency at most this.")
@click.option(
    "--max-error-rate",
    type=float,
    default=0.0,
    show_default=True,
    help="Exit 1 when more than this fraction of a run's requests fail.",
)
@click.option("--timeout-secs", type=float, default=600.0, show_default=True, help="Per request.")
@click.option("--json-out", type=click.Path(path_type=Path), help="Write the report (bench_serving's names).")
@click.option("--plot", type=click.Path(path_type=Path), help="Write latency CDFs (and sweep curves) as PNG.")
@click.option(
    "--server-metrics/--no-server-metrics",
    default=True,
    show_default=True,
    help="With NAME: sample the router's and engines' /metrics during the run.",
)
@click.option("--weights-reload-every", type=float, help="With NAME: reload weights from disk every N seconds.")
@click.option("--weights-path", help="The checkpoint --weights-reload-every loads (a path on the engines' nodes).")
@click.option(
    "--weights-refit",
    type=click.Choice([m.value for m in RefitMode]),
    help="How each reload treats requests in flight: drain or interrupt (default: the topology's weights.refit).",
)
@click.option("--progress/--no-progress", default=None, help="Progress bar (default: when stderr is a terminal).")
def run(name: str | None, **opts) -> None:  # fmt: skip
    """Load-test cluster NAME (its router; default: the only cluster) or --url.

    Measures from the stream: TTFT, inter-token latency, TPOT, end-to-end latency (mean,
    median, p90, p99), request and token throughput, goodput under --slo-*. Token counts are
    checked against the server's. Exit 1 when more than --max-error-rate of a run fails.
    """
    if name and opts["url"]:
        raise click.UsageError("give NAME or --url, not both")
    if opts["num_prompts"] < 1:
        raise click.BadParameter("must be >= 1", param_hint="--num-prompts")
    if opts["weights_reload_every"] is not None and not opts["weights_path"]:
        raise click.UsageError("--weights-reload-every needs --weights-path")
    if opts["plot"]:
        bench_report.check_plotting()  # before the run, not after all its requests
    config, reloader = _config(name, opts)
    progress = opts["progress"] if opts["progress"] is not None else sys.stderr.isatty()
    result = _run(config, reloader, progress)
    out = Console(width=None if sys.stdout.isatty() else 160)
    print_table(out, bench_report.table(result), fold="split")  # load points in groups that fit
    if opts["json_out"]:
        opts["json_out"].write_text(json.dumps(result, indent=1) + "\n")
        out.print(f"report written to {opts['json_out']}")
    if opts["plot"]:
        bench_report.plot(result, opts["plot"])
        out.print(f"plot written to {opts['plot']}")
    worst = max(run["failed"] / max(1, run["num_requests"]) for run in result["runs"])
    if worst > opts["max_error_rate"]:
        errors = "; ".join(f"{bench_report.run_label(r)}: {bench_report._errors(r['errors'])}" for r in result["runs"])
        click.secho(
            f"error: {worst:.1%} of a run's requests failed (--max-error-rate {opts['max_error_rate']:g}): {errors}",
            fg="red",
            err=True,
        )
        sys.exit(1)


def _config(name: str | None, opts: dict) -> tuple[BenchConfig, Reloader | None]:
    metrics: tuple[tuple[str, str], ...] = ()
    reloader = None
    key_env = opts["api_key_env"]
    if opts["url"]:
        url = opts["url"].rstrip("/")
        if opts["weights_reload_every"] is not None:
            raise click.UsageError("--weights-reload-every needs a pdctl cluster NAME (not --url)")
    else:
        store = StateStore()
        state = load_state(store, store.resolve_name(name))
        if not state.router_url:
            raise BenchError(f"cluster {state.name!r} has no router")
        url = state.router_url
        key_env = key_env or state.plan.api_key_env  # the cluster's client key
        if opts["server_metrics"]:
            metrics = _metrics_urls(state)
        if opts["weights_reload_every"] is not None:
            reloader = _reloader(state.name, opts["weights_path"], opts["weights_refit"])
    api_key = None
    if key_env:
        api_key = os.environ.get(key_env)
        if not api_key:
            raise BenchError(f"${key_env} is unset or empty (the API key)")
    config = BenchConfig(
        url=url,
        requests=tuple(_workload(opts)),
        points=_points(opts),
        api=opts["api"],
        model=opts["model"],
        api_key=api_key,
        warmup=opts["warmup_requests"],
        seed=opts["seed"],
        slo=Slo(opts["slo_ttft_ms"], opts["slo_tpot_ms"], opts["slo_e2e_ms"]),
        timeout_secs=opts["timeout_secs"],
        metrics_urls=metrics,
        reload_every_secs=opts["weights_reload_every"],
    )
    return config, reloader


def _metrics_urls(state) -> tuple[tuple[str, str], ...]:
    out = []
    for rec in state.processes.values():
        if rec.role == "router" and rec.url and "metrics" in rec.ports:
            host = rec.url.rsplit(":", 1)[0]
            out.append(("router", f"{host}:{rec.ports['metrics']}"))
        elif rec.role in ("prefill", "decode", "regular") and rec.url and rec.health_path:
            out.append((rec.role, rec.url))
    return tuple(out)


def _reloader(name: str, path: str, refit: str | None) -> Reloader:
    from pdctl.cluster.weights import load_weights

    def reload(n: int) -> dict[str, Any]:
        report = load_weights(name, path, f"bench-reload-{n}", refit=refit)
        return {"refit": report.refit, "transfer_s": report.phases.get("transfer", 0.0)}

    return reload


def _workload(opts: dict) -> list[BenchRequest]:
    n, seed, kind = opts["num_prompts"], opts["seed"], opts["dataset"]
    path = opts["dataset_path"]
    if kind in ("sharegpt", "jsonl") and path is None:
        raise click.UsageError(f"--dataset {kind} needs --dataset-path")
    for flag in ("input_len", "output_len", "prefix_len", "question_len"):
        if opts[flag] < 1:
            raise click.BadParameter("must be >= 1", param_hint=f"--{flag.replace('_', '-')}")
    if kind == "random":
        return random_workload(n, opts["input_len"], opts["output_len"], opts["range_ratio"], seed)
    if kind == "fixed":
        return fixed_workload(n, opts["input_len"], opts["output_len"], seed)
    if kind == "shared-prefix":
        return shared_prefix_workload(
            n, opts["prefix_groups"], opts["prefix_len"], opts["question_len"], opts["output_len"], seed
        )
    if kind == "sharegpt":
        return sharegpt_workload(path, n, None, seed)
    return jsonl_workload(path, n, opts["output_len"])


def _points(opts: dict) -> tuple[LoadPoint, ...]:
    rate = _rate(opts["request_rate"])
    conc = _concurrency(opts["max_concurrency"]) if opts["max_concurrency"] else None
    sweep = _sweep(opts["sweep"])
    if sweep is None:
        return (LoadPoint(rate, conc),)
    kind, values = sweep
    if kind == "rate":
        return tuple(LoadPoint(_rate(v), conc) for v in values)
    return tuple(LoadPoint(rate, _concurrency(v)) for v in values)


def _run(config: BenchConfig, reloader: Reloader | None, show: bool) -> dict:
    if not show:
        return run_bench(config, reloader=reloader)
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=Console(stderr=True), transient=True,
    ) as bar:  # fmt: skip
        tasks: dict[str, TaskID] = {}

        def progress(label: str, done: int, total: int) -> None:
            if label not in tasks:
                tasks[label] = bar.add_task(label, total=total)
            bar.update(tasks[label], completed=done)

        return run_bench(config, reloader=reloader, progress=progress)


COMMANDS = [bench]
