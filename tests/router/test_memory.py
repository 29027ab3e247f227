"""The router leaves no reference cycles behind: it runs the cyclic GC rarely (pdctl.router.cli),
so anything a request or a connection leaves in a cycle would pile up until a full collection."""

from __future__ import annotations

import asyncio
import gc

import aiohttp

from pdctl.router.app import RouterServer
from pdctl.router.cli import build_parser, config_from_args
from tests.helpers import NullEngine


def _pdctl_garbage() -> list[str]:
    """Names of the pdctl and httptools objects that only the cyclic GC could free."""
    gc.collect()
    found = []
    for obj in gc.garbage:
        module = type(obj).__module__ or ""
        if module.startswith(("pdctl", "httptools")):
            found.append(type(obj).__qualname__)
    return found


def test_requests_and_connections_leave_no_cycles(tmp_path) -> None:
    prefill, decode = NullEngine(tmp_path, "prefill").start(), NullEngine(tmp_path, "decode").start()
    argv = ["--port", "0", "--pd-disaggregation", "--prefill", prefill.url, str(prefill.bootstrap_port)]
    parser = build_parser()
    config = config_from_args(parser.parse_args([*argv, "--decode", decode.url]), parser)

    async def traffic(url: str) -> None:
        for round_ in range(4):  # a fresh client (fresh connections) each round
            async with aiohttp.ClientSession() as s:

                async def one(i: int, round_: int = round_) -> int:
                    body = {"text": f"r{round_} {i}", "sampling_params": {"max_new_tokens": 2}}
                    if i % 3 == 1:
                        body["stream"] = True
                    async with s.post(url + "/generate", json=body) as r:
                        await r.read()
                        return r.status

                statuses = await asyncio.gather(*(one(i) for i in range(30)))
                assert set(statuses) == {200}
                async with s.post(url + "/generate", data=b"not json") as r:
                    assert r.status == 400

    async def main() -> list[str]:
        router = RouterServer(config)
        await router.start()
        try:
            await traffic(router.url)  # warm: pools, caches, metric children
            gc.collect()
            gc.set_debug(gc.DEBUG_SAVEALL)  # keep what the GC finds, to look at it
            await traffic(router.url)
            return _pdctl_garbage()
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            await router.stop()

    try:
        assert asyncio.run(main()) == []
    finally:
        prefill.stop()
        decode.stop()
