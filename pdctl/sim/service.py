"""SimService: one started sim engine as its routes see it (native, OpenAI, weights).

It exists only once the model is loaded and the engine runs, so nothing in it is Optional.
It turns request items into engine requests (resolving PD legs: a decode reserves a KV slot
and fetches the prefill's KV first), yields their progress, and aborts what a route leaves
unfinished (a client that went away, a failed batch).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import aiohttp

from pdctl.errors import SimError
from pdctl.sglang import FAKE_BOOTSTRAP_HOST
from pdctl.sim.config import SimConfig
from pdctl.sim.engine import Engine, Mode, Request
from pdctl.sim.kv import Heartbeats, KVStore, bootstrap_timeout_secs, fetch_kv, waiting_timeout_secs
from pdctl.sim.metrics import SimMetrics
from pdctl.sim.model import TinyLM
from pdctl.sim.requests import ItemSpec
from pdctl.sim.sampling import SamplingOptions
from pdctl.sim.weights import WeightGroupMember

Progress = tuple[int, bool]
"""What the engine reports after each step of a request: (output tokens so far, finished)."""


class ProgressPost:
    """Progress reports from the scheduler's thread to the event loop's queues, with one wake-up of
    the loop per burst: a decode step reports a token of every running request, and a
    ``call_soon_threadsafe`` per token (a write to the loop's wake-up pipe, a loop iteration)
    cost the engine more CPU than the rest of the token's work."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue[Progress], Progress]] = []

    def put(self, queue: asyncio.Queue[Progress], progress: Progress) -> None:
        """Deliver ``progress`` to ``queue`` on the loop (any thread; never blocks for long)."""
        with self._lock:
            wake = not self._pending
            self._pending.append((queue, progress))
        if wake:  # the first of a burst wakes the loop; the rest ride along
            self._loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for queue, progress in pending:
            queue.put_nowait(progress)


@dataclass(frozen=True)
class Running:
    """One submitted request and the queue its progress arrives on."""

    request: Request
    progress: asyncio.Queue[Progress]


class SimService:
    """One started engine as its routes see it: the config, model, scheduler, weight group, metrics and the engine's
    current role and status. It submits request items to the engine (resolving PD legs first), reports their progress
    and aborts what a route leaves unfinished. Built on the event loop, once the model is loaded."""

    def __init__(
        self,
        config: SimConfig,
        model: TinyLM,
        engine: Engine,
        members: WeightGroupMember,
        metrics: SimMetrics,
        session: aiohttp.ClientSession,
        *,
        bootstrap_port: int,
        kv_store: KVStore | None = None,
    ):
        self.config = config
        self.model = model
        self.engine = engine
        self.members = members
        self.metrics = metrics
        self.session = session
        self.bootstrap_port = bootstrap_port
        self.kv_store = kv_store
        """The bootstrap server's rooms (a prefill's, and every engine's with --enable-pd-role-switch)."""
        self.mode = config.disaggregation_mode
        """prefill, decode or null; a role switch (pdctl.sim.role_switch) changes it."""
        self.decode_graphs = self.mode == "decode"
        """Whether decode CUDA graphs were "captured" (started as a decode, or switched to one)."""
        self.port = config.port  # the bound port once the HTTP site runs (port 0 binds a free one)
        self.status = "starting"  # starting -> up -> stopping, or failed (a TP peer node died)
        self.started_at = time.time()
        self.weight_session_open = False
        self.prealloc_waiting = 0
        self.bootstrap_waiting = 0
        """Prefill requests waiting for their decode's handshake (SGLang's prefill bootstrap queue)."""
        self.transferring = 0
        """Decode requests whose KV is on its way (SGLang's transfer queue)."""
        self.entering = 0  # requests past the queue-size check, not in the engine's queue yet
        self.resolving = 0  # requests not in the engine yet: a decode's waiting for a KV slot or its KV
        self.abort_epoch = 0
        """Counts every abort of all requests (``/pause_generation`` abort, ``/abort_request``
        abort_all, a version update's abort): a request still resolving its PD leg when one comes
        is aborted as it enters the engine, as SGLang aborts its decode prealloc and transfer
        queues (scheduler.py ``abort_request``): its KV may come from the weights before an update."""
        self.heartbeats = Heartbeats()  # the prefills this decode has lost (one verdict per prefill)
        self._prealloc_line = asyncio.Lock()  # FIFO: decode requests waiting for a KV slot, in arrival order
        self._slot_freed = asyncio.Event()  # set by the engine when a slot or a reservation frees
        loop = asyncio.get_running_loop()
        self._post = ProgressPost(loop)

        def capacity_freed() -> None:  # called on the scheduler thread
            loop.call_soon_threadsafe(self._slot_freed.set)

        engine.on_capacity = capacity_freed
        engine.hold_transfers_apart(self.mode == "decode")

    def idle(self) -> bool:
        """SGLang's ``is_fully_idle``: nothing running or queued, no decode request waiting for a
        KV slot or its KV (what ``/pd_role_switch`` requires)."""
        stats = self.engine.stats()  # (what busy() counts, and the decode slots reserved for KV to come)
        waiting = stats["num_running_reqs"] or stats["num_queue_reqs"] or stats["num_reserved_decode_slots"]
        return not waiting and not self.engine.busy() and self.resolving == 0

    @property
    def weight_version(self) -> str:
        """The engine's current weight version."""
        return self.engine.weight_version

    # -- submitting --------------------------------------------------------------------------------
    async def submit(self, items: list[ItemSpec], *, stream: bool = False) -> list[Running]:
        """Create and submit one engine Request per item (PD legs resolved here). ``stream``: the
        route streams the answer, so progress comes as the items' ``stream_interval`` (else the
        engine's ``--stream-interval``) says, as SGLang streams; otherwise only the end comes.

        For a decode leg this reserves a KV slot and fetches the KV from the prefill first. The
        items of a batch are resolved side by side and each enters the engine as soon as its KV
        is there, as SGLang's tokenizer manager sends a batch's items as separate requests: a
        batch never holds slots while it waits for more (several large batches together would
        otherwise each hold part of the slots and wait for the rest, for ever).
        Raises SimError: 400 for bad PD fields, 500 for KV that cannot come, 503 for a full queue;
        then no item of the batch runs on.
        """
        if not self.config.enable_return_hidden_states and any(i.return_hidden_states for i in items):
            raise SimError(  # SGLang's TokenizerManager._validate_one_request, word for word
                "The server is not configured to return the hidden states. "
                "Please set `--enable-return-hidden-states` to enable this feature."
            )
        post = self._post.put
        out: list[Running] = []
        for item in items:
            queue: asyncio.Queue[Progress] = asyncio.Queue()

            def emit(req: Request, q: asyncio.Queue[Progress] = queue) -> None:
                post(q, (len(req.output_ids), req.finish is not None))

            req = Request(
                rid=item.rid or self.engine.new_rid(),
                input_ids=item.input_ids,
                sampling=item.sampling,
                emit=emit,
                stream_interval=max(1, item.sampling.stream_interval or self.config.stream_interval) if stream else 0,
                return_logprob=item.return_logprob,
                top_logprobs_num=item.top_logprobs_num,
                return_hidden_states=item.return_hidden_states,
            )
            out.append(Running(req, queue))
        limit = self.config.max_queued_requests  # (a null-mode server: no slot is reserved)
        queued = limit is not None and self.mode == "null"
        if limit is not None and queued:
            # Requests let in but not in the engine's queue yet count too: a burst checked before any
            # of it was queued would all pass.
            if self.engine.stats()["num_queue_reqs"] + self.entering + len(out) > limit:
                raise SimError("The request queue is full.", status=503)  # SGLang's words and status
            self.entering += len(out)
        submitted: list[Request] = []

        async def start(running: Running, item: ItemSpec) -> None:
            self.resolving += 1
            epoch = self.abort_epoch
            try:
                await self._resolve_pd(running.request, item)
                self.engine.submit(running.request)  # no await since its KV came: it runs at once
                submitted.append(running.request)
                if self.abort_epoch != epoch:  # an abort of all came while it waited for its slot or KV
                    self.engine.abort_requests([running.request], "Aborted")
            finally:
                self.resolving -= 1
                if queued:
                    self.entering -= 1

        starts = [asyncio.ensure_future(start(r, item)) for r, item in zip(out, items, strict=True)]
        try:
            await asyncio.gather(*starts)
        except BaseException:  # one item failed (or the client left): none of the batch runs on
            for task in starts:
                task.cancel()
            await asyncio.gather(*starts, return_exceptions=True)  # each gives back its own slot
            self.engine.abort_requests(submitted, "another item of the batch failed")
            raise
        self.metrics.requests_started(len(out))
        return out

    @contextlib.contextmanager
    def aborting_unfinished(self, batch: list[Running], reason: str = "client disconnected") -> Iterator[None]:
        """Whatever ends the block (an answer, an error, a client that went away), the engine
        stops working on the requests of ``batch`` that have not finished."""
        try:
            yield
        finally:  # one pass whatever the batch's size (aborting by rid would search per request)
            self.engine.abort_requests((r.request for r in batch), reason)

    async def _reserve_decode_slot(self) -> None:
        """Wait, in arrival order, for a KV slot (SGLang's decode prealloc queue: a full decode
        queues its requests, it does not refuse them). A client that goes away leaves the line."""
        self.prealloc_waiting += 1
        try:
            async with self._prealloc_line:
                while True:
                    self._slot_freed.clear()
                    if self.engine.reserve_slot():
                        break
                    with contextlib.suppress(asyncio.TimeoutError):  # a safety net: frees wake it at once
                        await asyncio.wait_for(self._slot_freed.wait(), 0.1)
        finally:
            self.prealloc_waiting -= 1

    async def _wait_bootstrap(self, room: int) -> None:
        """Wait until the decode of ``room`` has a slot for it (its first ask for the KV), as
        SGLang's prefill keeps a request in its bootstrap queue until the decode preallocated;
        SimError once SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT passes."""
        assert self.kv_store is not None
        self.bootstrap_waiting += 1
        try:
            timeout = bootstrap_timeout_secs()
            if not await self.kv_store.wait_bootstrap(room, timeout):
                raise SimError(
                    f"bootstrap_room {room}: no decode asked for its KV within {timeout:g}s "
                    "(SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT)",
                    status=500,
                )
        finally:
            self.bootstrap_waiting -= 1

    async def _resolve_pd(self, req: Request, item: ItemSpec) -> None:
        if self.mode == "null":
            return
        fake = item.bootstrap_host == FAKE_BOOTSTRAP_HOST
        if not fake and (item.bootstrap_host is None or item.bootstrap_room is None):
            raise SimError(
                f"this is a PD {self.mode} server: requests need bootstrap_host and bootstrap_room "
                "(send them through a PD router)"
            )
        if self.mode == "prefill":
            req.mode = Mode.PREFILL
            req.room = None if fake else item.bootstrap_room
            if req.room is not None and self.kv_store is not None:
                await self._wait_bootstrap(req.room)
            return
        if fake:  # SGLang moves no KV for 2.2.2.2 (warm-up, /health); the sim runs the prompt itself
            # ...but takes it through the prealloc queue as every decode request: queued without a
            # slot, ahead of requests whose slots wait for their KV, it stalled them all behind it
            await self._reserve_decode_slot()
            req.reserved = True
            return
        assert item.bootstrap_host is not None and item.bootstrap_room is not None  # checked above
        sent_at = time.time()  # the prefill that got this room is one that had started by now
        await self._reserve_decode_slot()
        req.reserved, req.mode = True, Mode.DECODE
        port = item.bootstrap_port if item.bootstrap_port is not None else self.config.bootstrap_port
        started = time.monotonic()
        self.transferring += 1
        try:
            payload = await fetch_kv(
                self.session,
                item.bootstrap_host,
                port,
                item.bootstrap_room,
                waiting_timeout_secs(),
                self.heartbeats,
                sent_at,
            )
            if payload.prompt_ids != req.input_ids:
                raise SimError(f"KV of bootstrap_room {item.bootstrap_room} belongs to another prompt")
            profile = self.engine.profile
            if profile is not None:  # from when the KV was ready: its bytes over the profile's link (the sim sent none)
                await asyncio.sleep(profile.transfer_ms(len(req.input_ids)) / 1000)
        except BaseException as exc:  # the reserved slot is given back on every failure
            self.engine.release_slot()
            req.reserved = False
            if isinstance(exc, SimError):
                self.metrics.transfer_failed()
                raise SimError(str(exc), status=500) from exc
            raise
        finally:
            self.transferring -= 1
        profile = self.engine.profile
        nbytes = (
            len(req.input_ids) * profile.kv_bytes_per_token
            if profile is not None
            else payload.kv.numel() * payload.kv.element_size()
        )
        self.metrics.kv_transferred(time.monotonic() - started, nbytes)
        req.kv = payload

    # -- progress ----------------------------------------------------------------------------------
    @staticmethod
    async def updates(running: Running) -> AsyncIterator[Progress]:
        """(token count, finished) after each update, until the request finishes."""
        while True:
            n, done = await running.progress.get()
            while not running.progress.empty():  # coalesce: each chunk carries the cumulative text
                n, done = running.progress.get_nowait()
            yield n, done
            if done:
                return

    async def finished(self, running: Running) -> int:
        """Wait for the request to finish; its output token count."""
        tokens = 0
        async for n, _ in self.updates(running):
            tokens = n
        return tokens

    async def interleaved(self, batch: list[Running]) -> AsyncIterator[tuple[int, int, bool]]:
        """(index in batch, token count, finished) after each update of any request of ``batch``,
        in the order they happen (a batch streams its items side by side, as SGLang's does)."""
        if len(batch) == 1:  # (most streams: no pump task and second queue per update)
            async for n, done in self.updates(batch[0]):
                yield 0, n, done
            return
        merged: asyncio.Queue[tuple[int, int, bool] | None] = asyncio.Queue()

        async def pump(index: int, running: Running) -> None:
            async for n, done in self.updates(running):
                await merged.put((index, n, done))
            await merged.put(None)

        tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(batch)]
        try:
            remaining = len(tasks)
            while remaining:
                event = await merged.get()
                if event is None:
                    remaining -= 1
                else:
                    yield event
        finally:
            for task in tasks:
                task.cancel()

    async def one_token(self, timeout_secs: float = 20.0) -> None:
        """SGLang's health probe: one token for input_ids [0] (fake bootstrap host in PD)."""
        pd = self.mode != "null"
        item = ItemSpec(
            None,
            [0],
            SamplingOptions(max_new_tokens=1, temperature=0.0),
            False,
            FAKE_BOOTSTRAP_HOST if pd else None,
            None,
            0 if pd else None,
        )
        loop = asyncio.get_running_loop()
        progressed = asyncio.Event()

        def told() -> None:  # on the scheduler's thread
            loop.call_soon_threadsafe(progressed.set)

        unwatch = self.engine.watch_progress(told)
        try:
            batch = await self.submit([item])
            with self.aborting_unfinished(batch, "health check timed out"):
                # SGLang's health check passes on any output the scheduler gives after it began
                # (``last_receive_tstamp``): a scheduler busy with a large batch is healthy.
                own = asyncio.ensure_future(self.finished(batch[0]))
                other = asyncio.ensure_future(progressed.wait())
                try:
                    done, _ = await asyncio.wait(
                        {own, other}, timeout=timeout_secs, return_when=asyncio.FIRST_COMPLETED
                    )
                finally:
                    own.cancel()
                    other.cancel()
                if not done:
                    raise asyncio.TimeoutError
                if own in done:
                    own.result()
        finally:
            unwatch()
