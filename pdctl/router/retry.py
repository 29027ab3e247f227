"""One retry policy for every place the router tries again: a request's attempts on fresh pairs,
the continuation of a stream whose engine died, the continuation of answers a weight update
interrupted.

An attempt that did not answer the client ends in an outcome: ``Retry`` (try another worker
or pair) or ``Stop`` (end the request with this error). For a ``Retry`` the policy says how
long to wait, or that the request is over:
- a failure (a connection error, a 5xx) uses the budget: at most ``retry.max_retries`` retries
  per request (none with ``retry.disabled``), after an exponential backoff with jitter;
- backpressure (``busy``: a 429 or 503 from a live worker, or an attempt a weight update
  interrupted) leaves the budget alone and waits with the same backoff for as long as the
  request timeout allows, counted from the first busy answer since the request last made
  progress (``progressed``), and without the time a weight update held the router (``paused``);
- once the retries are spent the client gets the last worker's own 5xx answer (as sglang-router
  and smg pass it), else 502 (failures) or 503 (backpressure).

The clock, the sleep and the jitter's randomness are parameters, so that tests can run the
policy on a fake clock with no sleeps.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pdctl.router.config import RetryConfig
from pdctl.router.errors import RouteError
from pdctl.router.reply import Reply


@dataclass(frozen=True, slots=True)
class Retry:
    """This attempt failed before anything reached the client; try another worker or pair."""

    message: str
    code: str
    busy: bool = False
    """The worker is alive but full (or a weight update interrupted the attempt): backpressure."""
    answer: Reply | None = None
    """The worker's own answer (a 5xx), passed to the client as is once the retries are spent."""


@dataclass(frozen=True, slots=True)
class Stop:
    """End the request with this error (no retry can help)."""

    status: int
    code: str
    message: str


class RetryPolicy:
    """The router's retry rules (module docstring) over ``config``; ``timeout_secs``: the request
    timeout that bounds waiting out backpressure."""

    def __init__(
        self,
        config: RetryConfig,
        timeout_secs: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        uniform: Callable[[float, float], float] = random.uniform,
    ):
        self.config = config
        self.timeout_secs = timeout_secs
        self.clock, self.sleep, self.uniform = clock, sleep, uniform
        self.attempts = 1 if config.disabled else 1 + config.max_retries
        """Attempts per request that may fail (busy ones aside)."""

    def start(self) -> Tries:
        """A new request's retries."""
        return Tries(self)

    def backoff(self, retry_number: int) -> float:
        """Seconds before retry ``retry_number`` (0: the first), with jitter."""
        c = self.config
        base = min(c.initial_backoff_ms * c.backoff_multiplier**retry_number, c.max_backoff_ms)
        return base * (1 + self.uniform(-c.jitter_factor, c.jitter_factor)) / 1000


class Tries:
    """One request's retries under a ``RetryPolicy``."""

    __slots__ = ("busy", "deadline", "failures", "policy")

    def __init__(self, policy: RetryPolicy):
        self.policy = policy
        self.failures = 0
        self.busy = 0
        self.deadline: float | None = None  # set by the first busy answer of a streak

    def next(self, retry: Retry) -> float | None:
        """Seconds to wait before the next attempt after ``retry``; None when the request is over
        (then ``give_up`` is its answer)."""
        policy = self.policy
        if retry.busy:
            self.busy += 1
            delay = policy.backoff(min(self.busy - 1, 6))
            now = policy.clock()
            if self.deadline is None:
                self.deadline = now + policy.timeout_secs
            return None if now + delay > self.deadline else delay
        self.failures += 1
        if self.failures >= policy.attempts:
            return None
        return policy.backoff(self.failures - 1)

    def give_up(self, retry: Retry) -> Reply:
        """The answer once ``next(retry)`` said the request is over: the worker's own 5xx, else
        RouteError (503 for backpressure, 502 for failures)."""
        if retry.busy:
            raise RouteError(503, retry.code, f"{retry.message} (busy for {self.policy.timeout_secs:.0f}s)")
        if retry.answer is not None:
            return retry.answer
        raise RouteError(502, retry.code, f"{retry.message} (after {self.failures} attempt(s))")

    def progressed(self) -> None:
        """The request made progress (tokens reached the client): a later busy streak gets its
        own request timeout."""
        self.busy, self.deadline = 0, None

    def paused(self, secs: float) -> None:
        """A weight update held the request for ``secs``: not counted against the timeout."""
        if self.deadline is not None:
            self.deadline += secs
