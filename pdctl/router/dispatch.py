"""Dispatch: a request's attempts until one answers, and the answer as the client gets it.

    select (pdctl.router.selection) -> legs (pdctl.router.legs: PairAttempt owns a PD
    attempt's two legs) -> retry (pdctl.router.retry: one policy) -> shape (pdctl.router.shaping)
    -> a stream's relay (pdctl.router.relay)

The dispatcher returns a ``Reply`` or a ``StreamReply`` (pdctl.router.reply) and never touches
the client's socket: the HTTP server writes what it returns. A stream's body is a ``Relay``:
the engine's blocks as they come, then its tail, the continuation of answers a weight update
interrupted (refit ``interrupt``) or of a one-answer /generate stream whose engine died
mid-stream (``tail`` here: fresh legs under the same retry policy as every other attempt). A
non-streamed answer a weight update interrupted is continued item by item before it is returned
(or sent again whole when it cannot be; see pdctl.router.refit.resume).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from pdctl.roles import Role
from pdctl.router import errors
from pdctl.router.config import RouterConfig
from pdctl.router.errors import RouteError
from pdctl.router.jsonutil import dumps
from pdctl.router.legs import Legs, Outcome, PairAttempt, StreamLeg
from pdctl.router.metrics import RouterMetrics
from pdctl.router.policies import RequestContext
from pdctl.router.refit.gate import RefitGate
from pdctl.router.refit.resume import Job, Piece, asked_abort, settle
from pdctl.router.relay import Live, Relay
from pdctl.router.reply import Answer, Reply, StreamReply
from pdctl.router.retry import Retry, RetryPolicy, Stop, Tries
from pdctl.router.selection import Selector
from pdctl.router.shaping import ROUTING_KEY, Headers, interrupted_answer, items, passed_headers
from pdctl.router.streaming import DONE, Continued, Interrupted, error_event
from pdctl.router.upstream import Upstream, UpstreamPool
from pdctl.router.workers import Worker, WorkerRegistry
from pdctl.sglang import batch_size_of, inject_bootstrap

log = logging.getLogger("pdctl.router")
_NO_WORKER_YET = {errors.NO_PREFILL: Role.PREFILL, errors.NO_DECODE: Role.DECODE, errors.NO_WORKERS: Role.REGULAR}
"""Selection's 503s that a wait may cure (``admission.worker_wait_secs``), and the role that had none."""


class _SelectAgain:
    """An attempt that sent nothing: a worker may have come into rotation, select again."""


_SELECT_AGAIN = _SelectAgain()


@dataclass(eq=False, slots=True)
class ClientRequest:
    """One client request as the dispatcher serves it."""

    path: str
    body: dict[str, Any]
    ctx: RequestContext
    headers: Headers
    pd: bool
    batch: int | None = None
    stream: bool = False
    with_logprobs: bool = False
    sent: int = 0
    """The refit gate's epoch when the latest attempt was sent."""
    waits_until: float | None = None
    """Its deadline for a worker to come into rotation, once it found a role with none."""
    _job: Job | bool | None = field(default=False, repr=False)  # False: not read yet

    @property
    def job(self) -> Job | None:
        """The request as a /generate job that can be continued (read only when needed)."""
        if self._job is False:
            self._job = Job.of(self.path, self.body)
        return self._job  # type: ignore[return-value]


