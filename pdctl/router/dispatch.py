"""PD dispatch, top to bottom: select_pair -> add_bootstrap -> race the legs -> shape the answer.

Every attempt ends in an outcome that the retry loop reads, never an exception from a helper:
a ``Reply`` for the client, ``Retry`` (this pair failed before anything reached the client;
try another) or ``Stop`` (end the request with this error). The rules (sglang-protocol.md 2.3,
style.md R9):
- both legs run as tasks the dispatcher owns (cancelled on stop); a client that goes away
  cancels both (and the engines abort them); each leg counts in its worker's load through one
  guard (``WorkerRegistry.in_flight``), from its start to its end, whatever ends it;
- a prefill that ends the request (an abort in a 200, a 4xx, a 5xx or no answer) cancels its
  decode leg at once, which would otherwise wait for KV until its own timeout; the client gets
  the prefill's answer (an abort or a 4xx is the client's business) or a retry (a failure);
- a decode that fails is blamed only once the prefill's answer is known: when the prefill
  ended the request, the decode only followed it;
- a 429 or 503 from a live worker is backpressure: retried on another pair after a backoff,
  within the request timeout, without using the retry budget or touching the breaker;
- a connection error or another 5xx is retried on a freshly selected pair with a new bootstrap
  room, with exponential backoff and jitter, at most ``retry.max_retries`` (``--retry-max-retries``) times, and only
  while nothing has been sent to the client; it counts against the worker's breaker;
- a leg that times out (``request_timeout_secs``) ends the request with a 504, not retried;
- a worker's 4xx is the client's fault: returned as is, never retried, and it counts as a
  success for the circuit breaker;
- a stream whose decode fails after the head went out ends with an SGLang-shaped error event
  and ``[DONE]``, never a broken transfer encoding;
- prefill's ``input_token_logprobs`` are put in front of decode's only when asked for.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from pdctl.roles import Role
from pdctl.router import errors
from pdctl.router.config import RouterConfig
from pdctl.router.gate import RefitGate
from pdctl.router.jsonutil import dumps, loads, sse_data, sse_event
from pdctl.router.metrics import RouterMetrics
from pdctl.router.policies import RequestContext, policy_class
from pdctl.router.resume import GENERATE, Job, Piece, asked_abort, settle
from pdctl.router.server import STREAMED, Reply, Request
from pdctl.router.streaming import (
    DONE,
    Continued,
    Interrupted,
    Opened,
    Pumped,
    error_event,
    first_event,
    pump,
    sse_events,
)
from pdctl.router.upstream import Response, Upstream, UpstreamError, UpstreamPool, UpstreamTimeout
from pdctl.router.workers import Worker, WorkerRegistry
from pdctl.sglang import batch_size_of, inject_bootstrap

log = logging.getLogger("pdctl.router")
PREFILL_GRACE_SECS = 5.0  # how long a prefill leg may run on after the reply went out without it
VERDICT_GRACE_SECS = 2.0  # how long a failed decode waits for its prefill's answer to learn who failed
BACKPRESSURE = (429, 503)
_HOP_HEADERS = {
    b"content-length",
    b"transfer-encoding",
    b"connection",
    b"keep-alive",
    b"content-encoding",
    b"date",
    b"server",
}


ROUTING_KEY = "x-smg-routing-key"
FORWARDED = frozenset({"x-correlation-id", "traceparent", "tracestate", ROUTING_KEY})
"""Client headers sent on to workers (with X-Request-ID and ``x-request-id-*``), as smg does;
the rest (cookies, custom headers) stay at the router. Never the client's Authorization: a
worker gets its own key (``Worker.auth``), so no worker learns a client's credentials."""


class Headers(dict[str, str]):
    """The reply's headers (the dict itself) and ``upstream``, the headers sent to workers."""

    def __init__(self, reply: dict[str, str], upstream: dict[str, str]):
        super().__init__(reply)
        self.upstream = upstream

    @classmethod
    def of(cls, request_id: str, client: dict[str, str]) -> Headers:
        """``client``: the request's headers, names in lower case. Values with CR or LF are dropped."""
        forwarded = {
            name: value
            for name, value in client.items()
            if (name in FORWARDED or name.startswith("x-request-id-")) and "\r" not in value and "\n" not in value
        }
        return cls({"X-Request-ID": request_id}, {**forwarded, "X-Request-ID": request_id})


class RouteError(Exception):
    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code = status, code


@dataclass
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
        return self.server_failed or self.status >= 400 or _aborted(self.body)


@dataclass(frozen=True)
class Retry:
    """This pair failed before anything reached the client; try another pair. ``busy``: the
    worker is alive but full (backpressure), so the retry does not use the budget."""

    message: str
    code: str
    busy: bool = False
    answer: Leg | None = None
    """The worker's own answer (a 5xx), passed to the client as is once the retries are spent."""


@dataclass(frozen=True)
class Stop:
    """End the request with this error (no retry can help)."""

    status: int
    code: str
    message: str


Outcome = Reply | Retry | Stop


