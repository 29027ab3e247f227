"""What other threads ask of the sim's scheduler: pause and continue, release and resume memory,
the weight update's writer lock, and a wait for its next round.

Pause modes follow SGLang: ``abort`` ends running and queued requests, ``retract`` sends
running ones back to the queue (they re-prefill prompt + output on continue), ``in_place``
keeps their KV and just stops stepping. ``exclusive()`` is the weight-update writer lock.

A pause, a continue and the memory calls are commands: the caller queues one and waits for the
scheduler thread to run it at the top of its next iteration (``run_pending``), so a command
never races a batch. The scheduler loop itself is pdctl.sim.scheduler's.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

from pdctl.choices import parse_choice
from pdctl.errors import SimError
from pdctl.sglang.control import MEMORY_TAGS
from pdctl.sglang.protocol import PauseMode
from pdctl.sim.engine_request import Request, abort_reason
from pdctl.sim.queues import RequestQueues

__all__ = ["SchedulerControl"]


class SchedulerControl:
    """The scheduler's switches (paused, updating, released memory tags) and the commands and
    locks that set them. The flags are read and written under the queues' ``cond``; ``step_lock``
    is held by the scheduler while it runs the model (and by ``exclusive``/``stalled`` callers).

    Call order, from a handler thread::

        control.pause("retract")   # returns once the scheduler has acted
        with control.exclusive():  # no request runs; new ones are held
            load_weights()
        control.resume()
    """

    def __init__(self, queues: RequestQueues, free_kv: Callable[[Request], None]):
        self._queues = queues
        self._free_kv = free_kv
        self._commands: deque[tuple[Callable[[], None], threading.Event]] = deque()
        self.paused = False
        self.updating = False
        self.released: set[str] = set()
        """Memory tags released (``/release_memory_occupation``): nothing is scheduled until they are resumed."""
        self._watchers: list[Callable[[], None]] = []
        """Told after each round of the scheduler (SGLang's health check passes on any output)."""
        self.step_lock = threading.Lock()  # held by the scheduler while it runs the model

    @property
    def blocked(self) -> bool:
        """Whether the scheduler must neither admit nor step: paused, updating weights, or memory released."""
        return self.paused or self.updating or bool(self.released)

    # -- the scheduler thread's side ------------------------------------------------------
    def pending(self) -> bool:
        """Whether a command waits for the scheduler. Caller holds the queues' ``cond``."""
        return bool(self._commands)

    def run_pending(self) -> None:
        """Run every queued command in order and tell each caller. Scheduler thread, holding ``cond``."""
        while self._commands:
            act, done = self._commands.popleft()
            act()
            done.set()

    def fail_pending(self) -> None:
        """Release every caller waiting for a command without running it: the scheduler is gone.
        Caller holds ``cond``."""
        while self._commands:
            _act, done = self._commands.popleft()
            done.set()

    def progressed(self) -> None:
        """Tell every watcher that a round ended. Scheduler thread, without ``cond``."""
        if not self._watchers:  # (the common case: no health check waiting, no lock taken)
            return
        with self._queues.cond:
            watchers = list(self._watchers)
        for told in watchers:
            told()

    # -- other threads' side --------------------------------------------------------------
    def pause(self, how: PauseMode | str) -> None:
        """Pause as SGLang's /pause_generation does; returns once the scheduler has acted. Raises
        SimError for an unknown mode, or when the scheduler does not answer within 60 seconds."""
        try:
            mode = parse_choice(PauseMode, how, "pause mode")
        except ValueError as exc:
            raise SimError(str(exc)) from None
        q = self._queues

        def act() -> None:
            self.paused = True
            if mode is PauseMode.ABORT:
                for req in (*q.running, *q.waiting):
                    q.finish(req, abort_reason("Aborted"))  # SGLang: FINISH_ABORT()'s default message
                q.purge()
            elif mode is PauseMode.RETRACT:
                for req in reversed(q.running):
                    self._free_kv(req)
                    if not req.finished:
                        req.retractions += 1
                        req.slot = None
                        req.queued = True
                        q.waiting.appendleft(req)
                q.running.clear()
                q.capacity_freed()

        self._command(act)

    def resume(self) -> None:
        """Undo a pause, as SGLang's /continue_generation does; returns once the scheduler has acted. Raises SimError
        when the scheduler does not answer within 60 seconds."""

        def act() -> None:
            self.paused = False

        self._command(act)

    def watch_progress(self, told: Callable[[], None]) -> Callable[[], None]:
        """Call ``told`` (on the scheduler's thread) after each round that admitted or stepped
        requests, until the returned function is called."""
        with self._queues.cond:
            self._watchers.append(told)

        def unwatch() -> None:
            with self._queues.cond, contextlib.suppress(ValueError):
                self._watchers.remove(told)

        return unwatch

    def release_memory(self, tags: list[str] | None) -> None:
        """``/release_memory_occupation``: only when idle (queued requests count only when not
        paused), as SGLang asserts; until ``resume_memory`` has given back every tag, nothing is
        scheduled (the sim keeps its weights and KV: SGLang's memory saver would drop them).
        Raises SimError when not idle."""
        failure: list[str] = []
        q = self._queues

        def act() -> None:
            running = any(not r.finished for r in q.running)
            queued = not self.paused and any(not r.finished for r in (*q.waiting, *q.held))
            if running or queued:
                failure.append("release_memory_occupation should be called only when server is idle.")
                return
            self.released.update(tags or MEMORY_TAGS)

        self._command(act)
        if failure:
            raise SimError(failure[0])

    def resume_memory(self, tags: list[str] | None) -> None:
        """``/resume_memory_occupation``: give back ``tags`` (None: every memory tag); scheduling restarts once no tag
        is released. Returns once the scheduler has acted."""

        def act() -> None:
            self.released.difference_update(tags or MEMORY_TAGS)

        self._command(act)

    def _command(self, act: Callable[[], None]) -> None:
        done = threading.Event()
        with self._queues.cond:
            self._commands.append((act, done))
            self._queues.cond.notify_all()
        if not done.wait(timeout=60):
            raise SimError("the scheduler did not answer within 60 s")

    @contextlib.contextmanager
    def exclusive(self, timeout_secs: float = 600.0) -> Iterator[None]:
        """The weight-update writer lock: unless paused, stop admitting and wait until running
        requests finish; requests that arrive meanwhile wait until the update is done. The
        scheduler runs nothing while the caller holds it. Raises SimError when another update
        holds it, or when running requests outlast ``timeout_secs``."""
        q = self._queues
        with q.cond:
            if self.updating:
                raise SimError("another weight update is in progress")
            self.updating = True
            q.held.extend(q.waiting)
            q.waiting.clear()
            deadline = time.monotonic() + timeout_secs
            while any(not r.finished for r in q.running) and not self.paused:
                if not q.cond.wait(timeout=max(0.0, deadline - time.monotonic())):
                    self._release_update()
                    raise SimError("timed out waiting for in-flight requests before the weight update")
            q.cond.notify_all()
        try:
            with self.step_lock:
                yield
        finally:
            with q.cond:
                self._release_update()

    @contextlib.contextmanager
    def stalled(self) -> Iterator[None]:
        """The scheduler inside a control request (SGLang's remote-instance send runs in its
        scheduler): it runs no step while the caller holds this; running requests stall, none
        is aborted or drained."""
        with self.step_lock:
            yield

    def _release_update(self) -> None:
        q = self._queues
        self.updating = False
        q.waiting.extend(q.held)
        q.held.clear()
        q.cond.notify_all()
