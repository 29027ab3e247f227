"""The circuit breaker: each worker's answers decide whether requests go to it (closed), not
(open, for ``timeout_duration_secs``), or as trials (half-open) until ``success_threshold``
answers close it again. Its state lives on the ``Worker`` (``cb_*``), read by selection."""

from __future__ import annotations

import logging
import time

from pdctl.router.config import BreakerConfig
from pdctl.router.workers import Worker

log = logging.getLogger("pdctl.router")


class CircuitBreaker:
    """Each worker's circuit breaker (module docstring), configured by ``BreakerConfig``; its state lives on the
    workers."""

    def __init__(self, config: BreakerConfig):
        self.config = config

    def record(self, worker: Worker, ok: bool, answered: bool = False) -> None:
        """Circuit breaker bookkeeping for an answer that says whether ``worker`` works (a 4xx is
        the client's fault and counts as ok; backpressure, 429/503 from a live worker, is not
        recorded at all). ``answered``: the failure is the worker's own answer (a 5xx), not a
        failed connection.

        One state, read the same way by selection, ``/workers`` and the log: open while
        ``cb_open_until`` is ahead; then half-open, when only trial requests' outcomes count
        (answers to requests sent before the circuit opened neither close nor extend it)."""
        if ok and not worker.cb_half_open and not worker.cb_open_until:  # (closed, never opened: no clock needed)
            worker.cb_failures = 0
            return
        if self.config.disabled:
            return
        now = time.monotonic()
        if worker.cb_open_until > now:
            return  # open: late answers of requests sent before it opened change nothing
        if ok:
            worker.cb_failures = 0
            if worker.cb_half_open:
                worker.cb_successes += 1
                if worker.cb_successes >= self.config.success_threshold:
                    worker.cb_half_open = False
                    worker.cb_open_until = 0.0
                    log.info("circuit closed for %s", worker.url)
            return
        worker.cb_successes = 0
        if now - worker.cb_window_start > self.config.window_duration_secs:
            worker.cb_failures, worker.cb_window_start = 0, now  # older failures are forgotten
        worker.cb_failures += 1
        if worker.cb_half_open or worker.cb_failures >= self.config.failure_threshold:
            worker.cb_open_until = now + self.config.timeout_duration_secs
            worker.cb_opens += 1
            worker.cb_by_answers = answered
            worker.cb_half_open = True  # after the timeout, trial requests decide
            worker.cb_failures = 0
            log.warning("circuit opened for %s for %.0fs", worker.url, self.config.timeout_duration_secs)
