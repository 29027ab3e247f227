"""Each policy on its own, and the circuit breaker / health thresholds of the registry."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from pdctl.roles import Role
from pdctl.router.breaker import CircuitBreaker
from pdctl.router.config import BreakerConfig, CacheConfig, HealthConfig, RouterConfig
from pdctl.router.health import HealthChecks
from pdctl.router.policies import RequestContext, make_policy
from pdctl.router.versions import VersionRule
from pdctl.router.workers import Worker, WorkerRegistry


def workers(n: int) -> list[Worker]:
    return [Worker(url=f"http://w{i}", role="decode") for i in range(n)]


def test_round_robin_cycles() -> None:
    ws, policy = workers(3), make_policy("round_robin")
    assert [policy.select(ws, RequestContext()).url for _ in range(6)] == [w.url for w in ws] * 2


def test_random_spreads() -> None:
    ws, policy = workers(4), make_policy("random", seed=1)
    counts = Counter(policy.select(ws, RequestContext()).url for _ in range(4000))
    assert len(counts) == 4 and min(counts.values()) > 800


def test_power_of_two_prefers_the_less_loaded() -> None:
    ws = workers(2)
    ws[0].load, ws[1].load = 10, 0
    policy = make_policy("power_of_two", seed=3)
    assert {policy.select(ws, RequestContext()).url for _ in range(50)} == {"http://w1"}


def test_cache_aware_sticks_to_the_prefix_and_balances_load() -> None:
    ws = workers(3)
    policy = make_policy("cache_aware", cache_threshold=0.5, balance_abs_threshold=4, balance_rel_threshold=1.5)
    first = policy.select(ws, RequestContext(text="system prompt: you are helpful. user: hi"))
    again = policy.select(ws, RequestContext(text="system prompt: you are helpful. user: bye"))
    assert again is first
    first.load = 50  # imbalance: the least loaded wins even with a prefix match
    assert policy.select(ws, RequestContext(text="system prompt: you are helpful. user: x")) is not first


def test_unknown_policy_lists_the_valid_names() -> None:
    names = "cache_aware, consistent_hashing, manual, power_of_two, prefix_hash, random, round_robin"
    with pytest.raises(ValueError, match=names):
        make_policy("least_loaded")


def test_health_thresholds_and_first_wait() -> None:
    reg = WorkerRegistry(RouterConfig(health=HealthConfig(failure_threshold=2, success_threshold=2, first_wait_secs=0)))
    w = reg.add("http://a", "decode")
    reg.observe_health(w, False)
    assert not w.healthy and not w.activated  # still starting: out of rotation, failure not counted
    reg.observe_health(w, True)
    assert w.healthy and w.activated  # the first passed check admits it
    reg.observe_health(w, False)
    assert w.healthy
    reg.observe_health(w, False)
    assert not w.healthy and reg.routable("decode") == []
    reg.observe_health(w, True)
    assert not w.healthy
    reg.observe_health(w, True)
    assert w.healthy
    grace = WorkerRegistry(RouterConfig(health=HealthConfig(failure_threshold=1, first_wait_secs=60)))
    g = grace.add("http://b", "decode")
    grace.observe_health(g, True)
    grace.observe_health(g, False)
    assert g.healthy  # failures during the first-wait grace period do not count


def test_circuit_breaker_opens_and_half_opens() -> None:
    breaker = BreakerConfig(failure_threshold=2, success_threshold=1, timeout_duration_secs=0)
    reg = WorkerRegistry(RouterConfig(breaker=breaker))
    cb = CircuitBreaker(breaker)
    w = reg.add("http://a", "prefill", 8998, healthy=True)
    cb.record(w, False)
    cb.record(w, False)
    assert w.cb_half_open
    cb.record(w, True)
    assert not w.cb_half_open
    slow_config = BreakerConfig(failure_threshold=1, timeout_duration_secs=60)
    slow = WorkerRegistry(RouterConfig(breaker=slow_config))
    s = slow.add("http://b", "prefill", 8998, healthy=True)
    CircuitBreaker(slow_config).record(s, False)
    assert slow.routable("prefill") == []  # open circuit: out of rotation until the timeout


def test_a_worker_back_from_the_dead_is_on_trial_not_behind_its_open_circuit() -> None:
    """A crashed engine fails every request it held at once: its circuit opens, and it fails its
    health checks. Back (its supervisor restarted it), it gets trial requests at once (half-open)
    rather than after the breaker's timeout; a trial that fails opens the circuit again."""
    breaker = BreakerConfig(failure_threshold=3, success_threshold=2, timeout_duration_secs=600)
    reg = WorkerRegistry(RouterConfig(breaker=breaker, health=HealthConfig(failure_threshold=1, success_threshold=2)))
    cb = CircuitBreaker(breaker)
    w = reg.add("http://d", "decode", healthy=True)
    for _ in range(3):
        cb.record(w, False)  # the requests it held when it died
    reg.observe_health(w, False)
    assert not w.healthy and w.to_dict()["circuit_open"]
    reg.observe_health(w, True)
    reg.observe_health(w, True)  # back
    assert w.healthy and reg.routable("decode") == [w] and w.cb_half_open
    cb.record(w, False)
    assert reg.routable("decode") == []  # the trial failed: open again


