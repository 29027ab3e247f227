"""What ``pdctl top`` shows: frames of a running cluster, each made of two samples of its HTTP
endpoints (pdctl.cluster.sampling) and the latest word from its nodes' supervisors.

Rates (tokens/s, requests/s) are counter deltas between the newest sample and the one before;
the router's p50/p99 come from its latency histogram's bucket deltas over the last
``LATENCY_WINDOW_SECS``. Restarts, the trainer and whether each process is alive come from
``pdctl.cluster.inspect.status`` (the node agents), which costs a process per node and so runs
in the background, at most once per ``STATUS_EVERY_SECS``.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from pdctl.cluster.inspect import ClusterStatus, ProcessStatus
from pdctl.cluster.sampling import EngineSample, Sample, Sampler
from pdctl.cluster.state import ClusterState
from pdctl.roles import Role

STATUS_EVERY_SECS = 5.0
LATENCY_WINDOW_SECS = 10.0


# -- one frame --------------------------------------------------------------------------------------
@dataclass
class EngineRow:
    """One engine's line of a frame: health, weight version, load and token rates; ``None`` where the
    samples do not tell."""

    engine: str
    role: str
    node: str
    health: str
    weight_version: str | None
    running: float | None
    queued: float | None
    kv_use: float | None
    prompt_tokens_per_s: float | None
    generation_tokens_per_s: float | None
    restarts: int | None
    url: str


@dataclass
class RouterRow:
    """The router's line of a frame: health, request and error rates, latency percentiles, retries,
    load and open circuit breakers; ``None`` where the samples do not tell."""

    health: str
    requests_per_s: float | None
    errors_per_s: float | None
    """Answers with status >= 500 per second."""
    p50_ms: float | None
    p99_ms: float | None
    retries_per_s: float | None
    in_flight: float | None
    queued: float | None
    open_breakers: list[str]
    restarts: int | None


@dataclass
class TrainerRow:
    """The trainer's line of a frame, from its supervisors' word."""

    state: str
    """running, completed, exited N, restarting, left down, not running, unknown."""
    processes: int
    restarts: int | None


@dataclass
class Frame:
    """One screen of ``pdctl top``: the cluster's engines, router, weights, trainer and planner at one
    moment."""

    cluster: str
    status: str
    interval_secs: float
    engines: list[EngineRow]
    router: RouterRow | None
    weights: dict[str, Any] | None
    """The router's latest weight transaction: version, state, refit, phases, seconds, age."""
    trainer: TrainerRow | None
    processes_checked_secs_ago: float | None
    """How old the supervisors' word (restarts, trainer, alive) is; None: not yet."""
    processes_error: str | None = None
    """Why the latest ask of the node agents failed (the frame keeps the answer before)."""
    planner: dict[str, Any] | None = None
    """The P:D planner: running or not, and its latest decision (action, reason, outcome, age)."""

    def to_dict(self) -> dict[str, Any]:
        """The frame as JSON-ready data."""
        return asdict(self)


def make_frame(
    state: ClusterState,
    samples: Iterable[Sample],
    status: ClusterStatus | None,
    status_age_secs: float | None,
    now_wall: float | None = None,
) -> Frame:
    """The frame for the newest of ``samples`` (oldest first; at least one, two for rates)."""
    history = list(samples)
    new = history[-1]
    old = history[-2] if len(history) > 1 else None
    dt = new.at - old.at if old is not None else 0.0
    procs: dict[str, ProcessStatus] = {p.id: p for p in status.processes} if status else {}
    router_view = (
        {w.get("url", "").rstrip("/"): w for w in new.router.workers}
        if new.router is not None and new.router.workers_known
        else None
    )
    rows = []
    for pid, es in new.engines.items():
        rec = state.processes.get(pid)
        if rec is None:  # removed since the sample was planned (an apply)
            continue
        engine_id = rec.engine_id or pid
        members = [p for p in state.processes.values() if (p.engine_id or p.id) == engine_id]
        restarts = _restarts(procs, [m.id for m in members]) if status else None
        before = old.engines.get(pid) if old else None
        prompt_before = before.prompt_tokens if before else None
        generated_before = before.generation_tokens if before else None
        rows.append(
            EngineRow(
                engine=engine_id,
                role=str(rec.role),
                node=rec.node,
                health=_engine_health(
                    es,
                    [procs[m.id] for m in members if m.id in procs],
                    router_view.get(rec.url or "") if router_view is not None else None,
                    router_known=router_view is not None,
                ),
                weight_version=es.weight_version,
                running=es.running,
                queued=es.queued,
                kv_use=es.kv_use,
                prompt_tokens_per_s=_rate(prompt_before, es.prompt_tokens, dt),
                generation_tokens_per_s=_rate(generated_before, es.generation_tokens, dt),
                restarts=restarts,
                url=rec.url or "",
            )
        )
    router = _router_row(history, procs, state, status is not None) if new.router else None
    return Frame(
        cluster=state.name,
        status=str(status.status if status else state.status),
        interval_secs=dt,
        engines=rows,
        router=router,
        weights=_weights(new.router.last_push if new.router else None, now_wall),
        trainer=_trainer(state, procs) if status else _trainer_unknown(state),
        processes_checked_secs_ago=status_age_secs,
        planner=_planner(status, now_wall),
    )


