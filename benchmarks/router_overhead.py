"""Router cost per request, side by side in one run, on the same null backends.

Targets (closed loop, concurrency 64, /generate, plain and streamed with 8 SSE events): the
decode backend directly; pdctl router in PD mode; sglang-router 0.3.2 (Rust) and smg 1.13.0
(its successor; SMG_PYTHON names its interpreter, default the real-clients venv) in PD mode
with round_robin; sglang-router's Python MiniLB (--mini-lb, plain only).
All the routers of a mode run at once; one load generator (loadgen.py --cycle) takes them in
turn, ROUNDS cycles of one slice each: WARM seconds not counted, then DURATION seconds counted.
This machine's speed drifts by up to 1.8x over minutes (its neighbours'): slices seconds apart
see the same machine, where the old way (a router started, loaded 8 s, stopped, the next one)
compared routers across minutes and swung by +-20% from round to round. A router idle between
its slices uses next to no CPU (its health checks).
With two or more CPUs the routers are pinned to the last CPU and the load generator and
backends to the others, so that they do not take turns on the routers' core (unpinned,
the CPU-per-request figures of every router swung by +-40% from run to run here).
Reported: req/s, p50/p99 latency, and the router's CPU microseconds per request (psutil,
user+system over the router's process tree during each slice's counted seconds), medians over
slices; ratios are the median of the per-cycle ratios.

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
from loadgen import tree_cpu_secs

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
PY = sys.executable
DURATION = float(os.environ.get("ROUTER_BENCH_DURATION", 1.5))  # counted seconds per slice
WARM = 0.5  # seconds per slice before counting (connections made, the loop steady)
CONCURRENCY = 64
ROUNDS = int(os.environ.get("ROUTER_BENCH_ROUNDS", 20))  # cycles over the targets
STREAM_TOKENS = 8  # streamed requests: 8 SSE events of one token each, then [DONE]
SMG_PYTHON = os.environ.get("SMG_PYTHON", "/tmp/pdctl-real-clients/smg/bin/python")


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


def stop(*procs: subprocess.Popen) -> None:
    """Terminate ``procs`` and wait for each to exit."""
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=30)


def checkout(ref: str, into: Path) -> Path:
    """A detached worktree of this repository at ``ref`` (removed by ``remove_checkout``)."""
    repo = ROOT.parent
    subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", str(into), ref], check=True)
    return into


def remove_checkout(path: Path) -> None:
    subprocess.run(["git", "-C", str(ROOT.parent), "worktree", "remove", "--force", str(path)], check=False)


def _pin_to_others() -> None:
    os.sched_setaffinity(0, OTHER_CPUS)


def _warm_up(url: str, stream: bool) -> None:
    """A second of light load on ``url``: a router's caches and pools, and the loadgen's own start."""
    argv = [PY, str(ROOT / "loadgen.py"), url, *(["--stream"] if stream else []), "--concurrency", "8"]
    subprocess.run([*argv, "--duration", "1"], capture_output=True, check=True, preexec_fn=_pin_to_others)


def cycle(targets: list[tuple[str, str, int]], stream: bool) -> list[dict]:
    """loadgen.py --cycle over ``targets`` (name, URL, router pid or 0): one row per slice."""
    specs = [f"{name}={url}@{pid}" for name, url, pid in targets]
    argv = [PY, str(ROOT / "loadgen.py"), "--cycle", *specs, "--cycles", str(ROUNDS), "--concurrency", str(CONCURRENCY)]
    argv += ["--warm", str(WARM), "--duration", str(DURATION), *(["--stream"] if stream else [])]
    for _, url, _ in targets:
        _warm_up(url, stream)
    out = subprocess.run(argv, capture_output=True, text=True, check=True, preexec_fn=_pin_to_others)
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def measure(name: str, url: str, router: subprocess.Popen | None, stream: bool, duration: float = 8.0) -> dict:
    """One router loaded alone for ``duration`` seconds (router_floor.py's way; this file cycles)."""
    loadgen = [PY, str(ROOT / "loadgen.py"), url, *(["--stream"] if stream else [])]
    _warm_up(url, stream)
    before = tree_cpu_secs(router.pid) if router else 0.0
    out = subprocess.run(
        [*loadgen, "--concurrency", str(CONCURRENCY), "--duration", str(duration)],
        capture_output=True,
        text=True,
        check=True,
        preexec_fn=_pin_to_others,
    )
    used = (tree_cpu_secs(router.pid) - before) if router else 0.0
    row = json.loads(out.stdout)
    row.update(
        target=name,
        mode="streamed" if stream else "plain",
        router_cpu_us_per_req=(used / row["requests"] * 1e6) if router and row["requests"] else None,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", metavar="REF", help="also run pdctl's router as of this git ref")
    parser.add_argument("--modes", default="plain,streamed", help="plain, streamed or both (comma-separated)")
    parser.add_argument(
        "--only", help="measure only these targets (comma-separated: direct, pdctl, sglang-router, smg, minilb)"
    )
    args = parser.parse_args()
    baseline_dir = checkout(args.baseline, Path(tempfile.mkdtemp()) / "baseline") if args.baseline else None
    try:
        only = {t.strip() for t in args.only.split(",")} if args.only else None
        run(args.baseline, baseline_dir, [m.strip() for m in args.modes.split(",")], only)
    finally:
        if baseline_dir:
            remove_checkout(baseline_dir)


PDCTL, RUST, SMG, MINI = (
    "pdctl router (PD)",
    "sglang-router 0.3.2 (PD, Rust)",
    "smg 1.13.0 (PD, Rust)",
    "MiniLB (sglang-router --mini-lb)",
)


SHORT = {
    "direct to decode": "direct",
    PDCTL: "pdctl",
    RUST: "sglang-router",
    SMG: "smg",
    MINI: "minilb",
}


def run(baseline: str | None, baseline_dir: Path | None, modes: list[str], only: set[str] | None = None) -> None:
    prefill_port, boot_port, decode_port = free_port(), free_port(), free_port()
    null = [PY, "-m", "pdctl.sim.null", "--stream-tokens", str(STREAM_TOKENS)]
    backends = [
        start([*null, "--port", str(prefill_port), "--role", "prefill", "--bootstrap-port", str(boot_port)]),
        start([*null, "--port", str(decode_port), "--role", "decode"]),
    ]
    prefill, decode = f"http://127.0.0.1:{prefill_port}", f"http://127.0.0.1:{decode_port}"
    wait(prefill + "/health")
    wait(decode + "/health")

    # the same workers and policy for every router
    pd_workers = ["--pd-disaggregation", "--prefill", prefill, str(boot_port), "--decode", decode]
    pd_workers += ["--policy", "round_robin"]

    def pdctl_router(port: int) -> list[str]:
        python = os.environ.get("PDCTL_ROUTER_PYTHON", PY)  # another interpreter's venv with pdctl installed
        return [python, "-m", "pdctl", "router", "--port", str(port), *pd_workers, "--log-level", "error"]

    def rust_router(python: str, module: str, port: int, mini: bool = False) -> list[str]:
        argv = [python, "-m", module, *pd_workers, "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--prometheus-port", str(free_port()), "--log-level", "error"]
        return [*argv, "--mini-lb"] if mini else argv

    targets: dict[str, Callable[[int], list[str]] | None] = {
        "direct to decode": None,
        PDCTL: pdctl_router,
        RUST: lambda port: rust_router(PY, "sglang_router.launch_router", port),
    }
    if Path(SMG_PYTHON).exists():
        targets[SMG] = lambda port: rust_router(SMG_PYTHON, "smg.launch_router", port)
    else:
        print(f"smg not found at {SMG_PYTHON}: run ../shared/tools/real-clients/setup.sh", file=sys.stderr)
    targets[MINI] = lambda port: rust_router(PY, "sglang_router.launch_router", port, mini=True)
    if only is not None:
        targets = {name: make for name, make in targets.items() if SHORT[name] in only}
    old_name = f"pdctl router at {baseline} (PD)"
    if baseline_dir:  # the old tree's code, this environment's packages; no build of its sources
        targets[old_name] = pdctl_router
    runs: dict[tuple[str, str], list[dict]] = {}
    try:
        for mode in modes:
            stream = mode == "streamed"
            started: list[tuple[str, str, subprocess.Popen | None]] = []
            try:
                for name, make in targets.items():
                    if stream and name == MINI:
                        continue  # MiniLB is 4x slower than every other router: measured for plain requests only
                    if make is None:
                        started.append((name, decode + "/generate", None))
                        continue
                    port = free_port()
                    proc = start(make(port), ROUTER_CPUS, baseline_dir if name == old_name else None)
                    started.append((name, f"http://127.0.0.1:{port}/generate", proc))
                    wait(f"http://127.0.0.1:{port}/health")
                time.sleep(1.0)  # the Rust routers mark workers healthy after their first check
                routed = {n for n, _, p in started if p is not None}
                for row in cycle([(n, u, p.pid if p else 0) for n, u, p in started], stream):
                    row.update(mode=mode, router_cpu_us_per_req=None)
                    if row["target"] in routed and row["requests"]:
                        row["router_cpu_us_per_req"] = row["cpu_secs"] / row["requests"] * 1e6
                    runs.setdefault((mode, row["target"]), []).append(row)
            finally:
                stop(*(p for _, _, p in started if p is not None))
    finally:
        stop(*backends)
    rows = []
    for rs in runs.values():
        best = sorted(rs, key=lambda r: r["rps"])[len(rs) // 2]  # the median slice by req/s
        cpu = [r["router_cpu_us_per_req"] for r in rs if r["router_cpu_us_per_req"] is not None]
        rows.append({**best, "router_cpu_us_per_req": statistics.median(cpu) if cpu else None, "all_runs": rs})
    by = {(r["mode"], r["target"]): r for r in rows}

    def cpu_ratio(mode: str, other: str) -> tuple[float, list[float]] | None:
        a, b = by.get((mode, PDCTL)), by.get((mode, other))
        if a is None or b is None:
            return None
        rounds = [
            x["router_cpu_us_per_req"] / y["router_cpu_us_per_req"]
            for x, y in zip(a["all_runs"], b["all_runs"], strict=True)
        ]
        return statistics.median(rounds), rounds

    goals = {("plain", SMG): 0.5, ("streamed", SMG): 0.6}
    ratios: dict[str, object] = {}
    summary: list[str] = []
    for mode in modes:
        others = ((SMG, "smg 1.13.0"), (RUST, "sglang-router 0.3.2"))
        for other, label in (*others, (old_name, f"pdctl at {baseline}")):
            got = cpu_ratio(mode, other)
            if got is None:
                continue
            ratio, rounds = got
            key = f"{mode}_pdctl_cpu_per_req_vs_{SHORT.get(other, 'baseline')}"
            ratios[key], ratios[key + "_per_round"] = ratio, rounds
            goal = goals.get((mode, other))
            summary.append(
                f"{mode}: pdctl CPU per request / {label}'s: {ratio:.2f}x"
                + (f" (goal <= {goal}x)" if goal else "")
                + f"; quartiles {' - '.join(f'{q:.2f}x' for q in statistics.quantiles(rounds, n=4)[::2])}"
            )
    if ("plain", MINI) in by:
        ratios["plain_pdctl_rps_vs_minilb"] = by[("plain", PDCTL)]["rps"] / by[("plain", MINI)]["rps"]
        summary.append(f"plain: pdctl req/s / MiniLB's: {ratios['plain_pdctl_rps_vs_minilb']:.2f}x (goal >= 3x)")
    RESULTS.mkdir(exist_ok=True)
    meta = {
        "machine": platform.machine(),
        "cpus": psutil.cpu_count(),
        "python": platform.python_version(),
        "slice_counted_s": DURATION,
        "slice_warm_s": WARM,
        "concurrency": CONCURRENCY,
        "rounds": ROUNDS,
        "stream_tokens": STREAM_TOKENS,
        "baseline": baseline,
        "head": subprocess.run(
            ["git", "-C", str(ROOT.parent), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
    }
    stem = f"router_overhead_vs_{baseline}".replace("/", "_") if baseline else "router_overhead"
    (RESULTS / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows, "ratios": ratios}, indent=2))
    lines = [
        "| mode | target | req/s | p50 ms | p99 ms | router CPU us/req | errors |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cpu = f"{r['router_cpu_us_per_req']:.0f}" if r["router_cpu_us_per_req"] else "-"
        lines.append(
            f"| {r['mode']} | {r['target']} | {r['rps']:.0f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {cpu} "
            f"| {r['errors']} |"
        )
    lines += [
        "",
        *summary,
        f"\nAll routers up at once, {ROUNDS} cycles of a slice each ({WARM:g} s warm-up, {DURATION:g} s counted), "
        f"closed loop at concurrency {CONCURRENCY}; CPU per request is the median over slices, a ratio the "
        f"median of the per-cycle ratios, "
        f"at {meta['head']}, streamed: {STREAM_TOKENS} SSE events and [DONE], "
        "one write each; the router runs on "
        f"CPU {sorted(ROUTER_CPUS)}, load generator and backends on {sorted(OTHER_CPUS)}.",
    ]
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