@pytest.mark.timeout(30)
def test_a_worker_its_requests_took_out_is_checked_at_the_fast_interval() -> None:
    """Three failed requests (reset connections, not a refused one) take a worker out; the health
    loop then checks it at the startup interval, not after its slow one (it slept the 10 s
    default out first, and a restarted only decode stayed out that long)."""
    import aiohttp
    from aiohttp import web

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/health", lambda _: web.Response(text=""))
        app.router.add_get("/model_info", lambda _: web.json_response({"weight_version": "v0"}))
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        health = HealthConfig(interval_secs=3600, startup_interval_secs=0.01, failure_threshold=3, success_threshold=2)
        config = RouterConfig(health=health, breaker=BreakerConfig(disabled=True))
        reg = WorkerRegistry(config)
        checks = HealthChecks(config, reg, VersionRule(config, reg))
        w = reg.add(f"http://127.0.0.1:{port}", "decode", healthy=True)
        w.activated = True
        async with aiohttp.ClientSession() as session:
            checks.start(session)
            try:
                await asyncio.sleep(0)  # the loop is asleep on its hour-long interval
                for _ in range(3):
                    reg.mark_failed(w, ConnectionResetError())
                assert not w.healthy
                while not w.healthy:  # within the test's timeout: two checks at the fast interval
                    await asyncio.sleep(0.01)
            finally:
                await checks.stop()
        await runner.cleanup()

    asyncio.run(main())


def test_which_workers_out_of_rotation_may_come_back_by_themselves() -> None:
    reg = WorkerRegistry(RouterConfig())
    w = reg.add("http://d", "decode", healthy=False)  # restarting: health checks bring it back
    assert reg.may_return(Role.DECODE) and not reg.may_return(Role.PREFILL)
    reg.set_quarantine(w.url, "weight push t1 stopped half way")  # only a later push brings it back
    assert not reg.may_return(Role.DECODE)
    reg.loading[w.url] = None  # type: ignore[assignment]  # the fleet's checkpoint is being loaded into it
    assert reg.may_return(Role.DECODE)
    off = WorkerRegistry(RouterConfig(health=HealthConfig(disabled=True)))
    off.add("http://e", "decode", healthy=False)  # left with health checks off: nothing brings it back
    assert not off.may_return(Role.DECODE)