def _planner(status: ClusterStatus | None, now_wall: float | None) -> dict[str, Any] | None:
    """The planner's line: whether it runs (as the node agents' last answer said) and its latest
    decision (from its record, as read with that answer)."""
    if status is None or (status.planner_process is None and not status.planner):
        return None
    last = status.planner[-1] if status.planner else None
    now = time.time() if now_wall is None else now_wall
    return {
        "alive": None if status.planner_process is None else bool(status.planner_process["alive"]),
        "last": None
        if last is None
        else {
            "action": last.get("action"),
            "mode": last.get("mode"),
            "reason": last.get("reason"),
            "outcome": last.get("outcome"),
            "secs_ago": max(0.0, now - float(last.get("at") or now)),
        },
    }


def _restarts(procs: Mapping[str, ProcessStatus], ids: list[str]) -> int | None:
    known = [procs[i].restarts for i in ids if i in procs and procs[i].restarts is not None]
    return sum(known) if known else None  # type: ignore[arg-type]


def _engine_health(
    sample: EngineSample, procs: list[ProcessStatus], worker: dict[str, Any] | None, *, router_known: bool
) -> str:
    """One word or two for the row: what is wrong first (gone, restarting, out of rotation), else
    serving; ``up`` when it answers but the router's view is unknown (no router, or it did not answer)."""
    for p in procs:
        if p.supervisor == "backoff":
            return "restarting"
        if p.supervisor == "gave_up":
            return "left down"
    if sample.reach == "refused":
        return "down"
    if sample.reach != "up":
        return sample.reach
    if not router_known:
        return "up"
    if worker is None:
        return "up (not routed)"
    if worker.get("cordoned"):
        return "cordoned"
    if worker.get("quarantined"):
        return "quarantined"
    if worker.get("circuit_open"):
        return "breaker open"
    if not worker.get("is_healthy"):
        return "unhealthy"
    return "serving"


def _rate(before: float | None, now: float | None, dt: float) -> float | None:
    if now is None or before is None or dt <= 0:
        return None
    delta = now - before
    return (now if delta < 0 else delta) / dt  # a counter that went back: the process restarted


def _router_row(
    history: list[Sample], procs: Mapping[str, ProcessStatus], state: ClusterState, known: bool
) -> RouterRow:
    new = history[-1].router
    assert new is not None
    old = history[-2].router if len(history) > 1 else None
    dt = history[-1].at - history[-2].at if len(history) > 1 else 0.0
    since = next(
        (s.router for s in history[:-1] if s.router is not None and history[-1].at - s.at <= LATENCY_WINDOW_SECS),
        None,
    )
    base = since.latency if since is not None else {}
    if any(new.latency[b] < base.get(b, 0.0) for b in new.latency):
        base = {}  # the router restarted in the window: its counts began again
    window = {b: new.latency[b] - base.get(b, 0.0) for b in new.latency}
    p50, p99 = quantile(0.5, window), quantile(0.99, window)
    router_ids = [p.id for p in state.processes.values() if p.role == Role.ROUTER]
    return RouterRow(
        health="up" if new.reach == "up" else ("down" if new.reach == "refused" else new.reach),
        requests_per_s=_rate(sum(old.requests.values()), sum(new.requests.values()), dt) if old else None,
        errors_per_s=_rate(_errors(old.requests), _errors(new.requests), dt) if old else None,
        p50_ms=None if p50 is None else p50 * 1000,
        p99_ms=None if p99 is None else p99 * 1000,
        retries_per_s=_rate(old.retries, new.retries, dt) if old else None,
        in_flight=new.in_flight,
        queued=new.queued,
        open_breakers=sorted(str(w.get("url")) for w in new.workers if w.get("circuit_open")),
        restarts=_restarts(procs, router_ids) if known else None,
    )


