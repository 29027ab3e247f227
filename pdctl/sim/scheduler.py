"""The sim's scheduler thread: continuous batching, like SGLang's scheduler process's event loop.

Each round it runs the commands other threads queued (pdctl.sim.scheduler_control), reaps
finished requests from the running set (keeping slots dense), admits requests off the head of
the waiting queue (pdctl.sim.queues) into the free slots, prefills each, then runs one batched
decode step over every running request (pdctl.sim.runner). A profile engine's round also waits
what the profile's GPU would take (pdctl.sim.kv_budget, pdctl.sim.costed).

Failures: an exception while starting one request ends that request with a 500 and the
scheduler goes on (``ModelRunner.start``); one the scheduler cannot recover from (a batched step
failed: every running request's state is suspect) ends every request with a 500, refuses new
ones (``fatal``) and calls ``on_fatal``, so that the process exits and its supervisor restarts
it, as SGLang's scheduler ends its server, rather than leaving a live process that never
answers again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch

from pdctl.sim.costed import wait_until
from pdctl.sim.engine_request import Request, abort_reason
from pdctl.sim.kv_budget import KVBudget
from pdctl.sim.queues import RequestQueues
from pdctl.sim.runner import ModelRunner
from pdctl.sim.scheduler_control import SchedulerControl

__all__ = ["Scheduler"]

log = logging.getLogger("pdctl.sim")


def _forward(gpu_free: float | None, modelled_ms: float) -> float:
    """Wait out one modelled forward on a GPU that was busy until ``gpu_free`` (None: idle, it
    starts now), and return when it ends. The scheduler's own CPU work between two forwards
    overlaps the next one, as SGLang's overlap scheduler's does and as the published step times
    include: a step costs the larger of the model and the work, not their sum. A GPU that fell
    behind (the work took longer) starts its next forward when the work ends, owing nothing."""
    now = time.monotonic()
    end = max(gpu_free if gpu_free is not None else now, now - modelled_ms / 1000) + modelled_ms / 1000
    wait_until(end)
    return max(end, time.monotonic())


class Scheduler:
    """The scheduler thread over the engine's parts. Only this thread runs the model, touches the
    KV pool and changes the running set; ``start`` and ``stop`` may be called from any thread,
    once each. ``fatal`` is set (under the queues' ``cond``) when the thread died; ``on_fatal``
    is then called once, on this thread, and must not block."""

    def __init__(
        self,
        queues: RequestQueues,
        control: SchedulerControl,
        runner: ModelRunner,
        kv: KVBudget,
    ):
        self._queues = queues
        self._control = control
        self._runner = runner
        self._kv = kv
        self.on_fatal: Callable[[str], None] | None = None
        """Called once, on the scheduler thread, when the scheduler cannot go on (must not block)."""
        self.fatal: str | None = None
        """Why the scheduler stopped for good; new requests then fail at once with a 500."""
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="sim-scheduler", daemon=True)

    def start(self) -> None:
        """Start the scheduler thread."""
        self._thread.start()

    def stop(self) -> None:
        """Ask the scheduler thread to stop and wait up to 10 seconds for it to exit."""
        with self._queues.cond:
            self._stopping = True
            self._queues.cond.notify_all()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        try:
            self._run()
        except Exception as exc:  # a bug or a broken model: no request can be trusted to go on
            self._die(exc)

    def _die(self, exc: Exception) -> None:
        reason = f"scheduler failed: {type(exc).__name__}: {exc}"
        log.exception("%s; ending every request and this engine", reason)
        q = self._queues
        with q.cond:
            self.fatal = reason
            for req in q.live():
                q.finish(req, abort_reason(f"the engine failed: {reason}", 500))
            q.purge()
            self._control.fail_pending()  # a caller waiting for the scheduler learns it is gone
        if self.on_fatal is not None:
            self.on_fatal(reason)

    def _run(self) -> None:
        q, control = self._queues, self._control
        gpu_free: float | None = None  # when the modelled GPU ends its last forward (None: it idles)
        while True:
            with q.cond:
                while not self._stopping and not self._has_work():
                    gpu_free = None
                    q.cond.wait()
                if self._stopping:
                    return
                control.run_pending()
                self._reap()
                q.admitting = []  # the last round's are in running now
                admit = self._admit()
                q.admitting = list(admit)
                step = bool(q.running) and not control.blocked
            with control.step_lock:
                if self._kv.costed is not None and admit:
                    gpu_free = _forward(gpu_free, self._kv.prefill_ms(admit))
                for req in admit:
                    self._runner.start(req)
                if step:
                    if self._kv.costed is not None:
                        gpu_free = _forward(gpu_free, self._kv.decode_ms(q.running))
                    self._runner.step(q.running)  # only this thread changes it (under cond); slots are 0..n-1
            control.progressed()

    def _admit(self) -> list[Request]:
        """Take this round's requests off the head of the waiting queue, each given the next slot,
        while slots (and a profile engine's KV pool and prefill chunk) allow. Holds cond."""
        q = self._queues
        admit: list[Request] = []
        new_tokens = 0
        while q.waiting and not self._control.blocked:
            req = q.waiting[0]
            if req.finished:
                q.waiting.popleft()
                req.queued = False
                q.stale -= 1
                continue
            if not q.room_for(req.reserved, len(admit)):
                break
            if self._kv.costed is not None:
                profile = self._kv.costed.profile
                if admit and new_tokens >= profile.chunk_tokens:
                    break  # this round's prefill batch is full (SGLang's chunked prefill size)
                held = self._kv.hold(req)
                if held is None:
                    break  # the KV pool is full: it waits, as in SGLang's queue
                req.held, req.cached_tokens = held, held.cached
                new_tokens += held.new_tokens
            q.waiting.popleft()
            req.queued = False
            if req.reserved:
                req.reserved = False
                q.reserved -= 1
            req.slot = len(q.running) + len(admit)
            admit.append(req)
        return admit

    def _has_work(self) -> bool:
        q = self._queues
        if self._control.pending():
            return True
        if self._control.blocked:
            return any(r.finished for r in q.running)
        head = q.waiting[0] if q.waiting else None
        can_admit = head is not None and (head.finished or q.room_for(head.reserved))
        return bool(q.running) or can_admit

    def _reap(self) -> None:
        """Drop finished requests from the running set, keeping slots dense. Holds cond."""
        q = self._queues
        i = 0
        while i < len(q.running):
            req = q.running[i]
            if not req.finished:
                i += 1
                continue
            last = q.running.pop()
            if last is not req:
                assert last.slot is not None  # a running request holds a slot
                self._runner.pool.move(last.slot, i, last.kv_len)
                last.slot = i
                q.running[i] = last
            req.slot = None
            self._kv.free(req)
            q.capacity_freed()
