"""PD dispatch, top to bottom: select_pair -> add_bootstrap -> send_both -> shape_response.

Failure rules (sglang-protocol.md 2.3, style.md R9), implemented as written:
- both legs run as tasks owned by the request's handler, so a client that goes away
  cancels both (and the engines abort them);
- a prefill that fails cancels its decode leg, which would otherwise wait for KV until
  SGLANG_DISAGGREGATION_WAITING_TIMEOUT; a decode that fails first cancels the prefill;
- a failed leg (connection error or 5xx) is retried on a freshly selected pair with a new
  bootstrap room, with exponential backoff and jitter, at most ``retry_max_retries`` times,
  and only while nothing has been sent to the client;
- a leg that times out (``request_timeout_secs``) ends the request with a 504, not retried;
- a worker's 4xx is the client's fault: returned as is, never retried, and it counts as a
  success for the circuit breaker;
- prefill's ``input_token_logprobs`` are put in front of decode's only when asked for.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from pdctl.router import errors
from pdctl.router.config import RouterConfig
from pdctl.router.jsonutil import dumps, loads
from pdctl.router.metrics import RouterMetrics
from pdctl.router.policies import RequestContext, make_policy
from pdctl.router.server import STREAMED, Reply, Request
from pdctl.router.upstream import Response, UpstreamError, UpstreamPool, UpstreamTimeout
from pdctl.router.workers import Worker, WorkerRegistry
from pdctl.sglang import inject_bootstrap

PREFILL_GRACE_SECS = 5.0  # how long a prefill leg may run on after the reply went out without it
_HOP_HEADERS = {
    b"content-length",
    b"transfer-encoding",
    b"connection",
    b"keep-alive",
    b"content-encoding",
    b"date",
    b"server",
}


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

    @property
    def server_failed(self) -> bool:
        return self.error is not None or self.status >= 500


class Retry(Exception):
    """This pair failed before anything reached the client; try another pair."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