def _errors(requests: Mapping[int, float]) -> float:
    return sum(n for status, n in requests.items() if status >= 500)


def quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """Prometheus' ``histogram_quantile`` over cumulative ``buckets`` (bound -> count): linear
    within the bucket that holds the rank; the largest finite bound when it falls in +Inf;
    None without observations."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower_bound, lower_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


def _weights(push: dict[str, Any] | None, now_wall: float | None) -> dict[str, Any] | None:
    if not push:
        return None
    now = time.time() if now_wall is None else now_wall
    started, ended = push.get("started_at"), push.get("ended_at")
    out = {k: push.get(k) for k in ("version", "state", "refit", "source")}
    out["phases"] = dict(push.get("phases") or {})
    started = started if isinstance(started, (int, float)) else None
    ended = ended if isinstance(ended, (int, float)) else None
    out["seconds"] = ended - started if started is not None and ended is not None else None
    last = ended if ended is not None else started
    out["secs_ago"] = now - last if last is not None else None
    out["failed"] = dict(push.get("failed") or {})
    return out


def _trainer(state: ClusterState, procs: Mapping[str, ProcessStatus]) -> TrainerRow | None:
    ranks = [procs[p.id] for p in state.processes.values() if p.role == Role.TRAINER and p.id in procs]
    if not ranks:
        return _trainer_unknown(state)
    restarts = _restarts(procs, [p.id for p in ranks])
    if all(p.completed for p in ranks):
        word = "completed"
    elif any(p.supervisor == "backoff" for p in ranks):
        word = "restarting"
    elif any(p.supervisor == "gave_up" for p in ranks):
        word = "left down"
    elif all(p.alive for p in ranks):
        word = "running"
    elif any(p.alive is None for p in ranks):
        word = "unknown (node unreachable)"
    else:
        codes = sorted({p.exit_code for p in ranks if not p.alive and p.exit_code is not None})
        word = f"exited {', '.join(map(str, codes))}" if codes else "not running"
    return TrainerRow(word, len(ranks), restarts)


def _trainer_unknown(state: ClusterState) -> TrainerRow | None:
    n = sum(1 for p in state.processes.values() if p.role == Role.TRAINER)
    return TrainerRow("unknown (checking)", n, None) if n else None


class Watch:
    """Keeps the samples a frame needs and the nodes' latest status; ``frame()`` takes a new
    sample. ``status_source`` is called in a worker thread (it blocks on the node agents) and
    returns the state as saved now with its status: an engine ``apply`` adds or removes joins or
    leaves the view at the next ask."""

    def __init__(self, state: ClusterState, sampler: Sampler, status_source: Any):
        self.state = state
        self.sampler = sampler
        self.status_source = status_source
        self.history: deque[Sample] = deque()
        self.status: ClusterStatus | None = None
        self.status_at: float | None = None
        self.status_error: str | None = None
        self._status_task: asyncio.Task | None = None

    async def refresh_status(self) -> None:
        """Ask the node agents now (and wait). A failure keeps the last answer and says why."""
        try:
            state, self.status = await asyncio.to_thread(self.status_source)
            self.state = state
            self.sampler.follow(state)
            self.status_error = None
        except Exception as exc:  # a node agent's trouble must not end the view
            self.status_error = str(exc) or type(exc).__name__
        self.status_at = time.monotonic()

    def _status_due(self) -> None:
        if self._status_task is not None and not self._status_task.done():
            return
        if self.status_at is None or time.monotonic() - self.status_at >= STATUS_EVERY_SECS:
            self._status_task = asyncio.ensure_future(self.refresh_status())

    async def frame(self) -> Frame:
        """A new frame: takes a sample now and, when due, starts a fresh ask of the node agents in the
        background (the frame shows the latest answer, not waiting for it)."""
        self._status_due()
        sample = await self.sampler.sample()
        self.history.append(sample)
        while len(self.history) > 2 and sample.at - self.history[0].at > LATENCY_WINDOW_SECS:
            self.history.popleft()
        age = None if self.status_at is None else time.monotonic() - self.status_at
        frame = make_frame(self.state, self.history, self.status, age)
        frame.processes_error = self.status_error
        return frame

    async def close(self) -> None:
        """Cancel a background ask of the node agents still under way."""
        if self._status_task is not None:
            self._status_task.cancel()
            try:
                await self._status_task
            except (asyncio.CancelledError, Exception):
                pass
