"""The sim's engine: continuous batching on a thread, like SGLang's scheduler process.

HTTP handlers ``submit`` requests; the scheduler thread admits them into KV slots (one
prefill each), then runs one batched decode step over every running request per iteration,
streaming each new token back through the request's ``emit`` callback.

``Engine`` is the face the routes see: it builds the parts below, each with one job, and
forwards its thread-safe calls to them.

- pdctl.sim.engine_request: ``Request``, ``Mode``, ``KVPayload`` and the finish reasons
  (re-exported here, where the routes import them);
- pdctl.sim.queues: where each request is (waiting, held, admitting, running), the slot
  reservations, and ``finish``/``abort``;
- pdctl.sim.scheduler: the scheduler thread's loop (commands, reap, admit, prefill, step) and
  its failure rules;
- pdctl.sim.scheduler_control: pause, continue, memory release, the weight-update writer
  lock, and the commands other threads hand to the scheduler;
- pdctl.sim.runner: the model's prefill and decode steps, tokens and finish checks;
- pdctl.sim.kv_budget: a profile engine's KV reserve and modelled time per request.

The engine itself keeps the weight version's bookkeeping (``set_weight_version``) and request
seeding (``submit``).
"""

from __future__ import annotations

import contextlib
import itertools
import random
import time
from collections.abc import Callable, Iterable

import torch

from pdctl.gpu_profiles import SimProfile
from pdctl.sglang.protocol import PauseMode
from pdctl.sim.costed import CostedPool, NoKV, StandInForward
from pdctl.sim.engine_request import KVPayload, Mode, Request, abort_reason, failure_of, first_failure
from pdctl.sim.kv_budget import KVBudget
from pdctl.sim.model import KVPool, TinyLM
from pdctl.sim.queues import RequestQueues, decode_pre_alloc
from pdctl.sim.runner import ModelRunner
from pdctl.sim.scheduler import Scheduler
from pdctl.sim.scheduler_control import SchedulerControl

__all__ = [
    "Engine",
    "KVPayload",
    "Mode",
    "Request",
    "abort_reason",
    "failure_of",
    "first_failure",
]


