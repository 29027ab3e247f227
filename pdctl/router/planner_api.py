"""The P:D planner's mailbox on the router: a trainer or framework says a step boundary
(``POST /pdctl/step``: a new batch is coming), the planner reports each decision (``POST
/pdctl/planner``), and both are counted in the router's metrics, which the planner reads back
and Prometheus scrapes (``pdctl_router_step_boundaries_total``, ``pdctl_planner_decisions_total``).
``GET /pdctl/planner`` shows the latest of each. The router also times each announced step as its
clients see it (``StepClock``: from the first generation request that arrived after its boundary
to the last answer of those that did), which the planner takes as the step's time. The router is
the cluster's one HTTP face that always runs: the planner process serves nothing, and a trainer
already holds the router's URL and control key (``PDCTL_ROUTER_URL``, ``PDCTL_CONTROL_KEY``).
Writes need the control key.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter, Gauge

from pdctl.role_planner.config import PlannerMode
from pdctl.role_planner.decide import OUTCOMES, Action
from pdctl.router import errors
from pdctl.router.jsonutil import json_object
from pdctl.router.metrics import RouterMetrics
from pdctl.router.reply import Reply, json_reply
from pdctl.router.server import Request, Routes
from pdctl.step_hint import PLANNER_PATH, STEP_PATH

DECISION_LABELS = {
    "action": frozenset(a.value for a in Action),
    "mode": frozenset(m.value for m in PlannerMode if m is not PlannerMode.OFF),
    "outcome": frozenset(OUTCOMES),
}
"""The labels of a reported decision, each from the planner's own closed sets: a caller cannot
grow the metric's series."""


@dataclass
class _StepTimes:
    said: int
    """The requests its boundary said it would send (0: not said)."""
    first_at: float = 0.0
    last_done_at: float | None = None
    arrived: int = 0
    in_flight: int = 0

    def done(self) -> None:
        self.in_flight -= 1
        self.last_done_at = time.monotonic()


class StepClock:
    """Each announced step's makespan as its clients see it: from the first generation request that
    arrived after its boundary to the last answer of those requests (failed or cancelled ones
    too), each request counted to the step it arrived in, so a last step's tail answered after
    the boundary is not the next step's. A boundary that said its ``requests`` (M) times its
    first M arrivals only: a request sent after the step's own (an eval, a smoke test while the
    trainer trains) is not the step's, and a step whose arrivals differ from M is no measure to
    a planner (``pdctl_router_previous_step_requests``). Exported for the step before the latest
    announced one (the one a planner learns from at the new boundary): ``pdctl_router_previous_step``
    (its number, 0: none), ``..._seconds`` (0: none answered), ``..._in_flight`` (its requests not
    yet answered: while any are, the seconds are not its makespan yet), ``..._requests`` (the
    requests it timed) and ``..._age_seconds`` (from its first arrival to the scrape: a planner
    tells by it whether the step's burst came before a switch ended); and for the latest
    announced step ``pdctl_router_step_arrivals`` (its requests so far: a planner tells its start
    by them). Nothing is counted before the first boundary."""

    def __init__(self, metrics: RouterMetrics):
        r = metrics.registry
        self.step = 0
        self._times: dict[int, _StepTimes] = {}
        """The latest announced step's and the one before's (a request keeps its own step's object)."""
        for name, what, read in (
            ("", "The step before the latest announced one (0: none)", lambda: max(0, self.step - 1)),
            (
                "_seconds",
                "... from its first request's arrival to its last answer",
                lambda: self.seconds(self.step - 1),
            ),
            ("_in_flight", "... its requests not yet answered", lambda: self._read(self.step - 1, "in_flight")),
            ("_requests", "... the requests it timed", lambda: self._read(self.step - 1, "arrived")),
            ("_age_seconds", "... seconds since its first request arrived", lambda: self.age(self.step - 1)),
        ):
            help_text = what.replace("...", "The step before the latest announced one:")
            Gauge(f"pdctl_router_previous_step{name}", help_text, registry=r).set_function(read)
        Gauge(
            "pdctl_router_step_arrivals", "Requests the latest announced step has timed so far", registry=r
        ).set_function(lambda: self._read(self.step, "arrived"))

    def boundary(self, requests: int = 0) -> None:
        """A step boundary was announced, saying it will send ``requests`` (0: not said): requests
        from now on are the new step's."""
        self.step += 1
        self._times = {s: t for s, t in self._times.items() if s == self.step - 1}
        self._times[self.step] = _StepTimes(requests)

    def arrived(self) -> Callable[[], None] | None:
        """A generation request arrived: counted to the step under way; the callable marks its
        answer ended. None before the first boundary, and past the requests the step said."""
        times = self._times.get(self.step)
        if times is None or (times.said and times.arrived >= times.said):
            return None
        if not times.arrived:
            times.first_at = time.monotonic()
        times.arrived += 1
        times.in_flight += 1
        return times.done

    def seconds(self, step: int) -> float:
        """Step ``step``'s time so far: its first arrival to its last answer (0: none answered or
        not kept)."""
        times = self._times.get(step)
        if times is None or times.last_done_at is None:
            return 0.0
        return times.last_done_at - times.first_at

    def age(self, step: int) -> float:
        """Seconds since step ``step``'s first request arrived (0: none did, or not kept)."""
        times = self._times.get(step)
        return time.monotonic() - times.first_at if times is not None and times.arrived else 0.0

    def _read(self, step: int, field: str) -> int:
        times = self._times.get(step)
        return getattr(times, field) if times is not None else 0