class Dispatcher:
    def __init__(self, config: RouterConfig, registry: WorkerRegistry, metrics: RouterMetrics):
        self.config = config
        self.registry = registry
        self.metrics = metrics
        opts = {
            "cache_threshold": config.cache_threshold,
            "balance_abs_threshold": config.balance_abs_threshold,
            "balance_rel_threshold": config.balance_rel_threshold,
        }
        self.prefill_policy = make_policy(config.prefill_policy or config.policy, **opts)
        self.decode_policy = make_policy(config.decode_policy or config.policy, **opts)
        self.regular_policy = make_policy(config.policy, **opts)
        self.upstream = UpstreamPool()
        self._timeout = config.request_timeout_secs
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        # Cached: on Python 3.11 every asyncio.get_running_loop() (inside create_task too) is a
        # getpid() syscall, which was 6% of the router's CPU in a native profile.
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    # -- phase 1: select ----------------------------------------------------------------------
    def select_pair(self, ctx: RequestContext) -> tuple[Worker, Worker]:
        """A prefill and a decode on the same weight version; RouteError (503) names what is missing."""
        prefills = self.registry.routable("prefill")
        if not prefills:
            raise RouteError(503, errors.NO_PREFILL, "No prefill workers available" + self._why_none("prefill"))
        decodes = self.registry.routable("decode")
        if not decodes:
            raise RouteError(503, errors.NO_DECODE, "No decode workers available" + self._why_none("decode"))
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
        prefill = self.prefill_policy.select(pairable, ctx) or pairable[0]
        same = [d for d in decodes if d.weight_version == prefill.weight_version]
        decode = self.decode_policy.select(same, ctx) or same[0]
        self.metrics.selected(prefill, decode)
        return prefill, decode

    def _why_none(self, role: str) -> str:
        held = [w for w in self.registry.of_role(role) if w.quarantined]
        if held:
            return f" ({len(held)} out of rotation for their weights: {held[0].quarantined})"
        return " (none healthy)"

    def select_regular(self, ctx: RequestContext) -> Worker:
        workers = self.registry.routable("regular")
        if not workers:
            raise RouteError(503, errors.NO_WORKERS, "No healthy workers available" + self._why_none("regular"))
        return self.regular_policy.select(workers, ctx) or workers[0]

    # -- the request loop (retries) ---------------------------------------------------------------
    async def _with_retries(self, attempt_once: Callable[[], Awaitable[Reply]]) -> Reply:
        """Run ``attempt_once`` until it does not raise Retry, with backoff; then a 502."""
        attempts = 1 if self.config.disable_retries else 1 + self.config.retry_max_retries
        attempt = 0
        while True:
            try:
                return await attempt_once()
            except Retry as retry:
                self.metrics.retried(retry.code)
                attempt += 1
                if attempt >= attempts:
                    raise RouteError(502, retry.code, f"{retry} (after {attempt} attempt(s))") from None
            await asyncio.sleep(self._backoff(attempt - 1))

    async def pd_request(
        self, request: Request, path: str, body: dict[str, Any], batch: int | None, headers: dict[str, str]
    ) -> Reply:
        ctx = RequestContext(text=_text_of(body) if self._needs_text() else None)
        stream = bool(body.get("stream"))
        with_logprobs = bool(body.get("return_logprob") or body.get("logprobs"))

        async def attempt() -> Reply:
            prefill, decode = self.select_pair(ctx)
            # phase 2: a new room per attempt (a retried room could collide with the orphan)
            bootstrapped = inject_bootstrap(
                body, host=prefill.bootstrap_host, port=prefill.bootstrap_port, batch_size=batch
            )
            wire = dumps(bootstrapped)
            decode.load += 1  # prefill's load is counted by its leg's task (it may outlive the reply)
            try:
                if stream:
                    return await self._stream_both(request, path, wire, prefill, decode, headers, with_logprobs)
                return await self._send_both(path, wire, prefill, decode, headers, with_logprobs)
            finally:
                decode.load -= 1

        return await self._with_retries(attempt)

    async def regular_request(
        self, request: Request, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> Reply:
        ctx = RequestContext(text=_text_of(body) if self.regular_policy.needs_text else None)
        data = dumps(body)

        async def attempt() -> Reply:
            worker = self.select_regular(ctx)
            worker.load += 1
            try:
                if body.get("stream"):
                    return await self._stream_one(request, path, data, worker, headers)
                leg = await self._post(worker, path, data, headers)
                self._judge(worker, leg, errors.WORKER_FAILED)
                return _respond(leg, headers)
            finally:
                worker.load -= 1

        return await self._with_retries(attempt)

    # -- phase 3: send both -----------------------------------------------------------------------
    async def _send_both(
        self, path: str, wire: bytes, prefill: Worker, decode: Worker, headers: dict[str, str], with_logprobs: bool
    ) -> Reply:
        p_task: asyncio.Task[Leg] | None = self._prefill_leg(prefill, path, wire, headers)
        d_task = self.loop.create_task(self._post(decode, path, wire, headers))
        prefill_failed = False

        def on_prefill(task: asyncio.Task) -> None:
            nonlocal prefill_failed
            if not task.cancelled() and (task.result().server_failed or task.result().status >= 400):
                prefill_failed = True
                d_task.cancel()  # decode would wait for KV that never comes

        # A done-callback instead of asyncio.wait(FIRST_COMPLETED): cheaper on the hot path.
        p_task.add_done_callback(on_prefill)
        try:
            try:
                d_leg = await d_task
            except asyncio.CancelledError:
                if not prefill_failed:
                    raise  # the client went away
                p_leg = p_task.result()
                self._judge(prefill, p_leg, errors.PREFILL_FAILED)
                return _respond(p_leg, headers)  # a 4xx: the client's fault
            self._judge(decode, d_leg, errors.DECODE_FAILED)
            if d_leg.status >= 400 or not with_logprobs:
                self._finish_unawaited(prefill, p_task)
                p_task = None
                return _respond(d_leg, headers)
            p_leg = await p_task
            self._judge(prefill, p_leg, errors.PREFILL_FAILED)
            return _respond(_merge_logprobs(p_leg, d_leg), headers)
        finally:
            await _cancel(p_task, d_task)

    async def _stream_both(
        self,
        request: Request,
        path: str,
        wire: bytes,
        prefill: Worker,
        decode: Worker,
        headers: dict[str, str],
        with_logprobs: bool,
    ) -> Reply:
        p_task: asyncio.Task[Leg] | None = self._prefill_leg(prefill, path, wire, headers)
        d_head = self.loop.create_task(self._open_stream(decode, path, wire, headers, errors.DECODE_FAILED))
        upstream: Response | None = None
        try:
            done, _ = await asyncio.wait({p_task, d_head}, return_when=asyncio.FIRST_COMPLETED)
            if p_task in done and (p_task.result().server_failed or p_task.result().status >= 400):
                d_head.cancel()  # decode would wait for KV that never comes
                self._judge(prefill, p_task.result(), errors.PREFILL_FAILED)
                return _respond(p_task.result(), headers)
            upstream = await d_head
            if upstream.status >= 400:
                leg = Leg(upstream.status, await upstream.read(), upstream.content_type)
                self._judge(decode, leg, errors.DECODE_FAILED)
                return _respond(leg, headers)
            resp = await request.stream(upstream.status, {**_pass_headers(upstream), **headers})
            prefix = None
            if with_logprobs:
                prefix = _first_input_logprobs(await p_task)
            async for event in _sse_events(upstream):
                await resp.write(_prepend_logprobs(event, prefix) if prefix is not None else event)
            self.registry.record(decode, True)
            self._finish_unawaited(prefill, p_task)
            p_task = None
            await resp.end()
            return STREAMED
        finally:
            if upstream is not None:
                upstream.close()
            await _cancel(p_task, d_head)

    def _prefill_leg(self, prefill: Worker, path: str, wire: bytes, headers: dict[str, str]) -> asyncio.Task[Leg]:
        """The prefill leg as a task that counts in prefill's load until it ends."""
        prefill.load += 1
        task = self.loop.create_task(self._post(prefill, path, wire, headers))
        task.add_done_callback(lambda _: _unload(prefill))
        return task

    def _finish_unawaited(self, prefill: Worker, task: asyncio.Task[Leg]) -> None:
        """The reply does not need prefill's answer: record its outcome when it comes, without
        holding the reply, and cancel it if it takes longer than PREFILL_GRACE_SECS."""

        def record(t: asyncio.Task[Leg]) -> None:
            if not t.cancelled():
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
        self, request: Request, path: str, data: bytes, worker: Worker, headers: dict[str, str]
    ) -> Reply:
        upstream = await self._open_stream(worker, path, data, headers, errors.WORKER_FAILED)
        try:
            if upstream.status >= 400:
                leg = Leg(upstream.status, await upstream.read(), upstream.content_type)
                self._judge(worker, leg, errors.WORKER_FAILED)
                return _respond(leg, headers)
            resp = await request.stream(upstream.status, {**_pass_headers(upstream), **headers})
            async for chunk in upstream.chunks():
                await resp.write(chunk)
            self.registry.record(worker, True)
            await resp.end()
            return STREAMED
        finally:
            upstream.close()

    async def _post(self, worker: Worker, path: str, data: bytes, headers: dict[str, str]) -> Leg:
        try:
            r = await self.upstream.post(worker.url + path, data, headers, timeout=self._timeout)
        except (UpstreamError, OSError) as exc:
            return Leg(error=exc)
        return Leg(r.status, r.body, r.content_type)

    async def _open_stream(
        self, worker: Worker, path: str, data: bytes, headers: dict[str, str], code: str
    ) -> Response:
        """Status and headers of a streamed response; a failure to get them raises like ``_fail``."""
        try:
            return await asyncio.wait_for(
                self.upstream.post(worker.url + path, data, headers, stream=True), self._timeout
            )
        except asyncio.TimeoutError:
            self._fail(worker, UpstreamTimeout("no response head within the request timeout"), code)
        except (UpstreamError, OSError) as exc:
            self._fail(worker, exc, code)

    def _judge(self, worker: Worker, leg: Leg, code: str) -> None:
        """Record the outcome; raise (see ``_fail``) for a server-side failure."""
        if leg.error is not None:
            self._fail(worker, leg.error, code)
        self.registry.record(worker, leg.status < 500)
        if leg.status >= 500:
            raise Retry(f"{worker.role} {worker.url} answered {leg.status}: {leg.body[:300]!r}", code)

    def _fail(self, worker: Worker, error: BaseException, code: str) -> NoReturn:
        """Record a leg that got no answer: 504 for a timeout (another try would wait as long
        again), else Retry; a connection failure also counts as a failed health check."""
        self.registry.record(worker, False)
        if isinstance(error, UpstreamTimeout):
            raise RouteError(504, errors.TIMEOUT, f"{worker.role} {worker.url}: {error}")
        if isinstance(error, OSError):  # UpstreamError is a ConnectionError
            self.registry.mark_failed(worker)
        raise Retry(f"{worker.role} {worker.url} failed: {type(error).__name__}: {error}", code)

    # -- helpers ---------------------------------------------------------------------------------------
    def _needs_text(self) -> bool:
        return self.prefill_policy.needs_text or self.decode_policy.needs_text

    def _backoff(self, attempt: int) -> float:
        c = self.config
        base = min(c.retry_initial_backoff_ms * c.retry_backoff_multiplier**attempt, c.retry_max_backoff_ms)
        return base * (1 + random.uniform(-c.retry_jitter_factor, c.retry_jitter_factor)) / 1000


