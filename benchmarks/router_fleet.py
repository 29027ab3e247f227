"""The router's CPU per request and its latency as the fleet grows: 4, 256 and 1024 workers (issue 59.3).

router_overhead.py's method (real sockets, the router pinned to the last CPU, one load generator
cycling over targets that are all up at once, medians over slices), with pdctl's router as every
target and only the number of workers changed: each router has N/2 prefills and N/2 decodes,
all null engines answering at once, served by two processes (``pdctl.sim.null --listen N/2``).
What grows with N is all the router does beside requests: the health checks and liveness probes
of its workers, ``/workers`` and the metrics it exports; so the router's process CPU over a
slice, divided by the slice's requests, is the whole cost per request at that size, its loops
included. Each size's p99 latency says whether a health round delays requests.
The routers not in their slice still run their loops on the same CPU (as they would on a node).

    python benchmarks/router_fleet.py [--sizes 4,256,1024] [--modes plain,streamed]
        # writes benchmarks/results/router_fleet.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil
from loadgen import tree_cpu_secs
from router_overhead import (
    CONCURRENCY,
    DURATION,
    PY,
    RESULTS,
    ROOT,
    ROUNDS,
    ROUTER_CPUS,
    STREAM_TOKENS,
    WARM,
    cycle,
    free_port,
    start,
    stop,
    wait,
)

SCRAPES = 20  # /workers and /metrics reads per size, timed from here


def null_fleet(count: int, role: str, into: Path) -> tuple[subprocess.Popen, list[int], int | None]:
    """One null engine process answering on ``count`` ports: (process, ports, bootstrap port)."""
    port_file = into / f"{role}.json"
    argv = [PY, "-m", "pdctl.sim.null", "--port", "0", "--listen", str(count), "--role", role]
    argv += ["--stream-tokens", str(STREAM_TOKENS), "--port-file", str(port_file)]
    if role == "prefill":
        argv += ["--bootstrap-port", "0"]
    proc = start(argv)
    deadline = time.monotonic() + 120
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the null {role} fleet did not start")
        time.sleep(0.1)
    ports = json.loads(port_file.read_text())
    return proc, [ports["port"], *ports.get("more_ports", [])], ports.get("bootstrap_port")


def every_worker_up(url: str, size: int, timeout: float = 300) -> None:
    """Wait until the router has every one of its ``size`` workers in rotation (the startup
    checks over: what is measured after is the steady state)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(url + "/workers", timeout=30) as r:
            workers = json.loads(r.read())["workers"]
        if sum(1 for w in workers if w.get("is_healthy")) == size:
            return
        time.sleep(0.5)
    raise TimeoutError(f"{url}: not every worker up after {timeout:.0f}s")


def cpu_during(pid: int, secs: float) -> float:
    before = tree_cpu_secs(pid)
    time.sleep(secs)
    return tree_cpu_secs(pid) - before


