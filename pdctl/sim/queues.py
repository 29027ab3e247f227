"""Where each of the engine's requests is, and the slots they count against, under one lock.

A request enters ``waiting`` (``held`` while a weight update runs), moves to ``admitting`` when
the scheduler takes it for a prefill, then to ``running`` (dense slots 0..n-1), and leaves when
the scheduler reaps it after ``finish``. A decode request may hold a slot ``reserved`` while its
KV is fetched, before it is queued. The scheduler (pdctl.sim.scheduler) moves requests between
these; the engine's control (pdctl.sim.scheduler_control) and HTTP handlers end them through
``finish`` and ``abort_requests``.

Aborts mark requests finished without searching the queues for them; the queues drop finished
requests in one pass afterwards (``purge``), so aborting N queued requests costs O(N), not O(N^2).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from pdctl.sim.engine_request import KVPayload, Mode, Request, abort_reason

__all__ = ["RequestQueues", "decode_pre_alloc"]


def decode_pre_alloc(capacity: int) -> int:
    """Slots a decode holds for requests whose KV is on its way, beyond its ``capacity`` running
    ones: SGLang's DecodeReqToTokenPool ``pre_alloc_size``, 2 x ``--max-running-requests`` up to
    32 of them, else none (model_runner: "if max_num_reqs <= 32, we pre-allocate 2x requests"),
    so that a decode's transfers do not take the slots of the requests it runs."""
    return 2 * capacity if capacity <= 32 else 0


class RequestQueues:
    """The engine's requests by place (waiting, held, admitting, running) and its slot books.

    ``cond`` guards every field; the methods take it themselves (it is re-entrant, so a caller
    that holds it may call them too). Only the scheduler thread moves requests into and out of
    ``running``. ``on_finish`` and ``on_capacity`` are set by the engine's owner after
    construction and must not block.
    """

    def __init__(self, capacity: int, publish_kv: Callable[[int, KVPayload | str], None] | None):
        self.cond = threading.Condition()
        """Guards every field below; a re-entrant lock (``threading.Condition``'s default)."""
        self.capacity = capacity
        """Running requests allowed at once (``--max-running-requests``), reservations included
        unless ``pre_alloc`` adds room for them."""
        self.pre_alloc = 0
        """Reservations a decode may hold beyond ``capacity`` (``decode_pre_alloc``); running
        requests stay within ``capacity``."""
        self.publish_kv = publish_kv
        self.on_finish: Callable[[Request], None] | None = None
        self.on_capacity: Callable[[], None] | None = None
        """Called (any thread, must not block) when a running slot or a reservation is freed."""
        self.waiting: deque[Request] = deque()
        self.held: deque[Request] = deque()  # arrived during a weight update
        self.stale = 0  # finished requests still in waiting or held
        self.running: list[Request] = []  # running[i].slot == i
        self.reserved = 0
        self.admitting: list[Request] = []  # popped from the queue, being prefilled

    def live(self) -> tuple[Request, ...]:
        """Every request the engine holds, finished or not: running, admitting, waiting, then held."""
        with self.cond:
            return (*self.running, *self.admitting, *self.waiting, *self.held)

    def used(self) -> int:
        """Slots taken: running, being admitted, or reserved for a decode's KV. Caller holds ``cond``."""
        # Admitted requests count from the moment they leave the queue: a reservation made while
        # they are being started (outside the lock) would otherwise take their slot too.
        return len(self.running) + len(self.admitting) + self.reserved

    def room_for(self, reserved: bool, admitted: int = 0) -> bool:
        """Whether one more request may start beside ``admitted`` already taken this round: one
        that holds a ``reserved`` slot of the pool needs a running slot only; any other, a slot of
        ``capacity`` counting reservations too. Caller holds ``cond``."""
        if reserved:
            return len(self.running) + admitted < self.capacity
        return self.used() + admitted < self.capacity

    def started(self, req: Request) -> None:
        """Move ``req`` from admitting to running (its prefill ran, or it ended while starting):
        a finished one is reaped next iteration, keeping slots dense."""
        with self.cond:
            self.running.append(req)
            self.admitting.remove(req)

    def reserve_slot(self) -> bool:
        """Reserve capacity for a decode request while its KV is fetched; False when full."""
        with self.cond:
            if self.used() >= self.capacity + self.pre_alloc:
                return False
            self.reserved += 1
            return True

    def release_slot(self) -> None:
        """Give back a capacity reservation made by ``reserve_slot``; ``on_capacity`` is told."""
        with self.cond:
            self.reserved -= 1
            self.cond.notify_all()
        self.capacity_freed()

    def capacity_freed(self) -> None:
        """Tell ``on_capacity`` (when set) that a running slot or a reservation was freed."""
        if self.on_capacity is not None:
            self.on_capacity()

    def abort(self, rid: str | None, message: str) -> int:
        """Abort one request (or all with rid None); returns how many were aborted."""
        with self.cond:
            victims = [r for r in self.live() if not r.finished and (rid is None or r.rid == rid)]
        return self.abort_requests(victims, message)

    def abort_requests(self, requests: Iterable[Request], message: str) -> int:
        """Abort these requests (those not finished yet): one pass over the queues whatever their
        number (a 100k-prompt batch whose client left costs O(100k)); how many were aborted."""
        with self.cond:
            aborted = 0
            for req in requests:
                if not req.finished:
                    self.finish(req, abort_reason(message))
                    aborted += 1
            if self.stale * 2 > len(self.waiting) + len(self.held):
                self.purge()  # amortized: each purge drops at least half of what it scans
            return aborted

    def purge(self) -> None:
        """Drop finished requests from the queues (one pass)."""
        with self.cond:
            self.waiting = deque(r for r in self.waiting if not r.finished)
            self.held = deque(r for r in self.held if not r.finished)
            self.stale = 0

    def busy(self) -> bool:
        """Whether any request is queued, being prefilled, running or held (SGLang's
        flush_cache refuses then)."""
        with self.cond:
            return any(not r.finished for r in self.live())

    def finish(self, req: Request, reason: dict[str, Any]) -> None:
        """Mark ``req`` finished with ``reason`` and deliver it (``on_finish``, then its ``emit``);
        a request already finished is left as it is. The scheduler frees its slot later."""
        with self.cond:
            if req.finished:
                return
            req.finish = reason  # a queued request stays queued until the next purge or admission pass
            if req.queued:
                self.stale += 1
            if req.reserved:
                req.reserved = False
                self.reserved -= 1
                self.capacity_freed()
            if req.mode is Mode.PREFILL and req.room is not None and self.publish_kv and reason.get("type") == "abort":
                # The decode waiting for this room's KV learns at once (SGLang's KV sender reports
                # the failure to the receiver) instead of waiting out its timeout.
                self.publish_kv(req.room, str(reason.get("message") or "aborted"))
            if self.on_finish is not None:
                self.on_finish(req)
            req.emit(req)
            self.cond.notify_all()
