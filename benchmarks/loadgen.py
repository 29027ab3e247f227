"""Closed-loop HTTP load: C workers each send the next request as soon as the last returns.

    python benchmarks/loadgen.py URL --concurrency 64 --duration 10   # prints one JSON line
    python benchmarks/loadgen.py --cycle NAME=URL@PID ... --cycles 20 --duration 1.5 --warm 0.5
        # the targets in turn, a slice each per cycle: WARM seconds not counted, then DURATION
        # seconds counted, with the CPU seconds the target's process tree (PID; 0: none) used
        # in them; one JSON line per slice

Cycling in short slices is how routers are compared on a machine whose speed drifts over
minutes: each target's slices sit seconds from the others', so a drift hits them alike.
Bounded in time and count; only for loopback targets this project starts itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import aiohttp

BODY = json.dumps({"text": "benchmark", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}).encode()
STREAM_BODY = json.dumps(
    {"text": "benchmark", "stream": True, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
).encode()


async def _one(session: aiohttp.ClientSession, url: str, body: bytes) -> bool:
    """One POST read whole: whether it succeeded."""
    try:
        async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
            data = await resp.read()
            return resp.status == 200 and b'"error"' not in data  # a stream may end in an error event
    except (aiohttp.ClientError, OSError):
        return False


def _summary(latencies: list[float], errors: int, seconds: float) -> dict:
    latencies.sort()
    q = statistics.quantiles(latencies, n=100) if len(latencies) > 100 else [0.0] * 99
    return {
        "requests": len(latencies),
        "errors": errors,
        "seconds": seconds,
        "rps": len(latencies) / seconds,
        "p50_ms": q[49] * 1000,
        "p99_ms": q[98] * 1000,
    }


async def run(url: str, concurrency: int, duration: float, max_requests: int, body: bytes = BODY) -> dict:
    latencies: list[float] = []
    errors = 0
    deadline = time.monotonic() + duration
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            nonlocal errors
            while time.monotonic() < deadline and len(latencies) + errors < max_requests:
                start = time.perf_counter()
                if await _one(session, url, body):
                    latencies.append(time.perf_counter() - start)
                else:
                    errors += 1

        started = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.monotonic() - started
    return _summary(latencies, errors, elapsed)


def tree_cpu_secs(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its children (0 for pid 0, or one gone)."""
    import psutil

    if not pid:
        return 0.0
    try:
        root = psutil.Process(pid)
        children = root.children(recursive=True)
    except psutil.Error:
        return 0.0
    total = 0.0
    for proc in [root, *children]:
        try:
            t = proc.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


async def slice_of(url: str, pid: int, concurrency: int, warm: float, duration: float, body: bytes) -> dict:
    """One slice: a closed loop on ``url`` for ``warm`` + ``duration`` seconds; what completed in the
    last ``duration`` seconds, and the CPU seconds ``pid`` used meanwhile."""
    done: list[float] = []  # completion times
    latencies: list[float] = []
    errors = 0
    counting: list[float] = []  # [start, end] of the counted window once it began
    stop = time.monotonic() + warm + duration
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            nonlocal errors
            while time.monotonic() < stop:
                start = time.perf_counter()
                ok = await _one(session, url, body)
                if counting:
                    if ok:
                        done.append(time.monotonic())
                        latencies.append(time.perf_counter() - start)
                    else:
                        errors += 1

        async def clock() -> tuple[float, float]:
            await asyncio.sleep(warm)
            before = tree_cpu_secs(pid)
            counting.append(time.monotonic())
            await asyncio.sleep(duration)
            end = time.monotonic()
            used = tree_cpu_secs(pid) - before
            counting.append(end)
            return used, end

        workers = [asyncio.ensure_future(worker()) for _ in range(concurrency)]
        used, end = await clock()
        await asyncio.gather(*workers)
    n, seconds = sum(1 for t in done if t <= end), end - counting[0]  # (what ended in the counted window)
    return {**_summary(latencies, errors, seconds), "requests": n, "rps": n / seconds, "cpu_secs": used}


async def cycle(
    targets: list[tuple[str, str, int]], cycles: int, concurrency: int, warm: float, duration: float, body: bytes
) -> None:
    for k in range(cycles):
        for name, url, pid in targets:
            row = await slice_of(url, pid, concurrency, warm, duration, body)
            print(json.dumps({"target": name, "cycle": k, **row}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("url", nargs="?")
    p.add_argument("--cycle", nargs="+", metavar="NAME=URL@PID", help="targets to cycle through (see above)")
    p.add_argument("--cycles", type=int, default=10)
    p.add_argument("--warm", type=float, default=0.5)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--max-requests", type=int, default=1_000_000)
    p.add_argument("--stream", action="store_true", help="Streamed /generate requests (read to the end).")
    a = p.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    body = STREAM_BODY if a.stream else BODY
    if a.cycle:
        targets = []
        for spec in a.cycle:
            name, rest = spec.split("=", 1)
            url, pid = rest.rsplit("@", 1)
            targets.append((name, url, int(pid)))
        asyncio.run(cycle(targets, a.cycles, a.concurrency, a.warm, a.duration, body))
        return
    if a.url is None:
        p.error("a URL, or --cycle")
    print(json.dumps(asyncio.run(run(a.url, a.concurrency, a.duration, a.max_requests, body))))


if __name__ == "__main__":
    main()
