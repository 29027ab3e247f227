"""The attempt loop: a request's attempts on freshly selected workers until one answers, under
the one retry policy (pdctl.router.retry). Everything that tries again goes through ``run``: a
client's request (pdctl.router.dispatch), and its continuation after a weight update
interrupted it or its decode died (pdctl.router.continuation).

    select (pdctl.router.selection) -> legs (pdctl.router.legs: PairAttempt owns a PD
    attempt's two legs) -> an outcome: an answer, an open stream (``Live``), or a ``Retry`` /
    ``Stop`` judged by the retry policy

An attempt that finds a role with no worker in rotation waits for one
(``admission.worker_wait_secs``) and selects again; no retry is counted, since nothing was
sent. A retry waits out a weight update's hold when the update interrupted its attempt (or is
interrupting: its paused engines would abort the retry as if the client had asked).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable
from typing import Any

from pdctl.roles import Role
from pdctl.router import errors
from pdctl.router.admission import Admission
from pdctl.router.config import RouterConfig
from pdctl.router.errors import RouteError
from pdctl.router.gate import RefitGate
from pdctl.router.jsonutil import dumps
from pdctl.router.legs import Legs, Live, Outcome, PairAttempt, StreamLeg
from pdctl.router.metrics import RouterMetrics
from pdctl.router.pair_room import PairRoom
from pdctl.router.reply import Reply
from pdctl.router.request import ClientRequest
from pdctl.router.retry import Retry, RetryPolicy, Stop, Tries
from pdctl.router.selection import Selector
from pdctl.router.shaping import Headers
from pdctl.router.workers import Worker, WorkerRegistry
from pdctl.sglang import inject_bootstrap

_NO_WORKER_YET: dict[str, Role | None] = {
    errors.NO_PREFILL: Role.PREFILL,
    errors.NO_DECODE: Role.DECODE,
    errors.NO_WORKERS: Role.REGULAR,
    errors.VERSION_MISMATCH: None,
}
"""Selection's 503s that a wait may cure (``admission.worker_wait_secs``), and the role that had
none; None: both roles have workers in rotation on different versions, which an update's
relabelling, a reload or a restart pairs again."""


class _SelectAgain:
    """An attempt that sent nothing: a worker may have come into rotation, select again."""


_SELECT_AGAIN = _SelectAgain()


class Interrupt:
    """``Attempts.run``'s answer, when asked (``interrupts``), for an attempt a weight update
    interrupted: the update was waited out and the retry counted; the caller decides what to
    send next (a continuation re-reads what its answers have)."""


INTERRUPT = Interrupt()


class Attempts:
    """The attempt loop over a router's workers (module docstring)."""

    def __init__(
        self,
        config: RouterConfig,
        registry: WorkerRegistry,
        metrics: RouterMetrics,
        select: Selector,
        legs: Legs,
        gate: RefitGate,
        retry: RetryPolicy,
        admission: Admission,
    ):
        self.config = config
        self.admission = admission
        self.registry = registry
        self.metrics = metrics
        self.select = select
        self.legs = legs
        self.gate = gate
        self.retry = retry
        self.room: PairRoom | None = None
        """Late pairing's queue (pdctl.router.pair_room), when the router pairs late."""

    async def run(
        self,
        request: ClientRequest,
        payload: dict[str, Any],
        batch: int | None,
        tries: Tries,
        *,
        version: str | None = None,
        continuation: bool = False,
        interrupts: bool = False,
    ) -> Reply | Live | Interrupt:
        """Attempts on freshly selected workers until one answers: its Reply (the last worker's own
        5xx once the retries are spent), or its open stream; RouteError when the request is over
        without an answer (a ``Stop``, no worker, retries spent with no answer to pass on).

        ``version``: the weight version the workers must serve (a dead decode's continuation goes
        on on the same weights) until an update interrupts an attempt. ``continuation``: the
        payload continues a stream the client already has, so an answer that is not a stream is
        a failure of the continuation (retried), and the prefill's input logprobs were shown
        already. ``interrupts``: an interrupted attempt returns ``INTERRUPT`` once its retry was
        waited for, instead of being sent again as it was."""
        data = None if request.pd else dumps(payload)
        room = self.room if request.pd else None
        again = continuation  # a request in flight already waits at the head of late pairing's queue
        while True:
            if room is not None:
                # A request let out of the queue during a weight update's hold goes on as one
                # queued at an engine would: a drain waits for it, an interrupt stops it (retried).
                await room.enter(first=again)
                again = True
                try:  # (the pair is made and claims its engines before the attempt's first await)
                    request.sent = self.gate.epoch
                    attempt = self._attempt(request, payload, batch, data, version, continuation)
                finally:
                    room.freed()  # any room left goes to the next request waiting
                outcome = await attempt
            else:
                request.sent = self.gate.epoch
                outcome = await self._attempt(request, payload, batch, data, version, continuation)
            if isinstance(outcome, Live):
                return outcome
            if isinstance(outcome, Reply):
                if not (continuation and request.stream):
                    return outcome
                outcome = Retry(f"the continuation was answered {outcome.status}", errors.CONTINUATION_FAILED)
            elif isinstance(outcome, _SelectAgain):
                if not self.gate.is_open:  # an update began meanwhile: nothing goes out before its release
                    await self.held_out_of_flight(tries, request)
                continue
            elif isinstance(outcome, Stop):
                raise RouteError(outcome.status, outcome.code, outcome.message)
            elif outcome.code == errors.HANDED_OFF:  # (no backoff, no budget: it waited at an engine now drained)
                self.metrics.retried(outcome.code)
                if not self.gate.is_open:
                    await self.held_out_of_flight(tries, request)
                continue
            over = await self._after(outcome, tries, request.headers)
            if over is not None:
                return over
            if outcome.code == errors.INTERRUPTED:
                version = None  # the fleet's weights moved on
                if interrupts:
                    return INTERRUPT

    def _attempt(
        self,
        request: ClientRequest,
        payload: dict[str, Any],
        batch: int | None,
        data: bytes | None,
        version: str | None,
        continuation: bool,
    ) -> Awaitable[Outcome | Live | _SelectAgain]:
        """One attempt on freshly selected workers, sent now; its outcome, awaited at once. Not a
        coroutine of its own: it returns the coroutine that runs the attempt (a layer less on
        every request)."""
        if not request.pd:
            try:
                worker = self.select.regular(request.ctx, version)
            except RouteError as exc:
                return self._no_worker(request, exc)
            request.waits_until = None
            assert data is not None
            return self._regular(request, worker, data)
        try:
            prefill, decode = self.select.pair(request.ctx, version)
        except RouteError as exc:
            return self._no_worker(request, exc)
        request.waits_until = None  # a later continuation that finds none waits afresh
        # a new room per attempt (a retried room could collide with the orphan)
        bootstrapped = inject_bootstrap(
            payload, host=prefill.bootstrap_host, port=prefill.bootstrap_port, batch_size=batch
        )
        pair = PairAttempt(self.legs, prefill, decode, request.path, dumps(bootstrapped), request.headers)
        if not request.stream:
            return pair.whole(request.with_logprobs)  # (it closes the pair)
        return self._open(request, pair, continuation)

    async def _regular(self, request: ClientRequest, worker: Worker, data: bytes) -> Outcome | Live:
        headers = request.headers
        legs = self.legs
        claim = legs.claim(worker)
        if request.stream:
            one = await legs.open_one(claim, request.path, data, headers)
            if isinstance(one, StreamLeg):
                return Live(one)
            leg = one
        else:
            leg = await legs.start(claim, request.path, data, headers)
        return legs.verdict(claim, leg, errors.WORKER_FAILED) or leg.reply(headers)

    async def _open(self, request: ClientRequest, pair: PairAttempt, continuation: bool) -> Outcome | Live:
        """A PD stream once decode's first block came (the prefill's input logprobs first when
        asked for), else why not; the pair is closed unless the stream is handed on."""
        handed = False
        opened: StreamLeg | Outcome | None = None
        try:
            opened = await pair.open()
            if not isinstance(opened, StreamLeg):
                return opened
            prefix = None
            if request.with_logprobs and not continuation:
                got = await pair.input_logprobs()
                if not isinstance(got, list):
                    return got
                prefix = got
            handed = True
            return Live(opened, pair, prefix)
        finally:
            if not handed:
                if isinstance(opened, StreamLeg):
                    opened.cancel()
                pair.close()

    async def _no_worker(self, request: ClientRequest, exc: RouteError) -> _SelectAgain:
        """A role has workers but none in rotation: wait for one (``admission.worker_wait_secs``
        from the first time this request found none), then select again (``_SELECT_AGAIN``);
        ``exc`` past the wait, or at once when the role has no worker that may come back by
        itself (``WorkerRegistry.may_return``; none at all: a router started without workers
        answers as sglang-router does). An engine that crashed and is restarted
        by its supervisor costs its requests a wait rather than a 503 each. Nothing was sent,
        so no retry is counted."""
        wait = self.config.admission.worker_wait_secs
        if exc.code not in _NO_WORKER_YET or wait <= 0:
            raise exc  # not for lack of a worker, or no wait asked
        role = _NO_WORKER_YET[exc.code]
        if role is not None and not self.registry.may_return(role):
            raise exc  # none of the role that may come back
        if not self.gate.is_open:  # an update holds the fleet: the worker may be out until its release
            return _SELECT_AGAIN
        now = time.monotonic()  # the registry's clock (its waits are on the loop, not the retry policy's clock)
        if request.waits_until is None:
            request.waits_until = now + wait
        left = request.waits_until - now
        if left <= 0:
            raise RouteError(exc.status, exc.code, f"{exc} (waited {wait:g} s for one)")
        self.metrics.waiting_for_workers += 1
        try:
            await self.registry.wait_for_rotation(left)
        finally:
            self.metrics.waiting_for_workers -= 1
        return _SELECT_AGAIN

    async def _after(self, retry: Retry, tries: Tries, headers: Headers) -> Reply | None:
        """Wait before the next attempt after ``retry``; the answer when the request is over
        (the worker's own 5xx, or RouteError). A retry waits while a weight update holds the
        router when that update interrupted its attempt, or interrupts (its paused engines would
        abort the retry as if the client had asked); a drain's hold lets it go on, since the
        drain waits for it. The wait is not counted against the request timeout."""
        interrupted = retry.code == errors.INTERRUPTED
        self.metrics.retried("busy" if retry.busy and not interrupted else retry.code)
        delay = tries.next(retry)
        if delay is None:
            answer = tries.give_up(retry)
            return Reply(answer.status, answer.body, answer.content_type, headers)
        await self.retry.sleep(delay)
        if (interrupted and not self.gate.is_open) or self.gate.interrupting:
            await self.held(tries)
        return None

    async def wait_open(self) -> None:
        """Wait while a weight update holds the router (at most ``admission.max_hold_secs``)."""
        if not await self.gate.wait_open(self.config.admission.max_hold_secs):
            raise RouteError(503, errors.HELD_TIMEOUT, "router held for a weight update too long")

    async def held_out_of_flight(self, tries: Tries, request: ClientRequest) -> None:
        """A request that found no worker while an update holds the fleet waits for the release
        as a new request would, out of the count of requests in flight: a drain waits for that
        count, and the worker it lacks may be kept out until the release (an engine restarted
        mid-update, on its boot weights), which would wait for the drain. Its wait for a worker
        starts afresh after the release."""
        self.admission.leave()
        try:
            await self.held(tries)
        finally:
            self.admission.enter()
        request.waits_until = None

    async def held(self, tries: Tries) -> None:
        """Wait for the release of the weight update that holds the router (not counted against
        the request timeout); RouteError past ``admission.max_hold_secs``."""
        start = self.retry.clock()
        await self.wait_open()
        tries.paused(self.retry.clock() - start)
