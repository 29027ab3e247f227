"""PD against co-located serving on the sim's latency model, measured with `pdctl bench`.

Two fleets of two sim engines each, behind pdctl's router, with the same latency model
(PREFILL_MS per prompt token, DECODE_MS per batched decode step): co-located (two regular
engines: each prefills and decodes, so a prefill stalls that engine's decode batch) and PD
(one prefill, one decode: decode steps never wait for a prefill). One Poisson rate sweep
each, the same seeded workload. This is the sim's model, not a GPU measurement: it shows the
shape of the trade (ITL against TTFT), not real figures.

    python benchmarks/pd_vs_colocated.py

writes benchmarks/results/pd_vs_colocated.{json,md} and docs/pd_vs_colocated.png.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from router_overhead import free_port, wait

from pdctl.bench import BenchConfig, LoadPoint, run_bench
from pdctl.bench.workloads import random_workload

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
DOCS = ROOT.parent / "docs"
PY = sys.executable
PREFILL_MS = 0.4
DECODE_MS = 15.0
INPUT_LEN, OUTPUT_LEN = 512, 48
RATES = (1.0, 2.0, 4.0, 6.0)
REQUESTS = 60
LATENCY = ["--sim-prefill-ms-per-token", str(PREFILL_MS), "--sim-decode-ms-per-step", str(DECODE_MS)]


def start(argv: list[str], url: str) -> subprocess.Popen:
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait(url + "/health", timeout=120)
    return proc


def fleet(kind: str) -> tuple[str, list[subprocess.Popen]]:
    procs, router_args = [], []
    roles = ("prefill", "decode") if kind == "pd" else ("null", "null")
    for role in roles:
        port = free_port()
        argv = [PY, "-m", "pdctl.sim", "--model-path", "sim://tiny", "--port", str(port), *LATENCY]
        if role != "null":
            argv += ["--disaggregation-mode", role]
        if role == "prefill":
            boot = free_port()
            argv += ["--disaggregation-bootstrap-port", str(boot)]
            router_args += ["--prefill", f"http://127.0.0.1:{port}", str(boot)]
        elif role == "decode":
            router_args += ["--decode", f"http://127.0.0.1:{port}"]
        else:
            router_args += ["--worker-urls", f"http://127.0.0.1:{port}"]
        procs.append(start(argv, f"http://127.0.0.1:{port}"))
    port = free_port()
    mode = ["--pd-disaggregation"] if kind == "pd" else []
    router = [PY, "-m", "pdctl", "router", "--port", str(port), "--policy", "round_robin", *mode, *router_args]
    procs.append(start(router, f"http://127.0.0.1:{port}"))
    return f"http://127.0.0.1:{port}", procs


def main() -> None:
    RESULTS.mkdir(exist_ok=True)
    DOCS.mkdir(exist_ok=True)
    requests = tuple(random_workload(REQUESTS, INPUT_LEN, OUTPUT_LEN, 0.5, seed=7))
    out: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "prefill_ms_per_token": PREFILL_MS,
                 "decode_ms_per_step": DECODE_MS, "input_len": INPUT_LEN, "output_len": OUTPUT_LEN,
                 "requests_per_rate": REQUESTS, "fleets": {}}  # fmt: skip
    for kind in ("colocated", "pd"):
        url, procs = fleet(kind)
        try:
            config = BenchConfig(url=url, requests=requests, points=tuple(LoadPoint(r) for r in RATES), warmup=2)
            report = run_bench(config)
        finally:
            for p in procs:
                p.terminate()
                p.wait(timeout=20)
        keys = ("request_rate", "completed", "request_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms",
                "p99_itl_ms", "median_e2e_latency_ms")  # fmt: skip
        out["fleets"][kind] = [{k: run[k] for k in keys} for run in report["runs"]]
        print(kind, json.dumps(out["fleets"][kind]), flush=True)
    (RESULTS / "pd_vs_colocated.json").write_text(json.dumps(out, indent=1) + "\n")
    lines = [
        "# PD vs co-located serving on the sim's latency model",
        "",
        f"{out['date']}; two engines per fleet behind pdctl's router; {PREFILL_MS} ms per prompt token, "
        f"{DECODE_MS} ms per decode step; prompts {INPUT_LEN // 2}-{INPUT_LEN} tokens, outputs "
        f"{OUTPUT_LEN // 2}-{OUTPUT_LEN}; {REQUESTS} Poisson requests per rate. Simulation, not GPU measurement.",
        "",
        "| fleet | rate (req/s) | completed | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | E2E p50 (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for kind, runs in out["fleets"].items():
        for r in runs:
            lines.append(
                f"| {kind} | {r['request_rate']} | {r['completed']} "
                f"| {r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} "
                f"| {r['median_itl_ms']:.1f} / {r['p99_itl_ms']:.1f} | {r['median_e2e_latency_ms']:.0f} |"
            )
    (RESULTS / "pd_vs_colocated.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(out, DOCS / "pd_vs_colocated.png")


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for kind, runs in out["fleets"].items():
        rates = [math.inf if r["request_rate"] == "inf" else float(r["request_rate"]) for r in runs]
        axes[0].plot(rates, [r["p99_itl_ms"] for r in runs], "o-", label=f"{kind} p99")
        axes[0].plot(rates, [r["median_itl_ms"] for r in runs], "o--", label=f"{kind} p50")
        axes[1].plot(rates, [r["p99_ttft_ms"] for r in runs], "o-", label=f"{kind} p99")
        axes[1].plot(rates, [r["median_ttft_ms"] for r in runs], "o--", label=f"{kind} p50")
    axes[0].set(title="inter-token latency", xlabel="request rate (req/s)", ylabel="ms")
    axes[1].set(title="time to first token", xlabel="request rate (req/s)", ylabel="ms", yscale="log")
    # plain milliseconds on the log axis (matplotlib's default labels read 2x10^2, 3x10^2, ...)
    ttfts = [r[k] for runs in out["fleets"].values() for r in runs for k in ("median_ttft_ms", "p99_ttft_ms")]
    ticks = [t for t in (10, 20, 50, 100, 150, 200, 300, 500, 700, 1000, 2000, 5000, 10000)
             if min(ttfts) / 1.3 <= t <= max(ttfts) * 1.3]  # fmt: skip
    axes[1].set_yticks(ticks, [str(t) for t in ticks])
    axes[1].yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"PD vs co-located on the sim ({out['prefill_ms_per_token']} ms/prompt token, "
                 f"{out['decode_ms_per_step']} ms/decode step)")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    if sys.argv[1:] == ["--plot-only"]:  # redraw the figure from the committed results
        plot(json.loads((RESULTS / "pd_vs_colocated.json").read_text()), DOCS / "pd_vs_colocated.png")
    else:
        main()
