"""Is `pdctl bench` ever the bottleneck? Three load generators, side by side in one run,
against the same null engine (streams of STREAM_TOKENS one-token chunks on /generate, no
model): `pdctl bench` (one process), SGLang 0.5.23's `bench_serving` (from
../shared/tools/real-clients, when set up), and a bare aiohttp loop of the same shape
(closed loop, CONCURRENCY in flight, every chunk parsed). The null engine is pinned to one
CPU and the clients to the other, so a client's rate is what one client process sustains.
Reported per client: requests/s (median of ROUNDS, interleaved) and the client's CPU
milliseconds per request (user + system of its process tree).

Goals (issue 11): pdctl bench >= 2x bench_serving's rate and >= 1x the bare loop's.

    python benchmarks/bench_client.py   # writes benchmarks/results/bench_client.{json,md}
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from router_overhead import free_port, wait

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
PY = sys.executable
REQUESTS = int(os.environ.get("BENCH_CLIENT_REQUESTS", 1000))
"""bench_serving's random dataset draws from the local ShareGPT file of 1000 conversations: at most 1000."""
CONCURRENCY = 64
STREAM_TOKENS = 16
ROUNDS = int(os.environ.get("BENCH_CLIENT_ROUNDS", 5))
REAL_CLIENTS = Path(os.environ.get("REAL_CLIENTS_HOME", "/tmp/pdctl-real-clients"))
BENCH_SERVING = ROOT.parent.parent / "shared" / "tools" / "real-clients" / "bench_serving.sh"
CPUS = sorted(os.sched_getaffinity(0))
SERVER_CPUS = {CPUS[-1]}
CLIENT_CPUS = set(CPUS[:-1]) or set(CPUS)

BARE_LOOP = r"""
import asyncio, sys, time, aiohttp, orjson
url, n, conc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
body = orjson.dumps({"text": "x" * 32, "sampling_params": {"max_new_tokens": 16, "ignore_eos": True}, "stream": True})
async def main():
    left = n
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def worker():
            nonlocal left
            while left > 0:
                left -= 1
                t0 = time.monotonic(); first = None; tokens = 0
                async with s.post(url + "/generate", data=body, headers={"Content-Type": "application/json"}) as r:
                    async for line in r.content:
                        if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                            chunk = orjson.loads(line[5:])
                            tokens = chunk["meta_info"]["completion_tokens"]
                            first = first or time.monotonic()
        start = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(conc)))
        print(n / (time.monotonic() - start))
asyncio.run(main())
"""


def run_client(argv: list[str]) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds of the client and its descendants, stdout); pinned to CLIENT_CPUS."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, preexec_fn=lambda: os.sched_setaffinity(0, CLIENT_CPUS))
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"{argv[:5]} failed ({done.returncode}): {(done.stderr or done.stdout)[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.stdout


def pdctl_bench(url: str, out: Path) -> float:
    run_client([PY, "-m", "pdctl", "bench", "--url", url, "--num-prompts", str(REQUESTS), "--dataset", "fixed",
                "--input-len", "32", "--output-len", str(STREAM_TOKENS), "--max-concurrency", str(CONCURRENCY),
                "--no-progress", "--json-out", str(out)])  # fmt: skip
    run = json.loads(out.read_text())["runs"][0]
    assert run["completed"] == REQUESTS and run["output_token_mismatches"] == 0, run
    return run["request_throughput"]


def bench_serving(url: str, out: Path) -> float:
    run_client(["bash", str(BENCH_SERVING), url, "--num-prompts", str(REQUESTS), "--random-input-len", "32",
                "--random-output-len", str(STREAM_TOKENS), "--random-range-ratio", "1", "--max-concurrency",
                str(CONCURRENCY), "--request-rate", "inf", "--output-file", str(out)])  # fmt: skip
    row = json.loads(out.read_text().splitlines()[-1])
    assert row["completed"] == REQUESTS, row
    return row["request_throughput"]


def bare_loop(url: str, _: Path) -> float:
    _, _, out = run_client([PY, "-c", BARE_LOOP, url, str(REQUESTS), str(CONCURRENCY)])
    return float(out.strip().splitlines()[-1])


def main() -> None:
    RESULTS.mkdir(exist_ok=True)
    port = free_port()
    server = subprocess.Popen(
        [PY, "-m", "pdctl.sim.null", "--port", str(port), "--stream-tokens", str(STREAM_TOKENS)],
        preexec_fn=lambda: os.sched_setaffinity(0, SERVER_CPUS),
    )
    url = f"http://127.0.0.1:{port}"
    clients = {"pdctl bench": pdctl_bench, "bare aiohttp loop": bare_loop}
    have_bench_serving = BENCH_SERVING.exists() and (REAL_CLIENTS / "venv" / ".ok").exists()
    if have_bench_serving:
        clients["bench_serving 0.5.23"] = bench_serving
    rates: dict[str, list[float]] = {k: [] for k in clients}
    cpu_ms: dict[str, list[float]] = {k: [] for k in clients}
    try:
        wait(url + "/health")
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(ROUNDS):
                for name, fn in clients.items():
                    before = resource.getrusage(resource.RUSAGE_CHILDREN)
                    rates[name].append(fn(url, Path(tmp) / f"{r}-{name.split()[0]}.json"))
                    after = resource.getrusage(resource.RUSAGE_CHILDREN)
                    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
                    cpu_ms[name].append(cpu * 1000 / REQUESTS)
                    print(f"round {r + 1}: {name}: {rates[name][-1]:.0f} req/s, {cpu_ms[name][-1]:.2f} ms CPU/req",
                          flush=True)  # fmt: skip
    finally:
        server.terminate()
        server.wait(timeout=10)
    rows = {
        name: {
            "req_per_s": statistics.median(rates[name]),
            "client_cpu_ms_per_req": statistics.median(cpu_ms[name]),
            "runs_req_per_s": rates[name],
        }
        for name in clients
    }
    mine = rows["pdctl bench"]["req_per_s"]
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()}, {len(CPUS)} CPUs (null engine on CPU {sorted(SERVER_CPUS)}, clients on "
        f"{sorted(CLIENT_CPUS)})",
        "requests": REQUESTS,
        "concurrency": CONCURRENCY,
        "stream_tokens": STREAM_TOKENS,
        "rounds": ROUNDS,
        "clients": rows,
        "ratio_vs_bare_loop": mine / rows["bare aiohttp loop"]["req_per_s"],
        "ratio_vs_bench_serving": mine / rows["bench_serving 0.5.23"]["req_per_s"] if have_bench_serving else None,
    }
    (RESULTS / "bench_client.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        "# bench_client: can one `pdctl bench` process drive the server?",
        "",
        f"{result['date']}, {result['machine']}; {REQUESTS} requests per run, {CONCURRENCY} in flight, "
        f"{STREAM_TOKENS} one-token chunks each; median of {ROUNDS} interleaved rounds.",
        "",
        "| client | req/s | client CPU ms / request |",
        "|---|---|---|",
    ]
    for name, row in rows.items():
        lines.append(f"| {name} | {row['req_per_s']:.0f} | {row['client_cpu_ms_per_req']:.2f} |")
    lines.append("")
    lines.append(f"pdctl bench / bare loop: {result['ratio_vs_bare_loop']:.2f}x (goal >= 1x)")
    if have_bench_serving:
        lines.append(f"pdctl bench / bench_serving: {result['ratio_vs_bench_serving']:.2f}x (goal >= 2x)")
    else:
        lines.append("bench_serving not set up here (run ../shared/tools/real-clients/setup.sh): not compared")
    (RESULTS / "bench_client.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
