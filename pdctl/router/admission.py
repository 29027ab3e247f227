"""Admission: the concurrency limit's slots and their bounded queue, and the count of requests in
flight that a draining weight update waits for."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from pdctl.router import errors
from pdctl.router.config import AdmissionConfig
from pdctl.router.errors import RouteError
from pdctl.router.metrics import RouterMetrics


class Admission:
    """Who may be served now, and how many are (``admission.*`` settings)."""

    def __init__(self, config: AdmissionConfig, metrics: RouterMetrics):
        self.config = config
        self.metrics = metrics
        limit = config.max_concurrent_requests
        self.slots = asyncio.Semaphore(limit) if limit > 0 else None
        """None: no concurrency limit (the common case: no slot is taken)."""
        self.waiting = 0
        self.active = 0
        """Requests past the refit gate, until their answer ended."""
        self.idle = asyncio.Event()
        """Set while no request is active (a drain's hold waits for it)."""
        self.idle.set()
        metrics.in_flight.set_function(lambda: self.active)  # read at scrape time, not per request

    async def slot(self) -> Callable[[], None]:
        """A slot under the concurrency limit, waited for in a bounded queue (429 when the queue
        is full, 408 past the queue timeout); the callable gives it back."""
        slots = self.slots
        assert slots is not None
        if slots.locked() and self.waiting >= self.config.queue_size:
            raise RouteError(429, errors.QUEUE_FULL, f"too many requests: {self.waiting} already queued")
        self.waiting += 1
        self.metrics.queued.set(self.waiting)
        try:
            await asyncio.wait_for(slots.acquire(), self.config.queue_timeout_secs)
        except asyncio.TimeoutError:
            raise RouteError(408, errors.QUEUE_TIMEOUT, "timed out waiting for a free slot") from None
        finally:
            self.waiting -= 1
            self.metrics.queued.set(self.waiting)
        return slots.release

    def enter(self) -> None:
        """A request goes in flight (past the refit gate): ``leave`` when its answer ended."""
        if self.active == 0:
            self.idle.clear()
        self.active += 1

    def leave(self) -> None:
        """A request left flight (its answer ended); ``idle`` is set when none is left."""
        self.active -= 1
        if self.active == 0:
            self.idle.set()

    def in_flight(self) -> int:
        """How many requests are in flight now (between ``enter`` and ``leave``)."""
        return self.active
