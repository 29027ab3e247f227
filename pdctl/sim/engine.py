"""The sim's scheduler: continuous batching on a thread, like SGLang's scheduler process.

HTTP handlers ``submit`` requests; the scheduler thread admits them into KV slots (one
prefill each), then runs one batched ``decode_step`` over every running request per
iteration, streaming each new token back through the request's ``emit`` callback.

Pause modes follow SGLang: ``abort`` ends running and queued requests, ``retract`` sends
running ones back to the queue (they re-prefill prompt + output on continue), ``in_place``
keeps their KV and just stops stepping. ``exclusive()`` is the weight-update writer lock.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from pdctl.errors import SimError
from pdctl.sim.model import EOS_ID, KVPool, TinyLM, decode
from pdctl.sim.sampling import SamplingOptions, sample

log = logging.getLogger("pdctl.sim")


class Mode(str, Enum):
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


@dataclass(eq=False)
class Request:
    rid: str
    input_ids: list[int]
    sampling: SamplingOptions
    emit: Callable[[Request], None]
    """Called on the scheduler thread after each new token and at the end; must not block."""
    mode: Mode = Mode.NORMAL
    return_logprob: bool = False
    room: int | None = None
    kv: KVPayload | None = None
    slot: int | None = None
    reserved: bool = False
    """True while ``slot`` is a reservation made before the KV arrived (decode)."""
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    retractions: int = 0
    created: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    generator: torch.Generator | None = None

    @property
    def finished(self) -> bool:
        return self.finish is not None

    def text(self) -> str:
        """Output text; a matched stop string is trimmed unless no_stop_trim."""
        out = decode(self.output_ids)
        matched = self.finish.get("matched") if self.finish else None
        if isinstance(matched, str) and not self.sampling.no_stop_trim:
            out = out[: out.find(matched)] if matched in out else out
        return out


class Engine:
    """One model, one KV pool, one scheduler thread."""

    def __init__(
        self,
        model: TinyLM,
        *,
        max_running: int = 64,
        random_seed: int = 0,
        prefill_ms_per_token: float = 0.0,
        decode_ms_per_step: float = 0.0,
        publish_kv: Callable[[int, KVPayload], None] | None = None,
        weight_version: str = "default",
    ):
        self.model = model
        self.pool = KVPool(model.config, max_running)
        self.max_running = max_running
        self.prefill_ms_per_token = prefill_ms_per_token
        self.decode_ms_per_step = decode_ms_per_step
        self.publish_kv = publish_kv
        self.weight_version = weight_version
        self._seeds = torch.Generator().manual_seed(random_seed)
        self._cond = threading.Condition()
        self._model_lock = threading.Lock()
        self._waiting: deque[Request] = deque()
        self._held: deque[Request] = deque()  # arrived during a weight update
        self._running: list[Request] = []
        self._reserved = 0  # slots held by decode requests waiting for their KV
        self._paused = False
        self._updating = False
        self._stopping = False
        self._ids = itertools.count()
        self.steps = 0
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.on_finish: Callable[[Request], None] | None = None
        self._thread = threading.Thread(target=self._loop, name="sim-scheduler", daemon=True)

    # -- lifecycle -----------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    # -- requests ------------------------------------------------------------------
    def new_rid(self) -> str:
        return f"{time.time_ns():x}{next(self._ids):04x}"

    def submit(self, req: Request) -> None:
        """Queue a request (thread-safe). A DECODE request must come with a reserved slot."""
        if req.generator is None and not req.sampling.greedy:
            seed = req.sampling.sampling_seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seeds))
            req.generator = torch.Generator().manual_seed(seed)
        with self._cond:
            (self._held if self._updating else self._waiting).append(req)
            self._cond.notify_all()

    def reserve_slot(self) -> int | None:
        """Hold a KV slot for a decode request while its KV is fetched (None if full)."""
        with self._cond:
            slot = self.pool.alloc()
            if slot is not None:
                self._reserved += 1
            return slot

    def release_slot(self, slot: int) -> None:
        with self._cond:
            self.pool.release(slot)
            self._reserved -= 1
            self._cond.notify_all()

    def abort(self, rid: str | None, message: str = "Abort requested") -> int:
        """Abort one request (or all with rid None); returns how many were aborted."""
        with self._cond:
            victims = [r for r in (*self._running, *self._waiting, *self._held) if rid is None or r.rid == rid]
            for req in victims:
                self._finish(req, {"type": "abort", "message": message})
            self._cond.notify_all()
            return len(victims)

    # -- pause / continue / exclusive --------------------------------------------------
    def pause(self, mode: str) -> None:
        if mode not in ("abort", "retract", "in_place"):
            raise SimError(f"pause mode must be abort, retract or in_place, not {mode!r}")
        with self._cond:
            self._paused = True
            if mode == "abort":
                for req in (*self._running, *self._waiting):
                    self._finish(req, {"type": "abort", "message": "Generation paused (abort)"})
            elif mode == "retract":
                for req in list(self._running):
                    self._running.remove(req)
                    self.pool.release(req.slot)  # type: ignore[arg-type]
                    req.slot = None
                    req.retractions += 1
                    self._waiting.appendleft(req)
            self._cond.notify_all()

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    @contextlib.contextmanager
    def exclusive(self, timeout_secs: float = 600.0) -> Iterator[None]:
        """The weight-update writer lock: unless paused, stop admitting and wait for running
        requests to finish; new ones wait until the update is done."""
        with self._cond:
            if self._updating:
                raise SimError("another weight update is in progress")
            self._updating = True
            self._held.extend(self._waiting)
            self._waiting.clear()
            deadline = time.monotonic() + timeout_secs
            while self._running and not self._paused:
                if not self._cond.wait(timeout=max(0.0, deadline - time.monotonic())):
                    self._updating = False
                    raise SimError("timed out waiting for in-flight requests before the weight update")
        try:
            with self._model_lock:
                yield
        finally:
            with self._cond:
                self._updating = False
                self._waiting.extend(self._held)
                self._held.clear()
                self._cond.notify_all()

    def busy(self) -> bool:
        with self._cond:
            return bool(self._running or self._waiting or self._held)

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {
                "num_running_reqs": len(self._running),
                "num_queue_reqs": len(self._waiting) + len(self._held),
                "num_reserved_decode_slots": self._reserved,
                "free_slots": len(self.pool.free),
            }

    # -- the scheduler thread -----------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cond:
                while not self._stopping and not self._has_work():
                    self._cond.wait()
                if self._stopping:
                    return
                admit = []
                while self._waiting and not self._paused and not self._updating:
                    req = self._waiting[0]
                    slot = req.slot if req.reserved else self.pool.alloc()
                    if slot is None:
                        break
                    self._waiting.popleft()
                    req.slot = slot
                    if req.reserved:
                        req.reserved = False  # the reserved slot becomes a running one
                        self._reserved -= 1
                    admit.append(req)
                step = [r for r in self._running if not r.finished] if not self._paused else []
            with self._model_lock:
                for req in admit:
                    self._start(req)
                if step:
                    self._step(step)

    def _has_work(self) -> bool:
        if self._paused or self._updating:
            return False
        head = self._waiting[0] if self._waiting else None
        return bool(self._running) or (head is not None and (bool(self.pool.free) or head.reserved))

    def _start(self, req: Request) -> None:
        try:
            if req.mode is Mode.DECODE and req.kv is not None and req.retractions == 0:
                self.pool.write(req.slot, req.kv.kv)  # type: ignore[arg-type]
                self._emit_token(req, req.kv.first_token, req.kv.first_logprob)
            else:
                self._prefill(req)
        except SimError as exc:
            with self._cond:
                self._finish(req, {"type": "abort", "message": str(exc)})
            return
        with self._cond:
            if req.finished:
                return
            self._running.append(req)

    def _prefill(self, req: Request) -> None:
        ids = req.input_ids + req.output_ids[:-1] if req.output_ids else req.input_ids
        if self.prefill_ms_per_token:
            time.sleep(len(ids) * self.prefill_ms_per_token / 1000)
        logits, kv = self.model.prefill(ids)
        self.pool.write(req.slot, kv)  # type: ignore[arg-type]
        self.prompt_tokens += len(ids)
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
        token = sample(logits[-1], req.sampling, req.generator)
        logprob = float(torch.log_softmax(logits[-1], dim=-1)[token])
        if req.mode is Mode.PREFILL:
            payload = KVPayload(list(ids), kv, token, logprob, self.weight_version)
            if req.room is not None and self.publish_kv is not None:
                self.publish_kv(req.room, payload)
            req.output_ids.append(token)
            req.output_logprobs.append(logprob)
            with self._cond:
                self._finish(req, {"type": "length", "length": 1})
            return
        self._emit_token(req, token, logprob)

    def _step(self, batch: list[Request]) -> None:
        if self.decode_ms_per_step:
            time.sleep(self.decode_ms_per_step / 1000)
        ids = torch.tensor([r.output_ids[-1] for r in batch])
        positions = torch.tensor([len(r.input_ids) + len(r.output_ids) - 1 for r in batch])
        slots = torch.tensor([r.slot for r in batch])
        logits = self.model.decode_step(ids, positions, self.pool, slots)
        logps = torch.log_softmax(logits, dim=-1)
        self.steps += 1
        for row, req in enumerate(batch):
            if req.finished:  # aborted while the step ran
                continue
            token = sample(logits[row], req.sampling, req.generator)
            self._emit_token(req, token, float(logps[row, token]))

    def _emit_token(self, req: Request, token: int, logprob: float) -> None:
        if req.first_token_at is None:
            req.first_token_at = time.monotonic()
        req.output_ids.append(token)
        req.output_logprobs.append(logprob)
        self.generated_tokens += 1
        reason = self._finish_reason(req, token)
        with self._cond:
            if reason is not None:
                self._finish(req, reason)
            else:
                req.emit(req)

    def _finish_reason(self, req: Request, token: int) -> dict[str, Any] | None:
        opts = req.sampling
        n = len(req.output_ids)
        if n > opts.min_new_tokens:
            if token == EOS_ID and not opts.ignore_eos:
                return {"type": "stop", "matched": token}
            if token in opts.stop_token_ids:
                return {"type": "stop", "matched": token}
            if opts.stop:
                text = decode(req.output_ids)
                for stop in opts.stop:
                    if stop and stop in text:
                        return {"type": "stop", "matched": stop}
        if n >= opts.max_new_tokens:
            return {"type": "length", "length": opts.max_new_tokens}
        if len(req.input_ids) + n >= self.model.config.max_positions:
            return {"type": "length", "length": n}
        return None

    def _finish(self, req: Request, reason: dict[str, Any]) -> None:
        """Mark finished, free its slot, deliver. Caller holds ``_cond``."""
        if req.finished:
            return
        req.finish = reason
        for queue in (self._running, self._waiting, self._held):
            if req in queue:
                queue.remove(req)
        if req.slot is not None:
            self.pool.release(req.slot)
            req.slot = None
        if req.reserved:
            req.reserved = False
            self._reserved -= 1
        if self.on_finish is not None:
            self.on_finish(req)
        req.emit(req)
        self._cond.notify_all()
