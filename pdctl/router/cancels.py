"""A task's cancel requests (Python 3.11+ counts them): telling a cancellation the code made
itself, and withdrew, from one that came from outside (the client going away, the server
stopping). Used by the PD race (pdctl.router.legs) and the HTTP server's connection task."""

from __future__ import annotations

import asyncio


def cancel_requests(task: asyncio.Task | None) -> int:
    """How many cancel requests ``task`` has (Python 3.11+ counts them; 3.10: 0)."""
    cancelling = getattr(task, "cancelling", None)
    return cancelling() if cancelling is not None else 0


def withdraw_cancel(task: asyncio.Task | None, base: int) -> bool:
    """Withdraw one cancel request of the caller's own (if ``task`` holds more than ``base``, its
    count when the caller's work began), and say whether someone else cancelled it too. Python
    3.10 cannot tell: False (the caller's reading wins)."""
    uncancel = getattr(task, "uncancel", None)
    if uncancel is None:
        return False
    if cancel_requests(task) > base:
        uncancel()
    return cancel_requests(task) > base