class Engine:
    """One model, one KV pool, one scheduler thread. With a ``profile`` (``--sim-profile``) the
    scheduler runs pdctl.sim.costed's way: a KV pool of tokens with a prefix cache, each round
    waiting what the profile's GPU would take, a forward pass that computes nothing.

    Every public method is thread-safe. Set ``on_finish``, ``on_capacity`` and ``on_fatal``
    before ``start``; each is called without blocking, possibly on the scheduler thread::

        engine = Engine(model, max_running=8)
        engine.on_fatal = report
        engine.start()
        engine.submit(Request(rid=engine.new_rid(), input_ids=ids, sampling=opts, emit=told))
        engine.stop()
    """

    def __init__(
        self,
        model: TinyLM,
        *,
        max_running: int = 64,
        random_seed: int = 0,
        prefill_ms_per_token: float = 0.0,
        decode_ms_per_step: float = 0.0,
        publish_kv: Callable[[int, KVPayload | str], None] | None = None,
        weight_version: str = "default",
        capture_hidden_states: bool = False,
        profile: SimProfile | None = None,
        prefix_cache: bool = True,
    ):
        self.model = model
        self.profile = profile
        self.costed: CostedPool | None = None
        forward: TinyLM | StandInForward = model
        if profile is not None:
            context = min(profile.context_length, model.config.context_length or profile.context_length)
            forward = StandInForward(model.config, context)
            self.costed = CostedPool(profile, context, cache=prefix_cache)
        pool: KVPool = KVPool(model.config, max_running) if profile is None else NoKV()
        self._queues = RequestQueues(max_running, publish_kv)
        self._runner = ModelRunner(
            forward,
            pool,
            self._queues,
            capture_hidden_of=model if capture_hidden_states and profile is None else None,
            prefill_ms_per_token=prefill_ms_per_token,
            decode_ms_per_step=decode_ms_per_step,
            publish_kv=publish_kv,
            weight_version=weight_version,
        )
        self._kv = KVBudget(self.costed, max_running, self._runner.context)
        self._control = SchedulerControl(self._queues, self._kv.free)
        self._scheduler = Scheduler(self._queues, self._control, self._runner, self._kv)
        self._seeds = torch.Generator().manual_seed(random_seed)
        self._ids = itertools.count()

    @property
    def context(self) -> int:
        """Positions a request may hold (prompt plus output)."""
        return self._runner.context

    @property
    def capacity(self) -> int:
        """Running requests plus decode reservations allowed at once (``--max-running-requests``)."""
        return self._queues.capacity

    @property
    def weight_version(self) -> str:
        """The version of the weights the model runs (``set_weight_version`` changes it)."""
        return self._runner.weight_version

    @property
    def on_finish(self) -> Callable[[Request], None] | None:
        """Called (scheduler or caller thread, must not block) when a request finishes, before its ``emit``."""
        return self._queues.on_finish

    @on_finish.setter
    def on_finish(self, told: Callable[[Request], None] | None) -> None:
        self._queues.on_finish = told

    @property
    def on_capacity(self) -> Callable[[], None] | None:
        """Called (any thread, must not block) when a running slot or a reservation is freed."""
        return self._queues.on_capacity

    @on_capacity.setter
    def on_capacity(self, told: Callable[[], None] | None) -> None:
        self._queues.on_capacity = told

    @property
    def on_fatal(self) -> Callable[[str], None] | None:
        """Called once, on the scheduler thread, when the scheduler cannot go on (must not block)."""
        return self._scheduler.on_fatal

    @on_fatal.setter
    def on_fatal(self, told: Callable[[str], None] | None) -> None:
        self._scheduler.on_fatal = told

    @property
    def fatal(self) -> str | None:
        """Why the scheduler stopped for good (None while it runs); new requests then fail at once with a 500."""
        return self._scheduler.fatal

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        """Start the scheduler thread."""
        self._scheduler.start()

    def stop(self) -> None:
        """Ask the scheduler thread to stop and wait up to 10 seconds for it to exit."""
        self._scheduler.stop()

    # -- requests ------------------------------------------------------------------------
    def new_rid(self) -> str:
        """A request id unique within this engine (hex, growing with time)."""
        return f"{time.time_ns():x}{next(self._ids):04x}"

    def submit(self, req: Request) -> None:
        """Queue a request (thread-safe); after a fatal failure it is finished at once with a 500."""
        q = self._queues
        if req.rng is None and not req.sampling.greedy and req.sampling.sampling_seed is None:
            with q.cond:
                req.rng = random.Random(int(torch.randint(0, 2**62, (1,), generator=self._seeds)))
        with q.cond:
            fatal = self._scheduler.fatal
            if fatal is not None:
                q.finish(req, abort_reason(f"the engine failed: {fatal}", 500))
                return
            (q.held if self._control.updating else q.waiting).append(req)
            req.queued = True
            q.cond.notify_all()

    def hold_transfers_apart(self, on: bool) -> None:
        """As a decode (``on``), hold slots for requests whose KV is on its way beyond the running
        ones (``decode_pre_alloc``, SGLang's decode pool); otherwise share them (thread-safe)."""
        with self._queues.cond:
            self._queues.pre_alloc = decode_pre_alloc(self._queues.capacity) if on else 0

    def reserve_slot(self) -> bool:
        """Reserve capacity for a decode request while its KV is fetched; False when full."""
        return self._queues.reserve_slot()

    def release_slot(self) -> None:
        """Give back a capacity reservation made by ``reserve_slot`` (thread-safe); ``on_capacity`` is told."""
        self._queues.release_slot()

    def abort(self, rid: str | None, message: str = "Abort requested") -> int:
        """Abort one request (or all with rid None); returns how many were aborted."""
        return self._queues.abort(rid, message)

    def abort_requests(self, requests: Iterable[Request], message: str = "Abort requested") -> int:
        """Abort these requests (those not finished yet): one pass over the queues whatever their
        number (a 100k-prompt batch whose client left costs O(100k)); how many were aborted."""
        return self._queues.abort_requests(requests, message)

    def set_weight_version(self, version: str) -> None:
        """Take a new weight version; live requests with output note where it changed (SGLang's
        ``record_weight_version_change``), for the spans their final answer reports."""
        with self._queues.cond:
            old = self._runner.weight_version
            if version == old:
                return
            for req in self._queues.live():
                if not req.finished and req.output_ids:
                    req.version_events.append((old, len(req.output_ids)))
            self._runner.weight_version = version

    def busy(self) -> bool:
        """Whether any request is queued, being prefilled, running or held (SGLang's
        flush_cache refuses then)."""
        return self._queues.busy()

    def stats(self) -> dict[str, int]:
        """Counts for the metrics: requests, and KV tokens used of the total (a profile
        engine's pool; otherwise slots of the context length)."""
        q = self._queues
        with q.cond:
            running = sum(1 for r in (*q.running, *q.admitting) if not r.finished)
            free_slots = max(0, q.capacity - len(q.running) - q.reserved)
            used, total = self._kv.tokens(free_slots)
            return {
                "num_running_reqs": running,
                "num_queue_reqs": len(q.waiting) + len(q.held) - q.stale,
                "num_reserved_decode_slots": q.reserved,
                "free_slots": free_slots,
                "kv_used_tokens": used,
                "kv_total_tokens": total,
            }

    # -- pause / continue / exclusive (pdctl.sim.scheduler_control) ------------------------
    def pause(self, how: PauseMode | str) -> None:
        """Pause as SGLang's /pause_generation does (``SchedulerControl.pause``); returns once the
        scheduler has acted. Raises SimError for an unknown mode or a scheduler that does not answer."""
        self._control.pause(how)

    def resume(self) -> None:
        """Undo a pause, as SGLang's /continue_generation does; returns once the scheduler has acted. Raises SimError
        when the scheduler does not answer within 60 seconds."""
        self._control.resume()

    def watch_progress(self, told: Callable[[], None]) -> Callable[[], None]:
        """Call ``told`` (on the scheduler's thread) after each round that admitted or stepped
        requests, until the returned function is called."""
        return self._control.watch_progress(told)

    def release_memory(self, tags: list[str] | None) -> None:
        """``/release_memory_occupation`` (``SchedulerControl.release_memory``): SimError unless idle."""
        self._control.release_memory(tags)

    def resume_memory(self, tags: list[str] | None) -> None:
        """``/resume_memory_occupation``: give back ``tags`` (None: every memory tag); scheduling restarts once no tag
        is released. Returns once the scheduler has acted."""
        self._control.resume_memory(tags)

    def exclusive(self, timeout_secs: float = 600.0) -> contextlib.AbstractContextManager[None]:
        """The weight-update writer lock (``SchedulerControl.exclusive``): running requests finish
        first, new ones wait, the scheduler runs nothing while the caller holds it."""
        return self._control.exclusive(timeout_secs)

    def stalled(self) -> contextlib.AbstractContextManager[None]:
        """The scheduler inside a control request (SGLang's remote-instance send runs in its
        scheduler): it runs no step while the caller holds this; running requests stall, none
        is aborted or drained."""
        return self._control.stalled()
