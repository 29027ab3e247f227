"""One call to many workers at once, each with the router's key for it (the cold paths: info routes,
cache flushes, the SGLang control facade). Every worker's answer comes back, failures included:
what a caller makes of them is its own rule.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from pdctl.router.jsonutil import loads
from pdctl.router.workers import Worker


@dataclass(frozen=True)
class WorkerAnswer:
    """A worker's answer: its status and body (parsed JSON, else text), or ``status`` 0 and why
    nothing came (``body`` is then the error's text)."""

    worker: Worker
    status: int
    body: Any

    @property
    def ok(self) -> bool:
        """200, and not SGLang's ``{"success": false}``."""
        return self.status == 200 and not (isinstance(self.body, dict) and self.body.get("success") is False)

    @property
    def reached(self) -> bool:
        """The worker answered (whatever it said)."""
        return self.status != 0

    @property
    def message(self) -> str:
        """The worker's own words: SGLang's ``message`` or ``error.message``, else its body's text."""
        message = self.body
        if isinstance(message, dict):
            error = message.get("error")
            message = message.get("message") or (error.get("message") if isinstance(error, dict) else error) or message
        return "" if message is None else str(message).strip()

    def why(self) -> str:
        """What went wrong, in a few words (for messages that name the worker)."""
        if not self.reached:
            return f"no answer ({self.body})"
        text = self.message
        return f"answered {self.status}: {text[:300]}" if text else f"answered {self.status}"


async def call(
    session: aiohttp.ClientSession,
    worker: Worker,
    method: str,
    path: str,
    body: Any = None,
    timeout_secs: float = 30.0,
) -> WorkerAnswer:
    """``method path`` on ``worker`` (``body`` as JSON when given); never raises but for cancellation."""
    try:
        async with session.request(
            method,
            worker.url + path,
            json=body,
            timeout=aiohttp.ClientTimeout(total=timeout_secs),
            headers=worker.auth,
        ) as r:
            raw = await r.read()
            try:
                return WorkerAnswer(worker, r.status, loads(raw) if raw else None)
            except ValueError:
                return WorkerAnswer(worker, r.status, raw.decode(errors="replace"))
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        return WorkerAnswer(worker, 0, str(exc) or type(exc).__name__)


async def unreachable(workers: Iterable[Worker], timeout_secs: float = 5.0) -> dict[str, str]:
    """The workers whose port takes no connection now (URL -> why): a TCP connect to each, at
    once, closed straight away. A dead engine refuses here, before a call that others would act
    on is sent to anyone."""

    async def one(worker: Worker) -> str | None:
        parts = urlsplit(worker.url)
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)),
                timeout_secs,
            )
        except (OSError, asyncio.TimeoutError) as exc:
            return f"no connection ({exc or type(exc).__name__})"
        writer.close()
        return None

    workers = list(workers)
    results = await asyncio.gather(*(one(w) for w in workers))
    return {w.url: why for w, why in zip(workers, results, strict=True) if why is not None}


async def call_all(
    session: aiohttp.ClientSession,
    workers: Iterable[Worker],
    method: str,
    path: str,
    body: Any = None,
    timeout_secs: float = 30.0,
) -> list[WorkerAnswer]:
    """The same call to every worker at once; their answers in the workers' order."""
    return list(await asyncio.gather(*(call(session, w, method, path, body, timeout_secs) for w in workers)))
