"""``up``'s decode CUDA graph capture: each prefill of a role_switch group flips to decode and back
once, out of rotation, before ``up`` returns.

SGLang launches a prefill with its decode CUDA graph disabled and captures the graphs on the
engine's first flip to decode (``ModelRunner.ensure_decode_cuda_graphs``, idempotent: they stay
captured through later flips), 12-15 s on an H100 (docs/sim-profiles.md). Paid at ``up``, the
fleet is idle and every engine captures at once on its own GPUs; paid at a planner's move, it
falls inside the shift of load the move answers (the 8-engine 30 s trace lost 12 s per prefill
moved, one after the other). The KV pool is sized at launch whatever the role, so graphs captured
early hold no memory the first switch would not have taken.

Contract: every engine comes back a prefill in rotation, or ``up`` fails (and so stops every
process). An engine that refuses the flip to decode (no graph headroom, say: it did not switch)
serves on as a prefill uncaptured, said in an event; its later first switch pays the capture or
is refused as it would have been. One that switched to decode and will not switch back fails
``up``: it is not what the plan says it is.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from pdctl.cluster.keys import load_keys
from pdctl.cluster.nodes import Events
from pdctl.cluster.role_call import ask_switch, wait_let_go
from pdctl.cluster.router_control import RouterControl
from pdctl.cluster.state import ClusterState, StateStore
from pdctl.errors import LifecycleError
from pdctl.plan import EngineSpec
from pdctl.role_planner.config import PlannerConfig
from pdctl.roles import Role
from pdctl.sglang import Endpoint
from pdctl.weights.client import CallFailure, JsonClient

INFO_TIMEOUT_SECS = 10.0


def captures_at_start(state: ClusterState, engine_id: str) -> bool:
    """Whether engine ``engine_id`` is one the cluster captures the decode graphs of once it
    runs: a prefill of a role_switch group, in a cluster whose ``planner.captures_at_up``."""
    engine = next((e for e in state.plan.engines if e.id == engine_id), None)
    if engine is None or engine.role is not Role.PREFILL or not engine.role_switch:
        return False
    return PlannerConfig.from_dict(state.plan.planner).captures_at_up()


def uncaptured_prefills(state: ClusterState, store: StateStore) -> list[EngineSpec]:
    """The prefills of role_switch groups whose ``/server_info`` says they captured no decode
    graphs (``decode_cuda_graph_bs`` empty), or says nothing of it (an SGLang before the field:
    flipped too, as a first switch would)."""
    keys = load_keys(store, state.name)
    client = JsonClient(api_key=keys.engine if keys else None, timeout_secs=INFO_TIMEOUT_SECS)
    out = []
    for engine in state.plan.engines:
        if engine.role is not Role.PREFILL or not engine.role_switch or not engine.url:
            continue
        info = client.get(engine.url + Endpoint.SERVER_INFO.value)
        internal = (info.get("internal_states") or [{}])[0] if isinstance(info, dict) else {}
        if not (isinstance(internal, dict) and internal.get("decode_cuda_graph_bs")):
            out.append(engine)
    return out


def capture_decode_graphs(state: ClusterState, store: StateStore, router: RouterControl, events: Events) -> None:
    """Flip every prefill of ``uncaptured_prefills`` to decode and back, side by side, each
    cordoned for its flips (what reached it meanwhile handed to another prefill). Raises
    LifecycleError when an engine switched to decode and did not come back a prefill."""
    engines = uncaptured_prefills(state, store)
    if not engines:
        return
    started = time.monotonic()
    names = ", ".join(e.id for e in engines)
    events("graphs", f"capturing the decode CUDA graphs of {names}: each flips to decode and back, out of rotation")
    pool = ThreadPoolExecutor(len(engines), thread_name_prefix="graph-capture")
    try:
        outcomes = list(pool.map(lambda e: _flip_there_and_back(state, store, router, e), engines))
    finally:  # a Ctrl-C or a failure: `up` stops the engines now, not after their captures
        pool.shutdown(wait=False, cancel_futures=True)
    failed = [f"{e.id}: {why}" for e, why in zip(engines, outcomes, strict=True) if why]
    for line in failed:
        events("graphs", f"not captured: {line}; it serves on as a prefill, and its first switch to decode captures")
    done = len(engines) - len(failed)
    events("graphs", f"captured on {done} of {len(engines)} prefill(s) in {time.monotonic() - started:.1f} s")


def _flip_there_and_back(state: ClusterState, store: StateStore, router: RouterControl, engine: EngineSpec) -> str:
    """One engine's flips, cordoned; returns "" when captured, else why not (it serves on)."""
    url = engine.url or ""
    router.cordon(url, True, reason="pdctl up: capturing decode CUDA graphs", handoff=True)
    if router.handed_off.pop(url, 0):  # a client that sent before `up` returned
        wait_let_go(state, store, url)
    why = flip_there_and_back(state, store, engine, url)
    router.cordon(url, False)
    return why


def flip_there_and_back(state: ClusterState, store: StateStore, engine: EngineSpec, url: str) -> str:
    """Engine ``engine`` (idle, out of rotation) at ``url`` flips to decode and back to prefill;
    returns "" when it did, else why it refused the first flip (it is still a prefill). Raises
    LifecycleError when it switched to decode and did not switch back."""
    there = ask_switch(state, store, url, Role.DECODE, engine.tp)
    back = ask_switch(state, store, url, Role.PREFILL, engine.tp)  # "already" when it refused the first
    if isinstance(back, CallFailure):
        raise LifecycleError(
            f"{engine.id} was asked to switch to decode to capture its decode CUDA graphs, and did not switch "
            f"back to prefill: {back}"
        )
    return str(there) if isinstance(there, CallFailure) else ""
