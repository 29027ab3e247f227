"""up + down wall time for 1 to 32 test hosts with 4 engines each (2 prefill + 2 decode per
host, router on the first), over real SSH to network-namespace hosts.

Besides the totals, pdctl's own overhead is separated from the engines' start: overhead =
(preflight until the first spawn) + (last engine healthy until up returns). With ``--engine
sim`` every engine imports torch, and on this 2-core machine their start grows with their
number (CPU contention, not pdctl); the null engine (``args: {sim-null: true}``, the default
here) starts in a fraction of a second, so what grows is pdctl's.

    sudo .venv/bin/python benchmarks/lifecycle_scale.py [--engine null|sim] [--sizes 1,2,4,8,16,32]
        # needs root (ip netns), sshd; writes results/lifecycle_scale.{json,md} (sim: lifecycle_scale_sim)
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

import psutil
import yaml

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from pdctl.cluster import StateStore, down, up  # noqa: E402
from pdctl.plan import make_plan  # noqa: E402
from pdctl.topology import load_topology_text  # noqa: E402
from tests.netns import TestHosts, netns_unavailable  # noqa: E402

RESULTS = ROOT / "results"
SIZES = (1, 2, 4, 8, 16, 32)


def measure(hosts: TestHosts, n: int, home: Path, engine: str) -> dict:
    names = [h.name for h in hosts.hosts[:n]]
    args = {"sim-null": True} if engine == "null" else {}
    data = {
        "name": f"scale{n}",
        "model": {"path": "sim://tiny"},
        "engine": "sim",
        "nodes": [hosts.node(i) for i in range(n)],
        "ports": {"base": 25000},
        "prefill": {"replicas": 2 * n, "tp": 1, "nodes": names, "args": args},
        "decode": {"replicas": 2 * n, "tp": 1, "nodes": names, "args": args},
        "router": {"host": "0.0.0.0", "allow_unauthenticated": True},
    }
    top, _ = load_topology_text(yaml.safe_dump(data))
    plan = make_plan(top)
    marks: dict[str, float] = {}

    def events(process: str, message: str) -> None:
        now = time.monotonic()
        if message == "starting":
            marks.setdefault("first_spawn", now)
        if message == "healthy" and process != "router":
            marks["last_engine_healthy"] = now

    store = StateStore(home)
    m0, c0, t0 = machine_cpu(), control_cpu(), time.monotonic()
    up(top, plan, store=store, events=events, ready_timeout_secs=600)
    m1, c1, t1 = machine_cpu(), control_cpu(), time.monotonic()
    down(top.name, store=store, purge=True)
    m2, c2, t2 = machine_cpu(), control_cpu(), time.monotonic()
    overhead = (marks["first_spawn"] - t0) + (t1 - marks["last_engine_healthy"])
    return {
        "hosts": n,
        "engines": 4 * n,
        "up_s": t1 - t0,
        "down_s": t2 - t1,
        "total_s": t2 - t0,
        "engines_start_s": marks["last_engine_healthy"] - marks["first_spawn"],
        "pdctl_overhead_s": overhead,
        "control_cpu_up_s": c1 - c0,
        "control_cpu_down_s": c2 - c1,
        "machine_busy_up": (m1 - m0) / (t1 - t0),
        "machine_busy_down": (m2 - m1) / (t2 - t1),
    }


def machine_cpu() -> float:
    """CPU seconds the whole machine spent (every process, every core): divided by the wall
    time, how many cores were busy (the test hosts share this machine's)."""
    times = psutil.cpu_times()
    return times.user + times.system + getattr(times, "nice", 0.0)


def control_cpu() -> float:
    """CPU seconds of this process, every thread: what the control machine pays (SSH clients,
    planning, state); the nodes' agents, supervisors and engines are other processes."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["null", "sim"], default="null")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    reason = netns_unavailable()
    if reason:
        sys.exit(f"cannot run: {reason}")
    tmp = Path(tempfile.mkdtemp(prefix="pdctl-scale-"))
    hosts = TestHosts(max(sizes), tmp).start()
    try:
        rows = [measure(hosts, n, tmp / f"home{n}", args.engine) for n in sizes]
    finally:
        hosts.close()
    base = rows[0]
    for r in rows:
        r["total_vs_1_host"] = r["total_s"] / base["total_s"]
        r["overhead_vs_1_host"] = r["pdctl_overhead_s"] / base["pdctl_overhead_s"]
    RESULTS.mkdir(exist_ok=True)
    meta = {
        "machine": platform.machine(),
        "python": platform.python_version(),
        "engine": args.engine,
        "note": "2 CPU cores for all hosts",
    }
    null = args.engine == "null"
    stem = "lifecycle_scale" if null else "lifecycle_scale_sim"
    (RESULTS / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [
        "| hosts | engines | up (s) | down (s) | total (s) | x 1 host | engines' start (s) | pdctl overhead (s) "
        "| control CPU up / down (s) | cores busy up / down |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['hosts']} | {r['engines']} | {r['up_s']:.1f} | {r['down_s']:.1f} | {r['total_s']:.1f} | "
            f"{r['total_vs_1_host']:.2f} | {r['engines_start_s']:.1f} | {r['pdctl_overhead_s']:.2f} "
            f"| {r['control_cpu_up_s']:.1f} / {r['control_cpu_down_s']:.1f} "
            f"| {r['machine_busy_up']:.2f} / {r['machine_busy_down']:.2f} |"
        )
    last = rows[-1]
    lines += [
        "",
        f"Engine: {args.engine}"
        + (" (`args: {sim-null: true}`: no model, no torch)." if args.engine == "null" else "."),
        f"Goal 1 (1 -> {last['hosts']} hosts grows < 1.5x): total {last['total_vs_1_host']:.2f}x, "
        f"pdctl overhead {last['overhead_vs_1_host']:.2f}x.",
        f"Goal 2 (pdctl overhead < 2 s beyond the slowest engine's start): max "
        f"{max(r['pdctl_overhead_s'] for r in rows):.2f} s; `down` at most {max(r['down_s'] for r in rows):.1f} s.",
        "All hosts share this machine's 2 CPU cores, so the engines' start grows with their count; on real "
        "nodes each host has its own CPUs.",
    ]
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
