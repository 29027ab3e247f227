"""The router's own CPU per request, in one process with no sockets: a low-noise A/B for changes.

pdctl's real request path (its HTTP server protocol, the app, the dispatcher, the pooled
upstream connections and their parsers) runs on uvloop over in-memory transports: a client
connection is fed the bytes an aiohttp client sends, the engines' connections answer with
the bytes an aiohttp engine sends (the null engine's bodies, a stream as one read per event, each in
its own turn of the loop).
There are no system calls and no other process, so the figure moves by a few percent from run
to run where router_overhead.py's moves by 20%: it shows what a change to the Python costs or
saves. It leaves out the kernel's share and the event loop's polling (router_overhead.py has
them), so it is a part of the real figure, not a substitute for it.

    python benchmarks/router_inproc.py [--stream] [--requests 40000] [--rounds 5]
    python benchmarks/router_inproc.py --baseline REF   # this tree against git REF, interleaved
    python benchmarks/router_inproc.py --workers 4,256,1024   # the cost per request as the fleet grows

Prints the median over rounds of CPU microseconds per request (process time over the measured
requests, at concurrency 64) and, with --baseline, the ratio this tree / REF.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from router_overhead import checkout, remove_checkout

ROOT = Path(__file__).resolve().parent
CONCURRENCY = 64
STREAM_TOKENS = 8

BODY = json.dumps({"text": "benchmark", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}).encode()
STREAM_BODY = json.dumps(
    {"text": "benchmark", "stream": True, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
).encode()


def client_request(body: bytes) -> bytes:
    """The bytes aiohttp's client sends for a POST of ``body`` (its default headers)."""
    return (
        b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1:30000\r\nUser-Agent: Python/3.11 aiohttp/3.13.2\r\n"
        b"Accept: */*\r\nAccept-Encoding: gzip, deflate\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
    )


