"""The colocated data plane against the HTTP ``return_hidden_states`` path and a bare send/recv,
side by side in one run.

Two worker processes stand for an engine TP rank and its trainer rank (TP 1, world 2, gloo on
loopback, this machine's CPU). One step is the final hidden states of B sequences x 512 tokens x
hidden 1024 (float32), for B in 8, 16, 32, 64, moved three ways:

- **data plane**: the engine worker feeds one prefill forward's rows (ids, positions, hidden) to a
  real ``pdctl.colocate.engine.Producer``; the trainer worker takes the step with
  ``DataPlane.recv`` (ready handshake, header, ids/lengths/mask, hidden states).
- **bare**: one ``torch.distributed`` send/recv of the same bytes in a plain gloo group of the same
  two processes, into a buffer allocated once, each side starting when told (which side posts
  first varies from step to step, and with it the time: see posted).
- **bare, posted first** (CPU): the same send/recv, the trainer's receive posted before it tells the
  engine (one small gloo message) to send. Gloo sends a message only once its receive is
  announced: posted first, the send goes at once from the sending thread; posted later, it waits
  for the notice and goes from gloo's thread after a wake-up. The plane orders its messages so
  (the header first); this is the bare transfer in the same order, shown beside the plain bare
  the goal reads against.
- **HTTP**: what a trainer does today without a data plane: POST a batch to the engine, which
  answers as SGLang does with ``return_hidden_states`` (each sequence's ``meta_info.hidden_states``
  as JSON lists, encoded with orjson as SGLang's ORJSONResponse does), and build the tensor from
  the answer. The hidden states are computed once beforehand: only the transport is timed, as for
  the other two.

A step's time is the trainer worker's, from reading the command to holding the tensors (what a
trainer waits; the harness's pipes are not in it). Each round times one step of each path back
to back, the first path rotating from round to
round, so the machine's drift hits all three; times are medians over the rounds, and the ratio
to the bare send/recv is the median of each round's pair (with quartiles). CPU per step is the user + system time
both worker processes spent in it (psutil, in 10 ms ticks, so a mean over the rounds), so it counts
the engine's encoding and the trainer's decoding.

Goals (the data plane issue): >= 20x the HTTP path's bytes/s, and >= 0.9x the bare send/recv's.

With ``--device cuda`` (a GPU machine) both workers hold their tensors on GPU 0, under a fresh
CUDA MPS daemon with ``--mps``, and the paths are: the ``cuda_ipc`` data plane; the ``gloo`` data
plane from the same CUDA tensors (staged through host memory); HTTP; and as **bare**, the least
that moves the bytes between the two processes: the engine copies them into the trainer's
buffer, opened once by CUDA IPC, waits for the copy and says so in one gloo message (NCCL
send/recv, the torch.distributed path, refuses two ranks on one GPU).

    python benchmarks/data_plane.py                       # writes benchmarks/results/data_plane.{json,md}
    python benchmarks/data_plane.py --device cuda --mps   # writes benchmarks/results/data_plane_gpu.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
TOKENS = 512
HIDDEN = 1024
BATCHES = [int(b) for b in os.environ.get("DATA_PLANE_BENCH_BATCHES", "8,16,32,64").split(",")]
ROUNDS = int(os.environ.get("DATA_PLANE_BENCH_ROUNDS", 21))
HTTP_ROUNDS = int(os.environ.get("DATA_PLANE_BENCH_HTTP_ROUNDS", 3))
"""The HTTP path takes seconds per step at B 64: fewer rounds of it (the first ones of each round)."""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the workers ---------------------------------------------------------------------------------------
def worker(role: str, bare_port: int, http_port: int, device: str) -> None:
    """Read one command per line on stdin, answer one line on stdout when done.

    ``plane BACKEND B PORT``: join a fresh union world of that backend for steps of B sequences;
    ``dp BACKEND B``, ``bare B``, ``posted B``, ``http B``: one step of that path; ``exit``."""
    import torch
    import torch.distributed as dist

    from pdctl.colocate import ipc
    from pdctl.colocate.engine import Producer
    from pdctl.colocate.env import DataPlaneSpec, EngineRanks
    from pdctl.colocate.trainer import DataPlane

    torch.set_num_threads(1)
    on_gpu = device == "cuda"
    if on_gpu:
        torch.cuda.set_device(0)
    rank = 1 if role == "engine" else 0
    store = dist.TCPStore("127.0.0.1", bare_port, 2, is_master=rank == 0, timeout=timedelta(seconds=120))
    bare = dist.ProcessGroupGloo(dist.PrefixStore("bare", store), rank, 2, timedelta(seconds=600))
    most = max(BATCHES) * TOKENS
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(most, HIDDEN, generator=generator).to(device) if role == "engine" else None
    buffer = torch.empty(most, HIDDEN, device=device) if role == "trainer" else None
    ids = torch.randint(0, 32000, (most,), generator=generator).to(device)
    positions = torch.arange(TOKENS, device=device).repeat(max(BATCHES))
    producers: dict[str, Producer] = {}
    planes: dict[str, DataPlane] = {}
    flag = torch.zeros(1, dtype=torch.int64)
    if on_gpu:  # bare: the trainer's buffer opened once in the engine
        size = torch.zeros(1, dtype=torch.int64)
        if role == "trainer":
            assert buffer is not None
            raw = ipc.share(buffer).encode()
            size[0] = len(raw)
            bare.send([size], 1, 0).wait()
            bare.send([torch.frombuffer(bytearray(raw), dtype=torch.uint8)], 1, 0).wait()
        else:
            bare.recv([size], 0, 0).wait()
            raw_t = torch.empty(int(size), dtype=torch.uint8)
            bare.recv([raw_t], 0, 0).wait()
            opened = ipc.open_shared(ipc.Handle.decode(raw_t.numpy().tobytes()))
            buffer = opened.view(torch.float32).view(most, HIDDEN)
    if role == "engine":
        assert hidden is not None
        _serve_http(hidden, http_port)
    print("ready", flush=True)
    for line in sys.stdin:
        started = time.perf_counter()
        cmd, *args = line.split()
        if cmd == "exit":
            break
        if cmd == "plane":
            backend, batch = args[0], int(args[1])
            spec = DataPlaneSpec(
                master_address="127.0.0.1",
                master_port=int(args[2]),
                trainer_ranks=1,
                engines=(EngineRanks(id="engine", tp=1, first_rank=1),),
                backend=backend,
                batch_size=batch,
                timeout_secs=600,
            )
            if role == "engine":
                producers[backend] = Producer(spec, "engine", tp_ranks=[0])
            else:
                planes[backend] = DataPlane(spec, 0, device=device if backend == "cuda_ipc" else "cpu")
        elif cmd == "dp":
            backend, rows = args[0], int(args[1]) * TOKENS
            if role == "engine":
                assert hidden is not None
                producers[backend].add_forward(ids[:rows], positions[:rows], hidden[:rows])
                assert producers[backend].failure is None, producers[backend].failure
            else:
                step = planes[backend].recv()
                assert step.hidden.shape == (rows, HIDDEN)
        elif cmd == "bare":
            rows = int(args[0]) * TOKENS
            if role == "engine":
                assert hidden is not None
                if on_gpu:
                    assert buffer is not None
                    buffer[:rows].copy_(hidden[:rows])
                    torch.cuda.current_stream().synchronize()
                    bare.send([flag], 0, 0).wait()
                else:
                    bare.send([hidden[:rows]], 0, 0).wait()
            else:
                assert buffer is not None
                if on_gpu:
                    bare.recv([flag], 1, 0).wait()
                else:
                    bare.recv([buffer[:rows]], 1, 0).wait()
        elif cmd == "posted":  # (CPU only)
            rows = int(args[0]) * TOKENS
            if role == "engine":
                assert hidden is not None
                bare.recv([flag], 0, 1).wait()
                bare.send([hidden[:rows]], 0, 0).wait()
            else:
                assert buffer is not None
                received = bare.recv([buffer[:rows]], 1, 0)
                bare.send([flag], 1, 1).wait()
                received.wait()
        elif cmd == "http" and role == "trainer":
            got = _http_step(http_port, int(args[0]), device)
            assert got.shape == (int(args[0]) * TOKENS, HIDDEN)
        print(f"done {time.perf_counter() - started:.6f}", flush=True)


def _serve_http(hidden, port: int) -> None:
    """The engine's HTTP side: /generate answers B sequences' hidden states as SGLang does."""
    import asyncio

    import orjson
    from aiohttp import web

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        batch = len(body["text"])
        rows = hidden[: batch * TOKENS].view(batch, TOKENS, HIDDEN).cpu()
        answer = [
            {"text": "", "meta_info": {"id": str(i), "finish_reason": {"type": "length", "length": 1},
                                       "hidden_states": [rows[i].tolist()]}}
            for i in range(batch)
        ]  # fmt: skip
        return web.Response(body=orjson.dumps(answer), content_type="application/json")

    def run() -> None:
        app = web.Application(client_max_size=2**30)
        app.router.add_post("/generate", generate)
        web.run_app(app, host="127.0.0.1", port=port, print=None, handle_signals=False)

    threading.Thread(target=run, daemon=True).start()
    asyncio.run(_wait_port(port))


async def _wait_port(port: int) -> None:
    import asyncio

    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            await asyncio.sleep(0.05)


def _http_step(port: int, batch: int, device: str):
    import http.client

    import orjson
    import torch

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = orjson.dumps({"text": ["x"] * batch, "sampling_params": {"max_new_tokens": 1}, "return_hidden_states": True})
    conn.request("POST", "/generate", body=body, headers={"Content-Type": "application/json"})
    answer = orjson.loads(conn.getresponse().read())
    conn.close()
    got = torch.cat([torch.tensor(a["meta_info"]["hidden_states"][0], dtype=torch.float32) for a in answer])
    return got.to(device)


# -- the harness ---------------------------------------------------------------------------------------
class Pair:
    def __init__(self, device: str, env: dict[str, str]) -> None:
        import psutil

        bare_port, http_port = free_port(), free_port()
        self.procs = {
            role: subprocess.Popen(
                [sys.executable, __file__, "--worker", role, str(bare_port), str(http_port), device],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env={**os.environ, **env},
            )
            for role in ("trainer", "engine")
        }
        self.ps = {role: psutil.Process(p.pid) for role, p in self.procs.items()}
        for proc in self.procs.values():
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"

    def cpu(self) -> float:
        return sum(sum(p.cpu_times()[:2]) for p in self.ps.values())

    def step(self, command: str, roles: tuple[str, ...] = ("trainer", "engine")) -> tuple[float, float, float]:
        """(seconds, CPU seconds of both workers, the engine's seconds) of one command; the
        seconds are the trainer's, from reading the command to having the tensors (what a trainer
        waits), not the harness's pipe round trips; the engine's likewise, to having sent them."""
        cpu0 = self.cpu()
        seconds = engine_seconds = 0.0
        for role in roles:
            proc = self.procs[role]
            assert proc.stdin is not None
            proc.stdin.write(command + "\n")
            proc.stdin.flush()
        for role in roles:
            stdout = self.procs[role].stdout
            assert stdout is not None
            line = stdout.readline().split()
            assert line[:1] == ["done"], f"{role}: {command}: {line!r}"
            if role == "trainer":
                seconds = float(line[1])
            else:
                engine_seconds = float(line[1])
        return seconds, self.cpu() - cpu0, engine_seconds

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.stdin:
                proc.stdin.write("exit\n")
                proc.stdin.close()
        for proc in self.procs.values():
            proc.wait(timeout=60)


def run(device: str, env: dict[str, str]) -> dict:
    """Every path, round by round; the data plane ("dp") is cuda_ipc on a GPU, gloo on CPU."""
    pair = Pair(device, env)
    planes = ["cuda_ipc", "gloo"] if device == "cuda" else ["gloo"]
    paths = ["bare", *([] if device == "cuda" else ["posted"]), *(f"dp {b}" for b in planes), "http"]
    results = []
    try:
        for batch in BATCHES:
            for backend in planes:
                pair.step(f"plane {backend} {batch} {free_port()}")
            for path in paths:  # warm-up: connections, pages, allocator
                pair.step(f"{path} {batch}")
            samples: dict[str, list[tuple[float, float, float]]] = {path: [] for path in paths}
            for r in range(ROUNDS):
                now = paths if r < HTTP_ROUNDS else paths[:-1]
                for path in now[r % len(now) :] + now[: r % len(now)]:  # each path first in turn
                    samples[path].append(pair.step(f"{path} {batch}"))
            nbytes = batch * TOKENS * HIDDEN * 4
            row: dict = {"batch": batch, "tokens": TOKENS, "hidden": HIDDEN, "bytes": nbytes}
            for path, got in samples.items():
                wall = statistics.median(w for w, _, _ in got)
                key = "dp" if path == f"dp {planes[0]}" else path.replace(" ", "_")  # (dp_gloo beside cuda_ipc)
                row[key] = {
                    "seconds": round(wall, 6),
                    "gb_per_s": round(nbytes / wall / 1e9, 4),
                    "cpu_seconds": round(statistics.mean(c for _, c, _ in got), 5),  # (psutil ticks: 10 ms)
                    "engine_seconds": round(statistics.median(e for _, _, e in got), 6),
                    "samples": len(got),
                }
            main = f"dp {planes[0]}"
            row["dp_vs_http"] = round(row["http"]["seconds"] / row["dp"]["seconds"], 1)
            # Paired: each round's bare step beside that round's data-plane step (the drift of the
            # machine moves both), the median over rounds with its quartiles.
            paired = sorted(b[0] / d[0] for b, d in zip(samples["bare"], samples[main], strict=True))
            quartiles = statistics.quantiles(paired, n=4) if len(paired) > 1 else [paired[0]] * 3
            row["dp_vs_bare"] = round(statistics.median(paired), 3)
            row["dp_vs_bare_quartiles"] = [round(quartiles[0], 3), round(quartiles[2], 3)]
            if "posted" in samples:
                paired = sorted(b[0] / d[0] for b, d in zip(samples["posted"], samples[main], strict=True))
                quartiles = statistics.quantiles(paired, n=4) if len(paired) > 1 else [paired[0]] * 3
                row["dp_vs_posted"] = round(statistics.median(paired), 3)
                row["dp_vs_posted_quartiles"] = [round(quartiles[0], 3), round(quartiles[2], 3)]
            if "dp_gloo" in row:
                row["dp_vs_gloo"] = round(row["dp_gloo"]["seconds"] / row["dp"]["seconds"], 1)
            results.append(row)
            print(json.dumps(row), flush=True)
    finally:
        pair.close()
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    if device == "cuda":
        import torch

        machine["gpu"] = torch.cuda.get_device_name(0)
        machine["mps"] = bool(env)
    return {
        "machine": machine,
        "device": device,
        "rounds": ROUNDS,
        "http_rounds": HTTP_ROUNDS,
        "results": results,
        "goals": {"dp_vs_http": ">= 20", "dp_vs_bare": ">= 0.9"},
    }


def markdown(report: dict) -> str:
    gpu = report.get("device") == "cuda"
    if gpu:
        where = f"one {report['machine']['gpu']}" + (" under CUDA MPS" if report["machine"]["mps"] else " (no MPS)")
        intro = [
            "# Data plane on one GPU: cuda_ipc vs gloo vs HTTP return_hidden_states vs bare copy",
            "",
            f"One step = B sequences x {TOKENS} tokens x hidden {HIDDEN}, float32, on {where}; engine and trainer",
            "worker processes. bare = the engine copies the bytes into the trainer's buffer (opened once by CUDA",
            "IPC), waits for the copy and says so in one gloo message: the least that moves them between the two",
            "processes (NCCL send/recv refuses two ranks on one GPU). plane = the cuda_ipc data plane: the",
            "engine cuts the forward into prompts (ids and positions copied to the host), waits for the trainer's",
            "ready, copies hidden states and ids/lengths/mask into its buffer and sends the header; gloo plane =",
            "the gloo data plane from the same CUDA tensors (through host memory). engine ms = the engine's own",
            "time of a step (median), the rest of the plane's is the trainer's wait for messages.",
        ]
    else:
        intro = [
            "# Data plane vs HTTP return_hidden_states vs bare send/recv",
            "",
            f"One step = B sequences x {TOKENS} tokens x hidden {HIDDEN}, float32; engine and trainer worker",
            f"processes, gloo on loopback, {report['machine']['cpus']} CPUs. posted = a bare send/recv whose",
            "receive is posted before the engine is told to send (gloo sends a message once its receive is",
            "announced), in the order the plane uses, beside the plain bare the goal reads against.",
        ]
    lines = [
        *intro,
        f"Medians over {report['rounds']} rounds ({report['http_rounds']} for HTTP), each round one step of every "
        "path back to back.",
        "CPU = user + system seconds of both processes per step (mean). plane / bare: the median of each round's",
        "pair (quartiles in brackets). Goals: >= 20x HTTP, >= 0.9x bare.",
        "",
        "| B | MB/step | bare GB/s | data plane GB/s | "
        + ("gloo plane GB/s | plane / gloo plane | " if gpu else "")
        + "HTTP GB/s | plane / HTTP | plane / bare | CPU s: bare | plane | HTTP |"
        + (" ms: bare | plane | of which engine |" if gpu else " posted GB/s | plane / posted |"),
        "|---|---|---|---|" + ("---|---|" if gpu else "") + "---|" * 6 + "---|" * (3 if gpu else 2),
    ]
    for r in report["results"]:
        gloo = f"{r['dp_gloo']['gb_per_s']:.3f} | {r['dp_vs_gloo']}x | " if gpu else ""
        bare, plane = r["bare"]["seconds"] * 1e3, r["dp"]["seconds"] * 1e3
        if gpu:
            ms = f" {bare:.2f} | {plane:.2f} | {r['dp']['engine_seconds'] * 1e3:.2f} |"
        else:
            low, high = r["dp_vs_posted_quartiles"]
            ms = f" {r['posted']['gb_per_s']:.3f} | {r['dp_vs_posted']}x ({low}-{high}) |"
        lines.append(
            f"| {r['batch']} | {r['bytes'] / 2**20:.0f} | {r['bare']['gb_per_s']:.3f} | {r['dp']['gb_per_s']:.3f} | "
            f"{gloo}{r['http']['gb_per_s']:.4f} | {r['dp_vs_http']}x | {r['dp_vs_bare']}x "
            f"({r['dp_vs_bare_quartiles'][0]}-{r['dp_vs_bare_quartiles'][1]}) | {r['bare']['cpu_seconds']:.3f} | "
            f"{r['dp']['cpu_seconds']:.3f} | {r['http']['cpu_seconds']:.3f} |{ms}"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--mps", action="store_true", help="cuda: run both workers as clients of a fresh MPS daemon")
    parser.add_argument("--out", default="", help="name of the results (default data_plane, data_plane_gpu)")
    parser.add_argument(
        "--worker", nargs=4, metavar=("ROLE", "BARE_PORT", "HTTP_PORT", "DEVICE"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.worker:
        role, bare_port, http_port, device = args.worker
        worker(role, int(bare_port), int(http_port), device)
        return
    with _mps(args.mps) as env:
        report = run(args.device, env)
    name = args.out or ("data_plane_gpu" if args.device == "cuda" else "data_plane")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(markdown(report))
    print(markdown(report))


@contextmanager
def _mps(on: bool) -> Iterator[dict[str, str]]:
    """The environment of a client of a fresh MPS daemon (pdctl.node.mps), or nothing."""
    if not on:
        yield {}
        return
    import tempfile

    from pdctl.node import mps

    with tempfile.TemporaryDirectory() as tmp:
        req = {"pipe_dir": f"{tmp}/pipe", "log_dir": f"{tmp}/log"}
        daemon = mps.start(req)
        try:
            yield {"CUDA_MPS_PIPE_DIRECTORY": req["pipe_dir"], "CUDA_MPS_LOG_DIRECTORY": req["log_dir"]}
        finally:
            mps.stop({**req, **daemon, "grace_secs": 30})


if __name__ == "__main__":
    main()
