"""Executors for every node of a cluster, used in parallel (one thread per node)."""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable, Iterable
from typing import TypeVar

from pdctl.errors import RemoteError
from pdctl.remote import Executor, executor_for
from pdctl.topology.model import Node

T = TypeVar("T")
Events = Callable[[str, str], None]
"""Progress callback: (process id or phase, message); called from worker threads."""


def quiet(_: str, __: str) -> None:
    """The default Events sink."""


class NodeSet:
    def __init__(self, nodes: Iterable[Node], factory: Callable[[Node], Executor] = executor_for):
        self.nodes = {n.name: n for n in nodes}
        self._factory = factory
        self.executors: dict[str, Executor] = {}

    def executor(self, name: str) -> Executor:
        if name not in self.executors:
            self.executors[name] = self._factory(self.nodes[name])
        return self.executors[name]

    def each(self, names: Iterable[str], fn: Callable[[Executor], T]) -> dict[str, T | RemoteError]:
        """Run ``fn`` on each node in parallel; a node's RemoteError is returned, not raised."""
        names = list(dict.fromkeys(names))
        if not names:
            return {}

        def one(name: str) -> T | RemoteError:
            try:
                return fn(self.executor(name))
            except RemoteError as exc:
                return exc

        pool = cf.ThreadPoolExecutor(max_workers=min(32, len(names)))
        try:
            return dict(zip(names, pool.map(one, names), strict=True))
        except BaseException:
            # Ctrl-C: do not wait for blocked node calls (a readiness wait can last minutes);
            # the caller stops everything at once.
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        finally:
            pool.shutdown(wait=False)

    def close(self) -> None:
        for ex in self.executors.values():
            ex.close()
        self.executors.clear()

    def __enter__(self) -> NodeSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
