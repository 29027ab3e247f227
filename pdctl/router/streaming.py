"""An engine's SSE stream as the client gets it, and the pieces a continued stream needs.

A stream is forwarded in *blocks* (cut by ``pdctl.router.legs.StreamLeg``): what arrived, up to
the last event boundary, so that the client never gets half an event and the router parses none
of them on the common path. After a weight update (refit ``interrupt``) the ``Interrupted`` rule reads
the blocks that name an abort event by event and catches those that end an answer in an
asked-for abort, so that the dispatcher can continue those answers on the new weights
(``Continued`` shows a continuation's events as part of the client's stream).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdctl.router.jsonutil import dumps, sse_data, sse_event
from pdctl.router.resume import Job, Piece, asked_abort

DONE = b"data: [DONE]\n\n"
Transform = Callable[[bytes], bytes]
"""What the client sees of one event."""


def events_of(block: bytes) -> list[bytes]:
    """A block's events, each with its ``\\n\\n``."""
    return [event + b"\n\n" for event in block.split(b"\n\n") if event]


def shaped(block: bytes, transform: Transform) -> bytes:
    return b"".join(transform(event) for event in events_of(block))


def last_data(block: bytes | None) -> dict[str, Any] | None:
    """The JSON of the last ``data: {...}`` event in ``block``."""
    if block is None:
        return None
    start = block.rfind(b"data: {")
    return sse_data(block[start:]) if start >= 0 else None


@dataclass(slots=True)
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
        """Whether ``event`` is caught rather than forwarded: an asked-for abort while ``armed`` (kept in ``caught``; a
        one-answer stream is then ``over``), or the engine's [DONE] once something was caught (then ``over``)."""
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

    def reads(self, block: bytes) -> bool:
        """Whether ``block`` must be read event by event (``passed``) rather than passed whole."""
        return bool(self.caught) or (b'"abort"' in block and self.armed())

    def passed(self, block: bytes, transform: Transform | None) -> bytes:
        """What the client gets of ``block``: its events but those caught, and none after the
        one that ends the stream (``over``)."""
        out = []
        for event in events_of(block):
            if self.catches(event):
                if self.over:
                    break
                continue
            out.append(transform(event) if transform is not None else event)
        return b"".join(out)


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
        """The continuation's ``event`` as the client's stream shows it (under the client's answer and index, behind
        what it has so far); [DONE], errors and events without ``meta_info`` pass unchanged."""
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
