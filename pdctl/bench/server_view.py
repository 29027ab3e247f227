"""The servers' side of a run: their Prometheus ``/metrics`` sampled once a second.

Per role (router, prefill, decode, regular), gauges are summed over the role's servers at
each sample and reported as mean and max over the run (queue depth, running requests, KV
use); counters are reported as their increase from the first sample to the last. Names
are SGLang's (``sglang:num_queue_reqs`` ...) and pdctl's router's (``pdctl_router_*``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

GAUGES = {
    "sglang:num_running_reqs": "running_reqs",
    "sglang:num_queue_reqs": "queue_reqs",
    "sglang:num_decode_prealloc_queue_reqs": "decode_prealloc_queue_reqs",
    "sglang:token_usage": "kv_usage",
    "pdctl_router_in_flight_requests": "in_flight",
    "pdctl_router_queued_requests": "queued",
}
COUNTERS = {
    "sglang:prompt_tokens": "prompt_tokens",
    "sglang:generation_tokens": "generation_tokens",
    "sglang:num_requests": "requests",
    "pdctl_router_retries": "retries",
}
SAMPLE_SECS = 1.0


def parse(text: str) -> tuple[dict[str, float], dict[str, float]]:
    """(gauges, counters) of one server's /metrics, each summed over its label sets."""
    gauges: dict[str, float] = defaultdict(float)
    counters: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in GAUGES:
                gauges[GAUGES[sample.name]] += sample.value
            elif sample.name.removesuffix("_total") in COUNTERS and sample.name.endswith("_total"):
                counters[COUNTERS[sample.name.removesuffix("_total")]] += sample.value
    return dict(gauges), dict(counters)


class ServerView:
    """Samples the servers' ``/metrics`` once a second between ``start`` and ``stop``; ``targets``
    are (role, base URL) pairs."""

    def __init__(self, session: aiohttp.ClientSession, targets: Sequence[tuple[str, str]]):
        self.session = session
        self.targets = list(targets)
        self.samples: list[dict[str, tuple[dict[str, float], dict[str, float]]]] = []
        self.unreachable: set[str] = set()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Take a first sample, then keep sampling in the background; nothing when there are no targets."""
        if self.targets:
            await self._sample()
            self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> dict[str, Any] | None:
        """Stop sampling, take a last sample and return ``report``; None when sampling never started."""
        if self._task is None:
            return None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self._sample()
        return self.report()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(SAMPLE_SECS)
            await self._sample()

    async def _sample(self) -> None:
        texts = await asyncio.gather(*(self._get(url) for _, url in self.targets))
        by_role: dict[str, tuple[dict[str, float], dict[str, float]]] = {}
        for (role, url), text in zip(self.targets, texts, strict=True):
            if text is None:
                self.unreachable.add(url)
                continue
            gauges, counters = parse(text)
            g, c = by_role.setdefault(role, ({}, {}))
            for k, v in gauges.items():
                g[k] = g.get(k, 0.0) + v
            for k, v in counters.items():
                c[k] = c.get(k, 0.0) + v
        self.samples.append(by_role)

    async def _get(self, url: str) -> str | None:
        try:
            async with self.session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                return await resp.text() if resp.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
            return None

    def report(self) -> dict[str, Any]:
        """Per role: the sample count, each gauge's mean and max and each counter's increase;
        ``unreachable`` lists the URLs that failed to answer at least once."""
        out: dict[str, Any] = {}
        roles = {role for sample in self.samples for role in sample}
        for role in sorted(roles):
            series = [s[role] for s in self.samples if role in s]
            entry: dict[str, Any] = {"samples": len(series)}
            for key in sorted({k for g, _ in series for k in g}):
                values = [g.get(key, 0.0) for g, _ in series]
                entry[f"mean_{key}"] = sum(values) / len(values)
                entry[f"max_{key}"] = max(values)
            first, last = series[0][1], series[-1][1]
            for key in sorted(set(first) | set(last)):
                entry[f"{key}_delta"] = last.get(key, 0.0) - first.get(key, 0.0)
            out[role] = entry
        if self.unreachable:
            out["unreachable"] = sorted(self.unreachable)
        return out