class PlannerApi:
    """Step hints in, the planner's decisions in, both counted (module docstring)."""

    def __init__(self, metrics: RouterMetrics):
        r = metrics.registry
        self.steps = Counter(
            "pdctl_router_step_boundaries",
            "Step boundaries a trainer or framework announced (POST /pdctl/step: a new batch is coming)",
            registry=r,
        )
        self.step_prompt_tokens = Gauge(
            "pdctl_router_step_prompt_tokens",
            "Prompt tokens the latest announced step will prefill (0: not said)",
            registry=r,
        )
        self.step_requests = Gauge(
            "pdctl_router_step_requests", "Requests the latest announced step will send (0: not said)", registry=r
        )
        self.decisions = Counter(
            "pdctl_planner_decisions",
            "The P:D planner's decisions, by action (switch, stay, wait), mode and outcome",
            list(DECISION_LABELS),
            registry=r,
        )
        self.clock = StepClock(metrics)
        self.step_count = 0
        self.last_step: dict[str, Any] | None = None
        self.last_decision: dict[str, Any] | None = None

    def add_routes(self, r: Routes) -> None:
        """Register the step hint (``POST`` ``STEP_PATH``) and the planner's routes (``POST`` and ``GET``
        ``PLANNER_PATH``)."""
        r.add("POST", STEP_PATH, self.step)
        r.add("POST", PLANNER_PATH, self.decision)
        r.add("GET", PLANNER_PATH, self.show)

    async def step(self, request: Request) -> Reply:
        """``{"prompt_tokens": N, "requests": M}``, both optional non-negative integers."""
        body, problem = json_object(request.body)
        said: dict[str, int] = {}
        for key in ("prompt_tokens", "requests"):
            value = body.get(key, 0)
            if problem is None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                problem = f"{key} must be a non-negative integer, not {value!r}"
            said[key] = value if problem is None else 0
        if problem is not None:
            return errors.error_response(400, errors.BAD_REQUEST, problem)
        self.steps.inc()
        self.clock.boundary(said["requests"])
        self.step_count += 1
        self.step_prompt_tokens.set(said["prompt_tokens"])
        self.step_requests.set(said["requests"])
        self.last_step = {"at": time.time(), **said}
        return json_reply({"success": True, "steps": self.step_count})

    async def decision(self, request: Request) -> Reply:
        """``{"action", "mode", "outcome", ...}``: counted by the first three; the whole (reason,
        figures) kept as the latest for ``GET``."""
        body, problem = json_object(request.body)
        labels = [body.get(key) for key in DECISION_LABELS]
        for (key, allowed), value in zip(DECISION_LABELS.items(), labels, strict=True):
            if problem is None and value not in allowed:
                problem = f"{key} must be one of {', '.join(sorted(allowed))}, not {value!r}"
        if problem is not None:
            return errors.error_response(400, errors.BAD_REQUEST, problem)
        self.decisions.labels(*labels).inc()
        self.last_decision = {"received_at": time.time(), **body}
        return json_reply({"success": True})

    async def show(self, _: Request) -> Reply:
        """The latest step hint and planner decision as received (``last_step``, ``last_decision``; None before any)."""
        return json_reply({"last_step": self.last_step, "last_decision": self.last_decision})
