"""The routes of the transactions pdctl's own drivers ask the router to run, thin adapters over
``FleetTransactions``:

``POST /pdctl/load`` (``pdctl weights load``). Body: ``{"model_path", "version", "refit"?,
"max_staleness"?}`` (``refit``: drain or interrupt; absent: the router's own settings;
``max_staleness`` null: unbounded). The answer streams one JSON object per line
(``application/x-ndjson``): ``{"step": "holding", "drain"}``, ``{"step": "loading", "path",
"engines"}``, then ``{"result": {...}}`` or ``{"error", "status"}``. The transaction runs in a task
of its own: a client that goes away (a Ctrl-C) while requests drain cancels it with nothing
changed; after the hold's answer it runs to its end, so the fleet ends on one version either way
and ``pdctl weights status`` tells which.

A push (``pdctl.weights.WeightSync``), in steps its driver takes one at a time:

- ``POST /pdctl/push/open`` ``{"version"?, "refit"?, "max_staleness"?, "lease_secs"?,
  "timeout_secs"?, "call_secs"?, "pause_mode"?}``: hold (drain: answered once requests in flight
  are done, within ``timeout_secs``) and pause (drain: in ``pause_mode``, retract by default;
  interrupt: abort); each engine's answer to an update call is awaited ``call_secs``;
  answers ``{"txn", "engines"}``. Its driver then sends SGLang's own
  ``/init_weights_update_group`` and ``/update_weights_from_distributed`` to the router with
  the ``X-Pdctl-Txn`` header, as a framework does (pdctl.router.facade).
- ``POST /pdctl/push/renew`` ``{"txn"}``: its driver is alive between calls.
- ``POST /pdctl/push/redo`` ``{"txn", "engines"}``: after a failed update call, the update starts
  again on these engines (its driver builds their group again first).
- ``POST /pdctl/push/commit`` ``{"txn", "version"?, "checksums"?, "verify"?}``: end, verify,
  version, continue, release; answers the outcome (``FleetTxn.outcome``).
- ``POST /pdctl/push/abort`` ``{"txn", "why"}``: the update stopped; answers the outcome.

A commit or abort runs to its end whether or not its client waits for the answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from typing import Any

from pdctl.choices import parse_choice
from pdctl.refit import (
    LOAD_PATH,
    PUSH_ABORT_PATH,
    PUSH_COMMIT_PATH,
    PUSH_OPEN_PATH,
    PUSH_REDO_PATH,
    PUSH_RENEW_PATH,
    RefitMode,
    VerifyMode,
    parse_staleness,
)
from pdctl.router import errors
from pdctl.router.jsonutil import dumps, json_object
from pdctl.router.reply import Reply, StreamReply, json_reply, started
from pdctl.router.server import Request, Routes
from pdctl.router.transaction.runner import UNSET, FleetTransactions, Unset
from pdctl.router.transaction.state import FleetTxn, Opener
from pdctl.router.updates import Conflict, Driver
from pdctl.sglang import PauseMode
from pdctl.sglang import control as sg


class LoadRoute:
    """``POST /pdctl/load`` (module docstring)."""

    def __init__(self, txns: FleetTransactions):
        self.txns = txns

    def add_routes(self, r: Routes) -> None:
        """Register ``POST /pdctl/load`` on ``r``."""
        r.add("POST", LOAD_PATH, self.load)

    async def load(self, request: Request) -> Reply | StreamReply:
        """``POST /pdctl/load``: 400 for a bad body; else a 200 NDJSON stream of the load's steps, ending in its
        ``result`` or an ``error`` with its status (409 when another transaction holds the router)."""
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
                result = await self._load(disk, refit, staleness, steps.put_nowait, abandoned)
            except Conflict as exc:
                steps.put_nowait({"error": str(exc), "status": 409})
            except Exception as exc:  # a bug: said to the client, and the router's log has it
                steps.put_nowait({"error": f"the router's load failed: {type(exc).__name__}: {exc}", "status": 500})
                raise
            else:
                steps.put_nowait({"result": result})

        self.txns.tasks.spawn(run())

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

    async def _load(
        self,
        disk: sg.DiskUpdate,
        refit: RefitMode | None,
        max_staleness: int | Unset | None,
        tell: Callable[[dict[str, Any]], None],
        abandoned: asyncio.Event,
    ) -> dict[str, Any]:
        """The load as one transaction of its own, told step by step. Its driver going away while
        requests drain cancels it (nothing changed); from the hold's answer on, it runs to its end
        (the fleet ends on one version whether or not anyone waits for the answer). The outcome
        per engine URL: ``complete``, ``refused`` (kept their weights, in rotation), ``failed``
        (out of rotation; the router loads the checkpoint into each once it answers again)."""
        txns = self.txns
        mode = refit or txns.config.refit
        tell({"step": "holding", "drain": mode is RefitMode.DRAIN})
        txn = await txns.open(
            Opener.LOAD, None, Driver.PDCTL, refit=mode, max_staleness=max_staleness, abandoned=abandoned
        )
        tell({"step": "loading", "path": disk.model_path, "engines": len(txn.engines)})
        async with txns.call(txn):  # the router itself drives it: no lease runs out under it
            await txns.load(txn, disk)
            await txns.end(txn)
        return txn.outcome()


class PushRoutes:
    """A push's steps (module docstring)."""

    def __init__(self, txns: FleetTransactions):
        self.txns = txns

    def add_routes(self, r: Routes) -> None:
        """Register the push's steps (``/pdctl/push/open``, ``renew``, ``redo``, ``commit``, ``abort``) on ``r``."""
        r.add("POST", PUSH_OPEN_PATH, self.open)
        r.add("POST", PUSH_RENEW_PATH, self.renew)
        r.add("POST", PUSH_REDO_PATH, self.redo)
        r.add("POST", PUSH_COMMIT_PATH, self.commit)
        r.add("POST", PUSH_ABORT_PATH, self.abort)

    async def open(self, request: Request) -> Reply:
        """``POST /pdctl/push/open``: open a push and answer ``{"txn", "engines"}``; 400 for a bad body, 409 when
        another transaction holds the router or the drain did not finish. A client gone during the drain ends it with
        nothing changed."""
        raw, problem = json_object(request.body)
        try:
            if problem is not None:
                raise ValueError(problem)
            version = None if raw.get("version") is None else sg.text(raw, "version")
            refit = None if raw.get("refit") is None else RefitMode.parse(raw["refit"])
            staleness = parse_staleness(raw["max_staleness"]) if "max_staleness" in raw else UNSET
            lease = _seconds(raw, "lease_secs")
            timeout = _seconds(raw, "timeout_secs")
            call_secs = _seconds(raw, "call_secs")
            pause = parse_choice(PauseMode, raw.get("pause_mode") or PauseMode.RETRACT.value, "pause_mode")
        except ValueError as exc:
            return errors.error_response(400, errors.BAD_REQUEST, f"bad push: {exc}")
        abandoned = asyncio.Event()
        opening = self.txns.tasks.spawn(
            self.txns.open(
                Opener.PUSH, None, Driver.PDCTL, refit=refit, max_staleness=staleness, abandoned=abandoned,
                lease_secs=lease, version=version, call_secs=call_secs, drain_pause=pause,
                **({} if timeout is None else {"timeout_secs": timeout}),
            )
        )  # fmt: skip
        try:
            txn = await asyncio.shield(opening)
        except asyncio.CancelledError:  # its driver went away: a drain ends with nothing changed
            abandoned.set()
            raise
        except Conflict as exc:
            return errors.error_response(409, errors.BAD_REQUEST, str(exc))
        return json_reply({"txn": txn.id, "engines": [w.url for w in txn.engines]})

    def _txn(self, raw: dict[str, Any]) -> FleetTxn:
        """The open push ``raw`` names; Conflict when it is not the one open."""
        txn = self.txns.current
        named = raw.get("txn")
        if txn is None or txn.id != named or txn.opener is not Opener.PUSH:
            raise Conflict(f"push {named} is not open" + (f" ({txn.id} is)" if txn is not None else ""))
        return txn

    async def renew(self, request: Request) -> Reply:
        """``POST /pdctl/push/renew``: restart the open push's lease; 409 when ``txn`` is not the open push."""
        return await self._step(request, self._renew)

    async def redo(self, request: Request) -> Reply:
        """``POST /pdctl/push/redo``: start the failed update again on ``engines``; 400 for a bad list, 409 when ``txn``
        is not the open push."""
        return await self._step(request, self._redo)

    async def commit(self, request: Request) -> Reply:
        """``POST /pdctl/push/commit``: end the push (verify, version, continue, release) and answer its outcome; runs
        to its end even if the client goes away."""
        return await self._step(request, self._commit)

    async def abort(self, request: Request) -> Reply:
        """``POST /pdctl/push/abort``: fail the push for ``why`` and answer its outcome; does not wait for the
        transaction's lock."""
        return await self._step(request, self._abort)

    async def _renew(self, txn: FleetTxn, raw: dict[str, Any]) -> dict[str, Any]:
        self.txns.renew(txn)
        return {"txn": txn.id}

    async def _redo(self, txn: FleetTxn, raw: dict[str, Any]) -> dict[str, Any]:
        urls = raw.get("engines")
        if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
            raise ValueError("engines must be a list of engine URLs")
        async with self.txns.lock, self.txns.call(txn):
            await self.txns.redo(txn, urls)
        return {"txn": txn.id}

    async def _commit(self, txn: FleetTxn, raw: dict[str, Any]) -> dict[str, Any]:
        sums = raw.get("checksums")
        if sums is not None and not (isinstance(sums, dict) and all(isinstance(v, str) for v in sums.values())):
            raise ValueError("checksums must map tensor names to checksums")
        verify = VerifyMode(raw.get("verify") or VerifyMode.AUTO)
        if raw.get("version") is not None:
            txn.version = sg.text(raw, "version")
        async with self.txns.lock, self.txns.call(txn):
            await self.txns.end(txn, sums, verify)
        return txn.outcome()

    async def _abort(self, txn: FleetTxn, raw: dict[str, Any]) -> dict[str, Any]:
        # Not under the lock: an update call may wait on a broadcast its trainer never finishes.
        async with self.txns.call(txn):
            await self.txns.fail(txn, str(raw.get("why") or "its driver stopped it"))
        return txn.outcome()

    async def _step(self, request: Request, step: Any) -> Reply:
        """Run ``step`` on the push the body names, to its end even if the client goes away."""
        raw, problem = json_object(request.body)
        if problem is not None:
            return errors.error_response(400, errors.BAD_REQUEST, f"bad push step: {problem}")

        async def run() -> Reply:
            try:
                return json_reply(await step(self._txn(raw), raw))
            except Conflict as exc:
                return errors.error_response(409, errors.BAD_REQUEST, str(exc))
            except ValueError as exc:
                return errors.error_response(400, errors.BAD_REQUEST, f"bad push step: {exc}")

        return await asyncio.shield(self.txns.tasks.spawn(run()))


def _seconds(raw: dict[str, Any], key: str) -> float | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 24 * 3600:
        raise ValueError(f"{key} must be a number of seconds in (0, 86400]")
    return float(value)
