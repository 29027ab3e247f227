"""The engines and the router as a weight transaction sees them; no torch here.

``Fleet`` is what a push and a load from disk share: probing the engines (``/server_info``),
fan-out calls to all of them at once, and reading what the router's transaction did
(``take_outcome``): with a router, the router runs every transaction (pdctl.router.transaction;
a push's side of it is pdctl.weights.routed). ``WeightSync`` (torch) adds the broadcast group;
``pdctl weights load`` (the control machine, which has no torch) uses ``Fleet.load_from_disk``.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from pdctl.choices import parse_choice
from pdctl.errors import WeightSyncError
from pdctl.refit import (
    DEFAULT_HOLD_TIMEOUT_SECS,
    DEFAULT_LEASE_SECS,
    LOAD_PATH,
    RefitMode,
)
from pdctl.sglang import (
    Endpoint,
    PauseMode,
    pause_generation_body,
    update_weight_version_body,
    update_weights_from_disk_body,
)
from pdctl.weights.client import CallFailure, JsonClient
from pdctl.weights.phase import EngineFault, Failure, Phase
from pdctl.weights.report import PushReport

log = logging.getLogger("pdctl.weights")


@dataclass(frozen=True)
class EngineTarget:
    """One engine as the trainer sees it: its HTTP entrypoint and how many ranks it takes (its GPUs)."""

    id: str
    url: str
    gpus: int = 1

    @classmethod
    def coerce(cls, value: EngineTarget | Mapping[str, Any] | str, index: int) -> EngineTarget:
        """An EngineTarget from one ``engines`` entry: a target, a URL, or a mapping with ``url`` and
        optional ``id`` and ``gpus`` (or ``tp``). ``index`` names an entry without an id."""
        if isinstance(value, EngineTarget):
            return value
        if isinstance(value, str):
            return cls(id=f"engine-{index}", url=value.rstrip("/"))
        return cls(
            id=str(value.get("id") or f"engine-{index}"),
            url=str(value["url"]).rstrip("/"),
            gpus=int(value.get("gpus") or value.get("tp") or 1),
        )


@dataclass(frozen=True)
class Member:
    """An engine taking part in a transaction (in the group, for a push)."""

    target: EngineTarget
    rank_offset: int
    sglang_version: str
    is_sim: bool

    @classmethod
    def of(cls, target: EngineTarget, rank_offset: int, server_info: dict[str, Any]) -> Member:
        """A member from the engine's ``/server_info`` answer (its SGLang version, whether it is the sim)."""
        return cls(target, rank_offset, str(server_info.get("version", "0")), server_info.get("engine") == "pdctl-sim")

    @property
    def id(self) -> str:
        """The engine's id."""
        return self.target.id

    @property
    def url(self) -> str:
        """The engine's base URL."""
        return self.target.url


