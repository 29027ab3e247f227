"""What a router killed during one of its own fleet transactions left, ended when the next one
starts (pdctl.router.transaction.runner)."""

from __future__ import annotations

import logging
from typing import Any

import aiohttp

from pdctl.router.fanout import WorkerAnswer, call_all
from pdctl.router.transaction.groups import label
from pdctl.router.workers import Worker, WorkerRegistry
from pdctl.sglang import Endpoint

log = logging.getLogger("pdctl.router.transaction")


async def end_left_open(registry: WorkerRegistry, session: aiohttp.ClientSession, secs: float) -> None:
    """End what a transaction of a killed predecessor left (its engines paused, their update
    sessions open, memory released), as its record in the router's state file says. Engines it
    may have changed carry its ``pdctl:`` label, which keeps them out of rotation
    (pdctl.router.versions)."""
    record = registry.kept.transaction
    if not record:
        return

    async def post(workers: list[Worker], endpoint: Endpoint, body: Any) -> list[WorkerAnswer]:
        return await call_all(session, workers, "POST", endpoint.value, body, secs)

    urls = [str(u) for u in record.get("engines") or []]
    workers = [registry.workers[u] for u in urls if u in registry.workers]
    log.warning(
        "transaction %s (%s) was open when the previous router stopped: ending it on %d engine(s)",
        record.get("txn"), record.get("opener"), len(workers),
    )  # fmt: skip
    released = record.get("released") or {}
    for url, tags in released.items() if isinstance(released, dict) else ():
        if url in registry.workers:
            await post([registry.workers[url]], Endpoint.RESUME_MEMORY_OCCUPATION, {"tags": tags})
    sessions = [registry.workers[u] for u in record.get("sessions") or [] if u in registry.workers]
    if sessions:
        await post(sessions, Endpoint.END_WEIGHT_UPDATE, {})
    for a in await post(workers, Endpoint.CONTINUE_GENERATION, {}):
        if not a.ok:
            log.warning("continuing %s after the previous router: %s", label(a.worker), a.why())
    registry.keep_transaction(None)
