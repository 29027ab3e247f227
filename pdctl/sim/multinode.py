"""A sim engine over several nodes, as SGLang runs one (``--nnodes N --node-rank k --dist-init-addr H:P``).

Node rank 0 serves the HTTP API and listens on the dist-init address. Node rank k >= 1
holds TP ranks ``k*T/N .. (k+1)*T/N - 1`` (T = ``--tp-size``), joins node 0 there, and
serves only what SGLang 0.5.23's non-zero node ranks serve: the dummy health server
(``GET /ping``, ``/health``, ``/health_generate``; ``/metrics`` with ``--enable-metrics``) on its
``--port`` (sglang/srt/entrypoints/engine.py, ``launch_dummy_health_check_server``).

Node 0 waits for every peer before it loads anything (SGLang's TP ranks rendezvous first);
a peer that goes away afterwards fails node 0's health and ends it with exit 1, as a dead
TP peer fails SGLang's collectives. When node 0 stops it tells its peers to shut down
(SGLang's ShutdownReq broadcast); a peer that has joined ignores SIGTERM, as SGLang's do,
and exits when node 0 tells it to (0) or goes away (1).

The link carries newline-delimited JSON: the peer's hello, node 0's answer, then node 0's
weight-group commands (weights.py) and their replies. It carries no code (no pickle).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from pdctl.errors import SimError
from pdctl.httputil import start_site

log = logging.getLogger("pdctl.sim")
LINE_LIMIT = 64 * 1024 * 1024
"""A weight command lists every tensor of a bucket; large models have long lines."""
HELLO_TIMEOUT_SECS = 10.0
FAIL_EXIT_DELAY_SECS = 1.0
"""How long node 0 answers 503 on /health after a peer died before it exits."""


@dataclass(frozen=True)
class NodeLayout:
    """This process's place in a multi-node engine."""

    nnodes: int
    node_rank: int
    tp_size: int
    dist_init_host: str
    dist_init_port: int

    @classmethod
    def parse(cls, dist_init_addr: str | None, nnodes: int, node_rank: int, tp_size: int) -> NodeLayout | None:
        """None for a one-node engine; ValueError with the flag at fault otherwise."""
        if nnodes < 1:
            raise ValueError(f"--nnodes must be >= 1, got {nnodes}")
        if not 0 <= node_rank < nnodes:
            raise ValueError(f"--node-rank must be in [0, {nnodes - 1}] for --nnodes {nnodes}, got {node_rank}")
        if nnodes == 1:
            return None
        if not dist_init_addr:
            raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address)")
        host, sep, port = dist_init_addr.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--dist-init-addr must be HOST:PORT, got {dist_init_addr!r}")
        if tp_size % nnodes:
            raise ValueError(f"--tp-size {tp_size} must be a multiple of --nnodes {nnodes}")
        return cls(nnodes, node_rank, tp_size, host.strip("[]"), int(port))

    @property
    def tp_per_node(self) -> int:
        """TP ranks on each node: ``tp_size // nnodes``."""
        return self.tp_size // self.nnodes

    @property
    def first_tp_rank(self) -> int:
        """This node's first TP rank."""
        return self.node_rank * self.tp_per_node

    def hello(self, model_path: str) -> dict[str, Any]:
        """The first message a peer node sends node 0: what node 0 checks before it accepts the peer."""
        return {
            "hello": "pdctl-sim",
            "node_rank": self.node_rank,
            "nnodes": self.nnodes,
            "tp_size": self.tp_size,
            "model_path": model_path,
        }


