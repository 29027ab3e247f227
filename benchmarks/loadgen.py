"""Closed-loop HTTP load: C workers each send the next request as soon as the last returns.

    python benchmarks/loadgen.py URL --concurrency 64 --duration 10   # prints one JSON line

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
                try:
                    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
                        data = await resp.read()
                        ok = resp.status == 200 and b'"error"' not in data  # a stream may end in an error event
                except (aiohttp.ClientError, OSError):
                    ok = False
                if ok:
                    latencies.append(time.perf_counter() - start)
                else:
                    errors += 1

        started = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.monotonic() - started
    latencies.sort()
    q = statistics.quantiles(latencies, n=100) if len(latencies) > 100 else [0.0] * 99
    return {
        "requests": len(latencies),
        "errors": errors,
        "seconds": elapsed,
        "rps": len(latencies) / elapsed,
        "p50_ms": q[49] * 1000,
        "p99_ms": q[98] * 1000,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("url")
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
    print(json.dumps(asyncio.run(run(a.url, a.concurrency, a.duration, a.max_requests, body))))


if __name__ == "__main__":
    main()
