"""The sim's scheduler: continuous batching on a thread, like SGLang's scheduler process.

HTTP handlers ``submit`` requests; the scheduler thread admits them into KV slots (one
prefill each), then runs one batched ``decode_step`` over every running request per
iteration, streaming each new token back through the request's ``emit`` callback.

Only the scheduler thread touches the model and the KV pool. Running requests are kept in
dense slots 0..n-1 (a finished request's slot is refilled by moving the last one), so a
step reads the KV as a view instead of gathering it. Other threads talk to the scheduler
through ``_commands`` and wait for it to act (pause, continue) or mark requests finished
(abort), which the scheduler reaps at the top of its next iteration.

Pause modes follow SGLang: ``abort`` ends running and queued requests, ``retract`` sends
running ones back to the queue (they re-prefill prompt + output on continue), ``in_place``
keeps their KV and just stops stepping. ``exclusive()`` is the weight-update writer lock.

Failures: an exception while starting one request ends that request with a 500 and the
scheduler goes on; one the scheduler cannot recover from (a batched step failed: every running
request's state is suspect) ends every request with a 500, refuses new ones and calls
``on_fatal``, so that the process exits and its supervisor restarts it, as SGLang's scheduler
ends its server, rather than leaving a live process that never answers again.

Aborts mark requests finished without searching the queues for them; the queues drop finished
requests in one pass afterwards (``_purge``), so aborting N queued requests costs O(N), not O(N^2).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from pdctl.choices import Choice, parse_choice
from pdctl.errors import SimError
from pdctl.gpu_profiles import SimProfile
from pdctl.sglang.control import MEMORY_TAGS
from pdctl.sglang.protocol import PauseMode
from pdctl.sim.costed import CostedPool, Held, NoKV, StandInForward, wait_until
from pdctl.sim.model import EOS_ID, KVPool, TinyLM, decode
from pdctl.sim.sampling import SamplingOptions, sample

log = logging.getLogger("pdctl.sim")


TOP_LOGPROBS_SENT = 20
"""Top logprobs a prefill computes for the first token, for a decode that asks (OpenAI's maximum)."""


def _top(logps: torch.Tensor, k: int) -> list[tuple[float, int]]:
    if k <= 0:
        return []
    values, ids = torch.topk(logps, min(k, logps.numel()))
    return list(zip(values.tolist(), ids.tolist(), strict=True))


def abort_reason(message: str, status: int | None = None) -> dict[str, Any]:
    """SGLang 0.5.23's ``FINISH_ABORT(...).to_json()``. ``status`` is None for an abort that was
    asked for (/abort_request, a pause in abort mode): the request just ends. With an HTTP status
    it is a failure: a non-streamed answer becomes that error, a stream ends with it."""
    return {"type": "abort", "message": message, "status_code": status, "err_type": None}


def failure_of(finish: dict[str, Any] | None) -> tuple[str, int] | None:
    """(message, HTTP status) when ``finish`` is an abort that is a failure (SGLang's
    ``_handle_abort_finish_reason``: an abort whose status_code is in 400..599), else None."""
    if not finish or finish.get("type") != "abort":
        return None
    status = finish.get("status_code")
    return (str(finish.get("message")), status) if isinstance(status, int) and 400 <= status < 600 else None


def first_failure(requests: Iterable[Request]) -> tuple[str, int] | None:
    """The first failure (see ``failure_of``) among ``requests``: a non-streamed answer is that
    error (SGLang raises it), whatever the others hold."""
    return next(filter(None, (failure_of(r.finish) for r in requests)), None)


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


class Mode(Choice):
    """What a request does in the engine: a whole request (``normal``), or one leg of a PD pair (``prefill`` publishes
    its KV under the bootstrap room; ``decode`` starts from KV fetched from a prefill)."""

    NORMAL = "normal"
    PREFILL = "prefill"  # PD prefill: run the prompt, publish KV under the room, return 1 token
    DECODE = "decode"  # PD decode: start from KV fetched from a prefill


@dataclass
class KVPayload:
    """What a prefill hands to a decode for one bootstrap room."""

    prompt_ids: list[int]
    kv: torch.Tensor  # [layers, 2, heads, T, head_dim]
    first_token: int
    first_logprob: float
    weight_version: str
    first_top: list[tuple[float, int]] = field(default_factory=list)
    """The first token's top logprobs (for a decode asked for ``top_logprobs_num``)."""


@dataclass(eq=False)
class Request:
    """One sequence in the engine: its prompt, sampling options and PD leg, and the output, logprobs and finish reason
    the scheduler fills in. ``emit`` is told of each new token and of the end; once ``finish`` is set the request is
    never stepped again."""

    rid: str
    input_ids: list[int]
    sampling: SamplingOptions
    emit: Callable[[Request], None]
    """Called after each new token and at the end (scheduler or caller thread); must not block."""
    mode: Mode = Mode.NORMAL
    return_logprob: bool = False
    top_logprobs_num: int = 0
    room: int | None = None
    kv: KVPayload | None = None
    reserved: bool = False
    """True while a decode request holds a capacity reservation made before its KV arrived."""
    queued: bool = False
    """In the waiting (or held) queue: a finished one there is dropped by the next purge."""
    slot: int | None = None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    retractions: int = 0
    version_events: list[tuple[str, int]] = field(default_factory=list)
    """(old weight version, output tokens then) for each version change while it ran with output
    (SGLang's ``weight_version_events``): where its output's weight-version spans change."""
    created: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    generator: torch.Generator | None = None
    held: Held | None = None
    """A profile engine's KV reserve for it while it runs (pdctl.sim.costed)."""
    cached_tokens: int = 0
    """Prompt tokens found in the prefix cache (SGLang's ``meta_info.cached_tokens``)."""
    return_hidden_states: bool = False
    hidden_states: list[Any] = field(default_factory=list)
    """SGLang's ``meta_info.hidden_states``: the prompt's final hidden states (one row per prompt
    token, from the prefill), then one row per decode step (the step that made the next token)."""

    @property
    def finished(self) -> bool:
        """True once the request has a finish reason (it stopped, was aborted or failed)."""
        return self.finish is not None

    @property
    def kv_len(self) -> int:
        """Positions of KV held: the prompt plus every output token but the pending last one."""
        return len(self.input_ids) + max(len(self.output_ids) - 1, 0)

    def text(self) -> str:
        """Output text; a matched stop string is trimmed unless no_stop_trim."""
        out = decode(self.output_ids)
        matched = self.finish.get("matched") if self.finish else None
        if isinstance(matched, str) and not self.sampling.no_stop_trim and matched in out:
            out = out[: out.find(matched)]
        return out


class Engine:
    """One model, one KV pool, one scheduler thread. With a ``profile`` (``--sim-profile``) the
    scheduler runs pdctl.sim.costed's way: a KV pool of tokens with a prefix cache, each round
    waiting what the profile's GPU would take, a forward pass that computes nothing."""

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
        self._forward: TinyLM | StandInForward = model
        if profile is not None:
            context = min(profile.context_length, model.config.context_length or profile.context_length)
            self._forward = StandInForward(model.config, context)
            self.costed = CostedPool(profile, context, cache=prefix_cache)
        self._hidden: torch.Tensor | None = None
        """The latest forward's final hidden states (``model.norm``'s output), when captured."""
        if capture_hidden_states and profile is None:  # (--enable-return-hidden-states: a forward hook)
            model.model["norm"].register_forward_hook(self._keep_hidden)
        self.pool: KVPool = KVPool(model.config, max_running) if profile is None else NoKV()
        self.capacity = max_running
        self.prefill_ms_per_token = prefill_ms_per_token
        self.decode_ms_per_step = decode_ms_per_step
        self.publish_kv = publish_kv
        self.weight_version = weight_version
        self.on_finish: Callable[[Request], None] | None = None
        self.on_capacity: Callable[[], None] | None = None
        """Called (any thread, must not block) when a running slot or a reservation is freed."""
        self.on_fatal: Callable[[str], None] | None = None
        """Called once, on the scheduler thread, when the scheduler cannot go on (must not block)."""
        self.fatal: str | None = None
        """Why the scheduler stopped for good; new requests then fail at once with a 500."""
        self._seeds = torch.Generator().manual_seed(random_seed)
        self._cond = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._held: deque[Request] = deque()  # arrived during a weight update
        self._stale = 0  # finished requests still in _waiting or _held
        self._running: list[Request] = []  # running[i].slot == i
        self._reserved = 0
        self._admitting: list[Request] = []  # popped from the queue, being prefilled
        self._commands: deque[tuple[Callable[[], None], threading.Event]] = deque()
        self._paused = False
        self._updating = False
        self._released: set[str] = set()
        self._watchers: list[Callable[[], None]] = []
        """Told after each round of the scheduler (SGLang's health check passes on any output)."""
        """Memory tags released (``/release_memory_occupation``): nothing is scheduled until they are resumed."""
        self._stopping = False
        self._ids = itertools.count()
        self._step_lock = threading.Lock()  # held by the scheduler while it runs the model
        self._thread = threading.Thread(target=self._loop, name="sim-scheduler", daemon=True)

    @property
    def context(self) -> int:
        """Positions a request may hold (prompt plus output)."""
        return self._forward.config.context

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        """Start the scheduler thread."""
        self._thread.start()

    def stop(self) -> None:
        """Ask the scheduler thread to stop and wait up to 10 seconds for it to exit."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    # -- requests ------------------------------------------------------------------------
    def new_rid(self) -> str:
        """A request id unique within this engine (hex, growing with time)."""
        return f"{time.time_ns():x}{next(self._ids):04x}"

    def submit(self, req: Request) -> None:
        """Queue a request (thread-safe)."""
        if req.generator is None and not req.sampling.greedy:
            seed = req.sampling.sampling_seed
            if seed is None:
                with self._cond:
                    seed = int(torch.randint(0, 2**62, (1,), generator=self._seeds))
            req.generator = torch.Generator().manual_seed(seed)
        with self._cond:
            if self.fatal is not None:
                self._finish(req, abort_reason(f"the engine failed: {self.fatal}", 500))
                return
            (self._held if self._updating else self._waiting).append(req)
            req.queued = True
            self._cond.notify_all()

    def reserve_slot(self) -> bool:
        """Reserve capacity for a decode request while its KV is fetched; False when full."""
        with self._cond:
            if self._used() >= self.capacity:
                return False
            self._reserved += 1
            return True

    def release_slot(self) -> None:
        """Give back a capacity reservation made by ``reserve_slot`` (thread-safe); ``on_capacity`` is told."""
        with self._cond:
            self._reserved -= 1
            self._cond.notify_all()
        self._capacity_freed()

    def _capacity_freed(self) -> None:
        if self.on_capacity is not None:
            self.on_capacity()

    def _used(self) -> int:
        # Admitted requests count from the moment they leave the queue: a reservation made while
        # they are being started (outside the lock) would otherwise take their slot too.
        return len(self._running) + len(self._admitting) + self._reserved

    def abort(self, rid: str | None, message: str = "Abort requested") -> int:
        """Abort one request (or all with rid None); returns how many were aborted."""
        with self._cond:
            victims = [
                r
                for r in (*self._running, *self._admitting, *self._waiting, *self._held)
                if not r.finished and (rid is None or r.rid == rid)
            ]
        return self.abort_requests(victims, message)

    def abort_requests(self, requests: Iterable[Request], message: str = "Abort requested") -> int:
        """Abort these requests (those not finished yet): one pass over the queues whatever their
        number (a 100k-prompt batch whose client left costs O(100k)); how many were aborted."""
        with self._cond:
            aborted = 0
            for req in requests:
                if not req.finished:
                    self._finish(req, abort_reason(message))
                    aborted += 1
            if self._stale * 2 > len(self._waiting) + len(self._held):
                self._purge()  # amortized: each purge drops at least half of what it scans
            return aborted

    def _purge(self) -> None:
        """Drop finished requests from the queues (one pass). Holds _cond."""
        self._waiting = deque(r for r in self._waiting if not r.finished)
        self._held = deque(r for r in self._held if not r.finished)
        self._stale = 0

    def set_weight_version(self, version: str) -> None:
        """Take a new weight version; live requests with output note where it changed (SGLang's
        ``record_weight_version_change``), for the spans their final answer reports."""
        with self._cond:
            old = self.weight_version
            if version == old:
                return
            for req in (*self._running, *self._admitting, *self._waiting, *self._held):
                if not req.finished and req.output_ids:
                    req.version_events.append((old, len(req.output_ids)))
            self.weight_version = version

    # -- pause / continue / exclusive ---------------------------------------------------
    def pause(self, how: PauseMode | str) -> None:
        """Pause as SGLang's /pause_generation does; returns once the scheduler has acted."""
        try:
            mode = parse_choice(PauseMode, how, "pause mode")
        except ValueError as exc:
            raise SimError(str(exc)) from None

        def act() -> None:
            self._paused = True
            if mode is PauseMode.ABORT:
                for req in (*self._running, *self._waiting):
                    self._finish(req, abort_reason("Aborted"))  # SGLang: FINISH_ABORT()'s default message
                self._purge()
            elif mode is PauseMode.RETRACT:
                for req in reversed(self._running):
                    self._free_kv(req)
                    if not req.finished:
                        req.retractions += 1
                        req.slot = None
                        req.queued = True
                        self._waiting.appendleft(req)
                self._running.clear()
                self._capacity_freed()

        self._command(act)

    def resume(self) -> None:
        """Undo a pause, as SGLang's /continue_generation does; returns once the scheduler has acted. Raises SimError
        when the scheduler does not answer within 60 seconds."""

        def act() -> None:
            self._paused = False

        self._command(act)

    def watch_progress(self, told: Callable[[], None]) -> Callable[[], None]:
        """Call ``told`` (on the scheduler's thread) after each round that admitted or stepped
        requests, until the returned function is called."""
        with self._cond:
            self._watchers.append(told)

        def unwatch() -> None:
            with self._cond, contextlib.suppress(ValueError):
                self._watchers.remove(told)

        return unwatch

    def _progressed(self) -> None:
        if not self._watchers:  # (the common case: no health check waiting, no lock taken)
            return
        with self._cond:
            watchers = list(self._watchers)
        for told in watchers:
            told()

    def release_memory(self, tags: list[str] | None) -> None:
        """``/release_memory_occupation``: only when idle (queued requests count only when not
        paused), as SGLang asserts; until ``resume_memory`` has given back every tag, nothing is
        scheduled (the sim keeps its weights and KV: SGLang's memory saver would drop them)."""
        failure: list[str] = []

        def act() -> None:
            running = any(not r.finished for r in self._running)
            queued = not self._paused and any(not r.finished for r in (*self._waiting, *self._held))
            if running or queued:
                failure.append("release_memory_occupation should be called only when server is idle.")
                return
            self._released.update(tags or MEMORY_TAGS)

        self._command(act)
        if failure:
            raise SimError(failure[0])

    def resume_memory(self, tags: list[str] | None) -> None:
        """``/resume_memory_occupation``: give back ``tags`` (None: every memory tag); scheduling restarts once no tag
        is released. Returns once the scheduler has acted."""

        def act() -> None:
            self._released.difference_update(tags or MEMORY_TAGS)

        self._command(act)

    def _command(self, act: Callable[[], None]) -> None:
        done = threading.Event()
        with self._cond:
            self._commands.append((act, done))
            self._cond.notify_all()
        if not done.wait(timeout=60):
            raise SimError("the scheduler did not answer within 60 s")

    @contextlib.contextmanager
    def exclusive(self, timeout_secs: float = 600.0) -> Iterator[None]:
        """The weight-update writer lock: unless paused, stop admitting and wait until running
        requests finish; requests that arrive meanwhile wait until the update is done. The
        scheduler runs nothing while the caller holds it."""
        with self._cond:
            if self._updating:
                raise SimError("another weight update is in progress")
            self._updating = True
            self._held.extend(self._waiting)
            self._waiting.clear()
            deadline = time.monotonic() + timeout_secs
            while any(not r.finished for r in self._running) and not self._paused:
                if not self._cond.wait(timeout=max(0.0, deadline - time.monotonic())):
                    self._release_update()
                    raise SimError("timed out waiting for in-flight requests before the weight update")
            self._cond.notify_all()
        try:
            with self._step_lock:
                yield
        finally:
            with self._cond:
                self._release_update()

    @contextlib.contextmanager
    def stalled(self) -> Iterator[None]:
        """The scheduler inside a control request (SGLang's remote-instance send runs in its
        scheduler): it runs no step while the caller holds this; running requests stall, none
        is aborted or drained."""
        with self._step_lock:
            yield

    def _release_update(self) -> None:
        self._updating = False
        self._waiting.extend(self._held)
        self._held.clear()
        self._cond.notify_all()

    def busy(self) -> bool:
        """Whether any request is queued, being prefilled, running or held (SGLang's
        flush_cache refuses then)."""
        with self._cond:
            return any(not r.finished for r in (*self._running, *self._admitting, *self._waiting, *self._held))

    def stats(self) -> dict[str, int]:
        """Counts for the metrics: requests, and KV tokens used of the total (a profile
        engine's pool; otherwise slots of the context length)."""
        with self._cond:
            running = sum(1 for r in (*self._running, *self._admitting) if not r.finished)
            free_slots = self.capacity - len(self._running) - self._reserved
            if self.costed is not None:
                used, total = self.costed.used, self.costed.total
            else:
                total = self.capacity * self.context
                used = total - free_slots * self.context
            return {
                "num_running_reqs": running,
                "num_queue_reqs": len(self._waiting) + len(self._held) - self._stale,
                "num_reserved_decode_slots": self._reserved,
                "free_slots": free_slots,
                "kv_used_tokens": used,
                "kv_total_tokens": total,
            }

    # -- the scheduler thread -----------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        try:
            self._run()
        except Exception as exc:  # a bug or a broken model: no request can be trusted to go on
            self._die(exc)

    def _die(self, exc: Exception) -> None:
        reason = f"scheduler failed: {type(exc).__name__}: {exc}"
        log.exception("%s; ending every request and this engine", reason)
        with self._cond:
            self.fatal = reason
            for req in (*self._running, *self._admitting, *self._waiting, *self._held):
                self._finish(req, abort_reason(f"the engine failed: {reason}", 500))
            self._purge()
            while self._commands:  # a caller waiting for the scheduler learns it is gone
                _act, done = self._commands.popleft()
                done.set()
        if self.on_fatal is not None:
            self.on_fatal(reason)

    def _run(self) -> None:
        gpu_free: float | None = None  # when the modelled GPU ends its last forward (None: it idles)
        while True:
            with self._cond:
                while not self._stopping and not self._has_work():
                    gpu_free = None
                    self._cond.wait()
                if self._stopping:
                    return
                while self._commands:
                    act, done = self._commands.popleft()
                    act()
                    done.set()
                self._reap()
                self._admitting = []  # the last round's are in _running now
                admit: list[Request] = []
                new_tokens = 0
                while self._waiting and not self._paused and not self._updating and not self._released:
                    req = self._waiting[0]
                    if req.finished:
                        self._waiting.popleft()
                        req.queued = False
                        self._stale -= 1
                        continue
                    if not req.reserved and self._used() + len(admit) >= self.capacity:
                        break
                    if self.costed is not None:
                        profile = self.costed.profile
                        if admit and new_tokens >= profile.chunk_tokens:
                            break  # this round's prefill batch is full (SGLang's chunked prefill size)
                        held = self._hold_kv(req)
                        if held is None:
                            break  # the KV pool is full: it waits, as in SGLang's queue
                        req.held, req.cached_tokens = held, held.cached
                        new_tokens += held.new_tokens
                    self._waiting.popleft()
                    req.queued = False
                    if req.reserved:
                        req.reserved = False
                        self._reserved -= 1
                    req.slot = len(self._running) + len(admit)
                    admit.append(req)
                self._admitting = list(admit)
                step = bool(self._running) and not self._paused and not self._updating and not self._released
            with self._step_lock:
                if self.costed is not None and admit:
                    gpu_free = _forward(gpu_free, self._prefill_ms(admit))
                for req in admit:
                    self._start(req)
                if step:
                    if self.costed is not None:
                        gpu_free = _forward(gpu_free, self._decode_ms())
                    self._step()
            self._progressed()

    def _has_work(self) -> bool:
        if self._commands:
            return True
        if self._paused or self._updating or self._released:
            return any(r.finished for r in self._running)
        head = self._waiting[0] if self._waiting else None
        can_admit = head is not None and (head.reserved or self._used() < self.capacity or head.finished)
        return bool(self._running) or can_admit

    def _reap(self) -> None:
        """Drop finished requests from the running set, keeping slots dense. Holds _cond."""
        i = 0
        while i < len(self._running):
            req = self._running[i]
            if not req.finished:
                i += 1
                continue
            last = self._running.pop()
            if last is not req:
                assert last.slot is not None  # a running request holds a slot
                self.pool.move(last.slot, i, last.kv_len)
                last.slot = i
                self._running[i] = last
            req.slot = None
            self._free_kv(req)
            self._capacity_freed()

    # -- a profile engine's KV and time (pdctl.sim.costed) ----------------------------------------------
    def _hold_kv(self, req: Request) -> Held | None:
        """Room in the pool for ``req``, its cached prefix locked; None when it must wait."""
        assert self.costed is not None
        decode_kv = req.mode is Mode.DECODE and req.kv is not None and req.retractions == 0
        ids = req.input_ids + req.output_ids[:-1] if req.output_ids else req.input_ids
        left = 1 if req.mode is Mode.PREFILL else req.sampling.max_new_tokens - len(req.output_ids)
        return self.costed.admit(ids, left, prefill=not decode_kv, use_cache=req.mode is not Mode.DECODE)

    def _free_kv(self, req: Request) -> None:
        """Give back ``req``'s reserve; a request that ended normally leaves its tokens cached
        (a PD prefill its prompt; a PD decode caches nothing, as SGLang's decode side)."""
        held, req.held = req.held, None
        if held is None or self.costed is None:
            return
        keep: list[int] | None = None
        if req.finished and req.mode is not Mode.DECODE and (req.finish or {}).get("type") != "abort":
            keep = req.input_ids + req.output_ids[:-1] if req.mode is Mode.NORMAL else req.input_ids
        self.costed.release(held, keep)

    def _prefill_ms(self, admit: list[Request]) -> float:
        assert self.costed is not None
        prompts = [(r.held.new_tokens, r.held.cached) for r in admit if r.held is not None and r.held.new_tokens]
        return self.costed.profile.prefill_ms(prompts)

    def _decode_ms(self) -> float:
        assert self.costed is not None
        batch = [r for r in self._running if not r.finished]
        return self.costed.profile.decode_step_ms(len(batch), sum(r.kv_len for r in batch))

    def _start(self, req: Request) -> None:
        if req.finished:  # aborted while it was being admitted (its client left): no prefill for it
            with self._cond:
                self._running.append(req)
                self._admitting.remove(req)
            return
        try:
            if req.mode is Mode.DECODE and req.kv is not None and req.retractions == 0:
                assert req.slot is not None  # given by the caller before _start
                self.pool.write(req.slot, req.kv.kv)
                if req.top_logprobs_num:
                    req.output_top_logprobs.append(req.kv.first_top[: req.top_logprobs_num])
                self._emit_token(req, req.kv.first_token, req.kv.first_logprob)
            else:
                self._prefill(req)
        except SimError as exc:
            with self._cond:
                self._finish(req, abort_reason(str(exc), exc.status))
        except Exception as exc:  # this request's fault or a bug it hit: it ends, the others go on
            log.error("request %s failed in the scheduler: %s: %s", req.rid, type(exc).__name__, exc)
            with self._cond:
                self._finish(req, abort_reason(f"internal error: {type(exc).__name__}: {exc}", 500))
        with self._cond:
            self._running.append(req)  # finished ones are reaped next iteration, keeping slots dense
            self._admitting.remove(req)

    def _keep_hidden(self, _module: torch.nn.Module, _inputs: Any, output: torch.Tensor) -> None:
        self._hidden = output

    def _prefill(self, req: Request) -> None:
        ids = req.input_ids + req.output_ids[:-1] if req.output_ids else req.input_ids
        if self.prefill_ms_per_token:
            time.sleep(len(ids) * self.prefill_ms_per_token / 1000)
        logits, kv = self._forward.prefill(ids)
        if req.return_hidden_states and not req.output_ids and self._hidden is not None:
            req.hidden_states.append(self._hidden.tolist())  # (a re-prefill after a retract has them)
        assert req.slot is not None
        self.pool.write(req.slot, kv)
        if req.output_ids:  # re-prefill after retract: the pending token is already known
            return
        if req.return_logprob:
            logp = torch.log_softmax(logits[:-1], dim=-1)
            picked = logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:], dtype=torch.long)]
            req.input_logprobs = [None, *picked.tolist()]
        if req.sampling.max_new_tokens == 0:
            with self._cond:
                self._finish(req, {"type": "length", "length": 0})
            return
        token = sample(logits[-1], req.sampling, _at_position(req, len(ids) - 1))
        last = torch.log_softmax(logits[-1], dim=-1)
        logprob = float(last[token])
        # A decode may be asked for the first token's top logprobs: the prefill always sends some.
        top = _top(last, max(req.top_logprobs_num, TOP_LOGPROBS_SENT if req.mode is Mode.PREFILL else 0))
        if req.top_logprobs_num:
            req.output_top_logprobs.append(top[: req.top_logprobs_num])
        if req.mode is Mode.PREFILL:
            if req.room is not None and self.publish_kv is not None:
                self.publish_kv(req.room, KVPayload(list(ids), kv, token, logprob, self.weight_version, top))
            req.output_ids.append(token)
            req.output_logprobs.append(logprob)
            with self._cond:
                self._finish(req, {"type": "length", "length": 1})
            return
        self._emit_token(req, token, logprob)

    def _step(self) -> None:
        batch = self._running  # only this thread changes it (under _cond); slots are 0..n-1
        if self.decode_ms_per_step:
            time.sleep(self.decode_ms_per_step / 1000)
        # (a request aborted before its prefill ran has no token: its row is computed and dropped)
        ids = torch.tensor([r.output_ids[-1] if r.output_ids else 0 for r in batch])
        positions = torch.tensor([len(r.input_ids) + max(len(r.output_ids), 1) - 1 for r in batch])
        logits = self._forward.decode_step(ids, positions, self.pool)
        greedy = torch.argmax(logits, dim=-1).tolist()
        # log_softmax over [B, V] costs as much as a layer; only pay it when someone asked.
        logps = (
            torch.log_softmax(logits, dim=-1) if any(r.return_logprob or r.top_logprobs_num for r in batch) else None
        )
        emit = self._emit_token
        hidden = self._hidden
        for row, req in enumerate(batch):
            if req.finish is not None:  # aborted meanwhile; reaped next iteration
                continue
            if req.return_hidden_states and hidden is not None:
                req.hidden_states.append(hidden[row].tolist())
            opts = req.sampling
            token = (
                greedy[row]
                if opts.temperature <= 1e-6 or opts.top_k == 1
                else sample(logits[row], opts, _at_position(req, len(req.input_ids) + len(req.output_ids) - 1))
            )
            if req.top_logprobs_num and logps is not None:
                req.output_top_logprobs.append(_top(logps[row], req.top_logprobs_num))
            emit(req, token, float(logps[row, token]) if logps is not None else 0.0)

    def _emit_token(self, req: Request, token: int, logprob: float) -> None:
        if req.first_token_at is None:
            req.first_token_at = time.monotonic()
        req.output_ids.append(token)
        req.output_logprobs.append(logprob)
        reason = self._finish_reason(req, token)
        if reason is not None:
            with self._cond:
                self._finish(req, reason)
        else:
            req.emit(req)

    def _finish_reason(self, req: Request, token: int) -> dict[str, Any] | None:
        opts = req.sampling
        n = len(req.output_ids)
        if n < opts.max_new_tokens and token != EOS_ID and not opts.stop and not opts.stop_token_ids:
            return None if len(req.input_ids) + n < self.context else {"type": "length", "length": n}
        if n > opts.min_new_tokens:
            if token == EOS_ID and not opts.ignore_eos:
                return {"type": "stop", "matched": token}
            if token in opts.stop_token_ids:
                return {"type": "stop", "matched": token}
            if opts.stop:
                tail = decode(req.output_ids[-64:])
                for stop in opts.stop:
                    if stop and stop in tail:
                        return {"type": "stop", "matched": stop}
        if n >= opts.max_new_tokens:
            return {"type": "length", "length": opts.max_new_tokens}
        if len(req.input_ids) + n >= self.context:
            return {"type": "length", "length": n}
        return None

    def _finish(self, req: Request, reason: dict[str, Any]) -> None:
        """Mark finished and deliver. Caller holds ``_cond``; the scheduler frees the slot."""
        if req.finished:
            return
        req.finish = reason  # a queued request stays queued until the next _purge or admission pass
        if req.queued:
            self._stale += 1
        if req.reserved:
            req.reserved = False
            self._reserved -= 1
            self._capacity_freed()
        if req.mode is Mode.PREFILL and req.room is not None and self.publish_kv and reason.get("type") == "abort":
            # The decode waiting for this room's KV learns at once (SGLang's KV sender reports
            # the failure to the receiver) instead of waiting out its timeout.
            self.publish_kv(req.room, str(reason.get("message") or "aborted"))
        if self.on_finish is not None:
            self.on_finish(req)
        req.emit(req)
        self._cond.notify_all()


def _at_position(req: Request, position: int) -> torch.Generator | None:
    """The request's generator, reseeded from (sampling_seed, position) when it has a seed: as
    SGLang's seeded sampler hashes the seed with the position, the token drawn at a position
    does not depend on which engine drew the earlier ones (PD equals non-PD)."""
    seed = req.sampling.sampling_seed
    if seed is not None and req.generator is not None:
        req.generator.manual_seed((int(seed) * 1_000_003 + position) % 2**63)
    return req.generator
