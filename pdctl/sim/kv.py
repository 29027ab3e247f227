"""PD KV hand-off: the prefill's bootstrap server and the decode's fetch.

A prefill keeps each prompt's KV under its ``bootstrap_room`` and serves it from an aiohttp
server on ``--disaggregation-bootstrap-port`` (``GET /health`` -> ``OK`` as in SGLang, plus
``GET /kv/{room}``, which long-polls until the room's KV exists: the router sends both legs
at once, so decode usually asks before prefill is done). The body is binary: a 4-byte header
length, a JSON header, then the KV tensor's raw float64 bytes. An entry is dropped once
fetched, or after SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT seconds.

A decode asks for a room's KV once it has reserved the room's slot (its prealloc queue), so the
first ask is the room's handshake (``bootstrap``): as SGLang's prefill keeps a request in its
bootstrap queue until the decode has preallocated for it, the sim's prefill starts a room's
prompt only after it (``wait_bootstrap``). Without it the prefills computed prompts no decode had
room for, while the rooms the decodes had reserved waited behind them.

A decode that cannot reach the prefill's bootstrap server gives its rooms up as SGLang's
heartbeat checker does (SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL, 5 s, times
SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE, 2): a dead prefill fails its decode requests in
seconds instead of leaving them to SGLANG_DISAGGREGATION_WAITING_TIMEOUT (300 s). As in SGLang,
the verdict is per prefill, not per request (``Heartbeats``): once a bootstrap server is lost,
every other room waiting on it fails after one failed check, not after a heartbeat period each.
"""

from __future__ import annotations

import asyncio
import json
import os
import struct
import time

import aiohttp
import torch
from aiohttp import web

from pdctl.errors import SimError
from pdctl.sim.engine import KVPayload
from pdctl.sim.model import DTYPE

POLL_SLICE_SECS = 10.0  # one long-poll request waits at most this long; the client loops
STARTED_HEADER = "X-Sim-Bootstrap-Started"
"""The wall-clock time its bootstrap server started, on each answer of ``/kv/{room}``."""


