"""A health probe's answer that may predate a weight update's relabel never undoes it (in-process,
one real aiohttp engine whose /model_info answers when the test lets it)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web

from pdctl.router.config import RouterConfig
from pdctl.router.health import HealthChecks
from pdctl.router.versions import VersionRule
from pdctl.router.workers import Worker, WorkerRegistry

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _engine_and_checks(
    health: Handler, model_info: Handler, role: str
) -> tuple[web.AppRunner, Worker, HealthChecks, WorkerRegistry]:
    """One real aiohttp engine on port 0 of 127.0.0.1 (``/health``, ``/model_info``) and a
    router's health checks with it as a healthy ``role`` worker."""
    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/model_info", model_info)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    config = RouterConfig()
    registry = WorkerRegistry(config)
    checks = HealthChecks(config, registry, VersionRule(config, registry))
    worker = registry.add(f"http://127.0.0.1:{runner.addresses[0][1]}", role, healthy=True)
    return runner, worker, checks, registry


def test_a_version_read_before_a_relabel_does_not_overwrite_it() -> None:
    """Found by a failed update under load: a probe sent before the update labelled its engines,
    answered after, put the old label back on one engine; a request then found no prefill and
    decode on one version and got a 503."""

    async def run() -> list[str | None]:
        asked, answer = asyncio.Event(), asyncio.Event()

        async def model_info(_: web.Request) -> web.Response:
            asked.set()
            await answer.wait()
            return web.json_response({"weight_version": "v1"})

        async def ok(_: web.Request) -> web.Response:
            return web.Response(text="OK")

        runner, worker, health, registry = await _engine_and_checks(ok, model_info, "decode")
        seen = []
        try:
            async with aiohttp.ClientSession() as session:
                check = asyncio.ensure_future(health.check(session, worker))
                await asyncio.wait_for(asked.wait(), 60)
                registry.relabelled([worker], "pdctl:updating:t1")  # the update's label, while the probe is out
                answer.set()
                await check
                seen.append(worker.weight_version)
                asked.clear()
                await health.check(session, worker)  # a probe sent after the relabel is believed
                seen.append(worker.weight_version)
        finally:
            await runner.cleanup()
        return seen

    assert asyncio.run(run()) == ["pdctl:updating:t1", "v1"]


def test_a_cordoned_engine_is_probed_without_a_generation_unless_it_must_earn_its_way_back() -> None:
    """SGLang's /health runs a one-token generation, and one running at an engine as its role
    switch is asked makes SGLang refuse the flip ("not idle"): a healthy engine cordoned for a
    switch's or a restart's drain is asked /model_info; one out of rotation for its health still
    generates to come back; one in rotation is asked /health."""

    async def run() -> list[str]:
        asked: list[str] = []

        async def answer(request: web.Request) -> web.Response:
            asked.append(request.path)
            return web.json_response({"weight_version": "v1"}) if request.path == "/model_info" else web.Response()

        runner, worker, health, _ = await _engine_and_checks(answer, answer, "prefill")
        probes = []
        try:
            async with aiohttp.ClientSession() as session:
                for cordoned, healthy in ((None, True), ("switching to decode", True), ("restarting", False)):
                    worker.cordoned, worker.healthy = cordoned, healthy
                    asked.clear()
                    await health.check(session, worker)
                    probes.append(asked[0])
        finally:
            await runner.cleanup()
        return probes

    assert asyncio.run(run()) == ["/health", "/model_info", "/health"]
