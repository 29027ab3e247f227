"""Tasks the router starts that outlive the request that started them (a transaction's end that
its client stopped waiting for, a lapse's cleanup), kept referenced until they end."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any


class Tasks:
    """A set of the router's own tasks: each kept until it ends; ``stop`` cancels the rest."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Future[Any]] = set()

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Future[Any]:
        """Run ``coro`` in a task kept until it ends (cancelled when the router stops)."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def stop(self) -> None:
        """Cancel every task still running and wait for each to end."""
        for task in list(self._tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
