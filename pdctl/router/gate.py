"""The router's admission gate for weight updates (pdctl.refit).

Closed while a weight transaction holds the router: new requests, retries and continuations
wait at it until the transaction releases. An ``interrupt`` hold also starts a new *epoch*:
an answer that ends in an asked-for abort (a pause in SGLang's ``abort`` mode) to a request
sent before the epoch began was interrupted by the update, and is continued once the gate
opens; the same answer to a request sent within one epoch is the client's own abort.
"""

from __future__ import annotations

import asyncio

from pdctl.refit import RefitMode


class RefitGate:
    """The admission gate for weight updates (module docstring): open while requests may go on, closed while a weight
    transaction holds the router; ``epoch`` counts the interrupt holds begun."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self.is_open = True
        """Whether requests may go on: read on every request (a plain attribute: no call)."""
        self.epoch = 0
        """How many interrupt holds have begun; a request notes it when it is sent."""
        self.max_staleness: int | None = None
        """The current (or latest) interrupting transaction's bound, read when a request is interrupted."""
        self.mode: RefitMode | None = None
        """The holding transaction's refit mode while the gate is closed."""

    def close(self, mode: RefitMode, max_staleness: int | None, *, new_transaction: bool) -> None:
        """Hold new requests; an interrupting transaction's first hold starts a new epoch."""
        self._open.clear()
        self.is_open = False
        self.mode = mode
        if mode is RefitMode.INTERRUPT:
            self.max_staleness = max_staleness
            if new_transaction:
                self.epoch += 1

    def open(self) -> None:
        """Let requests go on again and wake every waiter; the epoch stays."""
        self._open.set()
        self.is_open = True
        self.mode = None

    @property
    def interrupting(self) -> bool:
        """Whether an ``interrupt`` transaction holds the gate now: its engines abort what they
        are sent, so that nothing (first attempt, retry or continuation) may go out until the
        release. (A ``drain`` hold lets retries and continuations go on: it waits for them.)"""
        return self.mode is RefitMode.INTERRUPT and not self.is_open

    def interrupted_since(self, epoch: int) -> bool:
        """Whether an interrupt hold has begun since ``epoch`` was read."""
        return self.epoch != epoch

    async def wait_open(self, timeout_secs: float) -> bool:
        """Wait until the gate is open when the waiter runs; False when it stayed closed
        ``timeout_secs``. A release wakes every waiter, but the next transaction's hold may close
        the gate again before a woken waiter runs (updates back to back): that waiter waits on,
        else it would send into engines paused to abort, at the new epoch, and its abort would
        reach the client as if the client had asked for it."""
        if self.is_open:
            return True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_secs
        while not self.is_open:
            try:
                await asyncio.wait_for(self._open.wait(), deadline - loop.time())
            except asyncio.TimeoutError:
                return False
        return True