def bootstrap_timeout_secs() -> float:
    return float(os.environ.get("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "300"))


def waiting_timeout_secs() -> float:
    """How long decode waits for KV (SGLang's SGLANG_DISAGGREGATION_WAITING_TIMEOUT, 300 s)."""
    return float(os.environ.get("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "300"))


def heartbeat_interval_secs() -> float:
    return float(os.environ.get("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", "5.0"))


def heartbeat_max_failure() -> int:
    return max(1, int(os.environ.get("SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", "2")))


def pack(payload: KVPayload) -> bytes:
    kv = payload.kv.to(DTYPE).contiguous()
    header = json.dumps(
        {
            "prompt_ids": payload.prompt_ids,
            "shape": list(kv.shape),
            "first_token": payload.first_token,
            "first_logprob": payload.first_logprob,
            "first_top": payload.first_top,
            "weight_version": payload.weight_version,
        }
    ).encode()
    return struct.pack("!I", len(header)) + header + kv.numpy().tobytes()


def unpack(data: bytes) -> KVPayload:
    (size,) = struct.unpack("!I", data[:4])
    header = json.loads(data[4 : 4 + size])
    raw = data[4 + size :]
    # (a profile engine's KV holds no positions: torch.frombuffer refuses an empty buffer)
    kv = (
        torch.frombuffer(bytearray(raw), dtype=DTYPE).view(*header["shape"])
        if raw
        else torch.zeros(header["shape"], dtype=DTYPE)
    )
    return KVPayload(
        header["prompt_ids"],
        kv,
        header["first_token"],
        header["first_logprob"],
        header["weight_version"],
        [tuple(pair) for pair in header.get("first_top", [])],
    )


class KVStore:
    """Rooms -> KV, owned by the event loop. ``put`` may be called from any thread.

    A room's entry is its KV, or a message when the prefill aborted the request (the decode
    waiting for it is told at once, as SGLang's KV sender reports a failed transfer)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.entries: dict[int, tuple[float, KVPayload | str]] = {}
        self.waiters: dict[int, asyncio.Event] = {}
        self.bootstrapped: dict[int, float] = {}
        """Rooms a decode has asked for (it holds their slots), not yet started here: when it asked."""
        self.boot_waiters: dict[int, asyncio.Event] = {}

    def bootstrap(self, room: int) -> None:
        """A decode asked for ``room``: it holds the room's slot, so its prompt may start here
        (wakes ``wait_bootstrap``). A handshake whose prompt never came goes with the stale KV
        entries (``_expire``)."""
        self.bootstrapped.setdefault(room, time.monotonic())
        event = self.boot_waiters.pop(room, None)
        if event is not None:
            event.set()

    async def wait_bootstrap(self, room: int, timeout_secs: float) -> bool:
        """Wait until a decode has asked for ``room`` (``bootstrap``); False after ``timeout_secs``.
        The handshake is used up: a room's prompt starts once."""
        if room not in self.bootstrapped:
            event = self.boot_waiters.setdefault(room, asyncio.Event())
            try:
                await asyncio.wait_for(event.wait(), timeout_secs)
            except asyncio.TimeoutError:
                if self.boot_waiters.get(room) is event:
                    del self.boot_waiters[room]
                return False
        self.bootstrapped.pop(room, None)
        return True

    def put_threadsafe(self, room: int, payload: KVPayload | str) -> None:
        """Store ``payload`` (KV, or the abort message for the decode) under ``room`` from any thread, waking a ``take``
        waiting for it. Entries older than SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT are dropped."""
        self.loop.call_soon_threadsafe(self._put, room, payload)

    def _put(self, room: int, payload: KVPayload | str) -> None:
        self._expire()
        self.entries[room] = (time.monotonic(), payload)
        event = self.waiters.pop(room, None)
        if event is not None:
            event.set()

    def _expire(self) -> None:
        """Drop KV entries and handshakes older than SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT (on each put)."""
        limit = time.monotonic() - bootstrap_timeout_secs()
        for room in [r for r, (t, _) in self.entries.items() if t < limit]:
            del self.entries[room]
        for room in [r for r, t in self.bootstrapped.items() if t < limit]:
            del self.bootstrapped[room]

    async def take(self, room: int, wait_secs: float) -> KVPayload | str | None:
        """Remove and return ``room``'s entry, waiting up to ``wait_secs`` for it to be put; None when it does not come
        in time. An entry is returned once only."""
        if room not in self.entries:
            event = self.waiters.setdefault(room, asyncio.Event())
            try:
                await asyncio.wait_for(event.wait(), wait_secs)
            except asyncio.TimeoutError:
                return None
        entry = self.entries.pop(room, None)
        return entry[1] if entry else None


class PrefillAborted(SimError):
    """The prefill ended the request without KV (an abort); the decode ends it too."""


def bootstrap_app(store: KVStore) -> web.Application:
    started = {STARTED_HEADER: repr(time.time())}

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def get_kv(request: web.Request) -> web.Response:
        try:
            room = int(request.match_info["room"])
            wait = min(float(request.query.get("wait", POLL_SLICE_SECS)), POLL_SLICE_SECS)
        except ValueError:
            return web.json_response({"error": {"message": "bad room or wait"}}, status=400)
        store.bootstrap(room)
        payload = await store.take(room, wait)
        if payload is None:
            return web.json_response({"error": {"message": f"no KV for room {room} yet"}}, status=404, headers=started)
        if isinstance(payload, str):
            return web.json_response({"error": {"message": payload}}, status=410)
        return web.Response(body=pack(payload), content_type="application/octet-stream")

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/kv/{room}", get_kv)
    return app


class Heartbeats:
    """The prefills' bootstrap servers this decode has lost, shared by all its rooms (SGLang's
    heartbeat checker judges a prefill once, and fails all of its rooms): without it, hundreds
    of queued rooms of one dead prefill each spent a heartbeat period in a decode slot, and a
    kill -9 of a prefill under bench_serving stalled the decode for minutes. A server that
    answers again is forgotten."""

    def __init__(self) -> None:
        self._lost: dict[tuple[str, int], str] = {}

    def lost(self, host: str, port: int) -> str | None:
        """Why ``host:port`` was given up, or None while it is not."""
        return self._lost.get((host, port))

    def mark_lost(self, host: str, port: int, why: str) -> None:
        """Give ``host:port`` up for ``why``: rooms waiting on it then fail after one more failed check."""
        self._lost[(host, port)] = why

    def mark_alive(self, host: str, port: int) -> None:
        """Forget that ``host:port`` was lost (it answered again)."""
        self._lost.pop((host, port), None)


async def fetch_kv(
    session: aiohttp.ClientSession,
    host: str,
    port: int,
    room: int,
    timeout_secs: float,
    heartbeats: Heartbeats,
    sent_at: float,
) -> KVPayload:
    """Fetch a room's KV from a prefill's bootstrap server, polling until ``timeout_secs``.

    Raises SimError naming the room, the server and the timeout; or, once the server has been
    unreachable for HEARTBEAT_MAX_FAILURE checks HEARTBEAT_INTERVAL apart, SimError saying the
    connection with the prefill was lost (SGLang's words). A server ``heartbeats`` already lost
    gets one check: if that fails too, the room fails at once. A bootstrap server that started
    after ``sent_at`` (wall clock: when the decode got the request) is a restarted prefill, which
    cannot hold the room: the room fails at once too. (SGLang's prefill answers only once its KV
    reached the decode, so a prefill killed after its answer loses nothing there; the sim's decode
    pulls the KV after the prefill answered, and without this check waited out
    SGLANG_DISAGGREGATION_WAITING_TIMEOUT for a prefill back within the heartbeat window.)
    """
    deadline = time.monotonic() + timeout_secs
    url = f"http://{host}:{port}/kv/{room}"
    last_error = "no answer"
    interval, max_failure = heartbeat_interval_secs(), heartbeat_max_failure()
    misses, first_miss = 0, 0.0  # consecutive unreachable checks, and when the first of them was
    lost_before = heartbeats.lost(host, port)
    while True:
        now = time.monotonic()
        left = deadline - now
        if left <= 0:
            raise SimError(
                f"KV for bootstrap_room {room} did not arrive from {host}:{port} within {timeout_secs:g}s "
                f"(SGLANG_DISAGGREGATION_WAITING_TIMEOUT); last: {last_error}"
            )
        if misses >= max_failure and now - first_miss >= interval * (max_failure - 1):
            why = f"{misses} failed checks in {now - first_miss:.1f}s"
            heartbeats.mark_lost(host, port, why)
            raise SimError(
                f"Lost connection with prefill instance (bootstrap_addr: {host}:{port}) "
                f"for bootstrap_room {room}: {why}; last: {last_error}"
            )
        wait = min(left, POLL_SLICE_SECS)
        try:
            async with session.get(
                url,
                params={"wait": f"{wait:.3f}"},
                timeout=aiohttp.ClientTimeout(total=wait + 5, sock_connect=interval),
            ) as resp:
                misses, lost_before = 0, None
                heartbeats.mark_alive(host, port)
                if resp.status == 200:
                    return unpack(await resp.read())
                if resp.status == 410:  # the prefill aborted the request: no KV will ever come
                    reason = (await resp.json(content_type=None)).get("error", {}).get("message", "aborted")
                    raise PrefillAborted(f"the prefill aborted bootstrap_room {room}: {reason}")
                last_error = f"HTTP {resp.status}"
                restarted = float(resp.headers.get(STARTED_HEADER, "0"))
                if restarted > sent_at:
                    raise SimError(
                        f"Lost connection with prefill instance (bootstrap_addr: {host}:{port}) for bootstrap_room "
                        f"{room}: it restarted after the request came, and its KV went with the old process"
                    )
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            last_error = f"{type(exc).__name__}: {exc}"
            if misses == 0:
                first_miss = time.monotonic()
            misses += 1
            if lost_before is not None:  # judged lost by an earlier room: this check confirms it
                raise SimError(
                    f"Lost connection with prefill instance (bootstrap_addr: {host}:{port}) "
                    f"for bootstrap_room {room}: the server was lost earlier ({lost_before}); last: {last_error}"
                ) from exc
            # the next check comes a heartbeat later (a second at most: a blip costs little)
            await asyncio.sleep(min(interval, 1.0, max(0.0, deadline - time.monotonic())))
