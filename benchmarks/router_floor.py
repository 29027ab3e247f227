"""The floor of pdctl's router design: a bare PD proxy on the same parts (asyncio + uvloop +
httptools, pooled keep-alive upstream connections, orjson), with none of the router's features
(no keys, admission, body checks, selection policies, retries, breakers, metrics, request ids,
refit gate), measured side by side with pdctl's router and smg 1.13.0 on the same null backends.

It answers one question: how far below smg can a Python router of this design go at all?
Plain /generate only, closed loop at concurrency 64, CPU per request of each router's process.

    python benchmarks/router_floor.py   # writes benchmarks/results/router_floor.{json,md}

``--serve PREFILL DECODE BOOTSTRAP_PORT PORT_FILE`` runs the bare proxy itself (the benchmark
starts it that way).
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from router_overhead import PY, RESULTS, ROUTER_CPUS, SMG_PYTHON, free_port, measure, start, stop, wait

ROUNDS = int(os.environ.get("ROUTER_BENCH_ROUNDS", 5))


def serve(prefill: str, decode: str, bootstrap_port: int, port_file: str) -> None:
    """The bare proxy: each request's body gets a bootstrap room and goes to both engines at
    once; the decode's answer is the client's. Nothing else (not for use beyond this benchmark)."""
    import httptools
    import orjson
    import uvloop

    def address(url: str) -> tuple[str, int]:
        host, port = url.split("//")[1].split(":")
        return host, int(port)

    class Upstream(asyncio.Protocol):
        def __init__(self) -> None:
            self.parser = httptools.HttpResponseParser(self)

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            self.parser.feed_data(data)

        def on_body(self, body: bytes) -> None:
            self.body.append(body)

        def on_message_complete(self) -> None:
            self.answer.set_result(b"".join(self.body))

    idle: dict[tuple[str, int], list[Upstream]] = collections.defaultdict(list)
    answering: set[asyncio.Future] = set()

    async def post(key: tuple[str, int], data: bytes) -> bytes:
        loop = asyncio.get_running_loop()
        conns = idle[key]
        conn = conns.pop() if conns else (await loop.create_connection(Upstream, *key))[1]
        conn.body, conn.answer = [], loop.create_future()
        conn.transport.write(data)  # type: ignore[attr-defined]
        answer = await conn.answer
        conns.append(conn)
        return answer

    prefill_at, decode_at = address(prefill), address(decode)

    async def answer(client: Client, body: bytes) -> None:
        request = orjson.loads(body)
        request.update(
            bootstrap_host=prefill_at[0], bootstrap_port=bootstrap_port, bootstrap_room=random.getrandbits(63)
        )
        data = orjson.dumps(request)
        wire = b"POST /generate HTTP/1.1\r\nHost: e\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
        wire %= (len(data), data)
        prefill_leg = asyncio.ensure_future(post(prefill_at, wire))
        out = await post(decode_at, wire)
        await prefill_leg
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
        client.transport.write(head % len(out) + out)

    class Client(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport  # type: ignore[assignment]
            self.parser = httptools.HttpRequestParser(self)

        def data_received(self, data: bytes) -> None:
            self.parser.feed_data(data)

        def on_message_begin(self) -> None:
            self.body = b""

        def on_body(self, body: bytes) -> None:
            self.body += body

        def on_message_complete(self) -> None:
            task = asyncio.ensure_future(answer(self, self.body))
            answering.add(task)  # held until done (the loop keeps only weak references)
            task.add_done_callback(answering.discard)

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Client, "127.0.0.1", 0)
        Path(port_file).write_text(json.dumps({"port": server.sockets[0].getsockname()[1]}))
        await asyncio.Event().wait()

    uvloop.install()
    asyncio.run(main())


def run() -> None:
    prefill_port, boot_port, decode_port = free_port(), free_port(), free_port()
    null = [PY, "-m", "pdctl.sim.null"]
    backends = [
        start([*null, "--port", str(prefill_port), "--role", "prefill", "--bootstrap-port", str(boot_port)]),
        start([*null, "--port", str(decode_port), "--role", "decode"]),
    ]
    prefill, decode = f"http://127.0.0.1:{prefill_port}", f"http://127.0.0.1:{decode_port}"
    pd = ["--pd-disaggregation", "--prefill", prefill, str(boot_port), "--decode", decode, "--policy", "round_robin"]
    cpu: dict[str, list[float]] = collections.defaultdict(list)
    try:
        wait(prefill + "/health")
        wait(decode + "/health")
        for _ in range(ROUNDS):
            for name in ("bare proxy", "pdctl router", "smg 1.13.0"):
                port = free_port()
                if name == "bare proxy":
                    port_file = Path(tempfile.gettempdir()) / f"pdctl-floor-{os.getpid()}.port"
                    port_file.unlink(missing_ok=True)
                    argv = [PY, __file__, "--serve", prefill, decode, str(boot_port), str(port_file)]
                elif name == "pdctl router":
                    argv = [PY, "-m", "pdctl", "router", "--port", str(port), *pd, "--log-level", "error"]
                else:
                    argv = [SMG_PYTHON, "-m", "smg.launch_router", *pd, "--host", "127.0.0.1", "--port", str(port)]
                    argv += ["--prometheus-port", str(free_port()), "--log-level", "error"]
                proc = start(argv, ROUTER_CPUS)
                try:
                    if name == "bare proxy":
                        while not port_file.exists() or not port_file.read_text():  # written once it listens
                            if proc.poll() is not None:
                                raise RuntimeError("the bare proxy exited")
                            time.sleep(0.05)
                        port = json.loads(port_file.read_text())["port"]
                        port_file.unlink()
                    else:
                        wait(f"http://127.0.0.1:{port}/health")
                        time.sleep(1.0)  # smg marks workers healthy after its first check
                    row = measure(name, f"http://127.0.0.1:{port}/generate", proc, stream=False)
                    if row["errors"]:
                        raise RuntimeError(f"{name}: {row['errors']} errors")
                    cpu[name].append(row["router_cpu_us_per_req"])
                finally:
                    stop(proc)
    finally:
        stop(*backends)
    smg = cpu["smg 1.13.0"]
    rows = {
        name: {
            "cpu_us_per_req": statistics.median(values),
            "vs_smg": statistics.median(v / s for v, s in zip(values, smg, strict=True)),
            "all": values,
        }
        for name, values in cpu.items()
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "router_floor.json").write_text(json.dumps({"rounds": ROUNDS, "rows": rows}, indent=2))
    lines = ["| router | CPU us/request (median) | / smg's, per round (median) | rounds |", "|---|---|---|---|"]
    for name, row in rows.items():
        rounds = ", ".join(f"{v:.0f}" for v in row["all"])
        lines.append(f"| {name} | {row['cpu_us_per_req']:.0f} | {row['vs_smg']:.2f}x | {rounds} |")
    lines += [
        "",
        f"Plain PD /generate, closed loop at concurrency 64, {ROUNDS} interleaved rounds, same null backends; "
        "the bare proxy has none of the router's features (see the script's docstring).",
    ]
    (RESULTS / "router_floor.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--serve":
        serve(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
    else:
        run()