class Dispatcher:
    def __init__(
        self,
        config: RouterConfig,
        registry: WorkerRegistry,
        metrics: RouterMetrics,
        upstream: Upstream | None = None,
        gate: RefitGate | None = None,
    ):
        """``upstream``: how engines are reached (the real connection pool unless given);
        ``gate``: the weight-update gate (the app's, so that its holds reach retries and continuations)."""
        self.config = config
        self.gate = gate if gate is not None else RefitGate()
        self.registry = registry
        self.metrics = metrics
        self.prefill_policy = policy_class(config.prefill_policy or config.policy).from_config(config)
        self.decode_policy = policy_class(config.decode_policy or config.policy).from_config(config)
        self.regular_policy = policy_class(config.policy).from_config(config)
        self.upstream: Upstream = upstream if upstream is not None else UpstreamPool()
        self._timeout = config.admission.request_timeout_secs
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task] = set()  # every leg in flight; cancelled by close()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        # Cached: on Python 3.11 every asyncio.get_running_loop() (inside create_task too) is a
        # getpid() syscall, which was 6% of the router's CPU in a native profile.
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    async def close(self) -> None:
        """Cancel every leg still running (a prefill that outlived its reply, for instance)."""
        await _cancel(*self._tasks)
        self.upstream.close()

    # -- phase 1: select ----------------------------------------------------------------------
    def select_pair(self, ctx: RequestContext, version: str | None = None) -> tuple[Worker, Worker]:
        """A prefill and a decode on the same weight version (``version`` when given);
        RouteError (503) names what is missing."""
        prefills = self.registry.routable(Role.PREFILL)
        if version is not None:
            prefills = [p for p in prefills if p.weight_version == version]
        if not prefills:
            raise RouteError(503, errors.NO_PREFILL, "No prefill workers available" + self._why_none(Role.PREFILL))
        decodes = self.registry.routable(Role.DECODE)
        if not decodes:
            raise RouteError(503, errors.NO_DECODE, "No decode workers available" + self._why_none(Role.DECODE))
        versions = {d.weight_version for d in decodes}
        pairable = [p for p in prefills if p.weight_version in versions]
        if not pairable:
            raise RouteError(
                503,
                errors.VERSION_MISMATCH,
                "no prefill and decode share a weight version "
                f"(prefill {sorted(map(str, {p.weight_version for p in prefills}))}, "
                f"decode {sorted(map(str, versions))})",
            )
        prefill = _chosen(self.prefill_policy.select(pairable, ctx), Role.PREFILL)
        same = [d for d in decodes if d.weight_version == prefill.weight_version]
        decode = _chosen(self.decode_policy.select(same, ctx), Role.DECODE)
        self.metrics.selected(prefill, decode)
        return prefill, decode

    def _why_none(self, role: Role) -> str:
        held = [w for w in self.registry.of_role(role) if w.quarantined]
        if held:
            return f" ({len(held)} out of rotation for their weights: {held[0].quarantined})"
        return " (none healthy)"

    def select_regular(self, ctx: RequestContext, version: str | None = None) -> Worker:
        workers = self.registry.routable(Role.REGULAR)
        if version is not None:
            workers = [w for w in workers if w.weight_version == version]
        if not workers:
            raise RouteError(503, errors.NO_WORKERS, "No healthy workers available" + self._why_none(Role.REGULAR))
        return _chosen(self.regular_policy.select(workers, ctx), Role.REGULAR)

    # -- the request loop (retries) ---------------------------------------------------------------
    async def wait_open(self) -> None:
        """Wait while a weight update holds the router (at most ``admission.max_hold_secs``)."""
        if not await self.gate.wait_open(self.config.admission.max_hold_secs):
            raise RouteError(503, errors.HELD_TIMEOUT, "router held for a weight update too long")

    async def _with_retries(self, attempt_once: Callable[[], Awaitable[Outcome]], headers: Headers) -> Reply:
        """Run ``attempt_once`` until it gives a Reply. A Retry uses the budget (then the last
        worker's own 5xx answer, as sglang-router and smg pass it, or 502 when no worker
        answered), unless it is backpressure, which waits for capacity within the request
        timeout (then 503). A retry of an attempt that a weight update interrupted waits until
        the update is released (that wait does not count against the request timeout)."""
        budget = 1 if self.config.retry.disabled else 1 + self.config.retry.max_retries
        failures = busy = 0
        deadline = time.monotonic() + self._timeout
        while True:
            outcome = await attempt_once()
            if isinstance(outcome, Reply):
                return outcome
            if isinstance(outcome, Stop):
                raise RouteError(outcome.status, outcome.code, outcome.message)
            interrupted = outcome.code == errors.INTERRUPTED
            self.metrics.retried("busy" if outcome.busy and not interrupted else outcome.code)
            if outcome.busy:
                busy += 1
                delay = self._backoff(min(busy - 1, 6))
                if time.monotonic() + delay > deadline:
                    raise RouteError(503, outcome.code, f"{outcome.message} (busy for {self._timeout:.0f}s)")
            else:
                failures += 1
                if failures >= budget:
                    if outcome.answer is not None:
                        return _respond(outcome.answer, headers)
                    raise RouteError(502, outcome.code, f"{outcome.message} (after {failures} attempt(s))")
                delay = self._backoff(failures - 1)
            await asyncio.sleep(delay)
            if interrupted and not self.gate.is_open:  # other retries go on: a drain waits for them
                held = time.monotonic()
                await self.wait_open()
                deadline += time.monotonic() - held

    async def pd_request(
        self, request: Request, path: str, body: dict[str, Any], batch: int | None, headers: Headers
    ) -> Reply:
        ctx = RequestContext(
            text=_text_of(body) if self._needs_text() else None, routing_key=headers.upstream.get(ROUTING_KEY)
        )
        stream = bool(body.get("stream"))
        with_logprobs = bool(body.get("return_logprob") or body.get("logprobs"))
        resume = _Resume(body, ctx, path)
        sent = [self.gate.epoch]  # the epoch the latest attempt was sent in

        def attempt_with(payload: dict[str, Any], size: int | None) -> Callable[[], Awaitable[Outcome]]:
            async def attempt() -> Outcome:
                sent[0] = self.gate.epoch
                prefill, decode = self.select_pair(ctx)
                # phase 2: a new room per attempt (a retried room could collide with the orphan)
                bootstrapped = inject_bootstrap(
                    payload, host=prefill.bootstrap_host, port=prefill.bootstrap_port, batch_size=size
                )
                wire = dumps(bootstrapped)
                if stream:
                    return await self._stream_both(request, path, wire, prefill, decode, headers, with_logprobs, resume)
                return await self._send_both(path, wire, prefill, decode, headers, with_logprobs)

            return attempt

        reply = await self._with_retries(attempt_with(body, batch), headers)
        if not stream and self.gate.interrupted_since(sent[0]):
            return await self._continue_whole(
                path,
                body,
                reply,
                sent,
                lambda cont: self._with_retries(attempt_with(cont, batch_size_of(cont)), headers),
            )
        return reply

    async def regular_request(self, request: Request, path: str, body: dict[str, Any], headers: Headers) -> Reply:
        text = _text_of(body) if self.regular_policy.needs_text else None
        ctx = RequestContext(text=text, routing_key=headers.upstream.get(ROUTING_KEY))
        resume = _Resume(body, ctx, path, pd=False)
        sent = [self.gate.epoch]  # the epoch the latest attempt was sent in

        def attempt_with(payload: dict[str, Any]) -> Callable[[], Awaitable[Outcome]]:
            data = dumps(payload)

            async def attempt() -> Outcome:
                sent[0] = self.gate.epoch
                worker = self.select_regular(ctx)
                if payload.get("stream"):
                    return await self._stream_one(request, path, data, worker, headers, resume)
                with self.registry.in_flight(worker):
                    leg = await self._post(worker, path, data, headers)
                return self._verdict(worker, leg, errors.WORKER_FAILED) or _respond(leg, headers)

            return attempt

        reply = await self._with_retries(attempt_with(body), headers)
        if not body.get("stream") and self.gate.interrupted_since(sent[0]):
            return await self._continue_whole(
                path, body, reply, sent, lambda cont: self._with_retries(attempt_with(cont), headers)
            )
        return reply

    async def _continue_whole(
        self,
        path: str,
        body: dict[str, Any],
        first: Reply,
        sent: list[int],
        send: Callable[[dict[str, Any]], Awaitable[Reply]],
    ) -> Reply:
        """A non-streamed answer whose items a weight update interrupted (an asked-for abort,
        pdctl.refit ``interrupt``): each such item is continued on the new weights once the
        update is released, for its remaining tokens, until it finishes, its budget is spent or
        it would span more than ``max_staleness`` + 1 weight versions; the client gets one answer.
        An answer that cannot be continued item by item (the OpenAI routes, constrained decoding,
        ...) has reached no client yet: it is sent again whole on the new weights instead.
        ``sent[0]``: the epoch ``send``'s latest attempt was sent in (``send`` keeps it current)."""
        if first.status != 200 or b'"abort"' not in first.body:
            return first
        job = Job.of(path, body)
        if job is None:
            return await self._redo_whole(first, body, sent, send)
        items = _items(first.body, job.answers)
        if items is None:
            return first
        final: list[Any] = list(items)
        raw = {k: item for k, item in enumerate(items) if asked_abort(item)}
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
            reply = await send(job.continuation([(k, bases[k]) for k in going_on]))
            answers = _items(reply.body, len(going_on)) if reply.status == 200 else None
            if answers is None:
                message = f"the continuation after a weight update failed ({reply.status}): {reply.body[:300]!r}"
                raise RouteError(reply.status if reply.status >= 400 else 502, errors.CONTINUATION_FAILED, message)
            for k, answer in zip(going_on, answers, strict=True):
                if asked_abort(answer) and self.gate.interrupted_since(sent[0]):
                    raw[k] = answer
                else:
                    final[k] = bases[k].view(answer)
        for k, item in enumerate(final):  # every item of a continued answer shows its spans
            if k not in bases:
                final[k] = Piece().view(item)
        return Reply(200, dumps(final[0] if job.single else final), first.content_type, first.headers)

    async def _redo_whole(
        self, reply: Reply, body: dict[str, Any], sent: list[int], send: Callable[[dict[str, Any]], Awaitable[Reply]]
    ) -> Reply:
        """Send ``body`` again, once the update is released, for as long as updates interrupt it."""
        while reply.status == 200 and _interrupted_answer(reply.body) and self.gate.interrupted_since(sent[0]):
            self.metrics.retried(errors.INTERRUPTED)
            await self.wait_open()
            reply = await send(body)
        return reply

    # -- phase 3: race the legs -------------------------------------------------------------------
    def _leg(self, worker: Worker, work: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """``work`` as a task the dispatcher owns, counted in ``worker``'s load until it ends."""

        async def guarded() -> Any:
            with self.registry.in_flight(worker):
                return await work

        task = self.loop.create_task(guarded())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _race(self, p_task: asyncio.Task[Leg], decode: Worker, work: Coroutine[Any, Any, Any]) -> Any:
        """Run the decode leg ``work`` in this task, counted in ``decode``'s load, against the
        prefill: its result, or None when the prefill ended the request first (then ``work``
        is cancelled: its KV will never come).

        The decode leg runs inline rather than as a second task, which cost CPU on every
        request (benchmarks/results/router_overhead_vs_cb21479.md). The prefill's done-callback
        cancels this task only while the race is on."""
        me = asyncio.current_task(self.loop)  # with the loop given: no get_running_loop() syscall
        assert me is not None
        racing, ended, caught = True, False, False
        base = _cancel_requests(me)  # requests already counted (a consumed one must not read as outside)

        def on_prefill(task: asyncio.Task[Leg]) -> None:
            nonlocal ended
            if racing and not task.cancelled() and task.result().ends_request:
                ended = True
                me.cancel()

        p_task.add_done_callback(on_prefill)
        try:
            with self.registry.in_flight(decode):
                return await work
        except asyncio.CancelledError:
            caught = True
            if not ended or _withdraw_cancel(me, base):
                raise  # the client went away (or the server stops)
            return None
        finally:
            racing = False
            p_task.remove_done_callback(on_prefill)
            if ended and not caught:
                # The leg consumed the race's cancel (Python 3.11's wait_for returns a result that
                # came with the cancel): withdraw it, or a later race would read it as the client's.
                _withdraw_cancel(me, base)

    async def _decode_failed(
        self, prefill: Worker, p_task: asyncio.Task[Leg], decode: Worker, d_leg: Leg, headers: Headers
    ) -> Outcome:
        """Decide which leg failed: the prefill, when its answer ended the request (the decode
        only followed it) or when the decode's error names the prefill's bootstrap server (it
        could not get the KV from it: SGLang 0.5.23's "Lost connection with prefill instance
        (bootstrap_addr: HOST:PORT)"), else the decode. Blaming the decode for a dead prefill
        opened the circuit of a healthy decode, the fleet's only one in a bench_serving run."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(p_task), VERDICT_GRACE_SECS)
        if p_task.done() and not p_task.cancelled() and p_task.result().ends_request:
            return self._prefill_ended(prefill, p_task.result(), headers)
        if d_leg.error is None and d_leg.status >= 500 and _names_bootstrap(d_leg.body, prefill):
            lost = UpstreamError(f"decode {decode.url} lost it: {d_leg.body[:300]!r}")
            return self._verdict(prefill, Leg(error=lost, epoch=d_leg.epoch), errors.PREFILL_FAILED) or _respond(
                d_leg, headers
            )
        return self._verdict(decode, d_leg, errors.DECODE_FAILED) or _respond(d_leg, headers)

    def _prefill_ended(self, prefill: Worker, p_leg: Leg, headers: Headers) -> Outcome:
        """The prefill ended the request: its failure is retried, its abort or 4xx answered as is;
        an abort that a weight update caused (refit ``interrupt``) is retried once the update is
        released (no token was generated, nothing reached the client)."""
        if self._interrupted(p_leg) and _aborted(p_leg.body):
            return Retry(f"prefill {prefill.url}: interrupted by a weight update", errors.INTERRUPTED, busy=True)
        return self._verdict(prefill, p_leg, errors.PREFILL_FAILED) or _respond(p_leg, headers)

    async def _send_both(
        self, path: str, wire: bytes, prefill: Worker, decode: Worker, headers: Headers, with_logprobs: bool
    ) -> Outcome:
        p_task = self._leg(prefill, self._post(prefill, path, wire, headers))
        keep_prefill = False
        try:
            d_leg = await self._race(p_task, decode, self._post(decode, path, wire, headers))
            if d_leg is None:
                return self._prefill_ended(prefill, p_task.result(), headers)
            if d_leg.server_failed or d_leg.status in BACKPRESSURE:
                return await self._decode_failed(prefill, p_task, decode, d_leg, headers)
            self.registry.record(decode, True)
            if d_leg.status >= 400 or not with_logprobs:
                keep_prefill = True
                self._finish_unawaited(prefill, p_task)
                return _respond(d_leg, headers)
            p_leg = await p_task
            return (
                self._prefill_ended(prefill, p_leg, headers)
                if p_leg.ends_request
                else _respond(_merge_logprobs(p_leg, d_leg), headers)
            )
        finally:
            await _cancel(None if keep_prefill else p_task)

    async def _stream_both(
        self,
        request: Request,
        path: str,
        wire: bytes,
        prefill: Worker,
        decode: Worker,
        headers: Headers,
        with_logprobs: bool,
        resume: _Resume,
    ) -> Outcome:
        epoch = self.gate.epoch  # before anything is sent: an interrupt from here on is this attempt's
        p_task = self._leg(prefill, self._post(prefill, path, wire, headers))
        opened: Opened | Leg | None = None
        keep_prefill = False
        try:
            opened = await self._open_decode(p_task, decode, self._open_stream(decode, path, wire, headers), epoch)
            if opened is None:
                return self._prefill_ended(prefill, p_task.result(), headers)
            if isinstance(opened, Leg):  # no stream: a failure, or an error status
                if opened.server_failed or opened.status in BACKPRESSURE:
                    return await self._decode_failed(prefill, p_task, decode, opened, headers)
                self.registry.record(decode, True)
                return _respond(opened, headers)
            prefix = None
            if with_logprobs:
                p_leg = await p_task
                if p_leg.ends_request:
                    return self._prefill_ended(prefill, p_leg, headers)
                prefix = _first_input_logprobs(p_leg)
            upstream = opened.response
            rule = self._interrupt_rule(epoch, resume)
            with self.registry.in_flight(decode):  # the head's leg has ended; the body still loads decode
                resp = await request.stream(upstream.status, {**_pass_headers(upstream), **headers})
                pumped = await pump(
                    resp,
                    opened.events(),
                    functools.partial(_prepend_logprobs, prefix=prefix) if prefix is not None else None,
                    rule,
                )
                keep_prefill = True
                self._finish_unawaited(prefill, p_task)
            opened.response.close()  # not held open through an update or a resume
            await self._stream_ended(resp, resume, decode, pumped, rule, headers, prefix)
            return STREAMED
        finally:
            if isinstance(opened, Opened):
                opened.response.close()
            await _cancel(None if keep_prefill else p_task)

    async def _stream_ended(
        self,
        resp: Any,
        resume: _Resume,
        worker: Worker,
        pumped: Pumped,
        rule: Interrupted | None,
        headers: Headers,
        prefix: list | None = None,
    ) -> None:
        """End the client's stream once the engine's ended: as it is, or continued on the new
        weights when a weight update interrupted answers (``rule.caught``), or on another
        engine when ``worker`` failed mid-stream (a one-answer /generate stream), else with an
        SGLang-shaped error event. ``prefix``: the prefill's input logprobs the client got."""
        if rule is not None and rule.caught and (pumped.error is None or rule.over):
            self.registry.record(worker, True)
            pending = {k: _with_input_logprobs(Piece().advanced(d), prefix) for k, d in rule.caught.items()}
            if not await self._resume(resp, resume, pending, headers, interrupted=True):
                await resp.write(error_event("the stream could not be continued after a weight update"))
        elif pumped.error is None:
            self.registry.record(worker, True)
        else:  # the engine went away: continue elsewhere, or end the stream properly
            self.registry.record(worker, False)
            self.registry.mark_failed(worker)
            last = pumped.last_data
            resumed = last is not None and await self._resume(
                resp, resume, {0: _with_input_logprobs(Piece().advanced(last), prefix)}, headers
            )
            if not resumed:
                await resp.write(error_event(f"{worker.role} {worker.url} failed mid-stream: {pumped.error}"))
        await resp.end()

    def _interrupted(self, leg: Leg) -> bool:
        """Whether a weight update began after ``leg`` was sent."""
        return leg.epoch is not None and self.gate.interrupted_since(leg.epoch)

    def _interrupt_rule(self, epoch: int, resume: _Resume) -> Interrupted:
        """The rule that catches a stream's answers that a weight update begun after ``epoch``
        interrupted, when the request can be continued (a /generate job)."""
        return Interrupted(lambda: self.gate.interrupted_since(epoch) and resume.job is not None)

    async def _open_decode(
        self, p_task: asyncio.Task[Leg], decode: Worker, open_head: Coroutine[Any, Any, Response | Leg], epoch: int
    ) -> Opened | Leg | None:
        """Decode's stream once its first event came; a Leg when it gave none (a failure, or
        an error status with its body) or when that event is a server-side abort (its status,
        see ``_server_abort``); None when the prefill ended the request first.

        SGLang sends a stream's head before the request even reaches the scheduler, so the
        head proves nothing: the first event does (it comes once the KV did). Until then the
        prefill can still end the request, and nothing has reached the client, so a failure
        is still retried on another pair. ``epoch``: the refit gate's when the attempt was sent."""
        head = await self._race(p_task, decode, open_head)
        if head is None or isinstance(head, Leg):
            return head
        if head.status >= 400:
            return Leg(head.status, await head.read(), head.content_type, epoch=epoch)
        events = sse_events(head)
        try:
            first = await self._race(p_task, decode, first_event(events, self._timeout))
        except BaseException:
            head.close()
            raise
        return None if first is None else _opened(head, first, events, epoch)

    async def _open_one(self, worker: Worker, path: str, wire: bytes, headers: Headers, epoch: int) -> Opened | Leg:
        """A regular engine's stream once its first event came, else a Leg saying why not."""
        with self.registry.in_flight(worker):
            head = await self._open_stream(worker, path, wire, headers)
            if isinstance(head, Leg):
                return head
            if head.status >= 400:
                try:
                    return Leg(head.status, await head.read(), head.content_type, epoch=epoch)
                finally:
                    head.close()
            events = sse_events(head)
            try:
                first = await first_event(events, self._timeout)
            except BaseException:
                head.close()
                raise
            return _opened(head, first, events, epoch)

    async def _open_continuation(
        self, resume: _Resume, body: dict[str, Any], version: str | None, headers: Headers, epoch: int
    ) -> _Continuation:
        """A stream of ``body`` (a continuation) on a freshly selected pair (PD) or engine,
        on weight ``version`` when given. RouteError when there is none."""
        if not resume.pd:
            worker = self.select_regular(resume.ctx, version)
            return _Continuation(worker, await self._open_one(worker, resume.path, dumps(body), headers, epoch))
        prefill, decode = self.select_pair(resume.ctx, version=version)
        wire = dumps(inject_bootstrap(body, host=prefill.bootstrap_host, port=prefill.bootstrap_port, batch_size=None))
        p_task = self._leg(prefill, self._post(prefill, resume.path, wire, headers))
        try:
            opened = await self._open_decode(
                p_task, decode, self._open_stream(decode, resume.path, wire, headers), epoch
            )
        except BaseException:
            await _cancel(p_task)
            raise
        return _Continuation(decode, opened, prefill, p_task)

    async def _resume(
        self, resp: Any, resume: _Resume, pending: dict[int, Piece], headers: Headers, *, interrupted: bool = False
    ) -> bool:
        """Continue a stream's answers on new legs (see pdctl.router.resume), writing their
        events into the client's stream: after a weight update interrupted them (``pending``:
        each such answer, by its index, with what the client has of it), on the new weights
        once the update is released; an answer interrupted more than ``max_staleness`` times
        ends with its tokens so far, one whose budget is spent simply ends. After its engine
        died (a one-answer stream, ``pending`` {0: ...}), on the same weight version.
        False when it cannot be continued: not a /generate job, no engine, or
        ``retry.max_retries`` failed attempts."""
        job = resume.job
        if job is None or not (interrupted or job.single):
            return False
        failures = 0
        # The version the next continuation must run on: any (the new one) after an update; the
        # version of the tokens so far after an engine died mid-stream. A continuation that fails
        # before its first token leaves it as it was.
        need = None if interrupted else pending[0].version
        while True:
            if failures >= max(1, self.config.retry.max_retries):
                return False
            if interrupted:
                need = None
                pending, ended = settle(job, pending, self.gate.max_staleness)
                shown = Continued(job, tuple(ended), {})
                tail = b"".join(shown.event(k, item) for k, item in ended.items())
                if not pending:
                    await resp.write(tail + DONE)
                    return True
                if tail:
                    await resp.write(tail)
                try:
                    await self.wait_open()
                except RouteError:
                    return False
            elif job.remaining(0, pending[0]) <= 0:
                await resp.write(DONE)
                return True
            order = tuple(pending)
            shown = Continued(job, order, pending)
            body = job.continuation([(k, pending[k]) for k in order])
            self.metrics.retried(errors.INTERRUPTED if interrupted else "stream_resumed")
            epoch = self.gate.epoch
            try:
                legs = await self._open_continuation(resume, body, need, headers, epoch)
            except RouteError:
                return False
            if not interrupted:
                log.warning(
                    "stream %s: %s failed after %d tokens; continuing on %s",
                    pending[0].meta.get("id"),
                    "decode" if resume.pd else "engine",
                    pending[0].tokens,
                    legs.worker.url,
                )
            keep_prefill = False
            try:
                opened = legs.opened
                if not isinstance(opened, Opened):
                    if self.gate.interrupted_since(epoch):  # the next update stopped it before its first token
                        interrupted = True
                        continue
                    if isinstance(opened, Leg) and opened.server_failed:
                        self._verdict(legs.worker, opened, errors.DECODE_FAILED)
                    failures, interrupted = failures + 1, False
                    continue
                rule = self._interrupt_rule(epoch, resume)
                with self.registry.in_flight(legs.worker):
                    pumped = await pump(resp, opened.events(), shown.rewrite, rule)
                keep_prefill = True
                if legs.prefill is not None and legs.p_task is not None:
                    self._finish_unawaited(legs.prefill, legs.p_task)
                if rule.caught and (pumped.error is None or rule.over):
                    self.registry.record(legs.worker, True)
                    pending, interrupted = shown.caught(rule), True
                    continue
                if pumped.error is None:
                    self.registry.record(legs.worker, True)
                    return True
                self.registry.record(legs.worker, False)
                self.registry.mark_failed(legs.worker)
                if len(order) > 1 or not job.single:
                    return False  # which of a batch's answers ended is not tracked: not continued
                last = pumped.last_data
                if last is not None:
                    pending = {0: pending[0].advanced(last)}
                    need = pending[0].version
                failures, interrupted = failures + 1, False
            finally:
                if isinstance(legs.opened, Opened):
                    legs.opened.response.close()
                await _cancel(None if keep_prefill else legs.p_task)

    def _finish_unawaited(self, prefill: Worker, task: asyncio.Task[Leg]) -> None:
        """The reply does not need prefill's answer: record its outcome when it comes, without
        holding the reply, and cancel it if it takes longer than PREFILL_GRACE_SECS."""

        def record(t: asyncio.Task[Leg]) -> None:
            if not t.cancelled() and t.result().status not in BACKPRESSURE:
                self.registry.record(prefill, not t.result().server_failed)

        if task.done():  # the common case: prefill answered first
            record(task)
            return
        timer = self.loop.call_later(PREFILL_GRACE_SECS, task.cancel)

        def settle(t: asyncio.Task[Leg]) -> None:
            timer.cancel()  # the handle would keep the task alive until it fires
            record(t)

        task.add_done_callback(settle)

    async def _stream_one(
        self, request: Request, path: str, data: bytes, worker: Worker, headers: Headers, resume: _Resume
    ) -> Outcome:
        """A regular engine's stream, forwarded; a /generate stream is read event by event, so
        that answers a weight update interrupts are continued (the rest pass as raw chunks)."""
        epoch = self.gate.epoch
        with self.registry.in_flight(worker):
            head = await self._open_stream(worker, path, data, headers)
        if isinstance(head, Leg):
            return self._verdict(worker, head, errors.WORKER_FAILED) or _respond(head, headers)
        upstream: Response = head
        try:
            if upstream.status >= 400:
                leg = Leg(upstream.status, await upstream.read(), upstream.content_type, epoch=epoch)
                return self._verdict(worker, leg, errors.WORKER_FAILED) or _respond(leg, headers)
            generate = path == GENERATE
            rule = self._interrupt_rule(epoch, resume) if generate else None
            with self.registry.in_flight(worker):
                resp = await request.stream(upstream.status, {**_pass_headers(upstream), **headers})
                pumped = await pump(resp, sse_events(upstream) if generate else upstream.chunks(), None, rule)
            upstream.close()
            if not generate:
                self.registry.record(worker, pumped.error is None)
                if pumped.error is not None:
                    await resp.write(error_event(f"worker {worker.url} failed mid-stream: {pumped.error}"))
                await resp.end()
                return STREAMED
            await self._stream_ended(resp, resume, worker, pumped, rule, headers)
            return STREAMED
        finally:
            upstream.close()

    async def _post(self, worker: Worker, path: str, data: bytes, headers: Headers) -> Leg:
        epoch = self.gate.epoch
        try:
            r = await self.upstream.post(worker.url + path, data, _to(worker, headers), timeout=self._timeout)
        except (UpstreamError, OSError) as exc:
            return Leg(error=exc, epoch=epoch)
        return Leg(r.status, r.body, r.content_type, epoch=epoch)

    async def _open_stream(self, worker: Worker, path: str, data: bytes, headers: Headers) -> Response | Leg:
        """The status and headers of a streamed response, or a Leg carrying why there are none."""
        epoch = self.gate.epoch
        try:
            return await asyncio.wait_for(
                self.upstream.post(worker.url + path, data, _to(worker, headers), stream=True), self._timeout
            )
        except asyncio.TimeoutError:
            return Leg(error=UpstreamTimeout("no response head within the request timeout"), epoch=epoch)
        except (UpstreamError, OSError) as exc:
            return Leg(error=exc, epoch=epoch)

    def _verdict(self, worker: Worker, leg: Leg, code: str) -> Retry | Stop | None:
        """What ``worker``'s answer means for the request: None when it answered (a 2xx to 4xx
        but 429: the answer goes to the client; counts as ok for the breaker), else a Retry or Stop.

        Backpressure (429/503) is a busy Retry and leaves the breaker alone. No answer at all
        counts against the breaker: a timeout Stops with 504 (another try would wait as long
        again), a connection failure also marks the worker failed until its next health check.
        A failure of a leg that a weight update interrupted (``interrupt`` refit: the engines
        abort what they run) is no fault of the worker: retried, once the update is released,
        as backpressure."""
        if (
            (leg.error is not None or leg.status >= 500)
            and not isinstance(leg.error, UpstreamTimeout)
            and self._interrupted(leg)
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
            return Retry(f"{worker.role} {worker.url} answered {leg.status}: {leg.body[:300]!r}", code, answer=leg)
        return None

    # -- helpers ---------------------------------------------------------------------------------------
    def _needs_text(self) -> bool:
        return self.prefill_policy.needs_text or self.decode_policy.needs_text

    def _backoff(self, attempt: int) -> float:
        c = self.config
        base = min(c.retry.initial_backoff_ms * c.retry.backoff_multiplier**attempt, c.retry.max_backoff_ms)
        return base * (1 + random.uniform(-c.retry.jitter_factor, c.retry.jitter_factor)) / 1000


class _Resume:
    """What continuing a stream elsewhere needs: the client's request (read as a ``Job`` only
    when a stream is to be continued)."""

    __slots__ = ("_job", "body", "ctx", "path", "pd")

    def __init__(self, body: dict[str, Any], ctx: RequestContext, path: str, *, pd: bool = True):
        self.body, self.ctx, self.path, self.pd = body, ctx, path, pd
        self._job: Job | bool | None = False  # False: not read yet

    @property
    def job(self) -> Job | None:
        if self._job is False:
            self._job = Job.of(self.path, self.body)
        return self._job  # type: ignore[return-value]


@dataclass(frozen=True)
class _Continuation:
    """A continuation's stream (``opened``) from ``worker``, and its prefill leg under PD."""

    worker: Worker
    opened: Opened | Leg | None
    prefill: Worker | None = None
    p_task: asyncio.Task[Leg] | None = None


def _opened(head: Response, first: bytes | BaseException, events: AsyncIterator[bytes], epoch: int) -> Opened | Leg:
    """The stream, or a Leg when its first event is a failure or a server-side abort (with its
    status: nothing was sent on yet, so it is retried)."""
    if isinstance(first, BaseException):
        head.close()
        return Leg(error=first, epoch=epoch)
    status = _server_abort(first)
    if status is not None:
        head.close()
        return Leg(status, first + DONE, "text/event-stream", epoch=epoch)
    return Opened(head, first, events)


def _chosen(worker: Worker | None, role: Role) -> Worker:
    if worker is None:  # a policy must choose among the workers it is given
        raise RouteError(503, errors.NO_WORKERS, f"the {role} policy chose no worker")
    return worker


def _names_bootstrap(body: bytes, prefill: Worker) -> bool:
    """Whether a decode's error body names ``prefill``'s bootstrap server (HOST:PORT)."""
    if prefill.bootstrap_port is None:
        return False
    return f"{prefill.bootstrap_host}:{prefill.bootstrap_port}".encode() in body


def _abort_of(body: bytes) -> dict[str, Any] | None:
    """The finish_reason of an engine's 200 whose (first) item finished with an abort (SGLang's
    shape: ``{"type": "abort", "message", "status_code"}``), whole or streamed (a prefill asked to
    stream answers in events), else None."""
    if b'"abort"' not in body:
        return None
    try:
        if body.startswith(b"data: "):
            data = next(loads(e[6:]) for e in body.split(b"\n\n") if e.startswith(b"data: {") and b'"abort"' in e)
        else:
            data = loads(body)
    except (ValueError, StopIteration):
        return None
    item = data[0] if isinstance(data, list) and data else data
    meta = item.get("meta_info") if isinstance(item, dict) else None
    reason = meta.get("finish_reason") if isinstance(meta, dict) else None
    return reason if isinstance(reason, dict) and reason.get("type") == "abort" else None


def _aborted(body: bytes) -> bool:
    return _abort_of(body) is not None


def _server_abort(event: bytes) -> int | None:
    """The status of a stream's event that ends its request with a server-side failure, else None.

    SGLang 0.5.23 streams an abort as an output whose finish_reason is an abort with its
    ``status_code`` (a decode that lost its prefill's KV: 500, "Lost connection with prefill
    instance (bootstrap_addr: HOST:PORT)"), and an error as ``{"error": {"code": ...}}``. A 4xx
    is the client's answer and is not reported here."""
    reason = _abort_of(event)
    if reason is not None:
        code = reason.get("status_code")
    elif b'"error"' in event and event.startswith(b"data: {"):
        try:
            data = loads(event[6:])
        except ValueError:
            return None
        error = data.get("error") if isinstance(data, dict) else None
        code = error.get("code") if isinstance(error, dict) else None
    else:
        return None
    return code if isinstance(code, int) and 500 <= code < 600 else None


def _interrupted_answer(body: bytes) -> bool:
    """Whether a /generate answer or an OpenAI completion has an item that an asked-for abort
    ended (SGLang's OpenAI routes give such a choice finish_reason "abort")."""
    if b'"abort"' not in body:
        return False
    try:
        parsed = loads(body)
    except ValueError:
        return False
    if isinstance(parsed, dict) and isinstance(parsed.get("choices"), list):
        return any(isinstance(c, dict) and c.get("finish_reason") == "abort" for c in parsed["choices"])
    items = [parsed] if isinstance(parsed, dict) else parsed
    return isinstance(items, list) and any(asked_abort(item) for item in items)


def _items(body: bytes, count: int) -> list[Any] | None:
    """A /generate answer's items (a list, or one object as a list of one) when there are ``count``."""
    try:
        parsed = loads(body)
    except ValueError:
        return None
    items = [parsed] if isinstance(parsed, dict) else parsed
    return items if isinstance(items, list) and len(items) == count else None


def _text_of(body: dict[str, Any]) -> str | None:
    for key in ("text", "prompt"):
        value = body.get(key)
        if isinstance(value, str):
            return value
    messages = body.get("messages")
    if isinstance(messages, list):
        return "".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
    return None


def _cancel_requests(task: asyncio.Task) -> int:
    """How many cancel requests ``task`` has (Python 3.11+ counts them; 3.10: 0)."""
    cancelling = getattr(task, "cancelling", None)
    return cancelling() if cancelling is not None else 0


def _withdraw_cancel(task: asyncio.Task, base: int) -> bool:
    """Withdraw the race's own cancel request (if ``task`` holds more than ``base``), and say
    whether someone else cancelled it too: the client going away, the server stopping. Python
    3.10 cannot tell, and the race's reading wins."""
    uncancel = getattr(task, "uncancel", None)
    if uncancel is None:
        return False
    if _cancel_requests(task) > base:
        uncancel()
    return _cancel_requests(task) > base


async def _cancel(*tasks: asyncio.Task | None) -> None:
    pending = [t for t in tasks if t is not None and not t.done()]
    for task in pending:
        task.cancel()
    for task in pending:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


def _to(worker: Worker, headers: Headers) -> dict[str, str]:
    """The headers sent to ``worker``: the forwarded client headers and the worker's own key."""
    return {**headers.upstream, **worker.auth} if worker.auth else headers.upstream


def _pass_headers(upstream: Response) -> dict[str, str]:
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in upstream.headers if k.lower() not in _HOP_HEADERS}


def _respond(leg: Leg, headers: Headers) -> Reply:
    return Reply(leg.status, leg.body, leg.content_type, headers)


def _merge_logprobs(p_leg: Leg, d_leg: Leg) -> Leg:
    """Put prefill's meta_info.input_token_logprobs in front of decode's (per item for batches)."""
    try:
        p, d = loads(p_leg.body), loads(d_leg.body)
    except ValueError:
        return d_leg
    pairs = zip(p, d, strict=False) if isinstance(p, list) and isinstance(d, list) else [(p, d)]
    for p_item, d_item in pairs:
        if isinstance(p_item, dict) and isinstance(d_item, dict) and "meta_info" in d_item:
            head = p_item.get("meta_info", {}).get("input_token_logprobs") or []
            d_item["meta_info"]["input_token_logprobs"] = head + (d_item["meta_info"].get("input_token_logprobs") or [])
    return Leg(d_leg.status, dumps(d), d_leg.content_type)


def _first_input_logprobs(p_leg: Leg) -> list | None:
    for line in p_leg.body.split(b"\n"):
        if line.startswith(b"data: {"):
            with contextlib.suppress(ValueError):
                return loads(line[6:]).get("meta_info", {}).get("input_token_logprobs") or []
    return []


def _with_input_logprobs(done: Piece, prefix: list | None) -> Piece:
    """``done`` with the prefill's input logprobs in front, as the client got them."""
    if prefix is not None:
        done.meta["input_token_logprobs"] = prefix + (done.meta.get("input_token_logprobs") or [])
    return done


def _prepend_logprobs(event: bytes, prefix: list) -> bytes:
    chunk = sse_data(event)
    meta = chunk.get("meta_info") if chunk is not None else None
    if not isinstance(meta, dict):
        return event
    meta["input_token_logprobs"] = prefix + (meta.get("input_token_logprobs") or [])
    return sse_event(chunk)
