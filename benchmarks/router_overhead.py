"""Router cost per request, side by side in one run, on the same null backends.

Targets (closed loop, concurrency 64, /generate): the decode backend directly; pdctl router
in PD mode; sglang-router 0.3.2 (Rust) in PD mode with round_robin; sglang-router's Python
MiniLB (--mini-lb). Each target runs ROUNDS times, interleaved, and the median is kept.
With two or more CPUs the router under test is pinned to the last CPU and the load generator
and backends to the others, so that they do not take turns on the router's core (unpinned,
the CPU-per-request figures of every router swung by +-40% from run to run here).
Reported: req/s, p50/p99 latency, and the router's CPU microseconds per request (psutil,
user+system over the router's process tree during the measured window).

    python benchmarks/router_overhead.py   # writes benchmarks/results/router_overhead.{json,md}
    python benchmarks/router_overhead.py --baseline REF   # adds pdctl's router as of git REF
        # (a worktree), writes router_overhead_vs_REF.{json,md}: this tree against an older one
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
PY = sys.executable
DURATION = float(os.environ.get("ROUTER_BENCH_DURATION", 8.0))
CONCURRENCY = 64
ROUNDS = int(os.environ.get("ROUTER_BENCH_ROUNDS", 5))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(url)


CPUS = sorted(os.sched_getaffinity(0))
ROUTER_CPUS = {CPUS[-1]} if len(CPUS) > 1 else set(CPUS)
OTHER_CPUS = set(CPUS[:-1]) if len(CPUS) > 1 else set(CPUS)


def start(argv: list[str], cpus: set[int] = OTHER_CPUS, cwd: Path | None = None) -> subprocess.Popen:
    """Start ``argv`` pinned to ``cpus``; with ``cwd``, ``python -m pdctl`` imports the pdctl found there."""
    return subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=lambda: os.sched_setaffinity(0, cpus),
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(cwd)} if cwd else None,
    )


def checkout(ref: str, into: Path) -> Path:
    """A detached worktree of this repository at ``ref`` (removed by ``remove_checkout``)."""
    repo = ROOT.parent
    subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", str(into), ref], check=True)
    return into


def remove_checkout(path: Path) -> None:
    subprocess.run(["git", "-C", str(ROOT.parent), "worktree", "remove", "--force", str(path)], check=False)


def cpu_secs(proc: subprocess.Popen) -> float:
    try:
        root = psutil.Process(proc.pid)
        total = 0.0
        for p in [root, *root.children(recursive=True)]:
            t = p.cpu_times()
            total += t.user + t.system
        return total
    except psutil.Error:
        return 0.0


def _pin_to_others() -> None:
    os.sched_setaffinity(0, OTHER_CPUS)


def measure(name: str, url: str, router: subprocess.Popen | None) -> dict:
    loadgen = [PY, str(ROOT / "loadgen.py"), url]
    subprocess.run(
        [*loadgen, "--concurrency", "8", "--duration", "1"], capture_output=True, check=True, preexec_fn=_pin_to_others
    )  # warm-up
    before = cpu_secs(router) if router else 0.0
    out = subprocess.run(
        [*loadgen, "--concurrency", str(CONCURRENCY), "--duration", str(DURATION)],
        capture_output=True,
        text=True,
        check=True,
        preexec_fn=_pin_to_others,
    )
    used = (cpu_secs(router) - before) if router else 0.0
    row = json.loads(out.stdout)
    row.update(
        target=name, router_cpu_us_per_req=(used / row["requests"] * 1e6) if router and row["requests"] else None
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", metavar="REF", help="also run pdctl's router as of this git ref")
    args = parser.parse_args()
    baseline_dir = checkout(args.baseline, Path(tempfile.mkdtemp()) / "baseline") if args.baseline else None
    try:
        run(args.baseline, baseline_dir)
    finally:
        if baseline_dir:
            remove_checkout(baseline_dir)


def run(baseline: str | None, baseline_dir: Path | None) -> None:
    prefill_port, boot_port, decode_port = free_port(), free_port(), free_port()
    backends = [
        start(
            [
                PY,
                "-m",
                "pdctl.sim.null",
                "--port",
                str(prefill_port),
                "--role",
                "prefill",
                "--bootstrap-port",
                str(boot_port),
            ]
        ),
        start([PY, "-m", "pdctl.sim.null", "--port", str(decode_port), "--role", "decode"]),
    ]
    prefill, decode = f"http://127.0.0.1:{prefill_port}", f"http://127.0.0.1:{decode_port}"
    wait(prefill + "/health")
    wait(decode + "/health")

    # the same workers and policy for both routers
    pd_workers = ["--pd-disaggregation", "--prefill", prefill, str(boot_port), "--decode", decode]
    pd_workers += ["--policy", "round_robin"]

    def pdctl_router(port: int) -> list[str]:
        return [
            PY,
            "-m",
            "pdctl",
            "router",
            "--port",
            str(port),
            *pd_workers,
            "--log-level",
            "error",
        ]

    def sglang_router(port: int, mini: bool = False) -> list[str]:
        argv = [
            PY,
            "-m",
            "sglang_router.launch_router",
            *pd_workers,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prometheus-port",
            str(free_port()),
            "--log-level",
            "error",
        ]
        return [*argv, "--mini-lb"] if mini else argv

    targets: dict[str, Callable[[int], list[str]] | None] = {
        "direct to decode": None,
        "pdctl router (PD)": pdctl_router,
        "sglang-router 0.3.2 (PD, Rust)": sglang_router,
        "MiniLB (sglang-router --mini-lb)": lambda port: sglang_router(port, mini=True),
    }
    old_name = f"pdctl router at {baseline} (PD)"
    if baseline_dir:  # the old tree's code, this environment's packages
        targets[old_name] = pdctl_router
    runs: dict[str, list[dict]] = {name: [] for name in targets}
    try:
        for _ in range(ROUNDS):
            for name, make in targets.items():
                if make is None:
                    runs[name].append(measure(name, decode + "/generate", None))
                    continue
                port = free_port()
                proc = start(make(port), ROUTER_CPUS, baseline_dir if name == old_name else None)
                try:
                    wait(f"http://127.0.0.1:{port}/health")
                    time.sleep(1.0)
                    runs[name].append(measure(name, f"http://127.0.0.1:{port}/generate", proc))
                finally:
                    proc.terminate()
                    proc.wait(timeout=30)
    finally:
        for b in backends:
            b.terminate()
            b.wait(timeout=30)
    rows = []
    for rs in runs.values():
        best = sorted(rs, key=lambda r: r["rps"])[len(rs) // 2]  # the median run by req/s
        cpu = [r["router_cpu_us_per_req"] for r in rs if r["router_cpu_us_per_req"] is not None]
        rows.append({**best, "router_cpu_us_per_req": statistics.median(cpu) if cpu else None, "all_runs": rs})
    by = {r["target"]: r for r in rows}
    pd, rust, mini = (
        by["pdctl router (PD)"],
        by["sglang-router 0.3.2 (PD, Rust)"],
        by["MiniLB (sglang-router --mini-lb)"],
    )
    per_round = [
        a["router_cpu_us_per_req"] / b["router_cpu_us_per_req"]
        for a, b in zip(pd["all_runs"], rust["all_runs"], strict=True)
    ]
    ratios = {
        "pdctl_cpu_per_req_vs_sglang_router": pd["router_cpu_us_per_req"] / rust["router_cpu_us_per_req"],
        "pdctl_cpu_per_req_vs_sglang_router_per_round": per_round,
        "pdctl_rps_vs_minilb": pd["rps"] / mini["rps"],
        "pdctl_rps_vs_sglang_router": pd["rps"] / rust["rps"],
    }
    if baseline:
        old = by[old_name]
        per_round_old = [
            a["router_cpu_us_per_req"] / b["router_cpu_us_per_req"]
            for a, b in zip(pd["all_runs"], old["all_runs"], strict=True)
        ]
        ratios["pdctl_cpu_per_req_vs_baseline"] = pd["router_cpu_us_per_req"] / old["router_cpu_us_per_req"]
        ratios["pdctl_cpu_per_req_vs_baseline_per_round"] = per_round_old
        ratios["pdctl_rps_vs_baseline"] = pd["rps"] / old["rps"]
        ratios["pdctl_p99_vs_baseline"] = pd["p99_ms"] / old["p99_ms"]
    RESULTS.mkdir(exist_ok=True)
    meta = {
        "machine": platform.machine(),
        "cpus": psutil.cpu_count(),
        "python": platform.python_version(),
        "duration_s": DURATION,
        "concurrency": CONCURRENCY,
        "rounds": ROUNDS,
        "baseline": baseline,
        "head": subprocess.run(
            ["git", "-C", str(ROOT.parent), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
    }
    stem = f"router_overhead_vs_{baseline}".replace("/", "_") if baseline else "router_overhead"
    (RESULTS / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows, "ratios": ratios}, indent=2))
    lines = ["| target | req/s | p50 ms | p99 ms | router CPU us/req | errors |", "|---|---|---|---|---|---|"]
    for r in rows:
        cpu = f"{r['router_cpu_us_per_req']:.0f}" if r["router_cpu_us_per_req"] else "-"
        lines.append(
            f"| {r['target']} | {r['rps']:.0f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {cpu} | {r['errors']} |"
        )
    lines += [
        "",
        f"pdctl CPU per request / sglang-router's: {ratios['pdctl_cpu_per_req_vs_sglang_router']:.2f}x (goal <= 1.5x)",
        f"same ratio within each round: {', '.join(f'{r:.2f}x' for r in per_round)}",
        f"pdctl req/s / MiniLB's: {ratios['pdctl_rps_vs_minilb']:.2f}x (goal >= 3x)",
        f"pdctl req/s / sglang-router's: {ratios['pdctl_rps_vs_sglang_router']:.2f}x",
        f"\nMedian of {ROUNDS} interleaved rounds, {DURATION:g} s each, closed loop at concurrency {CONCURRENCY}; "
        f"the router runs on CPU {sorted(ROUTER_CPUS)}, load generator and backends on {sorted(OTHER_CPUS)}.",
    ]
    if baseline:
        lines[-1:-1] = [
            f"pdctl (this tree, {meta['head']}) CPU per request / at {baseline}: "
            f"{ratios['pdctl_cpu_per_req_vs_baseline']:.2f}x",
            f"same ratio within each round: {', '.join(f'{r:.2f}x' for r in per_round_old)}",
            f"pdctl req/s / at {baseline}: {ratios['pdctl_rps_vs_baseline']:.2f}x; "
            f"p99 / at {baseline}: {ratios['pdctl_p99_vs_baseline']:.2f}x",
        ]
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