def _text_of(body: dict[str, Any]) -> str | None:
    for key in ("text", "prompt"):
        value = body.get(key)
        if isinstance(value, str):
            return value
    messages = body.get("messages")
    if isinstance(messages, list):
        return "".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
    return None


def _unload(worker: Worker) -> None:
    worker.load -= 1


async def _cancel(*tasks: asyncio.Task | None) -> None:
    pending = [t for t in tasks if t is not None and not t.done()]
    for task in pending:
        task.cancel()
    for task in pending:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


def _pass_headers(upstream: Response) -> dict[str, str]:
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in upstream.headers if k.lower() not in _HOP_HEADERS}


def _respond(leg: Leg, headers: dict[str, str]) -> Reply:
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


def _prepend_logprobs(event: bytes, prefix: list) -> bytes:
    if not event.startswith(b"data: {"):
        return event
    try:
        chunk = loads(event[6:].strip())
    except ValueError:
        return event
    meta = chunk.get("meta_info")
    if isinstance(meta, dict):
        meta["input_token_logprobs"] = prefix + (meta.get("input_token_logprobs") or [])
    return b"data: " + dumps(chunk) + b"\n\n"


async def _sse_events(upstream: Response):
    """Whole SSE events (``data: ...\\n\\n``) from a streaming response."""
    buffer = b""
    async for chunk in upstream.chunks():
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            yield event + b"\n\n"
    if buffer:
        yield buffer
