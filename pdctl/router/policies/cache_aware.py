"""cache_aware: send a prompt where its longest prefix was sent before, unless load is skewed.

Like sglang-router's: if the load is imbalanced (max - min > balance_abs_threshold and
max > balance_rel_threshold * min) pick the least loaded worker; else the worker whose
recent prompts share the longest prefix with this one, if that match covers at least
``cache_threshold`` of the prompt; else the least loaded. Prefixes are kept per worker as a
bounded list of recent prompts (the sim has no radix tree to mirror; this is enough to keep
conversations sticky).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from pdctl.router.policies.base import Policy, RequestContext

if TYPE_CHECKING:
    from pdctl.router.config import RouterConfig
    from pdctl.router.workers import Worker

RECENT_PER_WORKER = 256


class CacheAwarePolicy(Policy):
    """``cache_aware`` (module docstring): the worker whose recent prompts share the longest prefix with the request,
    unless load is imbalanced or the match is too short."""

    name = "cache_aware"
    needs_text = True

    def __init__(
        self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64, balance_rel_threshold: float = 1.5
    ):
        self.cache_threshold = cache_threshold
        self.abs_threshold = balance_abs_threshold
        self.rel_threshold = balance_rel_threshold
        self._recent: dict[str, deque[str]] = {}

    @classmethod
    def from_config(cls, config: RouterConfig) -> CacheAwarePolicy:
        """The policy with the thresholds of the router's ``cache`` settings."""
        return cls(config.cache.cache_threshold, config.cache.balance_abs_threshold, config.cache.balance_rel_threshold)

    def select(self, workers: list[Worker], ctx: RequestContext) -> Worker | None:
        """The least loaded of ``workers`` when load is imbalanced, the request has no text or no prefix match covers
        ``cache_threshold`` of it; else the best-matching worker. The prompt is remembered for the worker chosen. Never
        None."""
        least = min(workers, key=lambda w: w.load)
        most = max(workers, key=lambda w: w.load)
        imbalanced = most.load - least.load > self.abs_threshold and most.load > self.rel_threshold * max(least.load, 1)
        text = ctx.text or ""
        if imbalanced or not text:
            chosen = least
        else:
            best, best_len = least, 0
            for w in workers:
                match = max((_common_prefix(text, p) for p in self._recent.get(w.url, ())), default=0)
                if match > best_len:
                    best, best_len = w, match
            chosen = best if best_len >= self.cache_threshold * len(text) else least
        if text:
            self._recent.setdefault(chosen.url, deque(maxlen=RECENT_PER_WORKER)).append(text)
        return chosen


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
