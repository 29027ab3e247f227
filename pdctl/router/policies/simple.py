"""random, round_robin and power_of_two (two random picks, the less loaded wins)."""

from __future__ import annotations

import itertools
import random
from typing import TYPE_CHECKING

from pdctl.router.policies.base import Policy, RequestContext

if TYPE_CHECKING:
    from pdctl.router.workers import Worker


class RandomPolicy(Policy):
    """``random``: any candidate, uniformly (``seed`` makes the choices repeatable)."""

    name = "random"

    def __init__(self, seed: int | None = None):
        self._rng = random.Random(seed)

    def select(self, workers: list[Worker], ctx: RequestContext) -> Worker | None:
        """A uniformly random one of ``workers``; never None."""
        return self._rng.choice(workers)


class RoundRobinPolicy(Policy):
    """``round_robin``: the candidates in turn, by a counter shared across calls."""

    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def select(self, workers: list[Worker], ctx: RequestContext) -> Worker | None:
        """The next of ``workers`` by position; never None. A changed candidate list shifts the turn."""
        return workers[next(self._counter) % len(workers)]


class PowerOfTwoPolicy(Policy):
    """``power_of_two``: two random candidates, the less loaded wins."""

    name = "power_of_two"

    def __init__(self, seed: int | None = None):
        self._rng = random.Random(seed)

    def select(self, workers: list[Worker], ctx: RequestContext) -> Worker | None:
        """The less loaded of two distinct random ``workers`` (the first on a tie), or the only one; never None."""
        if len(workers) == 1:
            return workers[0]
        a, b = self._rng.sample(workers, 2)
        return a if a.load <= b.load else b
