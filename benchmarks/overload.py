"""Goodput past capacity, pdctl's router side by side with smg 1.13.0 in front of the same sims.

Fleet: 2 prefill + 2 decode sims, ``--max-running-requests 8`` each, so the fleet runs 16
requests at once (its capacity); a simulated 4 ms per decode step and 32 output tokens per
request keep a request on a decode for a while. Offered load: closed loop at 1x, 2x, 5x and
10x that capacity (16, 32, 80, 160 concurrent clients), DURATION seconds per step. Both
routers run round_robin; at each step pdctl's router and smg run one after the other (smg is
started fresh for its run). Reported per step: goodput (completed requests/s), p50/p99
latency, errors.

Goals (the overload issue): goodput at 10x >= 0.95x goodput at 1x, 0 errors, and at least
smg's goodput at every step.

    python benchmarks/overload.py   # writes benchmarks/results/overload.{json,md}
    SMG_PYTHON=/path/to/venv/bin/python   # smg's interpreter (default: the real-clients venv)
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import run
from router_overhead import free_port, wait

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
PY = sys.executable
SLOTS = 8
CAPACITY = 2 * SLOTS
MULTIPLES = [1, 2, 5, 10]
DURATION = float(os.environ.get("OVERLOAD_DURATION", 10))
SMG_PYTHON = os.environ.get("SMG_PYTHON", "/tmp/pdctl-real-clients/smg/bin/python")
BODY = json.dumps({"text": "overload benchmark", "sampling_params": {"max_new_tokens": 32, "temperature": 0}}).encode()


def start(argv: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="pdctl-overload-"))
    sims, workers = [], ["--pd-disaggregation"]
    for i, role in enumerate(["prefill", "prefill", "decode", "decode"]):
        port = free_port()
        argv = [
            PY,
            "-m",
            "pdctl.sim",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--model-path",
            "sim://tiny",
            "--disaggregation-mode",
            role,
            "--max-running-requests",
            str(SLOTS),
            "--sim-decode-ms-per-step",
            "4",
        ]
        if role == "prefill":
            boot = free_port()
            argv += ["--disaggregation-bootstrap-port", str(boot)]
            workers += ["--prefill", f"http://127.0.0.1:{port}", str(boot)]
        else:
            workers += ["--decode", f"http://127.0.0.1:{port}"]
        sims.append(start(argv, tmp / f"sim{i}.log"))
    routers = {
        "pdctl": lambda port: [
            PY,
            "-m",
            "pdctl",
            "router",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *workers,
            "--policy",
            "round_robin",
            "--log-level",
            "warn",
        ],
    }
    if Path(SMG_PYTHON).exists():
        routers["smg 1.13.0"] = lambda port: [
            SMG_PYTHON,
            "-m",
            "smg.launch_router",
            *workers,
            "--policy",
            "round_robin",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
    else:
        print(f"smg not found at {SMG_PYTHON}: pdctl only (run the real-clients setup.sh)", file=sys.stderr)
    rows: list[dict] = []
    try:
        for url in [w for w in workers if w.startswith("http")]:
            wait(url + "/health")
        for multiple in MULTIPLES:
            for name, argv in routers.items():
                port = free_port()
                proc = start(argv(port), tmp / f"router-{name.split()[0]}-{multiple}.log")
                try:
                    wait(f"http://127.0.0.1:{port}/readiness" if name == "pdctl" else f"http://127.0.0.1:{port}/health")
                    time.sleep(2.0)  # smg's workers become healthy after its first checks
                    url = f"http://127.0.0.1:{port}/generate"
                    asyncio.run(run(url, CAPACITY, 1.0, 10**9, BODY))  # warm-up
                    row = asyncio.run(run(url, multiple * CAPACITY, DURATION, 10**9, BODY))
                finally:
                    stop([proc])
                row.update(router=name, multiple=multiple, concurrency=multiple * CAPACITY)
                rows.append(row)
                print(
                    f"  {name} {multiple}x: {row['rps']:.1f} req/s, p99 {row['p99_ms']:.0f} ms, {row['errors']} errors",
                    flush=True,
                )
    finally:
        stop(sims)
    names = list(routers)
    by = {(r["router"], r["multiple"]): r for r in rows}
    lines = [
        "| offered load | concurrency | "
        + " | ".join(f"{n} goodput req/s | {n} p99 ms | {n} errors" for n in names)
        + " |",
        "|---|---|" + "---|---|---|" * len(names),
    ]
    for m in MULTIPLES:
        cells = []
        for n in names:
            r = by[(n, m)]
            cells.append(f"{r['rps']:.1f} | {r['p99_ms']:.0f} | {r['errors']}")
        lines.append(f"| {m}x | {m * CAPACITY} | " + " | ".join(cells) + " |")
    pd = [by[("pdctl", m)] for m in MULTIPLES]
    lines += [
        "",
        f"pdctl goodput at 10x / at 1x: {pd[-1]['rps'] / pd[0]['rps']:.2f}x (goal >= 0.95x); "
        f"errors at all steps: {sum(r['errors'] for r in pd)} (goal 0)",
    ]
    if "smg 1.13.0" in names:
        ratios = ", ".join(
            f"{m}x {by[('pdctl', m)]['rps'] / max(by[('smg 1.13.0', m)]['rps'], 1e-9):.2f}" for m in MULTIPLES
        )
        lines.append(f"pdctl goodput / smg's per step: {ratios} (goal >= 1.00 at every step)")
    lines += [
        "",
        f"Closed loop, {DURATION:.0f} s per step after a 1 s warm-up; 2 prefill + 2 decode sims with "
        f"--max-running-requests {SLOTS} and --sim-decode-ms-per-step 4; 32 output tokens per request; "
        f"{len(os.sched_getaffinity(0))} CPUs, Python {platform.python_version()}. Sim logs: {tmp}",
    ]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "overload.json").write_text(json.dumps({"rows": rows}, indent=2))
    (RESULTS / "overload.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
