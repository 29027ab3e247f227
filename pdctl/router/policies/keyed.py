"""Policies keyed by the request: ``manual`` (sticky by routing key), ``consistent_hashing``
(a hash ring over the routing key) and ``prefix_hash`` (a hash ring over the prompt's prefix,
with a load check), as smg 1.13.0 has them. The routing key is the client's
``X-SMG-Routing-Key`` header; without one, ``manual`` and ``consistent_hashing`` fall back to a
random worker.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from collections import OrderedDict
from typing import TYPE_CHECKING

from pdctl.router.policies.base import Policy, RequestContext

if TYPE_CHECKING:
    from pdctl.router.workers import Worker

VIRTUAL_NODES = 160  # points per worker on the ring: keys spread evenly, ~1/N move when one leaves


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class _Ring:
    """Workers placed on a hash ring by URL; a key goes to the first point clockwise."""

    def __init__(self, workers: list[Worker]):
        points = sorted((_hash(f"{w.url}#{i}"), w.url) for w in workers for i in range(VIRTUAL_NODES))
        self.hashes = [h for h, _ in points]
        self.urls = [u for _, u in points]

    def walk(self, key: str) -> list[str]:
        """URLs from the key's point clockwise, each once (the first is the key's worker)."""
        start = bisect.bisect(self.hashes, _hash(key)) % len(self.hashes)
        seen: dict[str, None] = {}
        for i in range(len(self.urls)):
            seen.setdefault(self.urls[(start + i) % len(self.urls)], None)
        return list(seen)


class _RingPolicy(Policy):
    def __init__(self, seed: int | None = None):
        self._rng = random.Random(seed)
        self._rings: dict[frozenset[str], _Ring] = {}

    def _ring(self, workers: list[Worker]) -> _Ring:
        # The candidates are the healthy workers: a ring over them sends an unhealthy worker's
        # keys to the next point clockwise and moves no other key, as smg's walk does.
        key = frozenset(w.url for w in workers)
        ring = self._rings.get(key)
        if ring is None:
            if len(self._rings) > 64:
                self._rings.clear()
            ring = self._rings[key] = _Ring(workers)
        return ring


class ConsistentHashingPolicy(_RingPolicy):
    """``consistent_hashing``: a routing key always goes to the same worker while the candidates stay the same; a worker
    leaving moves only its own keys."""

    name = "consistent_hashing"

    def select(self, workers: list[Worker], ctx: RequestContext) -> Worker | None:
        """The worker the ring gives ``ctx.routing_key``, or a random one without a key; never None."""
        if not ctx.routing_key:
            return self._rng.choice(workers)
        by_url = {w.url: w for w in workers}
        return by_url[self._ring(workers).walk(ctx.routing_key)[0]]


class PrefixHashPolicy(_RingPolicy):
    """The prompt's first ``prefix_chars`` characters pick a point on the ring; a worker loaded
    beyond ``load_factor`` x the average passes the request on clockwise."""

    name = "prefix_hash"
    needs_text = True

    def __init__(self, seed: int | None = None, prefix_chars: int = 256, load_factor: float = 1.25):
        super().__init__(seed)
        self.prefix_chars = prefix_chars
        self.load_factor = load_factor

    def select(self, workers: list[Worker], ctx: RequestContext) -> Worker | None:
        """The first worker clockwise from the prompt prefix's point that is not overloaded, else the least loaded; the
        least loaded when the request has no text. Never None."""
        if ctx.text is None:
            return min(workers, key=lambda w: w.load)
        by_url = {w.url: w for w in workers}
        order = [by_url[u] for u in self._ring(workers).walk(ctx.text[: self.prefix_chars])]
        limit = sum(w.load for w in workers) / len(workers) * self.load_factor
        return next((w for w in order if w.load <= limit), min(workers, key=lambda w: w.load))


class ManualPolicy(Policy):
    """Sticky: a routing key stays on the worker it was first given (chosen at random) until
    that worker leaves the candidates (unhealthy, removed); then it moves to a new one. Workers
    joining move no key. At most ``max_keys`` keys are remembered (least recently used go)."""

    name = "manual"

    def __init__(self, seed: int | None = None, max_keys: int = 100_000):
        self._rng = random.Random(seed)
        self._assigned: OrderedDict[str, str] = OrderedDict()
        self.max_keys = max_keys

    def select(self, workers: list[Worker], ctx: RequestContext) -> Worker | None:
        """The worker ``ctx.routing_key`` was given before while it is still a candidate, else a random one that the key
        keeps from now; a random one without a key. Never None."""
        key = ctx.routing_key
        if not key:
            return self._rng.choice(workers)
        url = self._assigned.get(key)
        worker = next((w for w in workers if w.url == url), None) if url else None
        if worker is None:
            worker = self._rng.choice(workers)
            self._assigned[key] = worker.url
        self._assigned.move_to_end(key)
        while len(self._assigned) > self.max_keys:
            self._assigned.popitem(last=False)
        return worker