class Fleet:
    """The engines of one weight transaction and, optionally, the router in front of them."""

    def __init__(
        self,
        engines: Sequence[EngineTarget | Mapping[str, Any] | str],
        *,
        router_url: str | None = None,
        api_key: str | None = None,
        engine_key: str | None = None,
        timeout_secs: float = 120.0,
        pause_mode: PauseMode | str = PauseMode.RETRACT,
        lease_secs: float = DEFAULT_LEASE_SECS,
        hold_timeout_secs: float = DEFAULT_HOLD_TIMEOUT_SECS,
        refit: RefitMode | str = RefitMode.DRAIN,
        max_staleness: int | None = None,
        follow_router: bool = False,
    ):
        """``refit`` and ``max_staleness``: see pdctl.refit; a transaction may override them.
        ``api_key``: the router's key (a pdctl cluster's control-plane key); ``engine_key``: the
        engines' (default: ``api_key``).
        ``follow_router``: each ``probe`` first takes the engine set from the router's workers
        (``pdctl apply`` adds and removes engines there), so that a trainer's next push reaches
        the engines the cluster has now; an engine it did not know takes as many ranks as its
        ``/server_info`` says it has GPUs.
        In ``interrupt`` mode the engines are paused in SGLang's ``abort`` mode whatever
        ``pause_mode`` says: that is what ends requests at a token boundary with their tokens."""
        self.engines = tuple(EngineTarget.coerce(e, i) for i, e in enumerate(engines))
        if len({e.url for e in self.engines}) != len(self.engines):
            raise WeightSyncError("an engine URL is listed twice")
        try:
            pause_mode = parse_choice(PauseMode, pause_mode, "pause_mode")
        except ValueError as exc:
            raise WeightSyncError(str(exc)) from None
        self.router_url = router_url.rstrip("/") if router_url else None
        self.timeout_secs = timeout_secs
        self.pause_mode = pause_mode
        self.lease_secs = lease_secs
        self.hold_timeout_secs = hold_timeout_secs
        self.refit = refit_mode(refit)
        self.max_staleness = max_staleness
        self.follow_router = follow_router and self.router_url is not None
        self.holding: str | None = None
        """The txn of this fleet's own push while the router runs it (pdctl.weights.routed)."""
        self.progress: Callable[[str], None] | None = None
        """Told what a transaction is doing, step by step (``pdctl weights load`` prints it)."""
        # The engines get the engine key (else the router's key, for engines that share it); the
        # router gets its own key (the control-plane key of a pdctl cluster).
        router_keys = {self.router_url: api_key} if self.router_url and api_key else {}
        self.client = JsonClient(api_key=engine_key or api_key, timeout_secs=timeout_secs, keys=router_keys)

    def close(self) -> None:
        """Shut down the HTTP client's threads."""
        self.client.close()

    def tell(self, what: str) -> None:
        """Pass ``what`` to ``progress``, when one is set."""
        if self.progress is not None:
            self.progress(what)

    def wait_ready(self, timeout_secs: float) -> None:
        """Wait until every engine answers ``/health`` and the router ``/readiness`` with 200,
        or ``timeout_secs`` pass (then ``probe`` goes on with the engines that answer)."""
        deadline = time.monotonic() + timeout_secs
        urls = [e.url + "/health" for e in self.engines]
        if self.router_url:
            urls.append(self.router_url + "/readiness")
        waiting = list(urls)
        while waiting and time.monotonic() < deadline:
            answers = [self.client.submit("GET", url, timeout_secs=5) for url in waiting]
            waiting = [url for url, f in zip(waiting, answers, strict=True) if isinstance(f.result(), CallFailure)]
            if waiting:
                time.sleep(0.5)
        if waiting:
            log.warning("weights: still not ready after %.0fs: %s", timeout_secs, ", ".join(waiting))

    def follow(self) -> None:
        """Take the engine set from the router's workers (``follow_router``): engines it no longer
        lists are dropped, new ones added (their ranks set by ``probe``). Kept as is when the
        router does not answer."""
        answer = self.client.get(f"{self.router_url}/workers", timeout_secs=10)
        if isinstance(answer, CallFailure) or not isinstance(answer, dict):
            log.warning("weights: the router did not list its workers (%s); keeping the engine set", answer)
            return
        urls = [str(w["url"]).rstrip("/") for w in answer.get("workers", []) if isinstance(w, dict) and "url" in w]
        known = {e.url: e for e in self.engines}
        engines = tuple(known.get(url) or EngineTarget(id=_engine_id(url), url=url, gpus=0) for url in urls)
        if {e.url for e in engines} != set(known):
            added = sorted(set(urls) - set(known))
            removed = sorted(set(known) - set(urls))
            log.info("weights: the router's engines changed (added %s, removed %s)", added or "none", removed or "none")
            self.engines = engines

    def probe(self, report: PushReport) -> tuple[list[EngineTarget], dict[str, dict[str, Any]]]:
        """The engines that answer ``/server_info`` (the others go to ``report.skipped``) and their answers."""
        if self.follow_router:
            self.follow()
        futures = {
            e.id: self.client.submit("GET", e.url + Endpoint.SERVER_INFO.value, timeout_secs=10) for e in self.engines
        }
        infos: dict[str, dict[str, Any]] = {}
        for engine in self.engines:
            result = futures[engine.id].result()
            if isinstance(result, CallFailure) or not isinstance(result, dict):
                log.warning("weights: engine %s is not answering (%s); going on without it", engine.id, result)
                report.skipped.append(engine.id)
            else:
                infos[engine.id] = result
        if any(e.gpus == 0 for e in self.engines):  # learned from the router: ranks from the engine itself
            self.engines = tuple(
                EngineTarget(e.id, e.url, _ranks(infos[e.id])) if e.gpus == 0 and e.id in infos else e
                for e in self.engines
            )
        live = [e for e in self.engines if e.id in infos and e.gpus > 0]
        if not live:
            raise WeightSyncError(
                "no engine answered /server_info; nothing to update", phase=Phase.PROBE, report=report
            )
        return live, infos

    # -- the router's side ------------------------------------------------------------------------------
    def refuse_if_held(self) -> None:
        """WeightSyncError (phase ``connect``) when an RL framework's update through SGLang's
        control routes holds the router: the engines' open update sessions are that update's, in
        use, not a dead trainer's to clear. (Another pdctl transaction is refused at its hold.)
        Nothing to check without a router, or with one too old to say."""
        if not self.router_url:
            return
        answer = self.client.get(f"{self.router_url}/pdctl/weights", timeout_secs=10)
        holder = answer.get("holder") if isinstance(answer, dict) and answer.get("held") else None
        framework = isinstance(answer, dict) and answer.get("holder_driver") == "framework"
        if holder and framework and holder != self.holding:
            raise WeightSyncError(
                f"weight push {answer['holder']} holds the router at {self.router_url}; "
                "not touching its engines' update sessions",
                phase=Phase.CONNECT,
            )

    def pause_body(self, refit: RefitMode) -> dict[str, Any]:
        """The /pause_generation body for a transaction in ``refit`` mode."""
        return pause_generation_body(PauseMode.ABORT if refit is RefitMode.INTERRUPT else self.pause_mode)

    def raise_if_failed(self, report: PushReport, what: str) -> None:
        """Raise WeightSyncError naming the first engine in ``report.failed`` or ``report.refused`` and
        which engines hold the version; ``what`` names the operation. Returns when none failed."""
        if not report.failed and not report.refused:
            return
        engine, failure = next(iter({**report.failed, **report.refused}.items()))
        holders = f"engines {', '.join(report.engines)} hold it completely" if report.engines else "no engine holds it"
        raise WeightSyncError(
            f"{what} failed on engine {engine} ({failure}); {holders}; "
            + (f"{', '.join(report.refused)} kept their previous weights and serve on; " if report.refused else "")
            + (
                "engines left without a complete version are out of the router's rotation until a later push "
                "reaches them"
                if report.failed
                else "no engine left rotation"
            ),
            engine=engine,
            phase=failure.phase,
            report=report,
        )

    def engine_id(self, url: str) -> str:
        """The id of the engine at ``url`` (one added since the trainer started has none: its URL)."""
        return next((e.id for e in self.engines if e.url == url), None) or _engine_id(url)

    def blame(self, failure: CallFailure) -> dict[str, str]:
        """Engine id -> what went wrong there, from the router's failed answer to a call it
        forwarded to the engines: those that gave no answer (``left``: dead, hung) when any did,
        since the others then fail because of them; else every engine it names; the router
        itself when it names none (it refused, or did not answer)."""
        body = failure.body if isinstance(failure.body, dict) else {}
        named = body.get("engines")
        if not isinstance(named, dict) or not named:
            return {"router": str(failure)}
        left = [url for url in body.get("left") or [] if url in named]
        return {self.engine_id(url): str(named[url]) for url in (left or named)}

    def take_outcome(self, report: PushReport, outcome: Mapping[str, Any], *, retry: bool = False) -> None:
        """What the router's transaction did (``FleetTxn.outcome``, by engine URL) into
        ``report`` (by engine id); failures already recorded there keep their first reason."""
        steps = outcome.get("steps") or {}
        report.engines = [self.engine_id(u) for u in outcome.get("complete", [])]
        for u, why in (outcome.get("refused") or {}).items():  # they kept their weights: not failed
            engine = self.engine_id(u)
            first = report.failed.pop(engine, None)
            report.refused.setdefault(engine, first or Failure(engine, Phase.TRANSFER, str(why), retry))
        for u, why in (outcome.get("failed") or {}).items():
            engine = self.engine_id(u)
            if engine not in report.failed:
                report.failed[engine] = Failure(engine, Phase(steps.get(u, "transfer")), str(why), retry)

    # -- fan-outs ----------------------------------------------------------------------------------------
    def fanout(self, members: Sequence[Member], phase: Phase, endpoint: Endpoint, body: Any) -> dict[str, Any]:
        """The same call to every member at once; raises EngineFault naming those that failed."""
        futures = {m.id: self.client.submit("POST", m.url + endpoint.value, body) for m in members}
        results = {i: f.result() for i, f in futures.items()}
        failed = {i: str(r) for i, r in results.items() if isinstance(r, CallFailure)}
        if failed:
            raise EngineFault(phase, failed)
        return results

    def fanout_quiet(self, targets: Iterable[Member | EngineTarget], endpoint: Endpoint, body: Any) -> list[str]:
        """Best-effort calls (cleanup); returns the ids that failed."""
        futures = {t.id: self.client.submit("POST", t.url + endpoint.value, body, timeout_secs=30) for t in targets}
        return [i for i, f in futures.items() if isinstance(f.result(), CallFailure)]

    # -- from disk -------------------------------------------------------------------------------------------
    def load_from_disk(self, model_path: str, version: str, refit: RefitMode | str | None = None) -> PushReport:
        """``/update_weights_from_disk`` on every engine under the push's transaction rules: hold,
        pause, load, version set last (only on engines that loaded), continue, release. With a
        router, the router runs the transaction (``POST /pdctl/load``, pdctl.router.transaction):
        this process only asks and reports, so a Ctrl-C here never leaves the fleet half loaded
        (the router cancels a load still waiting for requests in flight, and finishes one whose
        weights have begun to move). Without one, it runs here, engine by engine.

        An engine that answers the load with an error kept its previous weights (SGLang rolls
        back; the sim reads the file before touching the model): it stays in rotation on its old
        version (``report.refused``), and the router pairs prefill and decode by version, so no
        request mixes the two. One that does not answer, or loads but does not take the version,
        leaves rotation (``report.failed``). Raises WeightSyncError when any engine did not load.
        """
        mode = self.refit if refit is None else refit_mode(refit)
        if self.router_url:
            report = self._load_through_router(model_path, version, mode)
        else:
            report = self._load_here(model_path, version, mode)
        self.raise_if_failed(report, f"loading {model_path}")
        if report.skipped:
            raise WeightSyncError(
                f"loading {model_path}: {', '.join(report.skipped)} did not answer (restarting?); "
                f"{', '.join(report.engines)} hold {version}; the router loads {model_path} into the others "
                "once they answer again, and keeps them out of rotation until then",
                engine=report.skipped[0],
                phase=Phase.PROBE,
                report=report,
            )
        return report

    def _load_through_router(self, model_path: str, version: str, mode: RefitMode) -> PushReport:
        """The router's own load (pdctl.router.transaction.routes), its steps told as they come."""
        report = PushReport(version=version, load_format="disk", refit=mode.value)
        url = f"{self.router_url}{LOAD_PATH}"
        body = {"model_path": model_path, "version": version, "refit": mode.value, "max_staleness": self.max_staleness}
        parts = urlsplit(url)
        conn = http.client.HTTPConnection(parts.hostname or "", parts.port or 80, timeout=self.timeout_secs)
        try:
            conn.request("POST", parts.path, body=json.dumps(body).encode(), headers=self.client.headers_for(url))
            resp = conn.getresponse()
            if resp.status != 200:
                answer = CallFailure(url, f"{url} answered: {resp.read().decode(errors='replace')[:500]}", False)
                raise WeightSyncError(f"the router did not load {model_path}: {answer}", phase=Phase.HOLD)
            outcome = None
            for line in resp:
                step = json.loads(line)
                if step.get("step") == "holding":
                    draining = ": draining the requests in flight" if step.get("drain") else ""
                    self.tell(f"holding the router at {self.router_url}{draining}")
                elif step.get("step") == "loading":
                    self.tell(f"loading {model_path} on {step.get('engines')} engine(s)")
                elif "error" in step:
                    raise WeightSyncError(f"the router did not load {model_path}: {step['error']}", phase=Phase.HOLD)
                elif "result" in step:
                    outcome = step["result"]
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise WeightSyncError(
                f"lost the router at {self.router_url} during the load ({exc}); it finishes the load on its own "
                "once weights began to move: `pdctl weights status` says where the fleet is",
                phase=Phase.TRANSFER,
            ) from exc
        finally:
            conn.close()
        if not isinstance(outcome, dict):
            raise WeightSyncError(f"the router's load of {model_path} ended with no outcome", phase=Phase.RELEASE)
        absent = {u for u, why in (outcome.get("failed") or {}).items() if "no answer" in why}
        # not answering (restarting): the router loads it once it answers; skipped, not failed
        report.skipped.extend(self.engine_id(u) for u in absent)
        self.take_outcome(
            report, {**outcome, "failed": {u: w for u, w in outcome["failed"].items() if u not in absent}}
        )
        report.phases.update({k: float(v) for k, v in (outcome.get("phases") or {}).items()})
        return report

    def _load_here(self, model_path: str, version: str, mode: RefitMode) -> PushReport:
        """A load with no router: each engine paused, loaded, versioned and continued from here."""
        report = PushReport(version=version, load_format="disk", refit=mode.value)
        with report.phase(Phase.PROBE):
            live, infos = self.probe(report)
        members = tuple(Member.of(e, 0, infos[e.id]) for e in live)
        try:
            with report.phase(Phase.PAUSE):
                self.fanout(members, Phase.PAUSE, Endpoint.PAUSE_GENERATION, self.pause_body(mode))
            with report.phase(Phase.TRANSFER):
                self.tell(f"loading {model_path} on {len(members)} engine(s)")
                body = update_weights_from_disk_body(model_path)
                futures = {
                    m.id: self.client.submit("POST", m.url + Endpoint.UPDATE_WEIGHTS_FROM_DISK.value, body)
                    for m in members
                }
                answers = {i: f.result() for i, f in futures.items()}
            for engine_id, answer in answers.items():
                if isinstance(answer, CallFailure) and answer.transport:
                    report.failed[engine_id] = Failure(engine_id, Phase.TRANSFER, f"load: {answer}")
                elif isinstance(answer, CallFailure):
                    report.refused[engine_id] = Failure(engine_id, Phase.TRANSFER, f"load: {answer}")
            loaded = tuple(m for m in members if not isinstance(answers[m.id], CallFailure))
            with report.phase(Phase.VERSION):
                body = update_weight_version_body(version)
                self.fanout(loaded, Phase.VERSION, Endpoint.UPDATE_WEIGHT_VERSION, body)
            report.engines = [m.id for m in loaded]
        except EngineFault as fault:
            report.failed.update(fault.failures())
            report.engines = []
            if fault.phase is Phase.VERSION:  # they hold the new weights under the old version's name
                for m in loaded:
                    report.failed.setdefault(
                        m.id, Failure(m.id, Phase.VERSION, "loaded but the version was not set everywhere")
                    )
        finally:
            with report.phase(Phase.CONTINUE):
                self.fanout_quiet(members, Endpoint.CONTINUE_GENERATION, {})
        return report