def engine_answers(tokens: int | None = None) -> tuple[bytes, list[bytes]]:
    """What an aiohttp engine sends: a whole answer, and a stream's reads (head + first event,
    one per event after it, the last with [DONE] and the end) of ``tokens`` events (STREAM_TOKENS)."""
    import orjson

    from pdctl.sim.null import _item, _stream_events

    head = b"HTTP/1.1 200 OK\r\nDate: Wed, 25 Nov 2026 01:00:00 GMT\r\nServer: Python/3.11 aiohttp/3.13.2\r\n"
    body = orjson.dumps(_item())
    whole = head + b"Content-Type: application/json; charset=utf-8\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body)
    chunks = [b"%x\r\n%b\r\n" % (len(e), e) for e in _stream_events(STREAM_TOKENS if tokens is None else tokens)]
    stream = [head + b"Content-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks[0]]
    stream += chunks[1:-1]
    stream.append(chunks[-1] + b"0\r\n\r\n")
    return whole, stream


class _Transport:
    """An in-memory transport: what it is written goes to ``sink``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, protocol: asyncio.Protocol, sink):
        self.loop, self.protocol, self.sink = loop, protocol, sink
        self.closing = False

    def write(self, data: bytes) -> None:
        self.sink(data)

    def close(self) -> None:
        if not self.closing:
            self.closing = True
            self.loop.call_soon(self.protocol.connection_lost, None)

    def is_closing(self) -> bool:
        return self.closing

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_extra_info(self, name: str, default=None):
        return default


def fleet_argv(workers: int) -> list[str]:
    """A PD router over ``workers`` engines, half prefills, half decodes (distinct ports: the
    in-memory engine answers for all)."""
    half = max(workers // 2, 1)
    argv = ["--pd-disaggregation"]
    for i in range(half):
        argv += ["--prefill", f"http://127.0.0.1:{10000 + i}", str(20000 + i)]
    for i in range(half):
        argv += ["--decode", f"http://127.0.0.1:{30000 + i}"]
    return argv


async def measure(stream: bool, requests: int, workers: int = 2) -> float:
    """CPU microseconds per request over ``requests`` requests at concurrency 64, over
    ``workers`` engines."""
    from pdctl.router import errors
    from pdctl.router.app import RouterServer
    from pdctl.router.cli import _tune_gc, build_parser, config_from_args
    from pdctl.router.server import HttpServer, _Connection
    from pdctl.router.upstream import UpstreamPool, _Conn

    loop = asyncio.get_running_loop()
    whole, streamed = engine_answers()
    _, prefilled = engine_answers(1)  # a PD prefill streams its one token (pdctl.sim.null)

    def engine(conn: _Conn, data: bytes) -> None:  # answers once the whole request is written
        # find, not in: CPython 3.11's bytes `in` first tries its operand as an int (a TypeError
        # raised and cleared), which counted the harness's 2 per request as the router's.
        if data.find(b'"stream":true') >= 0:
            loop.call_soon(stream_from, conn, prefilled if conn.key[1] < 30000 else streamed, 0)
        else:
            loop.call_soon(conn.data_received, whole)

    def stream_from(conn: _Conn, reads: list[bytes], i: int) -> None:
        # One read per event, each in a later turn of the loop than the one before (as an engine's
        # events come over a socket): the router forwards each before the next is in.
        conn.data_received(reads[i])
        if i + 1 < len(reads):
            loop.call_soon(stream_from, conn, reads, i + 1)

    class Pool(UpstreamPool):
        async def _connect(self, key: tuple[str, int]) -> _Conn:
            conn = _Conn(self, key)
            conn.connection_made(_Transport(loop, conn, lambda data: engine(conn, data)))
            return conn

    parser = build_parser()
    config = config_from_args(parser.parse_args([*fleet_argv(workers), "--policy", "round_robin"]), parser)
    app = RouterServer(config, upstream=Pool())
    for worker in app.registry.workers.values():
        worker.healthy = worker.activated = True  # as after a health round that reached them
    http = HttpServer(app.handle, errors.server_error, check_head=app.keys.head_check)  # as RouterServer.start

    request = client_request(STREAM_BODY if stream else BODY)
    end = b"0\r\n\r\n" if stream else None
    left = [requests]
    active = [0]  # clients whose last request is unanswered
    done = asyncio.Event()

    def client() -> None:
        conn = _Connection(http)

        def received(data: bytes) -> None:
            if end is None or data.endswith(end):
                if left[0] <= 0:
                    active[0] -= 1
                    if not active[0]:
                        done.set()
                    return
                left[0] -= 1
                loop.call_soon(conn.data_received, request)

        conn.connection_made(_Transport(loop, conn, received))
        left[0] -= 1
        active[0] += 1
        conn.data_received(request)

    async def run(n: int) -> float:
        left[0] = n
        done.clear()
        start = time.process_time()
        for _ in range(CONCURRENCY):
            client()
        await done.wait()
        return time.process_time() - start

    await run(2000)  # warm: connections pooled, caches filled
    _tune_gc()
    used = await run(requests)
    return used / requests * 1e6


def worker(stream: bool, requests: int, workers: int) -> None:
    import uvloop

    print(json.dumps({"cpu_us": uvloop.run(measure(stream, requests, workers))}))


def one(tree: Path, stream: bool, requests: int, workers: int = 2) -> float:
    """CPU us per request of ``tree``'s router over ``workers`` engines."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--requests", str(requests)]
    argv += ["--workers", str(workers)]
    env = {"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [*argv, *(["--stream"] if stream else [])], capture_output=True, text=True, check=True, cwd=tree, env=env
    )
    return float(json.loads(out.stdout.strip().splitlines()[-1])["cpu_us"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stream", action="store_true", help="streamed /generate (8 SSE events)")
    p.add_argument("--requests", type=int, default=40000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--baseline", metavar="REF", help="also run the router as of this git ref, interleaved")
    p.add_argument(
        "--workers", default="2", help="engines behind the router (half prefills), or a list: 4,256,1024 (interleaved)"
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.stream, args.requests, int(args.workers))
        return
    sizes = [int(n) for n in args.workers.split(",")]
    if len(sizes) > 1:
        by_size(args.stream, args.requests, args.rounds, sizes)
        return
    trees = {"this tree": ROOT.parent}
    tmp = checkout(args.baseline, Path(tempfile.mkdtemp()) / "baseline") if args.baseline else None
    if tmp is not None:
        trees[args.baseline] = tmp
    try:
        got: dict[str, list[float]] = {name: [] for name in trees}
        for _ in range(args.rounds):
            for name, tree in trees.items():
                got[name].append(one(tree, args.stream, args.requests))
        mode = "streamed" if args.stream else "plain"
        for name, values in got.items():
            rounds = ", ".join(f"{v:.1f}" for v in values)
            print(f"{mode} {name}: {statistics.median(values):.1f} us/request (rounds {rounds})")
        if args.baseline:
            ratios = [a / b for a, b in zip(got["this tree"], got[args.baseline], strict=True)]
            rounds = ", ".join(f"{r:.3f}" for r in ratios)
            print(f"{mode} this tree / {args.baseline}: {statistics.median(ratios):.3f}x (rounds {rounds})")
    finally:
        if tmp is not None:
            remove_checkout(tmp)


def by_size(stream: bool, requests: int, rounds: int, sizes: list[int]) -> None:
    """The cost per request at each fleet size, interleaved, and each as a ratio of the first."""
    got: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(rounds):
        for n in sizes:
            got[n].append(one(ROOT.parent, stream, requests, n))
    mode = "streamed" if stream else "plain"
    first = sizes[0]
    rows = []
    for n, values in got.items():
        ratios = [a / b for a, b in zip(values, got[first], strict=True)]
        rows.append({"workers": n, "cpu_us": statistics.median(values), "ratio": statistics.median(ratios)})
        print(
            f"{mode} {n} workers: {statistics.median(values):.1f} us/request, {statistics.median(ratios):.3f}x "
            f"of {first} (rounds {', '.join(f'{v:.1f}' for v in values)})"
        )
    print(json.dumps({"mode": mode, "rows": rows}))


if __name__ == "__main__":
    main()