class Dispatcher:
    def __init__(
        self,
        config: RouterConfig,
        registry: WorkerRegistry,
        metrics: RouterMetrics,
        upstream: Upstream | None = None,
        gate: RefitGate | None = None,
        retry: RetryPolicy | None = None,
    ):
        """``upstream``: how engines are reached (the real connection pool unless given);
        ``gate``: the weight-update gate (the app's, so that its holds reach retries and
        continuations); ``retry``: the retry policy (``config.retry``'s unless given)."""
        self.config = config
        self.gate = gate if gate is not None else RefitGate()
        self.registry = registry
        self.metrics = metrics
        self.select = Selector(config, registry, metrics)
        timeout = config.admission.request_timeout_secs
        self.legs = Legs(upstream if upstream is not None else UpstreamPool(), registry, self.gate, timeout)
        self.retry = retry if retry is not None else RetryPolicy(config.retry, timeout)

    async def close(self) -> None:
        """Cancel every leg still running (a prefill that outlived its reply, for instance)."""
        await self.legs.close()

    async def wait_open(self) -> None:
        """Wait while a weight update holds the router (at most ``admission.max_hold_secs``)."""
        if not await self.gate.wait_open(self.config.admission.max_hold_secs):
            raise RouteError(503, errors.HELD_TIMEOUT, "router held for a weight update too long")

    # -- requests ------------------------------------------------------------------------------------
    # pd_request and regular_request return the request's coroutine rather than being one: a
    # layer less on every request.
    def pd_request(self, path: str, body: dict[str, Any], batch: int | None, headers: Headers) -> Awaitable[Answer]:
        """A request served by a prefill and a decode (``batch``: its batch size, for the rooms)."""
        ctx = self.select.context(body, headers.upstream.get(ROUTING_KEY), pd=True)
        with_logprobs = bool(body.get("return_logprob") or body.get("logprobs"))
        stream = bool(body.get("stream"))
        return self._serve(ClientRequest(path, body, ctx, headers, True, batch, stream, with_logprobs))

    def regular_request(self, path: str, body: dict[str, Any], headers: Headers) -> Awaitable[Answer]:
        """A request served by one regular engine."""
        ctx = self.select.context(body, headers.upstream.get(ROUTING_KEY), pd=False)
        return self._serve(ClientRequest(path, body, ctx, headers, False, stream=bool(body.get("stream"))))

    async def _serve(self, request: ClientRequest) -> Answer:
        tries = Tries(self.retry)  # (RetryPolicy.start, a call less)
        answer = await self._attempts(request, request.body, request.batch, tries)
        if isinstance(answer, Live):
            response = answer.leg.response
            assert response is not None
            body = Relay(self, request, answer, tries)
            return StreamReply(200, passed_headers(response.headers, request.headers), body, response.content_type)
        if not request.stream and self.gate.epoch != request.sent:  # (gate.interrupted_since, inline)
            return await self._continue_whole(request, answer, tries)
        return answer

    async def _attempts(
        self,
        request: ClientRequest,
        payload: dict[str, Any],
        batch: int | None,
        tries: Tries,
        *,
        version: str | None = None,
        continuation: bool = False,
    ) -> Reply | Live:
        """Attempts on freshly selected workers until one answers (a Reply, or an open stream),
        under the retry policy; RouteError when the request is over without an answer."""
        data = None if request.pd else dumps(payload)
        while True:
            request.sent = self.gate.epoch
            outcome = await self._attempt(request, payload, batch, data, version, continuation)
            if isinstance(outcome, (Reply, Live)):
                return outcome
            if isinstance(outcome, _SelectAgain):
                if self.gate.interrupting:  # an update began meanwhile: nothing goes out before its release
                    await self._held(tries)
                continue
            if isinstance(outcome, Stop):
                raise RouteError(outcome.status, outcome.code, outcome.message)
            over = await self._after(outcome, tries, request.headers)
            if over is not None:
                return over

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
        if request.stream:
            one = await self.legs.open_one(worker, request.path, data, headers)
            if isinstance(one, StreamLeg):
                return Live(one)
            leg = one
        else:
            leg = await self.legs.start(worker, request.path, data, headers)
        return self.legs.verdict(worker, leg, errors.WORKER_FAILED) or leg.reply(headers)

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
        role = _NO_WORKER_YET.get(exc.code)
        if role is None or wait <= 0 or not self.registry.may_return(role):
            raise exc  # not for lack of a worker, no wait asked, or none of the role that may come back
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
            await self._held(tries)
        return None

    async def _held(self, tries: Tries) -> None:
        """Wait for the release of the weight update that holds the router (not counted against
        the request timeout); RouteError past ``admission.max_hold_secs``."""
        held = self.retry.clock()
        await self.wait_open()
        tries.paused(self.retry.clock() - held)

    # -- streams' tails (pdctl.router.relay) ---------------------------------------------------------
    async def tail(
        self,
        request: ClientRequest,
        job: Job,
        pending: dict[int, Piece],
        tries: Tries,
        why: str,
        *,
        interrupted: bool = False,
        version: str | None = None,
    ) -> tuple[bytes, Live | None, Continued | None]:
        """Continue a stream's ``pending`` answers (each, by its index, with what the client has
        of it) on fresh legs: the bytes to send first, and the continuation's stream with how its
        events show (None when the client's stream ends with those bytes).

        After a weight update interrupted them (``interrupted``), on the new weights once the
        update is released: an answer interrupted more than ``max_staleness`` times ends with its
        tokens so far, one whose budget is spent simply ends. After its engine died (a one-answer
        stream, ``pending`` {0: ...}), on the same weight ``version``. Each attempt follows the
        request's retry policy; ``why`` ends the stream (as an error event) when it says stop."""
        out = b""
        settling = interrupted
        while True:
            if settling:
                pending, ended = settle(job, pending, self.gate.max_staleness)
                out += b"".join(Continued(job, tuple(ended), {}).event(k, item) for k, item in ended.items())
                if not pending:
                    return out + DONE, None, None
                settling = False
            elif not interrupted and job.remaining(0, pending[0]) <= 0:
                return out + DONE, None, None
            if interrupted or self.gate.interrupting:
                try:
                    await self._held(tries)
                except RouteError:
                    return out + error_event(why), None, None
            order = tuple(pending)
            shown = Continued(job, order, pending)
            body = job.continuation([(k, pending[k]) for k in order])
            self.metrics.retried(errors.INTERRUPTED if interrupted else "stream_resumed")
            request.sent = self.gate.epoch
            try:
                outcome: Outcome | Live | _SelectAgain = await self._attempt(
                    request, body, None, None if request.pd else dumps(body), version, continuation=True
                )
                while isinstance(outcome, _SelectAgain):
                    if self.gate.interrupting:  # an update began meanwhile: nothing goes out before its release
                        await self._held(tries)
                    outcome = await self._attempt(
                        request, body, None, None if request.pd else dumps(body), version, continuation=True
                    )
            except RouteError:
                return out + error_event(why), None, None
            if isinstance(outcome, Live):
                return out, outcome, shown
            if isinstance(outcome, Stop):
                return out + error_event(f"{why}; then {outcome.message}"), None, None
            if isinstance(outcome, Retry):
                retry = outcome
            else:
                retry = Retry(f"the continuation was answered {outcome.status}", errors.CONTINUATION_FAILED)
            if retry.code == errors.INTERRUPTED:  # the next update stopped it before its first token
                interrupted = settling = True
                version = None
            delay = tries.next(retry)
            if delay is None:
                return out + error_event(why), None, None
            await self.retry.sleep(delay)

    def interrupt_rule(self, epoch: int, request: ClientRequest) -> Interrupted:
        """The rule that catches a stream's answers that a weight update begun after ``epoch``
        interrupted, when the request can be continued (a /generate job)."""
        gate = self.gate
        return Interrupted(lambda: gate.interrupted_since(epoch) and request.job is not None)

    # -- whole answers a weight update interrupted ----------------------------------------------------
    async def _continue_whole(self, request: ClientRequest, first: Reply, tries: Tries) -> Reply:
        """A non-streamed answer whose items a weight update interrupted (an asked-for abort,
        pdctl.refit ``interrupt``): each such item is continued on the new weights once the
        update is released, for its remaining tokens, until it finishes, its budget is spent or
        it would span more than ``max_staleness`` + 1 weight versions; the client gets one answer.
        An answer that cannot be continued item by item (the OpenAI routes, constrained decoding,
        ...) has reached no client yet: it is sent again whole on the new weights instead."""
        if first.status != 200 or b'"abort"' not in first.body:
            return first
        job = request.job
        if job is None:
            return await self._redo_whole(request, first, tries)
        answers = items(first.body, job.answers)
        if answers is None:
            return first
        final: list[Any] = list(answers)
        raw = {k: item for k, item in enumerate(answers) if asked_abort(item)}
        bases = {k: Piece() for k in raw}
        while raw:
            for _ in raw:
                self.metrics.retried(errors.INTERRUPTED)
            pieces = {k: bases[k].advanced(answer) for k, answer in raw.items()}
            going, ended = settle(job, pieces, self.gate.max_staleness)
            for k, item in ended.items():
                final[k] = item
            bases.update(pieces)
            going_on = list(going)
            raw = {}
            if not going_on:
                break
            await self.wait_open()
            cont = job.continuation([(k, bases[k]) for k in going_on])
            reply = await self._attempts(request, cont, batch_size_of(cont), tries)
            assert isinstance(reply, Reply)  # a continuation of a whole answer is not streamed
            got = items(reply.body, len(going_on)) if reply.status == 200 else None
            if got is None:
                message = f"the continuation after a weight update failed ({reply.status}): {reply.body[:300]!r}"
                raise RouteError(reply.status if reply.status >= 400 else 502, errors.CONTINUATION_FAILED, message)
            for k, answer in zip(going_on, got, strict=True):
                if asked_abort(answer) and self.gate.interrupted_since(request.sent):
                    raw[k] = answer
                else:
                    final[k] = bases[k].view(answer)
        for k, item in enumerate(final):  # every item of a continued answer shows its spans
            if k not in bases:
                final[k] = Piece().view(item)
        return Reply(200, dumps(final[0] if job.single else final), first.content_type, first.headers)

    async def _redo_whole(self, request: ClientRequest, reply: Reply, tries: Tries) -> Reply:
        """Send the request again, once the update is released, for as long as updates interrupt it."""
        while reply.status == 200 and interrupted_answer(reply.body) and self.gate.interrupted_since(request.sent):
            self.metrics.retried(errors.INTERRUPTED)
            await self.wait_open()
            again = await self._attempts(request, request.body, request.batch, tries)
            assert isinstance(again, Reply)
            reply = again
        return reply
