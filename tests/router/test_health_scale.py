"""The health and liveness loops at fleet sizes beyond their rates (issue 59.3): what a round
checks, in what order, how many at once, and that a request's answer counts as liveness."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdctl.router import health as health_module
from pdctl.router.breaker import CircuitBreaker
from pdctl.router.config import BreakerConfig, HealthConfig, RouterConfig
from pdctl.router.health import CHECKS_IN_FLIGHT, CHECKS_PER_SEC, PROBES_AT_ONCE, PROBES_PER_SEC, HealthChecks
from pdctl.router.legs import Claim
from pdctl.router.versions import VersionRule
from pdctl.router.workers import Worker, WorkerRegistry


def fleet(
    n: int, *, interval: float = 10.0, liveness_timeout: float = 5.0, fast: float = 0.5
) -> tuple[HealthChecks, list[Worker]]:
    health = HealthConfig(interval_secs=interval, startup_interval_secs=fast, liveness_timeout_secs=liveness_timeout)
    config = RouterConfig(health=health, breaker=BreakerConfig(disabled=True))
    registry = WorkerRegistry(config)
    workers = []
    for i in range(n):
        w = registry.add(f"http://10.0.{i // 250}.{i % 250}:30000", "decode" if i % 2 else "prefill", healthy=True)
        w.activated = True
        workers.append(w)
    return HealthChecks(config, registry, VersionRule(config, registry)), workers


def test_a_fleet_within_the_rate_is_checked_whole_every_interval() -> None:
    checks, workers = fleet(100)
    now = time.monotonic()
    assert checks._due(now) == workers  # all, never checked; stamped at once
    assert all(w.checked_at == now for w in workers)
    assert checks._due(now + 5) == []
    assert checks._wait(now) == pytest.approx(10.0)
    assert checks._due(now + 10) == workers  # all again, together, at the interval


def test_a_fleet_within_the_rate_is_checked_whole_while_one_worker_is_out_of_rotation() -> None:
    """Rounds come at the fast interval then (for the one out): the budget the rounds in between
    did not spend is kept, so the others are still checked together at their interval."""
    checks, workers = fleet(100)
    now = time.monotonic()
    out = workers[40]
    out.healthy = False
    for w in workers:
        w.checked_at = now - 10.0
    checks._last_round = now - 10.0
    for tick in range(1, 20):  # 9.5 s of fast rounds: only the one out is due
        assert checks._due(now - 10.0 + tick * 0.5) == [out]
    due = checks._due(now)
    assert due[0] is out and due[1:] == [w for w in workers if w is not out]


def test_a_large_fleet_is_checked_within_the_rate_longest_unchecked_first_out_of_rotation_before() -> None:
    checks, workers = fleet(1024)
    period = 1024 / CHECKS_PER_SEC
    assert checks._period() == period  # 64 s: longer than the 10 s interval
    now = time.monotonic()
    for i, w in enumerate(workers):  # checked over the last period, one after another
        w.checked_at = now - period - 1 + i * (period / 1024)
    restarting, in_flight = workers[700], workers[0]
    restarting.healthy = False
    checks._checking[in_flight] = None  # type: ignore[assignment]  # its check has not answered yet
    checks._last_round, checks._budget = now - 1.0, 0.0
    due = checks._due(now)
    assert due[0] is restarting  # out of rotation: first, whatever the order
    routine = due[1:]
    assert len(routine) == CHECKS_PER_SEC  # one second's budget
    assert routine == [w for w in workers if w not in (restarting, in_flight)][:CHECKS_PER_SEC]
    assert checks._wait(now) == pytest.approx(0.5)  # the fast interval while one is out

    checks, workers = fleet(1024)  # every worker due after a long pause: a second's worth, no burst
    checks._last_round = now - 100.0
    assert len(checks._due(now)) == CHECKS_PER_SEC


def test_a_check_that_never_answers_holds_up_no_other_check() -> None:
    """Each check runs in a task of its own: 35 workers whose checks hang (a partition, until
    their timeout) do not keep a starting engine from being checked at the fast interval (the
    loop once waited for a whole round, and a round for its slowest check)."""
    checks, workers = fleet(40, fast=0.01)
    starting = workers[0]
    starting.activated = starting.healthy = False
    hanging = set(workers[1:36])
    seen = {"starting": 0}

    async def main() -> None:
        never = asyncio.Event()
        checked_thrice = asyncio.Event()

        async def check(_session: object, worker: Worker) -> None:
            if worker in hanging:
                await never.wait()
            elif worker is starting:
                seen["starting"] += 1
                if seen["starting"] >= 3:
                    checked_thrice.set()

        checks.check = check  # type: ignore[method-assign]
        checks.start(None)  # type: ignore[arg-type]
        try:
            await checked_thrice.wait()  # (the test's timeout: it never came before)
            assert len(checks._checking) >= len(hanging)  # the hanging ones are still in flight
        finally:
            await checks.stop()

    asyncio.run(main())
    assert seen["starting"] >= 3


def test_no_more_checks_than_the_in_flight_bound_the_out_of_rotation_first() -> None:
    checks, workers = fleet(300)
    now = time.monotonic()
    for w in workers[:10]:
        w.healthy = False
    busy = {object(): None for _ in range(CHECKS_IN_FLIGHT - 4)}
    checks._checking = busy  # type: ignore[assignment]  # as many in flight as a partition leaves
    assert checks._due(now) == workers[:4]  # the room there is, for those out of rotation
    checks._checking = {object(): None for _ in range(CHECKS_IN_FLIGHT)}  # type: ignore[misc]
    assert checks._due(now + 1) == []


def test_liveness_probes_every_worker_of_a_small_fleet_and_only_quiet_ones_of_a_large_one() -> None:
    checks, workers = fleet(PROBES_PER_SEC)
    now = time.monotonic()
    for w in workers:
        w.last_answer = now  # all just answered requests: a small fleet is probed all the same
    assert checks._to_probe(now, 1.0) == workers

    assert checks._to_probe(now, 0.25) == workers  # a short interval probes no fewer

    checks, workers = fleet(1024)
    for i, w in enumerate(workers):
        w.last_answer = now - (0.5 if i % 4 else 2.0)  # 3 in 4 answered a request within the interval
        w.probed_at = now - 2.0 - i / 1024
    hung = workers[1000]
    hung.silent_since = hung.probed_at = now - 1.0
    probed = checks._to_probe(now, 1.0)
    assert len(probed) == PROBES_PER_SEC
    assert probed[0] is hung  # already silent: probed every round until it answers or is found hung
    assert all(now - w.last_answer >= 1.0 for w in probed)
    quiet = sorted((w for w in workers if w is not hung and now - w.last_answer >= 1.0), key=lambda w: w.probed_at)
    assert probed[1:] == quiet[: PROBES_PER_SEC - 1]  # the longest unprobed

    checks, workers = fleet(1024, liveness_timeout=0.0)  # no silence makes a worker hung
    for w in workers[:100]:
        w.silent_since, w.probed_at, w.last_answer = now - 1.0, now - 1.0, now - 9.0
    for w in workers[100:]:
        w.last_answer, w.probed_at = now - 9.0, now - 5.0
    probed = checks._to_probe(now, 1.0)
    assert not any(w.silent_since for w in probed)  # the silent ones wait their turn, none holds every slot


def test_a_worker_seldom_probed_is_not_hung_at_its_first_silent_probe(monkeypatch) -> None:
    """In a large fleet a worker's last answer may be a minute old when it is probed: one probe
    unanswered is not 'silent for liveness_timeout_secs' (it was, before: every answer's age
    counted as silence); a silence that lasts the timeout from that probe on is."""
    checks, workers = fleet(1024, liveness_timeout=5.0)
    now = time.monotonic()
    for w in workers:
        w.last_answer = now - 60.0
    target = workers[0]

    async def model_info(_session, worker, _timeout):
        return health_module._SILENT if worker is target else {"weight_version": worker.weight_version}

    monkeypatch.setattr(health_module, "_model_info", model_info)
    asyncio.run(checks.liveness_round(None, 1.0))  # type: ignore[arg-type]
    assert target.healthy and target.silent_since >= now - 1.0
    target.silent_since -= 5.0  # as if its probes had gone unanswered for the timeout since
    asyncio.run(checks.liveness_round(None, 1.0))  # type: ignore[arg-type]
    assert not target.healthy
    assert all(w.healthy for w in workers if w in checks._to_probe(time.monotonic(), 1.0) and w is not target)


def test_a_round_has_at_most_probes_at_once_calls_in_flight() -> None:
    in_flight = peak = 0

    async def call(_: int) -> int:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        in_flight -= 1
        return _ * 2

    results = asyncio.run(health_module._each(list(range(10 * PROBES_AT_ONCE)), call))
    assert results == [i * 2 for i in range(10 * PROBES_AT_ONCE)]
    assert peak == PROBES_AT_ONCE


def test_a_request_answered_counts_as_the_workers_answer() -> None:
    w = Worker(url="http://w", role="decode")
    w.last_answer, w.silent_since = 0.0, 5.0
    claim = Claim(w, CircuitBreaker(BreakerConfig()))
    claim.judge(True)
    assert w.last_answer > 0.0 and w.silent_since == 0.0
    failed = Worker(url="http://f", role="decode")
    failed.last_answer = 0.0
    Claim(failed, CircuitBreaker(BreakerConfig())).judge(False)
    assert failed.last_answer == 0.0