def test_manual_is_sticky_per_key_and_moves_a_key_only_when_its_worker_leaves() -> None:
    ws, policy = workers(4), make_policy("manual", seed=3)
    first = {k: policy.select(ws, RequestContext(routing_key=k)).url for k in map(str, range(200))}
    assert len(set(first.values())) == 4  # keys spread
    assert all(policy.select(ws, RequestContext(routing_key=k)).url == u for k, u in first.items())
    gone = ws[0].url
    rest = [w for w in ws if w.url != gone]
    after = {k: policy.select(rest, RequestContext(routing_key=k)).url for k in first}
    assert all(after[k] == u for k, u in first.items() if u != gone)  # only the leaving worker's keys move
    assert all(after[k] != gone for k in first)
    assert all(policy.select(ws, RequestContext(routing_key=k)).url == after[k] for k in first)  # joining moves none
    no_key = Counter(policy.select(ws, RequestContext()).url for _ in range(400))
    assert len(no_key) == 4


def test_consistent_hashing_moves_about_one_nth_of_the_keys() -> None:
    ws, policy = workers(5), make_policy("consistent_hashing", seed=1)
    keys = [f"session-{i}" for i in range(2000)]
    before = {k: policy.select(ws, RequestContext(routing_key=k)).url for k in keys}
    assert before == {k: make_policy("consistent_hashing").select(ws, RequestContext(routing_key=k)).url for k in keys}
    counts = Counter(before.values())
    assert min(counts.values()) > 200  # even-ish: 400 each on average
    rest = ws[:-1]
    after = {k: policy.select(rest, RequestContext(routing_key=k)).url for k in keys}
    moved = [k for k in keys if after[k] != before[k]]
    assert all(before[k] == ws[-1].url for k in moved)  # only the removed worker's keys move


def test_prefix_hash_groups_by_prefix_and_passes_an_overloaded_worker() -> None:
    ws, policy = workers(4), make_policy("prefix_hash")
    prefix = "system prompt " * 30
    picks = {policy.select(ws, RequestContext(text=prefix + f"question {i}")).url for i in range(50)}
    assert len(picks) == 1  # the first 256 characters decide
    target = next(w for w in ws if w.url in picks)
    target.load = 50  # far above the average
    assert policy.select(ws, RequestContext(text=prefix + "again")).url != target.url


def test_breaker_forgets_failures_older_than_its_window() -> None:
    breaker = BreakerConfig(failure_threshold=3, window_duration_secs=120)
    reg, cb = WorkerRegistry(RouterConfig(breaker=breaker)), CircuitBreaker(breaker)
    w = reg.add("http://w0", "decode", None, healthy=True)
    cb.record(w, False)
    cb.record(w, False)
    w.cb_window_start -= 121  # those two are now older than the window
    cb.record(w, False)
    assert not w.to_dict()["circuit_open"]
    cb.record(w, False)
    cb.record(w, False)
    assert w.to_dict()["circuit_open"]


def test_policies_are_configured_from_the_router_settings_and_refuse_unknown_options() -> None:
    """Each policy takes what it needs from the router's settings (cache_aware: its thresholds);
    an option a policy does not take is an error, not silently dropped."""
    from pdctl.router.policies import policy_class

    config = RouterConfig(policy="cache_aware", cache=CacheConfig(cache_threshold=0.7, balance_abs_threshold=9))
    policy = policy_class("cache_aware").from_config(config)
    assert (policy.cache_threshold, policy.abs_threshold, policy.rel_threshold) == (0.7, 9, 1.5)
    assert type(policy_class("round_robin").from_config(config)).__name__ == "RoundRobinPolicy"
    with pytest.raises(TypeError):
        make_policy("round_robin", seed=1)


