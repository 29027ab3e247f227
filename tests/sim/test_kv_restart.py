"""The decode's KV fetch against a prefill that restarted after the request came (a kill -9
between the prefill's answer and the decode's fetch, and a supervisor that brought it back on the
same bootstrap port within the heartbeat window): the room fails at once, so the router retries
the request on another pair, instead of the decode waiting out
SGLANG_DISAGGREGATION_WAITING_TIMEOUT (300 s). Found by the suite beside a busy loop: two clients'
requests hung for 2 minutes and held a weight load's drain that long."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
import torch

from pdctl.errors import SimError
from pdctl.httputil import start_site
from pdctl.sim.engine import KVPayload
from pdctl.sim.kv import Heartbeats, KVStore, bootstrap_app, fetch_kv


async def _fetch_from_a_fresh_server(sent_before_start: bool) -> KVPayload:
    sent_at = time.time()
    if not sent_before_start:
        sent_at += 3600.0  # (a request that came after the server started)
    store = KVStore(asyncio.get_running_loop())
    runner, port = await start_site(bootstrap_app(store), "127.0.0.1", 0)
    try:
        if not sent_before_start:  # its prefill publishes the room (a restarted one never does)
            payload = KVPayload([1, 2], torch.zeros(1, 2, 1, 2, 4), 3, -0.5, "v")
            asyncio.get_running_loop().call_later(0.2, store.put_threadsafe, 7, payload)
        async with aiohttp.ClientSession() as session:
            return await asyncio.wait_for(fetch_kv(session, "127.0.0.1", port, 7, 60.0, Heartbeats(), sent_at), 60)
    finally:
        await runner.cleanup()


def test_a_room_from_a_prefill_that_started_after_the_request_fails_at_its_first_answer() -> None:
    """At the first "not yet" (one long-poll slice, 10 s at most), not at the 60 s timeout given."""
    with pytest.raises(SimError, match="restarted after the request came"):
        asyncio.run(_fetch_from_a_fresh_server(sent_before_start=True))


def test_a_room_from_a_prefill_that_was_up_before_the_request_is_fetched() -> None:
    payload = asyncio.run(_fetch_from_a_fresh_server(sent_before_start=False))
    assert payload.prompt_ids == [1, 2] and payload.first_token == 3
