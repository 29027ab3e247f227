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
a client that goes away leaves the queue. When a role has no engine in rotation at all the
request is let through, so that selection's own wait for a worker (``worker_wait_secs``) and
its 503 apply as without late pairing.
"""

from __future__ import annotations

import asyncio
import contextlib
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

    async def enter(self) -> None:
        """Until an engine of each bounded role has room, in arrival order; the caller pairs at
        once (without awaiting) and then calls ``freed()`` to pass on any room left.
        RouteError 503 past ``timeout_secs``."""
        if not self._waiting and not self.short():
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_secs
        first = False  # a woken request that finds the room taken again keeps its place
        while True:
            turn: asyncio.Future[None] = loop.create_future()
            if first:
                self._waiting.appendleft(turn)
            else:
                self._waiting.append(turn)
            try:
                await asyncio.wait_for(asyncio.shield(turn), deadline - loop.time())
            except BaseException as exc:
                if turn in self._waiting:
                    self._waiting.remove(turn)
                elif turn.done():
                    self.freed()  # it was woken and will not pair: the next one may
                if isinstance(exc, asyncio.TimeoutError):
                    raise RouteError(
                        503, errors.ROOM_TIMEOUT, f"waited {self.timeout_secs:g} s for a prefill or decode with room"
                    ) from None
                raise
            if not self.short():
                return
            first = True

    def freed(self) -> None:
        """An engine may have room (a request to it ended, a worker came into rotation): wake the
        first waiting request if there is room now. One at a time: the woken one takes its room
        before the next is woken (by its own ``freed()`` call after pairing)."""
        while self._waiting and not self.short():
            turn = self._waiting.popleft()
            if not turn.done():
                turn.set_result(None)
                return

    def close(self) -> None:
        """Wake every waiting request (the router is stopping: they go on to selection)."""
        while self._waiting:
            turn = self._waiting.popleft()
            with contextlib.suppress(asyncio.InvalidStateError):
                turn.set_result(None)
