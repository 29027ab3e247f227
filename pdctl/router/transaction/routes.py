"""``POST /pdctl/load``: ``pdctl weights load`` as a transaction the router runs itself, a thin
adapter over ``FleetTransactions.load_for_pdctl``.

Body: ``{"model_path", "version", "refit"?, "max_staleness"?}`` (``refit``: drain or interrupt;
absent: the router's own settings; ``max_staleness`` null: unbounded).
The answer streams one JSON object per line (``application/x-ndjson``): ``{"step": "holding",
"drain"}``, ``{"step": "loading", "path", "engines"}``, then ``{"result": {...}}`` or ``{"error",
"status"}``. The transaction runs in a task of its own: a client that goes away (a Ctrl-C) while
requests drain cancels it with nothing changed; after the hold's answer it runs to its end, so the
fleet ends on one version either way and ``pdctl weights status`` tells which.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from pdctl.refit import LOAD_PATH, RefitMode, parse_staleness
from pdctl.router import errors
from pdctl.router.jsonutil import dumps, json_object
from pdctl.router.refit import Conflict
from pdctl.router.reply import Reply, StreamReply, started
from pdctl.router.server import Request, Routes
from pdctl.router.transaction.runner import UNSET, FleetTransactions
from pdctl.sglang import control as sg


class LoadRoute:
    """``POST /pdctl/load`` (module docstring)."""

    def __init__(self, txns: FleetTransactions):
        self.txns = txns

    def add_routes(self, r: Routes) -> None:
        r.add("POST", LOAD_PATH, self.load)

    async def load(self, request: Request) -> Reply | StreamReply:
        raw, problem = json_object(request.body)
        try:
            if problem is not None:
                raise ValueError(problem)
            disk = sg.DiskUpdate(
                model_path=sg.text(raw, "model_path"),
                weight_version=sg.text(raw, "version"),
                abort_all_requests=False,
            )
            refit = None if raw.get("refit") is None else RefitMode.parse(raw["refit"])
            staleness = parse_staleness(raw["max_staleness"]) if "max_staleness" in raw else UNSET
        except ValueError as exc:
            return errors.error_response(400, errors.BAD_REQUEST, f"bad load: {exc}")
        steps: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        abandoned = asyncio.Event()

        async def run() -> None:
            try:
                result = await self.txns.load_for_pdctl(disk, refit, staleness, steps.put_nowait, abandoned)
            except Conflict as exc:
                steps.put_nowait({"error": str(exc), "status": 409})
            except Exception as exc:  # a bug: said to the client, and the router's log has it
                steps.put_nowait({"error": f"the router's load failed: {type(exc).__name__}: {exc}", "status": 500})
                raise
            else:
                steps.put_nowait({"result": result})

        self.txns.spawn(run())

        async def lines() -> AsyncGenerator[bytes, None]:
            yield b""
            try:
                while True:
                    step = await steps.get()
                    yield dumps(step) + b"\n"
                    if "result" in step or "error" in step:
                        return
            finally:
                abandoned.set()  # (after the end, too: nothing waits for it then)

        return StreamReply(200, None, await started(lines()), "application/x-ndjson")
