"""The report of a run: a table, a side-by-side comparison of two runs, plots."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rich.table import Table

from pdctl.bench.runner import BenchError

ROWS = (
    ("completed", "completed", "{:.0f}"),
    ("failed", "failed", "{:.0f}"),
    ("duration", "duration (s)", "{:.2f}"),
    ("request_throughput", "requests/s", "{:.2f}"),
    ("output_throughput", "output tokens/s", "{:.1f}"),
    ("total_throughput", "total tokens/s", "{:.1f}"),
    ("request_goodput", "goodput (req/s)", "{:.2f}"),
    ("mean_ttft_ms", "TTFT mean (ms)", "{:.1f}"),
    ("median_ttft_ms", "TTFT median (ms)", "{:.1f}"),
    ("p90_ttft_ms", "TTFT p90 (ms)", "{:.1f}"),
    ("p99_ttft_ms", "TTFT p99 (ms)", "{:.1f}"),
    ("mean_itl_ms", "ITL mean (ms)", "{:.2f}"),
    ("median_itl_ms", "ITL median (ms)", "{:.2f}"),
    ("p90_itl_ms", "ITL p90 (ms)", "{:.2f}"),
    ("p99_itl_ms", "ITL p99 (ms)", "{:.2f}"),
    ("mean_tpot_ms", "TPOT mean (ms)", "{:.2f}"),
    ("median_tpot_ms", "TPOT median (ms)", "{:.2f}"),
    ("p99_tpot_ms", "TPOT p99 (ms)", "{:.2f}"),
    ("mean_e2e_latency_ms", "E2E mean (ms)", "{:.1f}"),
    ("median_e2e_latency_ms", "E2E median (ms)", "{:.1f}"),
    ("p90_e2e_latency_ms", "E2E p90 (ms)", "{:.1f}"),
    ("p99_e2e_latency_ms", "E2E p99 (ms)", "{:.1f}"),
    ("concurrency", "mean concurrency", "{:.1f}"),
    ("output_token_mismatches", "output count != asked", "{:.0f}"),
)


def run_label(run: dict[str, Any]) -> str:
    conc = run.get("max_concurrency")
    return f"rate {run['request_rate']}" + (f", conc {conc}" if conc else "")


def table(report: dict[str, Any]) -> Table:
    runs = report["runs"]
    out = Table(title=f"pdctl bench {report['url']} ({report['api']}, {report['num_prompts']} requests per run)")
    out.add_column("metric")
    for run in runs:
        out.add_column(run_label(run), justify="right")
    for key, label, fmt in ROWS:
        if any(key in run for run in runs):
            out.add_row(label, *(fmt.format(run[key]) if key in run else "-" for run in runs))
    out.add_row("errors", *(_errors(run.get("errors", {})) for run in runs))
    versions = [run.get("weight_versions") for run in runs]
    if any(versions):
        out.add_row("weight versions", *(", ".join(f"{k}: {v}" for k, v in (w or {}).items()) for w in versions))
    for role in sorted({r for run in runs for r in run.get("server", {}) if r != "unreachable"}):
        keys = sorted({k for run in runs for k in run.get("server", {}).get(role, {}) if k != "samples"})
        for key in keys:
            out.add_row(f"{role} {key}", *(_num(run.get("server", {}).get(role, {}).get(key)) for run in runs))
    stalls = [run.get("refit_stall") for run in runs]
    if any(stalls):
        out.add_row(
            "weight updates (refit)",
            *(
                f"{st['updates']} ({st['refit']}): wall max {st['max_update_wall_ms']:.0f} ms, longest token gap "
                f"{st['max_stream_gap_ms']:.0f} ms, TTFT of {st['arrived_during_update']} sent meanwhile p99 "
                f"{st['p99_ttft_arrived_during_update_ms']:.0f} ms"
                if st
                else "-"
                for st in stalls
            ),
        )
    for run_i, run in enumerate(runs):
        windows = run.get("push_windows")
        if not windows:
            continue
        for side in ("inside", "outside"):
            w = windows[side]
            out.add_row(
                f"[run {run_i + 1}] {side} pushes",
                *(
                    f"{w['requests']} req, {w['failed']} failed, TTFT p99 {w['p99_ttft_ms']:.1f} ms, "
                    f"E2E p99 {w['p99_e2e_latency_ms']:.1f} ms"
                    if i == run_i
                    else ""
                    for i in range(len(runs))
                ),
            )
    return out


def _errors(errors: dict[str, int]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(errors.items())) or "none"


def _num(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if isinstance(value, float) and not value.is_integer() else f"{value:g}"


def load(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BenchError(f"{path}: cannot read a bench report: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list) or not data["runs"]:
        raise BenchError(f"{path}: not a `pdctl bench --json-out` report (no runs)")
    return data


def _load_of(run: dict[str, Any]) -> tuple[str, str]:
    return str(run.get("request_rate")), str(run.get("max_concurrency"))


def compare(a: dict[str, Any], b: dict[str, Any], names: tuple[str, str]) -> Table:
    """Each run of A beside B's run at the same load (request rate and concurrency), with B/A
    for every metric both have; runs whose load only one report has are named in the caption."""
    out = Table(title=f"{names[0]} (A) vs {names[1]} (B)")
    out.add_column("run")
    out.add_column("metric")
    out.add_column("A", justify="right")
    out.add_column("B", justify="right")
    out.add_column("B/A", justify="right")
    b_runs = {_load_of(run): run for run in b["runs"]}
    pairs = [(ra, b_runs[_load_of(ra)]) for ra in a["runs"] if _load_of(ra) in b_runs]
    for i, (ra, rb) in enumerate(pairs):
        for key, label, fmt in ROWS:
            if key not in ra or key not in rb:
                continue
            va, vb = float(ra[key]), float(rb[key])
            ratio = f"{vb / va:.2f}x" if va else "-"
            out.add_row(f"{i + 1}: {run_label(ra)}" if key == "completed" else "", label, fmt.format(va),
                        fmt.format(vb), ratio)  # fmt: skip
    a_loads = {_load_of(run) for run in a["runs"]}
    alone = [f"A {run_label(r)}" for r in a["runs"] if _load_of(r) not in b_runs] + [
        f"B {run_label(r)}" for r in b["runs"] if _load_of(r) not in a_loads
    ]
    if alone:
        out.caption = f"runs at a load only one report has (not compared): {', '.join(alone)}"
    return out


def check_plotting() -> None:
    """BenchError unless matplotlib can be imported: checked before any request is sent."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise BenchError("--plot needs matplotlib (pip install 'pdctl[bench]'); nothing was sent")


