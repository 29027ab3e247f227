"""Late pairing: a PD request waits in the router until a prefill (and, when bounded, a decode)
has room, and is paired then, among the engines of that moment.

sglang-router pairs a request with its prefill and its decode when it arrives; SGLang's decode
preallocates its KV and the prefill waits for that handshake, so the request is bound to both
engines from then on. A burst (an RL step's prompts, all sent at once) is then spread over the
engines there were when it came, and an engine a planner moves to a role mid-burst serves none
of it. With ``admission.prefill_room`` (``--pd-prefill-room``) each prefill holds at most that
many of the router's requests at once (those it queues and those it computes); the rest wait
here, first come first served, and each is paired when a prefill has room, with the decode
that has room then. ``admission.decode_room`` bounds the decodes' in the same way (a decode holds
a request from its pairing to the end of its answer, its prefill's time included).

A request waits here at most ``admission.request_timeout_secs`` (then a 503 ``room_timeout``);
a client that goes away leaves the queue. A retried attempt, a request handed off from a drained
engine and a stream's continuation wait at the head of the queue, not behind the requests that
came after them. When a role has no engine in rotation at all the request is let through, so
that selection's own wait for a worker (``worker_wait_secs``) and its 503 apply as without late
pairing. Requests that wait are woken by a leg that ends, a worker that comes into rotation, or
the end of an open circuit's timeout.

Known limits: the room is counted over a role's engines in rotation whatever their weight
version, so while the fleet is split across versions a request may be paired with a full engine
of its own version (as on arrival); and the hashing policies (``consistent_hashing``,
``prefix_hash``, ``manual``) are refused with late pairing (config.py), since choosing among the
engines with room would give up the stickiness they are for.
"""

from __future__ import annotations

import asyncio
from collections import deque

from pdctl.roles import Role
from pdctl.router import errors
from pdctl.router.errors import RouteError
from pdctl.router.workers import Worker, WorkerRegistry


class PairRoom:
    """The router's queue of PD requests waiting for an engine with room (module docstring)."""

    def __init__(self, registry: WorkerRegistry, prefill_room: int, decode_room: int, timeout_secs: float):
        """``prefill_room``/``decode_room``: requests an engine of that role may hold (0: no bound)."""
        self.registry = registry
        self.rooms = {Role.PREFILL: prefill_room, Role.DECODE: decode_room}
        self.timeout_secs = timeout_secs
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._woken = 0
        """Requests woken and not yet resumed: a newcomer does not pass them."""
        self.closed = False

    @property
    def waiting(self) -> int:
        """Requests waiting for room now."""
        return len(self._waiting)

    def short(self) -> list[Role]:
        """The roles none of whose engines in rotation has room now (a role with none in rotation
        is not short: its requests go on to selection, which waits for a worker)."""
        return [role for role, room in self.rooms.items() if room and not self._any_room(role, room)]

    def _any_room(self, role: Role, room: int) -> bool:
        workers = self.registry.routable(role)
        return not workers or any(w.load < room for w in workers)

    def with_room(self, role: Role, workers: list[Worker]) -> list[Worker]:
        """``workers`` of ``role`` that have room (all of them when none has, or when the role is
        unbounded: a weight version's pairing may leave none with room, and the request is
        already let through)."""
        room = self.rooms[role]
        if not room:
            return workers
        roomy = [w for w in workers if w.load < room]
        return roomy or workers

    async def enter(self, *, first: bool = False) -> None:
        """Until an engine of each bounded role has room, in arrival order (``first``: at the head,
        for a request already in flight: a retry, a hand-off, a continuation); the caller pairs at
        once (without awaiting) and then calls ``freed()`` to pass on any room left. RouteError
        503 past ``timeout_secs``; CancelledError when the client went away, even as it was woken
        (a plain await of the turn: ``asyncio.wait_for`` on 3.10 and 3.11 returns a result that
        came with the cancel and drops the cancel)."""
        if self.closed or (not self._waiting and not self._woken and not self.short()):
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_secs
        while True:
            turn: asyncio.Future[None] = loop.create_future()
            if first:
                self._waiting.appendleft(turn)
            else:
                self._waiting.append(turn)
            timer = loop.call_at(deadline, _expire, turn)
            reopens = self.registry.reopens_in()  # an open circuit's end is a change nothing announces
            reopen = loop.call_later(reopens, self.freed) if reopens is not None else None
            try:
                await turn
            except TimeoutError:  # (_expire: never a turn that was woken)
                self._waiting.remove(turn)
                raise RouteError(
                    503, errors.ROOM_TIMEOUT, f"waited {self.timeout_secs:g} s for a prefill or decode with room"
                ) from None
            except BaseException:  # the client went away
                if turn in self._waiting:
                    self._waiting.remove(turn)
                elif turn.done() and not turn.cancelled():
                    self._woken -= 1
                    self.freed()  # it was woken and will not pair: the next one may
                raise
            finally:
                timer.cancel()
                if reopen is not None:
                    reopen.cancel()
            self._woken -= 1
            if self.closed or not self.short():
                return
            first = True  # woken but the room was taken again: it keeps its place

    def freed(self) -> None:
        """An engine may have room (a request to it ended, a worker came into rotation): wake the
        first waiting request if there is room now. One at a time: the woken one takes its room
        before the next is woken (by its own ``freed()`` call after pairing)."""
        while self._waiting and not self._woken and not self.short():
            turn = self._waiting.popleft()
            if not turn.done():
                self._woken += 1
                turn.set_result(None)
                return

    def close(self) -> None:
        """Wake every waiting request and let every later one through (the router is stopping:
        they go on to selection)."""
        self.closed = True
        while self._waiting:
            turn = self._waiting.popleft()
            if not turn.done():
                self._woken += 1
                turn.set_result(None)


def _expire(turn: asyncio.Future[None]) -> None:
    if not turn.done():
        turn.set_exception(TimeoutError())