def read_secs(url: str) -> float:
    """Median seconds of SCRAPES reads of ``url``."""
    times = []
    for _ in range(SCRAPES):
        started = time.perf_counter()
        with urllib.request.urlopen(url, timeout=30) as r:
            r.read()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="4,256,1024", help="workers per router (half prefills, half decodes)")
    parser.add_argument("--modes", default="plain,streamed")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    modes = [m.strip() for m in args.modes.split(",")]
    half = max(sizes) // 2
    with tempfile.TemporaryDirectory() as tmp:
        prefills, pports, boot = null_fleet(half, "prefill", Path(tmp))
        decodes, dports, _ = null_fleet(half, "decode", Path(tmp))
        runs: dict[tuple[str, int], list[dict]] = {}
        idle: dict[int, float] = {}
        scrape: dict[int, dict[str, float]] = {}
        try:
            for mode in modes:
                routers: list[tuple[int, str, subprocess.Popen]] = []
                try:
                    for size in sizes:
                        argv = [PY, "-m", "pdctl", "router", "--port", str(port := free_port()), "--pd-disaggregation"]
                        for p in pports[: size // 2]:
                            argv += ["--prefill", f"http://127.0.0.1:{p}", str(boot)]
                        for p in dports[: size // 2]:
                            argv += ["--decode", f"http://127.0.0.1:{p}"]
                        argv += ["--policy", "round_robin", "--log-level", "error"]
                        proc = start(argv, ROUTER_CPUS)
                        routers.append((size, f"http://127.0.0.1:{port}", proc))
                    for size, url, _ in routers:
                        wait(url + "/readiness", timeout=300)
                        every_worker_up(url, size)
                    if mode == modes[0]:
                        for size, url, proc in routers:  # idle: what the loops alone cost
                            idle[size] = cpu_during(proc.pid, 10.0) / 10.0
                            scrape[size] = {"workers_s": read_secs(url + "/workers"),
                                            "metrics_s": read_secs(url + "/metrics")}  # fmt: skip
                    targets = [(f"{size} workers", url + "/generate", proc.pid) for size, url, proc in routers]
                    for row in cycle(targets, mode == "streamed"):
                        row.update(mode=mode, router_cpu_us_per_req=row["cpu_secs"] / row["requests"] * 1e6)
                        runs.setdefault((mode, int(row["target"].split()[0])), []).append(row)
                finally:
                    stop(*(proc for _, _, proc in routers))
        finally:
            stop(prefills, decodes)
    report(sizes, modes, runs, idle, scrape)


def report(
    sizes: list[int],
    modes: list[str],
    runs: dict[tuple[str, int], list[dict]],
    idle: dict[int, float],
    scrape: dict[int, dict[str, float]],
) -> None:
    base = sizes[0]
    rows = []
    lines = [
        f"| mode | workers | req/s | p50 ms | p99 ms | router CPU us/req | vs {base} (median of rounds) | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode in modes:
        for size in sizes:
            rs = runs[(mode, size)]
            ratios = [
                r["router_cpu_us_per_req"] / b["router_cpu_us_per_req"]
                for r, b in zip(rs, runs[(mode, base)], strict=True)
            ]
            row = {
                "mode": mode,
                "workers": size,
                "rps": statistics.median(r["rps"] for r in rs),
                "p50_ms": statistics.median(r["p50_ms"] for r in rs),
                "p99_ms": statistics.median(r["p99_ms"] for r in rs),
                "router_cpu_us_per_req": statistics.median(r["router_cpu_us_per_req"] for r in rs),
                "cpu_ratio_vs_base": statistics.median(ratios),
                "cpu_ratio_per_round": ratios,
                "errors": sum(r["errors"] for r in rs),
            }
            rows.append(row)
            lines.append(
                f"| {mode} | {size} | {row['rps']:.0f} | {row['p50_ms']:.1f} | {row['p99_ms']:.1f} "
                f"| {row['router_cpu_us_per_req']:.0f} | {row['cpu_ratio_vs_base']:.2f}x | {row['errors']} |"
            )
    lines += ["", "| workers | idle router CPU (s per s: its loops) | GET /workers ms | GET /metrics ms |"]
    lines.append("|---|---|---|---|")
    for size in sizes:
        ms = {k: v * 1e3 for k, v in scrape[size].items()}
        lines.append(f"| {size} | {idle[size]:.3f} | {ms['workers_s']:.1f} | {ms['metrics_s']:.1f} |")
    git = ["git", "-C", str(ROOT.parent), "rev-parse", "--short", "HEAD"]
    head = subprocess.run(git, capture_output=True, text=True)
    meta = {
        "machine": platform.machine(),
        "cpus": psutil.cpu_count(),
        "python": platform.python_version(),
        "rounds": ROUNDS,
        "slice_counted_s": DURATION,
        "slice_warm_s": WARM,
        "concurrency": CONCURRENCY,
        "head": head.stdout.strip(),
        "router_cpus": sorted(ROUTER_CPUS),
        "pid": os.getpid(),
    }
    lines += [
        "",
        f"All routers up at once over the same null workers, {ROUNDS} cycles of a slice each ({WARM:g} s warm-up, "
        f"{DURATION:g} s counted), closed loop at concurrency {CONCURRENCY}, at {meta['head']}; CPU per request "
        "is the router process's over the slice (its health and liveness loops included) divided by its requests.",
    ]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "router_fleet.json").write_text(
        json.dumps({"meta": meta, "rows": rows, "idle_cpu": idle, "scrape": scrape}, indent=2)
    )
    (RESULTS / "router_fleet.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
