"""The router's clock of announced steps (pdctl.router.planner_api.StepClock): each request is
counted to the step it arrived in, and a step's time runs from its first arrival to its last
answer, as the trainer that sent it saw it."""

from __future__ import annotations

from prometheus_client import generate_latest

from pdctl.cluster.sampling import RouterSample, parse_router_metrics
from pdctl.router.metrics import RouterMetrics
from pdctl.router.planner_api import StepClock
from tests.helpers import get, post
from tests.router.test_security import ADMIN, CLIENT, bearer, fleet  # noqa: F401 (the fixture)


def _seen(metrics: RouterMetrics) -> RouterSample:
    seen = RouterSample("up")  # as the planner's sampler reads the router
    parse_router_metrics(generate_latest(metrics.registry).decode(), seen)
    return seen


def test_a_request_counts_to_the_step_it_arrived_in_and_the_last_answer_ends_it() -> None:
    metrics = RouterMetrics()
    clock = StepClock(metrics)
    assert clock.arrived() is None  # (before the first boundary: nothing to time)
    clock.boundary()
    first = clock.arrived()
    late = clock.arrived()
    assert first is not None and late is not None
    first()
    clock.boundary()  # (step 2 announced while step 1's ``late`` is still answered)
    second = clock.arrived()
    assert second is not None
    seen = _seen(metrics)
    assert (seen.previous_step, seen.previous_step_in_flight) == (1, 1), seen
    answered_first = clock.seconds(1)
    late()  # step 1's last answer comes after step 2 began: it is step 1's
    seen = _seen(metrics)
    assert seen.previous_step_in_flight == 0 and clock.seconds(1) >= answered_first > 0
    assert seen.previous_step_secs == clock.seconds(1)
    assert clock.seconds(2) == 0  # (step 2's one request not answered yet)
    second()
    clock.boundary()
    seen = _seen(metrics)
    assert seen.previous_step == 2 and seen.previous_step_secs == clock.seconds(2) > 0
    assert clock.seconds(1) == 0  # (only the latest and the one before are kept)
    clock.boundary()  # a step no request arrived in
    seen = _seen(metrics)
    assert seen.previous_step_secs == 0 and seen.previous_step_requests == 0 and seen.previous_step_age_secs == 0


def test_a_step_that_said_its_requests_times_that_many_only() -> None:
    """Requests past the ones a boundary said (an eval while the trainer trains) are not the step's."""
    metrics = RouterMetrics()
    clock = StepClock(metrics)
    clock.boundary(requests=2)
    ends = [clock.arrived(), clock.arrived()]
    assert clock.arrived() is None  # (the third: not the step's, not timed)
    assert _seen(metrics).step_arrivals == 2  # (the step under way's, which tells a planner its start)
    for end in ends:
        assert end is not None
        end()
    clock.boundary(requests=2)
    seen = _seen(metrics)
    assert seen.previous_step_requests == 2 and seen.previous_step_in_flight == 0
    assert seen.previous_step_age_secs >= seen.previous_step_secs > 0


def test_the_router_times_a_step_its_clients_sent(fleet) -> None:  # noqa: F811 (the fixture)
    url = fleet.url
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    assert post(url + "/generate", body, headers=bearer(CLIENT))[0] == 200  # (before any step)
    assert post(url + "/pdctl/step", {"requests": 2}, headers=bearer(ADMIN))[0] == 200
    for _ in range(2):
        assert post(url + "/generate", body, headers=bearer(CLIENT))[0] == 200
    assert post(url + "/pdctl/step", {"requests": 2}, headers=bearer(ADMIN))[0] == 200
    seen = RouterSample("up")
    parse_router_metrics(get(url + "/metrics")[1], seen)
    assert seen.previous_step == 1 and seen.previous_step_in_flight == 0 and seen.previous_step_secs > 0, seen
    assert seen.previous_step_requests == 2, seen