def test_router_settings_check_themselves_and_the_cli_names_the_flag(capsys) -> None:
    """Each settings group refuses values out of range at construction; `pdctl router` turns
    that into a usage error (exit 2) naming the flag and the rule."""
    from pdctl.errors import RouterConfigError
    from pdctl.router.cli import build_parser, config_from_args
    from pdctl.router.config import SETTINGS, RetryConfig

    with pytest.raises(RouterConfigError, match="--health-failure-threshold 0: must be >= 1"):
        HealthConfig(failure_threshold=0)
    with pytest.raises(RouterConfigError, match="--retry-max-backoff-ms"):
        RetryConfig(initial_backoff_ms=100, max_backoff_ms=10)
    parser = build_parser()
    with pytest.raises(SystemExit) as info:
        config_from_args(parser.parse_args(["--cb-window-duration-secs", "0"]), parser)
    assert info.value.code == 2 and "--cb-window-duration-secs 0.0: must be > 0" in capsys.readouterr().err
    # one table: every grouped setting has a distinct flag the parser knows, with help and default
    flags = [s.flag for s in SETTINGS]
    known = {o for a in parser._actions for o in a.option_strings}
    assert len(flags) == len(set(flags)) == 36 and set(flags) <= known
    config = config_from_args(parser.parse_args(["--queue-size", "7", "--disable-retries"]), parser)
    assert config.admission.queue_size == 7 and config.retry.disabled and config.breaker == BreakerConfig()


@pytest.mark.parametrize(
    "argv, error",
    [
        (["--port", "99999"], "--port 99999: must be a port number"),
        (["--prometheus-port", "70000"], "--prometheus-port 70000: must be 0 to 65535"),
        (["--pd-disaggregation", "--prefill", "http://p:1", "70000", "--decode", "http://d:1"], "--prefill http://p:1"),
    ],
)
def test_a_port_out_of_range_is_a_usage_error_not_another_port(argv: list[str], error: str, capsys) -> None:
    """--port 99999 bound port 34463 (99999 modulo 65536) without a word: the socket layer
    does not refuse it."""
    from pdctl.router.cli import build_parser, config_from_args

    parser = build_parser()
    with pytest.raises(SystemExit) as info:
        config_from_args(parser.parse_args(argv), parser)
    assert info.value.code == 2 and error in capsys.readouterr().err


def test_the_routable_lists_follow_every_change_and_an_open_circuits_time(monkeypatch) -> None:
    """Selection reads the registry's routable lists per request; they are computed again only
    after a change, so every kind of change must show at once, and an open circuit's worker
    must be back when its time is up with no other change."""
    import pdctl.router.workers as workers

    now = [1000.0]
    monkeypatch.setattr(workers.time, "monotonic", lambda: now[0])
    reg = WorkerRegistry(RouterConfig())
    a = reg.add("http://a:1", "decode", healthy=True)
    b = reg.add("http://b:1", "decode", healthy=True)
    p = reg.add("http://p:1", "prefill", None, healthy=True)
    assert reg.routable(Role.DECODE) == [a, b] and reg.routable(Role.PREFILL) == [p]
    first = reg.routable(Role.DECODE)
    assert reg.routable(Role.DECODE) is first  # no change: the same list
    for change, undo in (
        (lambda: setattr(a, "healthy", False), lambda: setattr(a, "healthy", True)),
        (lambda: setattr(a, "cordoned", "restart"), lambda: setattr(a, "cordoned", None)),
        (lambda: reg.set_quarantine(a.url, "stale"), lambda: reg.set_quarantine(a.url, None)),
        (lambda: reg.remove(a.url), lambda: reg.add(a.url, "decode", healthy=True)),
    ):
        change()
        assert [w.url for w in reg.routable(Role.DECODE)] == [b.url]
        undo()
        assert sorted(w.url for w in reg.routable(Role.DECODE)) == [a.url, b.url]
    b.cb_open_until = now[0] + 30
    assert [w.url for w in reg.routable(Role.DECODE)] == [a.url]
    now[0] += 29.9
    assert [w.url for w in reg.routable(Role.DECODE)] == [a.url]
    now[0] += 0.2  # its circuit's time is up: a trial request may go
    assert sorted(w.url for w in reg.routable(Role.DECODE)) == [a.url, b.url]
