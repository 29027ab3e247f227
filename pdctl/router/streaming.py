"""Forwarding an engine's SSE stream to the client, and the pieces a continued stream needs.

``pump`` forwards events as they come and parses none of them on the common path; after a
weight update (refit ``interrupt``) its ``Interrupted`` rule catches the events that end an
answer in an asked-for abort, so that the dispatcher can continue those answers on the new
weights (``Continued`` shows a continuation's events as part of the client's stream).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from pdctl.router.jsonutil import dumps, sse_data, sse_event
from pdctl.router.resume import Job, Piece, asked_abort
from pdctl.router.upstream import Response, UpstreamError, UpstreamTimeout

DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class Opened:
    """An engine stream whose first event has come (and not yet been sent on)."""

    response: Response
    first: bytes
    rest: AsyncIterator[bytes]

    async def events(self) -> AsyncIterator[bytes]:
        yield self.first
        async for event in self.rest:
            yield event


async def first_event(events: AsyncIterator[bytes], timeout: float) -> bytes | BaseException:
    """The first event of a stream, or why there is none (UpstreamTimeout after ``timeout``)."""
    try:
        return await asyncio.wait_for(events.__anext__(), timeout)
    except asyncio.TimeoutError:
        return UpstreamTimeout("no first event within the request timeout")
    except StopAsyncIteration:
        return UpstreamError("the stream ended before its first event")
    except (UpstreamError, OSError) as exc:
        return exc


async def sse_events(upstream: Response) -> AsyncIterator[bytes]:
    """Whole SSE events (``data: ...\\n\\n``) from a streaming response."""
    buffer = b""
    async for chunk in upstream.chunks():
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            yield event + b"\n\n"
    if buffer:
        yield buffer


@dataclass
class Interrupted:
    """``pump``'s rule for streams a weight update may interrupt. ``armed()`` (an integer
    compare) says whether an update began since the stream was sent; only then is an event
    that names an abort parsed. An asked-for abort (SGLang's pause in ``abort`` mode) is caught,
    not forwarded: ``caught`` maps the event's ``index`` to its data. A one-answer stream (its
    events have no ``index``: SGLang numbers only a batch's) is ``over`` at its catch; a batch's
    goes on until the engine's [DONE], which is not forwarded either once something was caught
    (the client's stream goes on with the continuation)."""

    armed: Callable[[], bool]
    caught: dict[int, dict[str, Any]] = field(default_factory=dict)
    over: bool = False

    def catches(self, event: bytes) -> bool:
        if event == DONE and self.caught:
            self.over = True
            return True
        if not self.armed() or b'"abort"' not in event:
            return False
        data = sse_data(event)
        if data is None or not asked_abort(data):
            return False
        index = data.get("index")
        self.caught[index if isinstance(index, int) else 0] = data
        self.over = index is None
        return True


@dataclass(frozen=True)
class Pumped:
    """How forwarding a stream ended: ``last``, the last data event forwarded (as the upstream
    sent it; parsed only by a caller that continues the stream); ``error``, the upstream's
    failure."""

    last: bytes | None = None
    error: BaseException | None = None

    @property
    def last_data(self) -> dict[str, Any] | None:
        return sse_data(self.last) if self.last is not None else None


async def pump(
    resp: Any,
    events: AsyncIterator[bytes],
    transform: Callable[[bytes], bytes] | None,
    rule: Interrupted | None = None,
) -> Pumped:
    """Forward ``events`` (an upstream's SSE events or raw chunks) to the client. A failure to
    write to the client propagates: a client that goes away is not the worker's fault."""
    last: bytes | None = None
    events = events.__aiter__()
    while True:
        try:
            event = await events.__anext__()
        except StopAsyncIteration:
            return Pumped(last)
        except (UpstreamError, OSError) as exc:
            return Pumped(last, error=exc)
        if rule is not None and rule.catches(event):
            if rule.over:
                return Pumped(last)
            continue
        await resp.write(transform(event) if transform is not None else event)
        if event.startswith(b"data: {"):
            last = event


@dataclass(frozen=True)
class Continued:
    """A continuation of some of a job's answers, as the client's stream shows it: the
    continuation's answer ``j`` is the client's answer ``order[j]``, behind what it has so far
    (``pieces``), under the client's ``index`` (SGLang numbers a batch's answers; a one-answer
    stream has no index)."""

    job: Job
    order: tuple[int, ...]
    pieces: dict[int, Piece]

    def rewrite(self, event: bytes) -> bytes:
        data = sse_data(event)
        if data is None or not isinstance(data.get("meta_info"), dict):
            return event  # [DONE] and errors pass
        k = self.answer(data.get("index", 0))
        return self.event(k, self.pieces[k].view(data))

    def event(self, k: int, item: dict[str, Any]) -> bytes:
        """Answer ``k``'s ``item`` as an event of the client's stream."""
        if not self.job.single:
            item = {**item, "index": k}
        return sse_event(item)

    def caught(self, rule: Interrupted) -> dict[int, Piece]:
        """The client's answers that ``rule`` caught in this continuation, with what they have."""
        return {self.answer(j): self.pieces[self.answer(j)].advanced(data) for j, data in rule.caught.items()}

    def answer(self, j: Any) -> int:
        """The client's answer that the continuation's answer ``j`` continues."""
        return self.order[j if isinstance(j, int) and 0 <= j < len(self.order) else 0]


def error_event(message: str) -> bytes:
    """An SGLang-shaped error event and the stream's terminator."""
    return b"data: " + dumps({"error": {"message": message, "type": "server_error", "code": 500}}) + b"\n\n" + DONE