def _line(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


async def _read(reader: asyncio.StreamReader) -> dict[str, Any] | None:
    """The next message, or None at EOF (a broken or garbled link counts as EOF)."""
    try:
        raw = await reader.readline()
        return json.loads(raw) if raw else None
    except (ConnectionError, ValueError):
        return None


class RemotePeer:
    """A node of this engine as node 0's weight group sees it (weights.Peer).

    ``send``/``recv`` are called from worker threads (the weight routes run blocking group
    work off the event loop); they hop onto the loop that owns the connection."""

    def __init__(self, node_rank: int, ranks: int, writer: asyncio.StreamWriter, loop: asyncio.AbstractEventLoop):
        self.node_rank = node_rank
        self.ranks = ranks
        self._writer = writer
        self._loop = loop
        self._replies: asyncio.Queue[tuple[bool, Any]] = asyncio.Queue()
        self.lost: str | None = None

    def send(self, command: dict[str, Any]) -> None:
        """Send ``command`` to the peer node from a worker thread, waiting up to 30 seconds for it to be written;
        nothing is sent once the peer is lost."""
        if self.lost is None:
            asyncio.run_coroutine_threadsafe(self._write(command), self._loop).result(30)

    def recv(self) -> tuple[bool, Any]:
        """The peer's next reply as ``(ok, value)``, blocking the calling worker thread until it comes; ``(False,
        reason)`` once the peer is lost."""
        return asyncio.run_coroutine_threadsafe(self._replies.get(), self._loop).result()

    def close(self) -> None:
        """The hub owns the connection."""

    async def _write(self, command: dict[str, Any]) -> None:
        self._writer.write(_line(command))
        await self._writer.drain()

    def reply(self, message: dict[str, Any]) -> None:
        """Queue a reply message read from the peer's link, for ``recv`` (event loop only)."""
        self._replies.put_nowait((bool(message.get("ok")), message.get("value") or message.get("error")))

    def mark_lost(self, reason: str) -> None:
        """Record that the peer went away for ``reason``: later sends do nothing and a waiting ``recv`` fails with the
        reason."""
        self.lost = reason
        self._replies.put_nowait((False, reason))  # a command waiting on this peer fails now


class PeerHub:
    """Node 0's end: accepts every peer on the dist-init address, then watches them."""

    def __init__(self, layout: NodeLayout, model_path: str, on_lost: Callable[[str], None]):
        self.layout = layout
        self.model_path = model_path
        self.on_lost = on_lost
        self.peers: dict[int, RemotePeer] = {}
        self._writers: list[asyncio.StreamWriter] = []
        self._all_joined = asyncio.Event()
        self._failed: str | None = None
        self._stopping = False
        self._server: asyncio.base_events.Server | None = None

    async def start(self, timeout_secs: float) -> list[RemotePeer]:
        """Listen, and return the peers in node-rank order once all have joined.

        Raises SimError when they have not joined in time or one leaves during the wait."""
        lay = self.layout
        self._server = await asyncio.start_server(
            self._accept, lay.dist_init_host, lay.dist_init_port, limit=LINE_LIMIT
        )
        log.info(
            "node 0 of %d: waiting for node ranks 1..%d on %s:%d",
            lay.nnodes,
            lay.nnodes - 1,
            lay.dist_init_host,
            lay.dist_init_port,
        )
        try:
            await asyncio.wait_for(self._all_joined.wait(), timeout_secs)
        except asyncio.TimeoutError:
            missing = sorted(set(range(1, lay.nnodes)) - set(self.peers))
            raise SimError(f"node ranks {missing} did not join within {timeout_secs:.0f}s (--dist-timeout)") from None
        finally:
            self._server.close()  # no one else may join an engine that is whole
        if self._failed:
            raise SimError(self._failed)
        log.info("all %d nodes joined", lay.nnodes)
        return [self.peers[k] for k in sorted(self.peers)]

    async def stop(self) -> None:
        """Tell every peer to shut down (SGLang's ShutdownReq), then close the links."""
        self._stopping = True
        for writer in self._writers:
            with contextlib.suppress(ConnectionError, RuntimeError):
                writer.write(_line({"op": "shutdown"}))
                await asyncio.wait_for(writer.drain(), 5)
            writer.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        try:
            hello = await asyncio.wait_for(_read(reader), HELLO_TIMEOUT_SECS)
        except asyncio.TimeoutError:
            hello = None
        problem = self._check(hello)
        if problem:
            log.warning("refused a peer from %s: %s", writer.get_extra_info("peername"), problem)
            with contextlib.suppress(ConnectionError):
                writer.write(_line({"ok": False, "error": problem}))
                await writer.drain()
            writer.close()
            return
        assert hello is not None
        rank = int(hello["node_rank"])
        peer = RemotePeer(rank, self.layout.tp_per_node, writer, asyncio.get_running_loop())
        self.peers[rank] = peer
        writer.write(_line({"ok": True}))
        await writer.drain()
        log.info(
            "node rank %d joined from %s (TP ranks %d..%d)",
            rank,
            writer.get_extra_info("peername"),
            rank * peer.ranks,
            (rank + 1) * peer.ranks - 1,
        )
        if len(self.peers) == self.layout.nnodes - 1:
            self._all_joined.set()
        while (message := await _read(reader)) is not None:
            peer.reply(message)
        reason = f"TP peer node rank {rank} went away"
        peer.mark_lost(reason)
        if self._stopping:
            return
        if not self._all_joined.is_set():  # during start: start() fails with this
            self._failed = reason
            self._all_joined.set()
            return
        self.on_lost(reason)

    def _check(self, hello: dict[str, Any] | None) -> str | None:
        lay = self.layout
        if not isinstance(hello, dict) or hello.get("hello") != "pdctl-sim":
            return "not a pdctl sim node (no hello)"
        mine = lay.hello(self.model_path)
        for key in ("nnodes", "tp_size", "model_path"):
            if hello.get(key) != mine[key]:
                return f"{key} {hello.get(key)!r} differs from node 0's {mine[key]!r}"
        rank = hello.get("node_rank")
        if not isinstance(rank, int) or not 1 <= rank < lay.nnodes:
            return f"node_rank {rank!r} is not in 1..{lay.nnodes - 1}"
        if rank in self.peers:
            return f"node rank {rank} has already joined"
        return None


# -- node rank k >= 1 ---------------------------------------------------------------------------
async def _join(layout: NodeLayout, model_path: str, timeout_secs: float):
    """Connect to node 0 (retrying until it listens) and say hello; the open link."""
    deadline = time.monotonic() + timeout_secs
    where = f"{layout.dist_init_host}:{layout.dist_init_port}"
    while True:
        try:
            reader, writer = await asyncio.open_connection(
                layout.dist_init_host, layout.dist_init_port, limit=LINE_LIMIT
            )
            break
        except OSError as exc:
            if time.monotonic() > deadline:
                raise SimError(f"node 0 at {where} did not answer within {timeout_secs:.0f}s: {exc}") from exc
            await asyncio.sleep(0.2)
    writer.write(_line(layout.hello(model_path)))
    await writer.drain()
    answer = await _read(reader)
    if not answer or not answer.get("ok"):
        raise SimError(
            f"node 0 at {where} refused node rank {layout.node_rank}: {(answer or {}).get('error', 'link closed')}"
        )
    return reader, writer


def health_app(enable_metrics: bool) -> web.Application:
    """SGLang's dummy health server of a non-zero node rank."""

    async def ok(_: web.Request) -> web.Response:
        return web.Response(status=200)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text="", content_type="text/plain")  # this node's schedulers export nothing here

    app = web.Application()
    for path in ("/ping", "/health", "/health_generate"):
        app.router.add_get(path, ok)
    if enable_metrics:
        app.router.add_get("/metrics", metrics)
    return app