def refit_mode(value: RefitMode | str) -> RefitMode:
    """``value`` as a RefitMode; WeightSyncError naming the choices otherwise."""
    try:
        return RefitMode.parse(value)
    except ValueError as exc:
        raise WeightSyncError(str(exc)) from exc


def failures(futures: dict[str, Future], wait_until: float | None = None) -> dict[str, CallFailure]:
    """The futures that ended in a CallFailure (waiting until ``wait_until`` for unfinished ones)."""
    out = {}
    for engine_id, future in futures.items():
        if wait_until is not None and not future.done():
            with contextlib.suppress(Exception):
                future.result(timeout=max(0.0, wait_until - time.monotonic()))
        if future.done():
            result = future.result()
            if isinstance(result, CallFailure):
                out[engine_id] = result
    return out


def _engine_id(url: str) -> str:
    """An id for an engine known only by its URL (added to the cluster after the trainer started)."""
    return url.split("://", 1)[-1]


def _ranks(server_info: dict[str, Any]) -> int:
    """How many ranks an engine takes in the weight group: its GPUs (SGLang's server args)."""

    def size(key: str) -> int:
        value = server_info.get(key)
        return int(value) if isinstance(value, int) and value > 0 else 1

    dp = 1 if server_info.get("enable_dp_attention") else size("dp_size")
    return size("tp_size") * size("pp_size") * dp
