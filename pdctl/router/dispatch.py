"""Dispatch: a client's request from its body to the answer as the client gets it.

    ClientRequest (pdctl.router.request) -> the attempt loop (pdctl.router.attempts: select,
    legs, retry) -> a Reply, or an open stream whose body is a ``Relay`` (pdctl.router.relay)
    -> continued when a weight update interrupted it or its decode died
    (pdctl.router.continuation)

The dispatcher returns a ``Reply`` or a ``StreamReply`` (pdctl.router.reply) and never touches
the client's socket: the HTTP server writes what it returns. A non-streamed answer a weight
update interrupted is continued before it is returned; a stream is continued by its relay.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from pdctl.router.admission import Admission
from pdctl.router.attempts import Attempts, Interrupt
from pdctl.router.config import RouterConfig
from pdctl.router.continuation import Continuation
from pdctl.router.gate import RefitGate
from pdctl.router.legs import Legs, Live
from pdctl.router.metrics import RouterMetrics
from pdctl.router.pair_room import PairRoom
from pdctl.router.relay import Relay
from pdctl.router.reply import Answer, StreamReply
from pdctl.router.request import ClientRequest
from pdctl.router.retry import RetryPolicy, Tries
from pdctl.router.selection import Selector
from pdctl.router.shaping import ROUTING_KEY, Headers, passed_headers
from pdctl.router.upstream import Upstream, UpstreamPool
from pdctl.router.workers import WorkerRegistry


class Dispatcher:
    """A router's request path for client requests (module docstring)."""

    def __init__(
        self,
        config: RouterConfig,
        registry: WorkerRegistry,
        metrics: RouterMetrics,
        upstream: Upstream | None = None,
        gate: RefitGate | None = None,
        retry: RetryPolicy | None = None,
        *,
        admission: Admission | None = None,
    ):
        """``upstream``: how engines are reached (the real connection pool unless given);
        ``gate``: the weight-update gate (the app's, so that its holds reach retries and
        continuations); ``retry``: the retry policy (``config.retry``'s unless given);
        ``admission``: the count of requests in flight that a drain waits for (the app's)."""
        self.config = config
        self.gate = gate if gate is not None else RefitGate()
        self.registry = registry
        self.metrics = metrics
        self.select = Selector(config, registry, metrics)
        timeout = config.admission.request_timeout_secs
        self.legs = Legs(upstream if upstream is not None else UpstreamPool(), registry, self.gate, timeout)
        self.retry = retry if retry is not None else RetryPolicy(config.retry, timeout)
        admission = admission if admission is not None else Admission(config.admission, metrics)
        self.attempts = Attempts(config, registry, metrics, self.select, self.legs, self.gate, self.retry, admission)
        limits = config.admission
        self.room: PairRoom | None = None
        if limits.prefill_room or limits.decode_room:
            self.room = room = PairRoom(registry, limits.prefill_room, limits.decode_room, timeout)
            self.legs.freed = room.freed
            registry.on_rotation.append(room.freed)
            self.select.room = self.attempts.room = room
            metrics.watch_room(room)
        self.continuation = Continuation(self.attempts)

    async def close(self) -> None:
        """Cancel every leg still running (a prefill that outlived its reply, for instance)."""
        if self.room is not None:
            self.room.close()
        await self.legs.close()

    def wait_open(self) -> Awaitable[None]:
        """Wait while a weight update holds the router (at most ``admission.max_hold_secs``)."""
        return self.attempts.wait_open()

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
        answer = await self.attempts.run(request, request.body, request.batch, tries)
        if isinstance(answer, Live):
            response = answer.leg.response
            assert response is not None
            body = Relay(self.continuation, request, answer, tries)
            return StreamReply(200, passed_headers(response.headers, request.headers), body, response.content_type)
        assert not isinstance(answer, Interrupt)
        if not request.stream and self.gate.epoch != request.sent:  # (gate.interrupted_since, inline)
            return await self.continuation.whole(request, answer, tries)
        return answer