async def run_peer(
    layout: NodeLayout, model_path: str, host: str, port: int, *, enable_metrics: bool, timeout_secs: float
) -> int:
    """Run node rank ``layout.node_rank`` until node 0 ends it; the process's exit code."""
    reader, writer = await _join(layout, model_path, timeout_secs)
    first = layout.first_tp_rank
    log.info(
        "node rank %d of %d joined node 0: TP ranks %d..%d",
        layout.node_rank,
        layout.nnodes,
        first,
        first + layout.tp_per_node - 1,
    )
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(
        signal.SIGTERM,
        lambda: log.warning(
            "SIGTERM received on node_rank %d; waiting for the rank-0 ShutdownReq broadcast to stop the schedulers.",
            layout.node_rank,
        ),
    )
    from pdctl.sim.weights import WeightGroupMember, run_command  # torch: a peer node holds TP ranks

    member = await asyncio.to_thread(WeightGroupMember, layout.tp_per_node)
    runner, bound = await start_site(health_app(enable_metrics), host, port)
    log.info("dummy health server on http://%s:%d", host, bound)
    try:
        while (command := await _read(reader)) is not None:
            if command.get("op") == "shutdown":
                log.info("node 0 asked to shut down")
                return 0
            try:
                value = await asyncio.to_thread(run_command, member, {}, command)
                reply = {"ok": True, "value": value}
            except Exception as exc:  # the error goes back to node 0, which reports it
                reply = {"ok": False, "error": f"node rank {layout.node_rank}: {type(exc).__name__}: {exc}"}
            writer.write(_line(reply))
            await writer.drain()
        log.error("node 0 went away; exiting (its TP ranks cannot run alone)")
        return 1
    finally:
        writer.close()
        await runner.cleanup()
        await asyncio.to_thread(member.close)
