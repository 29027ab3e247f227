"""Legs: sending a request to one worker, reading what its answer means, and ``PairAttempt``,
the one owner of both legs of a PD attempt.

The rules (sglang-protocol.md 2.3, style.md R9):
- each leg counts in its worker's load through one guard (``WorkerRegistry.in_flight``), from
  its start to its end, whatever ends it; legs the router runs as tasks are owned here and
  cancelled on close, and a client that goes away cancels both legs (the engines abort them);
- a prefill that ends the request (an abort in a 200, a 4xx, a 5xx or no answer) cancels its
  decode leg at once, which would otherwise wait for KV until its own timeout; the client gets
  the prefill's answer (an abort or a 4xx is the client's business) or a retry (a failure);
- a decode that fails is blamed only once the prefill's answer is known: when the prefill
  ended the request, the decode only followed it; a decode whose error names the prefill's
  bootstrap server could not get the KV from it, and the prefill is blamed;
- a 429 or 503 from a live worker is backpressure (a busy ``Retry``): the breaker is left alone;
- a connection error or another 5xx is a ``Retry`` that counts against the worker's breaker
  (a refused connection also takes it out of rotation until its next health check);
- a leg that times out (``request_timeout_secs``) ends the request with a 504 (``Stop``);
- a worker's 4xx is the client's fault: returned as is, never retried, and it counts as a
  success for the circuit breaker;
- a failure of a leg that a weight update interrupted (refit ``interrupt``: the engines abort
  what they run) is no fault of the worker: a busy ``Retry`` once the update is released;
- prefill's ``input_token_logprobs`` are put in front of decode's only when asked for.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

from pdctl.router import errors
from pdctl.router.cancels import cancel_requests, withdraw_cancel
from pdctl.router.gate import RefitGate
from pdctl.router.reply import Reply
from pdctl.router.retry import Retry, Stop
from pdctl.router.shaping import Headers, aborted, first_input_logprobs, merged_logprobs, names_bootstrap, server_abort
from pdctl.router.streaming import DONE, Opened, first_block, sse_blocks
from pdctl.router.upstream import Response, Upstream, UpstreamError, UpstreamTimeout
from pdctl.router.workers import Worker, WorkerRegistry

PREFILL_GRACE_SECS = 5.0  # how long a prefill leg may run on after the reply went out without it
VERDICT_GRACE_SECS = 2.0  # how long a failed decode waits for its prefill's answer to learn who failed
BACKPRESSURE = (429, 503)
T = TypeVar("T")
Outcome = Reply | Retry | Stop


@dataclass(slots=True)
class Leg:
    """A buffered response from one worker, or the exception that stopped it."""

    status: int = 0
    body: bytes = b""
    content_type: str = "application/json"
    error: BaseException | None = None
    epoch: int | None = None
    """The refit gate's epoch when the leg was sent (an interrupt began since if it differs);
    None for a leg made up by the router, which no interrupt can explain."""

    @property
    def server_failed(self) -> bool:
        return self.error is not None or self.status >= 500

    @property
    def ends_request(self) -> bool:
        """A prefill answer after which no KV will come: a failure, a 4xx, or an abort."""
        return self.server_failed or self.status >= 400 or aborted(self.body)

    def reply(self, headers: Headers) -> Reply:
        return Reply(self.status, self.body, self.content_type, headers)


class Legs:
    """Sends legs to workers through ``upstream`` and judges their answers; owns the legs in flight."""

    def __init__(self, upstream: Upstream, registry: WorkerRegistry, gate: RefitGate, timeout_secs: float):
        self.upstream = upstream
        self.registry = registry
        self.gate = gate
        self.timeout = timeout_secs
        self._loop: asyncio.AbstractEventLoop | None = None
        self._legs: set[asyncio.Future[Leg]] = set()  # every whole leg in flight; cancelled by close()
        self.grace_secs = PREFILL_GRACE_SECS
        self._graced: dict[asyncio.Future[Leg], float] = {}  # prefill legs the reply went out without
        self._grace_timer: asyncio.TimerHandle | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        # Cached: on Python 3.11 every asyncio.get_running_loop() (inside create_task too) is a
        # getpid() syscall, which was 6% of the router's CPU in a native profile.
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    async def close(self) -> None:
        """Cancel every leg still running (a prefill that outlived its reply, for instance)."""
        if self._grace_timer is not None:
            self._grace_timer.cancel()
            self._grace_timer = None
        await cancel(*self._legs)
        self.upstream.close()

    def start(self, worker: Worker, path: str, data: bytes, headers: Headers) -> asyncio.Future[Leg]:
        """``worker``'s whole answer, as a future that its connection completes (no task and no
        coroutine per leg: they were a large share of the router's CPU per request), counted in
        ``worker``'s load until it is done. Cancelling it closes the connection: the engine
        aborts the request. ``close()`` cancels every leg still running."""
        epoch = self.gate.epoch
        leg: asyncio.Future[Leg] = self.loop.create_future()

        def answered(got: Response | BaseException) -> None:
            if leg.done():
                return
            if isinstance(got, Response):
                leg.set_result(Leg(got.status, got.body, got.content_type, epoch=epoch))
            elif isinstance(got, (UpstreamError, OSError)):
                leg.set_result(Leg(error=got, epoch=epoch))
            else:
                leg.set_exception(got)  # a bug: it reaches whoever awaits the leg

        sending = self.upstream.send(worker.url + path, data, _sent(worker, headers), answered, timeout=self.timeout)
        guard = self.registry.in_flight(worker)
        guard.__enter__()
        legs = self._legs
        legs.add(leg)

        def ended(done: asyncio.Future[Leg]) -> None:
            legs.discard(done)
            guard.__exit__(None, None, None)
            if done.cancelled():
                sending.cancel()

        leg.add_done_callback(ended)
        return leg

    async def open_stream(self, worker: Worker, path: str, data: bytes, headers: Headers) -> Response | Leg:
        """The status and headers of a streamed response, or a Leg carrying why there are none."""
        epoch = self.gate.epoch
        to = _sent(worker, headers)
        try:  # the timeout bounds the head and the first event (``opened`` disarms it then)
            return await self.upstream.post(worker.url + path, data, to, stream=True, timeout=self.timeout)
        except (UpstreamError, OSError) as exc:
            return Leg(error=exc, epoch=epoch)

    async def opened(self, head: Response, epoch: int) -> Opened | Leg:
        """A stream once its first block came; a Leg when it gives none: an error status with
        its body, a failure, or a first event that is a server-side abort (with its status:
        nothing was sent on yet, so it is retried)."""
        try:
            if head.status >= 400:
                return Leg(head.status, await head.read(), head.content_type, epoch=epoch)
            blocks = sse_blocks(head)
            first = await first_block(blocks)
        except BaseException:
            head.close()
            raise
        if isinstance(first, BaseException):
            head.close()
            return Leg(error=first, epoch=epoch)
        head.disarm()  # the rest of a stream may take longer than the request timeout
        status = server_abort(first)
        if status is not None:
            head.close()
            return Leg(status, first + DONE, "text/event-stream", epoch=epoch)
        return Opened(head, first, blocks)

    async def open_first(self, worker: Worker, path: str, data: bytes, headers: Headers, epoch: int) -> Opened | Leg:
        """A stream once its head and first block came, else a Leg saying why not (not counted
        in the worker's load: the caller counts it). ``epoch``: the refit gate's when sent."""
        head = await self.open_stream(worker, path, data, headers)
        return head if isinstance(head, Leg) else await self.opened(head, epoch)

    async def open_one(
        self, worker: Worker, path: str, data: bytes, headers: Headers, epoch: int | None = None
    ) -> Opened | Leg:
        """``open_first``, counted in ``worker``'s load until the stream opened or did not
        (``epoch``: the refit gate's when the attempt was sent; now unless given)."""
        with self.registry.in_flight(worker):
            return await self.open_first(worker, path, data, headers, self.gate.epoch if epoch is None else epoch)

    def verdict(self, worker: Worker, leg: Leg, code: str) -> Retry | Stop | None:
        """What ``worker``'s answer means for the request (module docstring): None when it
        answered (a 2xx to 4xx but 429: the answer goes to the client; ok for the breaker)."""
        if (
            (leg.error is not None or leg.status >= 500)
            and not isinstance(leg.error, UpstreamTimeout)
            and self.interrupted(leg)
        ):
            return Retry(f"{worker.role} {worker.url}: interrupted by a weight update", errors.INTERRUPTED, busy=True)
        if leg.error is not None:
            self.registry.record(worker, False)
            if isinstance(leg.error, UpstreamTimeout):
                return Stop(504, errors.TIMEOUT, f"{worker.role} {worker.url}: {leg.error}")
            self.registry.mark_failed(worker, leg.error)
            return Retry(f"{worker.role} {worker.url} failed: {type(leg.error).__name__}: {leg.error}", code)
        if leg.status in BACKPRESSURE:
            return Retry(f"{worker.role} {worker.url} is busy ({leg.status}): {leg.body[:200]!r}", code, busy=True)
        self.registry.record(worker, leg.status < 500)
        if leg.status >= 500:
            answer = Reply(leg.status, leg.body, leg.content_type)
            return Retry(f"{worker.role} {worker.url} answered {leg.status}: {leg.body[:300]!r}", code, answer=answer)
        return None

    def interrupted(self, leg: Leg) -> bool:
        """Whether a weight update began after ``leg`` was sent."""
        return leg.epoch is not None and self.gate.interrupted_since(leg.epoch)

    def finish_unawaited(self, prefill: Worker, leg: asyncio.Future[Leg]) -> None:
        """The reply does not need prefill's answer: record its outcome when it comes, without
        holding the reply, and cancel it if it takes longer than ``grace_secs``."""

        def record(done: asyncio.Future[Leg]) -> None:
            self._graced.pop(done, None)
            if not done.cancelled() and done.result().status not in BACKPRESSURE:
                self.registry.record(prefill, not done.result().server_failed)

        if leg.done():  # the common case: prefill answered first
            record(leg)
            return
        # One timer for all the legs in their grace, not one each (a timer armed and cancelled
        # per request cost microseconds): they end in the order they began it.
        self._graced[leg] = self.loop.time() + self.grace_secs
        leg.add_done_callback(record)
        if self._grace_timer is None:
            self._grace_timer = self.loop.call_later(self.grace_secs, self._end_grace)

    def _end_grace(self) -> None:
        """Cancel the legs whose grace is over; wait on for the next one's."""
        now = self.loop.time()
        over = []
        for leg, deadline in self._graced.items():
            if deadline > now:
                self._grace_timer = self.loop.call_at(deadline, self._end_grace)
                break
            over.append(leg)
        else:
            self._grace_timer = None
        for leg in over:
            leg.cancel()  # its done callback forgets it
            self._graced.pop(leg, None)


class PairAttempt:
    """Both legs of one PD attempt, from start to finish. The prefill is a leg future (``Legs``
    owns it); the decode is awaited in the caller's task, raced against it (``race``). Closing
    the attempt cancels the prefill unless ``keep_prefill`` handed it over (the reply does not
    need it: its outcome is recorded when it comes).

        outcome = await PairAttempt(legs, prefill, decode, path, wire, headers).whole(with_logprobs)

    ``whole`` closes the attempt itself; a stream's (``open``) is closed by whoever holds the
    stream, once it ends (``close``, or ``async with``).
    """

    __slots__ = ("_kept", "decode", "headers", "legs", "path", "prefill", "prefill_leg", "wire")

    def __init__(self, legs: Legs, prefill: Worker, decode: Worker, path: str, wire: bytes, headers: Headers):
        self.legs, self.prefill, self.decode = legs, prefill, decode
        self.path, self.wire, self.headers = path, wire, headers
        self.prefill_leg = legs.start(prefill, path, wire, headers)
        self._kept = False

    async def __aenter__(self) -> PairAttempt:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if not self._kept and not self.prefill_leg.done():
            await cancel(self.prefill_leg)

    def keep_prefill(self) -> None:
        if not self._kept:
            self._kept = True
            self.legs.finish_unawaited(self.prefill, self.prefill_leg)

    # -- the two shapes of an attempt ------------------------------------------------------------
    async def whole(self, with_logprobs: bool) -> Outcome:
        """Both answers, buffered: the client's Reply, or why not. This is the attempt's whole
        life: the pair is closed when it returns, however it ends (no ``async with`` around it:
        its two coroutines were a measurable share of a request's CPU)."""
        legs = self.legs
        try:
            d_leg = await self.race(legs.start(self.decode, self.path, self.wire, self.headers))
            if d_leg is None:
                return self.prefill_ended(self.prefill_leg.result())
            if d_leg.server_failed or d_leg.status in BACKPRESSURE:
                return await self.decode_failed(d_leg)
            legs.registry.record(self.decode, True)
            if d_leg.status >= 400 or not with_logprobs:
                self.keep_prefill()
                return d_leg.reply(self.headers)
            p_leg = await self.prefill_leg
            if p_leg.ends_request:
                return self.prefill_ended(p_leg)
            return Reply(d_leg.status, merged_logprobs(p_leg.body, d_leg.body), d_leg.content_type, self.headers)
        finally:
            if not self._kept and not self.prefill_leg.done():
                await cancel(self.prefill_leg)

    async def open(self, epoch: int) -> Opened | Outcome:
        """Decode's stream once its first block came, else why not (a Reply for an answer that
        is not a stream: an error status or the prefill's 4xx or abort).

        SGLang sends a stream's head before the request even reaches the scheduler, so the
        head proves nothing: the first event does (it comes once the KV did). Until then the
        prefill can still end the request, and nothing has reached the client, so a failure
        is still retried on another pair. ``epoch``: the refit gate's when the attempt was sent."""
        legs = self.legs
        opened = await self.race(legs.open_one(self.decode, self.path, self.wire, self.headers, epoch))
        if opened is None:  # (its stream, if it had one, was closed as the race cancelled it)
            return self.prefill_ended(self.prefill_leg.result())
        if isinstance(opened, Opened):
            return opened
        if opened.server_failed or opened.status in BACKPRESSURE:
            return await self.decode_failed(opened)
        legs.registry.record(self.decode, True)
        return opened.reply(self.headers)

    async def input_logprobs(self) -> list | Outcome:
        """The prefill's input logprobs (a stream that asked for them shows them first), or the
        outcome when the prefill ended the request."""
        p_leg = await self.prefill_leg
        return self.prefill_ended(p_leg) if p_leg.ends_request else first_input_logprobs(p_leg.body)

    # -- the race and its verdicts ---------------------------------------------------------------
    async def race(self, work: Awaitable[T]) -> T | None:
        """Await the decode leg ``work`` (a leg future, or a coroutine that counts its own load)
        in this task, against the prefill: its result, or None when the prefill ended the
        request first (then ``work`` is cancelled: its KV will never come).

        The decode leg runs inline rather than as a second task, which cost CPU on every
        request (benchmarks/results/router_overhead_vs_cb21479.md). The prefill's done-callback
        cancels this task only while the race is on."""
        legs = self.legs
        me = asyncio.current_task(legs.loop)  # with the loop given: no get_running_loop() syscall
        assert me is not None
        racing, ended, caught = True, False, False
        base = cancel_requests(me)  # requests already counted (a consumed one must not read as outside)

        def on_prefill(task: asyncio.Future[Leg]) -> None:
            nonlocal ended
            if racing and not task.cancelled() and task.result().ends_request:
                ended = True
                me.cancel()

        prefill_leg = self.prefill_leg
        prefill_leg.add_done_callback(on_prefill)
        try:
            return await work
        except asyncio.CancelledError:
            caught = True
            if not ended or withdraw_cancel(me, base):
                raise  # the client went away (or the server stops)
            return None
        finally:
            racing = False
            prefill_leg.remove_done_callback(on_prefill)
            if ended and not caught:
                # The leg consumed the race's cancel (Python 3.11's wait_for returns a result that
                # came with the cancel): withdraw it, or a later race would read it as the client's.
                withdraw_cancel(me, base)

    async def decode_failed(self, d_leg: Leg) -> Outcome:
        """Decide which leg failed (module docstring): the prefill, when its answer ended the
        request or the decode's error names its bootstrap server (SGLang 0.5.23's "Lost
        connection with prefill instance (bootstrap_addr: HOST:PORT)"), else the decode.
        Blaming the decode for a dead prefill opened the circuit of a healthy decode, the
        fleet's only one in a bench_serving run."""
        prefill_leg, prefill = self.prefill_leg, self.prefill
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(prefill_leg), VERDICT_GRACE_SECS)
        if prefill_leg.done() and not prefill_leg.cancelled() and prefill_leg.result().ends_request:
            return self.prefill_ended(prefill_leg.result())
        legs = self.legs
        if (
            d_leg.error is None
            and d_leg.status >= 500
            and names_bootstrap(d_leg.body, prefill.bootstrap_host, prefill.bootstrap_port)
        ):
            lost = UpstreamError(f"decode {self.decode.url} lost it: {d_leg.body[:300]!r}")
            verdict = legs.verdict(prefill, Leg(error=lost, epoch=d_leg.epoch), errors.PREFILL_FAILED)
        else:
            verdict = legs.verdict(self.decode, d_leg, errors.DECODE_FAILED)
        return verdict or d_leg.reply(self.headers)

    def prefill_ended(self, p_leg: Leg) -> Outcome:
        """The prefill ended the request: its failure is retried, its abort or 4xx answered as is;
        an abort that a weight update caused (refit ``interrupt``) is retried once the update is
        released (no token was generated, nothing reached the client)."""
        legs = self.legs
        if legs.interrupted(p_leg) and aborted(p_leg.body):
            return Retry(f"prefill {self.prefill.url}: interrupted by a weight update", errors.INTERRUPTED, busy=True)
        return legs.verdict(self.prefill, p_leg, errors.PREFILL_FAILED) or p_leg.reply(self.headers)


def _sent(worker: Worker, headers: Headers) -> dict[str, str]:
    """The headers sent to ``worker``: the forwarded client headers and the worker's own key."""
    return {**headers.upstream, **worker.auth} if worker.auth else headers.upstream


async def cancel(*tasks: asyncio.Future | None) -> None:
    """Cancel ``tasks`` (tasks or futures) and wait for them to end, their done callbacks
    included (a leg's closes its connection and gives back its worker's load)."""
    pending = [t for t in tasks if t is not None and not t.done()]
    for task in pending:
        task.cancel()
    for task in pending:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    if pending:
        await asyncio.sleep(0)  # a cancelled future's callbacks run in the loop's next turn
