"""``pdctl weights``: each engine's weight version and group membership, and loads from disk.

Both talk HTTP from the control machine to the engines and the router (as ``pdctl bench``
does), with the router's API key from the variable the topology names. Group membership comes
from two places: the plan (the ranks each engine takes in the trainer's flat group) and the
router, which keeps the group the trainer's latest push actually used (after a failure the
trainer rebuilds it without the failed engine, so the two can differ).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from pdctl.cluster.inspect import load_state, rotation_of
from pdctl.cluster.keys import load_keys
from pdctl.cluster.state import ClusterState, Phase, StateStore
from pdctl.errors import LifecycleError
from pdctl.refit import RefitMode
from pdctl.sglang import Endpoint
from pdctl.weights.client import CallFailure
from pdctl.weights.fleet import Fleet
from pdctl.weights.report import PushReport


@dataclass
class EngineWeights:
    """One engine's weights as ``pdctl weights`` reports them: the version it serves (``error`` when it
    did not answer), its planned and latest-push ranks, and why the router keeps it out, if it does."""

    id: str
    role: str
    url: str
    version: str | None = None
    error: str | None = None
    planned_ranks: tuple[int, int] | None = None
    """First and last rank the plan gives this engine in the weight group."""
    group_ranks: tuple[int, int] | None = None
    """Its ranks in the group of the latest push, None when that push left it out."""
    out_of_rotation: str | None = None
    """Why the router keeps it out of rotation (a push it missed), if it does."""


@dataclass
class WeightsStatus:
    """A cluster's weights as ``pdctl weights`` reports them: the planned group, the router's latest
    push and hold, and each engine's version and ranks."""

    name: str
    router_url: str | None
    group: dict[str, Any] | None
    """The planned group: name, backend, world size, master address and port."""
    last_push: dict[str, Any] | None
    """The router's record of the latest push: version, state, complete and failed engines, group."""
    engines: list[EngineWeights] = field(default_factory=list)
    router_error: str | None = None
    hold: dict[str, Any] | None = None
    """What holds the router's new requests now (a framework's pause, a push), and since when."""

    @property
    def ok(self) -> bool:
        """Every engine answers, none is out of rotation, all share one version, and nothing
        holds the router's requests."""
        versions = {e.version for e in self.engines}
        engines_ok = all(e.error is None and e.out_of_rotation is None for e in self.engines)
        return engines_ok and len(versions) == 1 and self.hold is None

    def to_dict(self) -> dict[str, Any]:
        """The status as JSON-ready data, with ``ok`` added."""
        return {**asdict(self), "ok": self.ok}


def fleet_of(state: ClusterState, timeout_secs: float = 30.0, store: StateStore | None = None) -> Fleet:
    """The cluster's HTTP engines and router as a ``Fleet``, with the cluster's keys."""
    engines = state.plan.engines
    if not engines:
        raise LifecycleError(f"cluster {state.name!r} has no engines")
    keys = load_keys(store or StateStore(), state.name)
    api_key: str | None
    engine_key: str | None
    if keys is not None:
        api_key, engine_key = keys.control, keys.engine
    else:  # a cluster brought up before pdctl made keys: the router's client key for both
        key_env = state.plan.api_key_env
        api_key, engine_key = os.environ.get(key_env) if key_env else None, None
        if key_env and not api_key:
            raise LifecycleError(f"the router needs its API key: set ${key_env} on this machine")
    return Fleet(
        [{"id": e.id, "url": e.url, "gpus": e.gpus} for e in engines],
        router_url=state.router_url,
        api_key=api_key,
        engine_key=engine_key,
        timeout_secs=timeout_secs,
        refit=state.plan.refit or RefitMode.DRAIN,  # the topology's weights.refit and max_staleness
        max_staleness=state.plan.max_staleness,
    )


def weights_status(name: str, *, store: StateStore | None = None) -> WeightsStatus:
    store = store or StateStore()
    state = _load(store, name)
    fleet = fleet_of(state, timeout_secs=10, store=store)
    try:
        planned = {e.url: e for e in state.plan.engines if e.rank_offset is not None}
        group = state.plan.weight_group
        result = WeightsStatus(
            state.name,
            state.router_url,
            {k: v for k, v in group.to_dict(()).items() if k != "engines"} if group else None,
            None,
        )
        router: dict[str, Any] = {}
        if state.router_url:
            answer = fleet.client.get(state.router_url + "/pdctl/weights")
            if isinstance(answer, CallFailure):
                result.router_error = str(answer)
            else:
                router = answer
                result.last_push = answer.get("last_push")
                result.hold = answer.get("hold")
        used = ((result.last_push or {}).get("group") or {}).get("ranks") or {}
        quarantine = router.get("quarantine") or {}
        workers = {w.get("url"): w for w in router.get("workers") or [] if isinstance(w, dict)}
        futures = {e.id: fleet.client.submit("GET", e.url + Endpoint.MODEL_INFO.value) for e in fleet.engines}
        roles = {e.id: e.role.value for e in state.plan.engines}
        for engine in fleet.engines:
            info = futures[engine.id].result()
            row = EngineWeights(engine.id, roles.get(engine.id, "?"), engine.url)
            if isinstance(info, CallFailure):
                row.error = str(info)
            elif isinstance(info, dict):
                row.version = info.get("weight_version")
            spec = planned.get(engine.url)
            if spec is not None and spec.rank_offset is not None:
                row.planned_ranks = (spec.rank_offset, spec.rank_offset + spec.gpus - 1)
            if engine.url in used:
                first_rank, last_rank = used[engine.url]
                row.group_ranks = (int(first_rank), int(last_rank))
            if quarantine.get(engine.url):
                row.out_of_rotation = quarantine[engine.url]
            elif workers:  # the router listed its workers: it says whether it routes to this one
                row.out_of_rotation = rotation_of(workers.get(engine.url))
            result.engines.append(row)
        return result
    finally:
        fleet.close()


def load_weights(
    name: str,
    model_path: str,
    version: str,
    *,
    refit: str | None = None,
    store: StateStore | None = None,
    progress: Callable[[str], None] | None = None,
) -> PushReport:
    """``/update_weights_from_disk`` of ``model_path`` (a path on each engine's node) on every
    engine, as one transaction (``Fleet.load_from_disk``), in ``refit`` mode (default: the
    topology's ``weights.refit``). Raises WeightSyncError naming the engine and phase when any
    engine did not load it (that engine leaves the router's rotation)."""
    store = store or StateStore()
    state = _load(store, name)
    fleet = fleet_of(state, timeout_secs=600, store=store)
    fleet.progress = progress
    try:
        return fleet.load_from_disk(model_path, version, refit)
    finally:
        fleet.close()


def _load(store: StateStore, name: str) -> ClusterState:
    state = load_state(store, name)
    if state.status not in (Phase.UP, Phase.STARTING):
        raise LifecycleError(f"cluster {name!r} is {state.status}; start it with `pdctl up`")
    return state
