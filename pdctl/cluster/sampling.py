"""One sample of a running cluster's HTTP endpoints, for ``pdctl top`` (pdctl.cluster.watch).

Each engine's ``/metrics`` (SGLang's ``sglang:`` names) and ``/model_info`` (its weight
version), the router's ``/metrics``, ``/workers`` and ``/pdctl/weights``: all concurrently, each
call bounded by ``HTTP_TIMEOUT_SECS`` so that one engine that hangs never makes a sample late.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from pdctl.cluster.keys import ClusterKeys
from pdctl.cluster.state import ClusterState, ProcessRecord
from pdctl.sglang import Endpoint

HTTP_TIMEOUT_SECS = 0.8


@dataclass
class EngineSample:
    """One engine at one moment, from its ``/metrics`` (and its weight version and loads, when asked):
    ``None`` for what it did not say or could not be reached for."""

    reach: str
    """``up``; ``refused`` (nothing listens: its process is gone); ``no answer`` (timed out);
    or the error."""
    running: float | None = None
    queued: float | None = None
    kv_use: float | None = None
    prompt_tokens: float | None = None
    cached_tokens: float | None = None
    """Of ``prompt_tokens``, those found in the prefix cache (summed over SGLang's cache sources):
    a prefill did not compute them."""
    generation_tokens: float | None = None
    weight_version: str | None = None
    prealloc: float | None = None
    """A decode's requests waiting for KV room (included in ``queued``)."""
    transfer: float | None = None
    """A decode's requests holding KV room while their prefill's KV comes (not in ``queued``)."""
    bootstrap: float | None = None
    """A prefill's requests waiting for their decode's handshake or sending their KV (SGLang's
    prefill prealloc and inflight queues; not in ``queued``)."""
    ttft: dict[float, float] = field(default_factory=dict)
    """Its TTFT histogram: cumulative count per bucket bound (``le``), summed over label sets."""
    itl: dict[float, float] = field(default_factory=dict)
    """Its inter-token latency histogram, the same way."""
    slots: float | None = None
    """The most requests it runs at once (``max_running_requests`` of ``/v1/loads``, summed over DP ranks)."""


@dataclass
class RouterSample:
    """The router at one moment: its answers, latency, retries, load, hold, last push and step
    announcements, and (when asked) its workers; ``reach`` as for an engine."""

    reach: str
    requests: dict[int, float] = field(default_factory=dict)
    """Answers so far by status (summed over routes)."""
    latency: dict[float, float] = field(default_factory=dict)
    """Cumulative count per bucket bound (``le``, inf included), summed over routes."""
    retries: float = 0.0
    in_flight: float | None = None
    queued: float | None = None
    workers: list[dict[str, Any]] = field(default_factory=list)
    workers_known: bool = False
    """Whether ``GET /workers`` answered (else the router's view of the engines is unknown)."""
    last_push: dict[str, Any] | None = None
    hold: str | None = None
    """What holds the router's requests now (a weight update, a framework's pause), in its words."""
    steps: float = 0.0
    """Step boundaries announced to it so far (``POST /pdctl/step``; pdctl.router.planner_api)."""
    step_prompt_tokens: float = 0.0
    """The prompt tokens the latest announced step said it will prefill (0: not said)."""
    step_requests: float = 0.0
    """The requests the latest announced step said it will send (0: not said)."""
    step_arrivals: float = 0.0
    """Requests the router timed for the latest announced step so far (its start)."""
    previous_step: float = 0.0
    """The step before the latest announced one (0: none; pdctl.router.planner_api.StepClock)."""
    previous_step_secs: float = 0.0
    """That step's time as its clients saw it: its first request's arrival to its last answer."""
    previous_step_in_flight: float = 0.0
    """That step's requests not yet answered (while any are, ``previous_step_secs`` is not final)."""
    previous_step_requests: float = 0.0
    """The requests the router timed in that step (at most what its boundary said)."""
    previous_step_age_secs: float = 0.0
    """Seconds since that step's first request arrived, as the router read its clock for this sample."""
    waiting_for_room: float = 0.0
    """PD requests waiting in the router for an engine with room (late pairing: pdctl.router.pair_room)."""
    room_short: tuple[str, ...] = ()
    """The roles none of whose engines has room (late pairing), by name."""


@dataclass
class Sample:
    """Every engine and the router at one moment (``at``: monotonic seconds); ``router`` is ``None``
    when the cluster has no router or the sample did not ask it."""

    at: float
    engines: dict[str, EngineSample]
    """By the engine's entrypoint process id."""
    router: RouterSample | None


ENGINE_GAUGES = {
    "sglang:num_running_reqs": ("running",),
    "sglang:num_queue_reqs": ("queued",),
    "sglang:num_decode_prealloc_queue_reqs": ("queued", "prealloc"),
    "sglang:num_decode_transfer_queue_reqs": ("transfer",),
    "sglang:num_prefill_prealloc_queue_reqs": ("bootstrap",),
    "sglang:num_prefill_inflight_queue_reqs": ("bootstrap",),
    "sglang:token_usage": ("kv_use",),
    "sglang:prompt_tokens_total": ("prompt_tokens",),
    "sglang:cached_tokens_total": ("cached_tokens",),
    "sglang:generation_tokens_total": ("generation_tokens",),
}
"""What ``top`` and the planner read from an engine's ``/metrics``: each sample adds to these fields
(the prealloc queue is part of ``queued`` too)."""
HISTOGRAMS = {
    "sglang:time_to_first_token_seconds_bucket": "ttft",
    "sglang:inter_token_latency_seconds_bucket": "itl",
}


def parse_engine_metrics(text: str, into: EngineSample) -> None:
    """An SGLang engine's ``/metrics`` into ``into`` in one pass: each gauge and counter summed over
    label sets, the TTFT and ITL histograms as cumulative counts per bucket bound."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for key in ENGINE_GAUGES.get(sample.name, ()):
                setattr(into, key, (getattr(into, key) or 0.0) + sample.value)
            bucket_of = HISTOGRAMS.get(sample.name)
            if bucket_of is not None:
                buckets = getattr(into, bucket_of)
                bound = float(sample.labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + sample.value


def _slots(loads: Any) -> float | None:
    """``max_running_requests`` summed over the DP ranks of a ``/v1/loads`` answer (None when an
    older SGLang has no such route or a rank does not say)."""
    if not isinstance(loads, list) or not loads:
        return None
    ranks = [load.get("max_running_requests") if isinstance(load, dict) else None for load in loads]
    sizes = [float(r) for r in ranks if isinstance(r, int | float) and r > 0]
    return sum(sizes) if len(sizes) == len(ranks) else None


def parse_router_metrics(text: str, into: RouterSample) -> None:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "pdctl_router_requests_total":
                status = int(s.labels.get("status", "0"))
                into.requests[status] = into.requests.get(status, 0.0) + s.value
            elif s.name == "pdctl_router_request_duration_seconds_bucket":
                bound = float(s.labels["le"])
                into.latency[bound] = into.latency.get(bound, 0.0) + s.value
            elif s.name == "pdctl_router_retries_total":
                into.retries += s.value
            elif s.name == "pdctl_router_in_flight_requests":
                into.in_flight = s.value
            elif s.name == "pdctl_router_queued_requests":
                into.queued = s.value
            elif s.name == "pdctl_router_step_boundaries_total":
                into.steps = s.value
            elif s.name == "pdctl_router_step_prompt_tokens":
                into.step_prompt_tokens = s.value
            elif s.name == "pdctl_router_step_requests":
                into.step_requests = s.value
            elif s.name == "pdctl_router_previous_step":
                into.previous_step = s.value
            elif s.name == "pdctl_router_previous_step_seconds":
                into.previous_step_secs = s.value
            elif s.name == "pdctl_router_previous_step_in_flight":
                into.previous_step_in_flight = s.value
            elif s.name == "pdctl_router_step_arrivals":
                into.step_arrivals = s.value
            elif s.name == "pdctl_router_previous_step_requests":
                into.previous_step_requests = s.value
            elif s.name == "pdctl_router_previous_step_age_seconds":
                into.previous_step_age_secs = s.value
            elif s.name == "pdctl_router_pd_waiting_for_room":
                into.waiting_for_room = s.value
            elif s.name == "pdctl_router_pd_room_short" and s.value:
                into.room_short += (s.labels.get("role", ""),)


class Sampler:
    """Samples one cluster's endpoints; ``keys`` open the engines' ``/model_info`` and the
    router's control-plane reads (without them those columns stay empty)."""

    def __init__(
        self,
        state: ClusterState,
        keys: ClusterKeys | None,
        session: aiohttp.ClientSession,
        *,
        versions_and_workers: bool = True,
    ):
        """``versions_and_workers``: also ask each engine its weight version and the router its
        workers (``top`` shows them; the planner, which samples five times an interval, does not
        need them)."""
        self.state = state
        self.keys = keys
        self.session = session
        self.versions_and_workers = versions_and_workers
        self.entrypoints = engine_entrypoints(state)

    def follow(self, state: ClusterState) -> None:
        """Sample ``state``'s engines from the next sample on (after an ``apply``)."""
        self.state, self.entrypoints = state, engine_entrypoints(state)

    async def sample(self) -> Sample:
        """A full sample: every engine's metrics and the router's, taken at once; an engine or router
        that does not answer is sampled with its ``reach`` saying why, not raised."""
        at = time.monotonic()
        ids = list(self.entrypoints)
        engines, router = await asyncio.gather(
            asyncio.gather(*(self._engine(self.entrypoints[i]) for i in ids)), self._router()
        )
        return Sample(at, dict(zip(ids, engines, strict=True)), router)

    async def running(self) -> Sample:
        """A light sample: each engine's running requests and slots from ``/v1/loads`` alone (no
        ``/metrics`` to render and parse), no router. The planner's samples inside an interval."""
        at = time.monotonic()
        ids = list(self.entrypoints)
        key = self.keys.engine if self.keys else None

        async def one(rec: ProcessRecord) -> EngineSample:
            reach, body = await self._get(f"{rec.url}{Endpoint.LOADS.value}?include=core", key)
            sample = EngineSample(reach)
            loads = _json_field(body, "loads")
            if isinstance(loads, list):
                sample.running = float(sum(_number(x, "num_running_reqs") for x in loads))
                sample.slots = _slots(loads)
            return sample

        engines = await asyncio.gather(*(one(self.entrypoints[i]) for i in ids))
        return Sample(at, dict(zip(ids, engines, strict=True)), None)

    async def captured_decode_graphs(self, rec: ProcessRecord) -> bool:
        """Whether the engine at ``rec`` says it captured decode CUDA graphs (``/server_info``
        ``decode_cuda_graph_bs``, as SGLang reports it: empty on a prefill never flipped to
        decode); False when it does not answer or say."""
        key = self.keys.engine if self.keys else None
        _, body = await self._get(f"{rec.url}{Endpoint.SERVER_INFO.value}", key)
        states = _json_field(body, "internal_states")
        first = states[0] if isinstance(states, list) and states else None
        return isinstance(first, dict) and bool(first.get("decode_cuda_graph_bs"))

    async def _get(self, url: str, key: str | None = None) -> tuple[str, Any]:
        """(reach, body): body is the text of a 200, else None."""
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            async with self.session.get(
                url, headers=headers, timeout=aiohttp.ClientTimeout(total=HTTP_TIMEOUT_SECS)
            ) as resp:
                if resp.status != 200:
                    return f"HTTP {resp.status}", None
                return "up", await resp.text()
        except aiohttp.ClientConnectorError as exc:
            refused = isinstance(exc.os_error, ConnectionRefusedError)
            return ("refused" if refused else f"unreachable ({exc.os_error})"), None
        except asyncio.TimeoutError:
            return "no answer", None
        except (aiohttp.ClientError, OSError) as exc:
            return f"error ({type(exc).__name__})", None

    async def _engine(self, rec: ProcessRecord) -> EngineSample:
        assert rec.url is not None
        key = self.keys.engine if self.keys else None
        (reach, text), (_, loads), (_, info) = await asyncio.gather(
            self._get(rec.url + "/metrics"),
            self._get(rec.url + Endpoint.LOADS.value + "?include=core", key),
            self._get(rec.url + Endpoint.MODEL_INFO.value, key) if self.versions_and_workers else _skipped(),
        )
        sample = EngineSample(reach)
        if text is not None:
            parse_engine_metrics(text, sample)
        version = _json_field(info, "weight_version")
        sample.weight_version = None if version is None else str(version)
        sample.slots = _slots(_json_field(loads, "loads"))
        return sample

    async def _router(self) -> RouterSample | None:
        url = self.state.router_url
        if not url:
            return None
        key = self.keys.control if self.keys else None
        (reach, text), (_, weights), (_, workers) = await asyncio.gather(
            self._get(url + "/metrics"),
            self._get(url + "/pdctl/weights", key),
            self._get(url + "/workers", key) if self.versions_and_workers else _skipped(),
        )
        sample = RouterSample(reach)
        if text is not None:
            parse_router_metrics(text, sample)
        listed = _json_field(workers, "workers")
        sample.workers = [w for w in listed if isinstance(w, dict)] if isinstance(listed, list) else []
        sample.workers_known = isinstance(listed, list)
        push = _json_field(weights, "last_push")
        sample.last_push = push if isinstance(push, dict) else None
        hold = _json_field(weights, "hold")
        if isinstance(hold, dict):
            sample.hold = str(hold.get("reason") or "a weight update holds the router")
        elif _json_field(weights, "held"):
            sample.hold = f"weight push {_json_field(weights, 'holder')} holds the router"
        return sample


def _number(raw: Any, key: str) -> float:
    value = raw.get(key) if isinstance(raw, dict) else None
    return float(value) if isinstance(value, int | float) else 0.0


async def _skipped() -> tuple[str, None]:
    return "skipped", None


def _json_field(body: str | None, key: str) -> Any:
    if body is None:
        return None
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return value.get(key) if isinstance(value, dict) else None


def engine_entrypoints(state: ClusterState) -> dict[str, ProcessRecord]:
    """Each engine's HTTP entrypoint (node rank 0 of a multi-node engine), by process id, in plan order."""
    order = state.plan.order()
    recs = [r for r in state.processes.values() if r.role.is_engine and r.url]
    return {r.id: r for r in sorted(recs, key=lambda r: order.get(r.id, len(order)))}
