"""An engine's ``/pd_role_switch`` call, and the wait before it for the engine to be idle: what
``pdctl switch`` (pdctl.cluster.switch) and ``up``'s graph capture (pdctl.cluster.graph_capture)
both ask of an engine."""

from __future__ import annotations

import time
from typing import Any

from pdctl.cluster.journal import interrupt_held
from pdctl.cluster.keys import load_keys
from pdctl.cluster.state import ClusterState, StateStore
from pdctl.roles import Role
from pdctl.sglang import Endpoint
from pdctl.weights.client import CallFailure, JsonClient

SWITCH_TIMEOUT_SECS = 300.0
"""An idle engine's switch tears down and rebuilds its PD structures (and captures decode CUDA
graphs on a first flip to decode): seconds, not a model load."""
LET_GO_TIMEOUT_SECS = 60.0
"""How long a switch waits for its engine to let go of the requests the router handed off from it:
the engine aborts each once it sees its client gone (the sim at once; SGLang need not). Past it
the switch is asked anyway (a refusal leaves it serving)."""
NOT_IDLE_TRIES = 3
"""How many times a switch refused as "not idle" is asked in all (``ask_switch``)."""
NOT_IDLE_WAIT_SECS = 10.0
"""How long a switch refused as "not idle" waits for its engine to be seen idle before it asks
again: a health check's generation takes milliseconds; a request held longer is a real one."""


def wait_let_go(state: ClusterState, store: StateStore, url: str) -> None:
    """Wait until the engine at ``url`` runs and queues nothing (``_busy``), at most
    ``LET_GO_TIMEOUT_SECS``; at once when its ``/metrics`` does not answer. The router's count of
    its requests fell to 0 when it handed them off, before the engine saw their clients go: asked
    then, a real-client run's switch was refused ("instance is not idle") with 138 handed off."""
    keys = load_keys(store, state.name)
    _wait_idle(JsonClient(api_key=keys.engine if keys else None, timeout_secs=10), url, LET_GO_TIMEOUT_SECS)


def _wait_idle(client: JsonClient, url: str, secs: float) -> bool:
    """Whether the engine at ``url`` was seen idle (``_busy`` 0, or no ``/metrics`` to read)
    within ``secs``, its ``/metrics`` read every 0.2 s; False at once once a Ctrl-C is held back
    (the switch is then not asked again: the user asked to stop)."""
    deadline = time.monotonic() + secs
    while not interrupt_held():
        text = client.get(url + "/metrics", timeout_secs=10)
        if not isinstance(text, str) or not _busy(text):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)
    return False


def _busy(metrics: str) -> float:
    """What an engine's ``/metrics`` text counts of what SGLang's idle check (``is_fully_idle``)
    waits for: running, queued (a decode's prealloc queue in it), a decode's transfers, a prefill's
    bootstrap and inflight queues (pdctl.cluster.sampling); 0 for a text that is no Prometheus
    exposition: nothing to wait on."""
    from pdctl.cluster.sampling import EngineSample, parse_engine_metrics  # (it imports aiohttp: not at `up`)

    sample = EngineSample("up")
    try:
        parse_engine_metrics(metrics, sample)
    except ValueError:
        return 0.0
    return sum(value or 0.0 for value in (sample.running, sample.queued, sample.transfer, sample.bootstrap))


def ask_switch(state: ClusterState, store: StateStore, url: str, role: Role, tp: int | None) -> Any:
    """``/pd_role_switch`` on the engine, with its key; a switch to decode carries the decode CUDA
    graph footprint a running decode of the same tp measured (SGLang needs it before it captures
    graphs on a first flip to decode, and checks the GPU has that much free; with none measured it
    is left out, and SGLang refuses such a flip saying why).

    Refused as not idle, it is asked again once the engine is seen idle, ``NOT_IDLE_TRIES`` asks
    in all: the engine is out of rotation, and what runs there is most likely a health check's
    one-token generation (SGLang's ``/health`` runs one: ``pdctl status``, a user's curl), gone in
    milliseconds (seen: ``pdctl restart``'s capture refused by the router's check of the engine it
    was bringing back). Not idle within ``NOT_IDLE_WAIT_SECS``, the refusal is the answer."""
    keys = load_keys(store, state.name)
    client = JsonClient(api_key=keys.engine if keys else None, timeout_secs=SWITCH_TIMEOUT_SECS)
    body: dict[str, Any] = {"new_role": role.value}
    if role is Role.DECODE:
        measured = _decode_graph_gb(client, state, tp)
        if measured is not None:
            body["decode_cuda_graph_memory_gb"] = measured
    for _ in range(NOT_IDLE_TRIES - 1):
        answer = client.post(url + Endpoint.PD_ROLE_SWITCH.value, body)
        if not refused_as_busy(answer) or not _wait_idle(client, url, NOT_IDLE_WAIT_SECS):
            return answer
    return client.post(url + Endpoint.PD_ROLE_SWITCH.value, body)


def refused_as_busy(answer: Any) -> bool:
    """Whether a ``/pd_role_switch`` answer is SGLang's refusal of an engine that is not idle
    (HTTP 400, "instance is not idle; drain all requests before switching")."""
    return isinstance(answer, CallFailure) and not answer.transport and "not idle" in answer.message


def _decode_graph_gb(client: JsonClient, state: ClusterState, tp: int | None) -> float | None:
    """What a running decode of the same tp says its decode CUDA graphs take (``/server_info``)."""
    for engine in state.plan.engines:
        if engine.role is not Role.DECODE or not engine.url or engine.tp != tp:
            continue
        info = client.get(engine.url + Endpoint.SERVER_INFO.value, timeout_secs=10)
        if isinstance(info, dict):
            for internal in info.get("internal_states") or []:
                value = internal.get("decode_cuda_graph_memory_gb") if isinstance(internal, dict) else None
                if isinstance(value, int | float) and not isinstance(value, bool):
                    return float(value)
    return None