def plot(report: dict[str, Any], path: Path) -> None:
    """Latency CDFs of every run; for a sweep also throughput and latency against the load."""
    check_plotting()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    sweep = len(runs) > 1
    fig, axes = plt.subplots(1, 4 if sweep else 2, figsize=(18 if sweep else 10, 4))
    for run in runs:
        done = [r for r in run["requests"] if r["ok"]]
        for ax, key in zip(axes[:2], ("ttft_ms", "e2e_ms"), strict=True):
            values = sorted(r[key] for r in done)
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=run_label(run))
    for ax, title in zip(axes[:2], ("TTFT CDF", "E2E latency CDF"), strict=True):
        ax.set(title=title, xlabel="ms", ylabel="fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if sweep:
        xs, xlabel = _sweep_axis(runs)
        axes[2].plot(xs, [r["request_throughput"] for r in runs], "o-", label="requests/s")
        if any("request_goodput" in r for r in runs):  # only with --slo-*: no legend entry without a line
            axes[2].plot(xs, [r.get("request_goodput", math.nan) for r in runs], "s--", label="goodput")
        axes[2].set(title="throughput", xlabel=xlabel, ylabel="requests/s")
        for key, style in (
            ("median_ttft_ms", "o-"),
            ("p99_ttft_ms", "o--"),
            ("median_itl_ms", "s-"),
            ("p99_itl_ms", "s--"),
        ):
            axes[3].plot(xs, [r[key] for r in runs], style, label=key)
        axes[3].set(title="latency", xlabel=xlabel, ylabel="ms", yscale="log")
        for ax in axes[2:]:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(f"pdctl bench {report['url']} ({report['api']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _sweep_axis(runs: list[dict[str, Any]]) -> tuple[list[float], str]:
    rates = [r["request_rate"] for r in runs]
    if len(set(map(str, rates))) > 1:
        return [math.inf if r == "inf" else float(r) for r in rates], "request rate (req/s)"
    return [float(r.get("max_concurrency") or 0) for r in runs], "max concurrency"
