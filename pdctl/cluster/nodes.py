"""Executors for every node of a cluster, used in parallel.

At a thousand nodes: up to ``PARALLEL`` calls at once, within the open-file limit
(``parallel_calls``; each mostly waits on its node), at most ``MAX_OPEN`` connections kept open
between calls (the rest are closed after each call and made
again at the next), and a node found unreachable is not asked again by the same command: its
error is the answer at once (the connect bound is paid once per node, not once per phase)."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import resource
import threading
from collections.abc import Callable, Iterable
from typing import TypeVar

from pdctl.errors import NodeUnreachable, RemoteError
from pdctl.remote import Executor, executor_for
from pdctl.topology.model import Node

T = TypeVar("T")
Events = Callable[[str, str], None]
"""Progress callback: (process id or phase, message); called from worker threads."""


def quiet(_: str, __: str) -> None:
    """The default Events sink."""


PARALLEL = 1024
"""Node calls at once at most (threads that mostly wait on a socket), within the open-file limit
(``parallel_calls``): a thousand hung nodes cost one connect bound, not four."""
FILES_PER_CALL = 3
"""Open files a node call may hold (its socket, paramiko's, a pipe): the limit's share per call."""
MAX_OPEN = 128
"""Connections a NodeSet keeps open between calls."""


def parallel_calls() -> int:
    """How many node calls may run at once: ``PARALLEL``, or what the open-file limit leaves (its
    soft limit raised to 4096, within the hard limit, when lower: a process-wide change, as
    servers that open many sockets make)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 4096 if hard == resource.RLIM_INFINITY else min(4096, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
    if soft == resource.RLIM_INFINITY:
        return PARALLEL
    return max(16, min(PARALLEL, (soft - 256) // FILES_PER_CALL))


class NodeSet:
    """The nodes of one command, with one executor per node, opened on first use and shared by the
    command's calls; close it (or use it as a context manager) to close their connections."""

    def __init__(self, nodes: Iterable[Node], factory: Callable[[Node], Executor] = executor_for):
        self.nodes = {n.name: n for n in nodes}
        self._factory = factory
        self.executors: dict[str, Executor] = {}
        self.unreachable: dict[str, NodeUnreachable] = {}
        """Nodes a call found unreachable, and why: later calls answer with it at once."""
        self._lock = threading.Lock()
        self._using: dict[str, int] = {}  # calls under way, by node

    def executor(self, name: str) -> Executor:
        """The node's executor, made on first use; raises ``KeyError`` for a node not in the set."""
        with self._lock:
            if name not in self.executors:
                self.executors[name] = self._factory(self.nodes[name])
            return self.executors[name]

    def _call(self, name: str, fn: Callable[[Executor], T]) -> T:
        """``fn`` on ``name``'s executor; past ``MAX_OPEN`` open, its connection is closed after
        (unless another call on the node is under way)."""
        with self._lock:
            self._using[name] = self._using.get(name, 0) + 1
        try:
            return fn(self.executor(name))
        finally:
            with self._lock:
                self._using[name] -= 1
                idle = not self._using[name]
                if idle:
                    del self._using[name]
            if idle and len(self.executors) > MAX_OPEN:
                self._drop(name)

    def each(self, names: Iterable[str], fn: Callable[[Executor], T]) -> dict[str, T | RemoteError]:
        """Run ``fn`` on each node in parallel; a node's RemoteError is returned, not raised."""
        names = list(dict.fromkeys(names))
        if not names:
            return {}

        def one(name: str) -> T | RemoteError:
            known = self.unreachable.get(name)
            if known is not None:
                return known
            try:
                return self._call(name, fn)
            except NodeUnreachable as exc:
                self.unreachable[name] = exc
                return exc
            except RemoteError as exc:
                return exc

        pool = cf.ThreadPoolExecutor(max_workers=min(parallel_calls(), len(names)))
        try:
            return dict(zip(names, pool.map(one, names), strict=True))
        except BaseException:
            # Ctrl-C: do not wait for blocked node calls (a readiness wait can last minutes);
            # the caller stops everything at once.
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        finally:
            pool.shutdown(wait=False)

    def forget_unreachable(self) -> None:
        """Ask the nodes found unreachable again at the next call (a live view's next refresh)."""
        self.unreachable.clear()

    def _drop(self, name: str) -> None:
        with self._lock:
            ex = self.executors.pop(name, None)
        if ex is not None:
            ex.close()

    def close(self) -> None:
        """Close every open executor; the set opens new ones if used again."""
        with self._lock:
            executors, self.executors = list(self.executors.values()), {}
        for ex in executors:
            ex.close()

    def __enter__(self) -> NodeSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
