"""Legs: sending a request to one worker, reading what its answer means, and ``PairAttempt``,
the one owner of both legs of a PD attempt.

The rules (sglang-protocol.md 2.3, style.md R9):
- each leg holds a ``Claim`` on its worker: it counts in the worker's load from its start to its
  end, whatever ends it, and its outcome reaches the circuit breaker at most once; a client that
  goes away cancels both legs (the engines abort them);
- a prefill that ends the request (an abort in a 200, a 4xx, a 5xx or no answer) cancels its
  decode leg at once, which would otherwise wait for KV until its own timeout; the client gets
  the prefill's answer (an abort or a 4xx is the client's business) or a retry (a failure);
- a decode that fails is blamed only once the prefill's answer is known: when the prefill
  ended the request, the decode only followed it; a decode whose error names the prefill's
  bootstrap server could not get the KV from it, and the prefill is blamed;
- a 429 or 503 from a live worker is backpressure (a busy ``Retry``): the breaker is left alone;
- a connection error or another 5xx is a ``Retry`` that counts against the worker's breaker
  (a refused connection also takes it out of rotation until its next health check);
- a leg that times out (``request_timeout_secs``) ends the request with a 504 (``Stop``);
- a worker's 4xx is the client's fault: returned as is, never retried, and it counts as a
  success for the circuit breaker;
- a failure of a leg that a weight update interrupted (refit ``interrupt``: the engines abort
  what they run) is no fault of the worker: a busy ``Retry`` once the update is released;
- an attempt still queued at a prefill that is being drained for a role switch (``hand_off``:
  neither its prefill has answered nor its decode's answer or stream begun, so nothing reached
  the client and no KV is at the decode) is taken back, both legs cancelled (the engines abort
  them), and sent to another pair at once (``HANDED_OFF``);
- prefill's ``input_token_logprobs`` are put in front of decode's only when asked for.

Legs are driven by the upstream connections' callbacks (``Upstream.send`` and ``stream``): a
leg's answer is taken in by the object that owns the leg (``PairAttempt``, ``StreamLeg``), which
wakes the request's task once, when there is something to decide. No task, future or done
callback is made per leg: they were most of the router's CPU per request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from pdctl.roles import Role
from pdctl.router import errors
from pdctl.router.breaker import CircuitBreaker
from pdctl.router.gate import RefitGate
from pdctl.router.reply import Reply
from pdctl.router.retry import Retry, Stop
from pdctl.router.shaping import Headers, aborted, first_input_logprobs, merged_logprobs, names_bootstrap, server_abort
from pdctl.router.streaming import DONE
from pdctl.router.upstream import Response, Sending, Streaming, Upstream, UpstreamError, UpstreamTimeout
from pdctl.router.workers import Worker, WorkerRegistry

PREFILL_GRACE_SECS = 5.0  # how long a prefill leg may run on after the reply went out without it
VERDICT_GRACE_SECS = 2.0  # how long a failed decode waits for its prefill's answer to learn who failed
BACKPRESSURE = (429, 503)
UNREAD_LIMIT = 1 << 20
"""Bytes a stream may read ahead of its reader before it has one (the prefill's input logprobs are
waited for first, say): beyond them the engine's stream is held back until ``attach``."""
Outcome = Reply | Retry | Stop


@dataclass(slots=True)
class Leg:
    """A buffered response from one worker, or the exception that stopped it."""

    status: int = 0
    body: bytes = b""
    content_type: str = "application/json"
    error: BaseException | None = None
    epoch: int | None = None
    """The refit gate's epoch when the leg was sent (an interrupt began since if it differs);
    None for a leg made up by the router, which no interrupt can explain."""

    @staticmethod
    def of(got: Response | BaseException, epoch: int) -> Leg:
        """The leg an upstream answer (or the exception that ended it) makes."""
        if isinstance(got, Response):
            return Leg(got.status, got.body, got.content_type, None, epoch)
        return Leg(error=got, epoch=epoch)

    @property
    def server_failed(self) -> bool:
        """Whether the leg failed on the server's side: no answer (``error``) or a 5xx."""
        return self.error is not None or self.status >= 500

    @property
    def ends_request(self) -> bool:
        """A prefill answer after which no KV will come: a failure, a 4xx, or an abort (the rule
        ``_ends_request`` applies to a prefill's Response before any Leg is made of it)."""
        return self.server_failed or self.status >= 400 or aborted(self.body)

    def reply(self, headers: Headers) -> Reply:
        """The leg's answer as the client's reply, with ``headers``."""
        return Reply(self.status, self.body, self.content_type, headers)


class Claim:
    """One leg's account with its worker, each side settled exactly once however the leg ends
    (smg's WorkerLoadGuard, with the circuit breaker's outcome beside the load): the leg counts
    in the worker's load from the claim's making to its first ``release``, and its outcome
    reaches the breaker at its first ``judge`` (never, for backpressure, a cancelled leg or an
    attempt a weight update interrupted). Later calls change nothing, so every way a leg can end
    releases it without knowing whether another way came first."""

    __slots__ = ("breaker", "freed", "held", "judged", "worker")

    def __init__(self, worker: Worker, breaker: CircuitBreaker, freed: Callable[[], None] | None = None):
        """``freed``: called once the load is given back (late pairing's wake: pdctl.router.pair_room)."""
        self.worker = worker
        self.breaker = breaker
        self.freed = freed
        self.held = True
        self.judged = False
        worker.took()

    def release(self) -> None:
        """The leg ended (answered, failed or cancelled): its load is given back."""
        if self.held:
            self.held = False
            self.worker.gave_back()
            if self.freed is not None:
                self.freed()

    def judge(self, ok: bool, answered: bool = False) -> None:
        """The leg's outcome for the breaker (``CircuitBreaker.record``)."""
        if not self.judged:
            self.judged = True
            if ok:  # an answer tells liveness as much as a probe would (pdctl.router.health)
                self.worker.last_answer, self.worker.silent_since = time.monotonic(), 0.0
            self.breaker.record(self.worker, ok, answered)


class Legs:
    """Sends legs to workers through ``upstream`` and judges their answers; owns the prefill legs
    that outlive their reply (``PairAttempt.keep_prefill``) and the whole legs of regular engines."""

    def __init__(self, upstream: Upstream, registry: WorkerRegistry, gate: RefitGate, timeout_secs: float):
        self.upstream = upstream
        self.registry = registry
        self.breaker = CircuitBreaker(registry.config.breaker)
        self.gate = gate
        self.timeout = timeout_secs
        self._loop: asyncio.AbstractEventLoop | None = None
        self._legs: set[asyncio.Future[Leg]] = set()  # regular engines' whole legs in flight
        self.grace_secs = PREFILL_GRACE_SECS
        self._graced: dict[PairAttempt, float] = {}  # attempts whose prefill the reply went out without
        self._grace_timer: asyncio.TimerHandle | None = None
        self.undecided: set[PairAttempt] = set()
        """PD attempts whose prefill has not answered and whose decode has not begun to (``hand_off``)."""
        self.freed: Callable[[], None] | None = None
        """Called whenever a leg gives its worker's load back (set by late pairing)."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The running event loop, looked up once and cached."""
        # Cached: on Python 3.11 every asyncio.get_running_loop() (inside create_task too) is a
        # getpid() syscall, which was 6% of the router's CPU in a native profile.
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    async def close(self) -> None:
        """Cancel every leg still running (a prefill that outlived its reply, for instance)."""
        if self._grace_timer is not None:
            self._grace_timer.cancel()
            self._grace_timer = None
        for pair in list(self._graced):
            pair.cancel_prefill()
        self._graced.clear()
        pending = [leg for leg in self._legs if not leg.done()]
        for leg in pending:
            leg.cancel()
        if pending:
            await asyncio.sleep(0)  # a cancelled future's callbacks run in the loop's next turn
        self.upstream.close()

    def claim(self, worker: Worker) -> Claim:
        """A new leg's claim on ``worker`` (counted in its load from now)."""
        return Claim(worker, self.breaker, self.freed)

    def send(self, claim: Claim, path: str, data: bytes, headers: Headers, answered: Callable) -> Sending:
        """Start a whole leg to ``claim``'s worker; ``answered(Response | exception)`` must
        release the claim, and so must whoever cancels it."""
        worker = claim.worker
        return self.upstream.send(worker.url + path, data, _sent(worker, headers), answered, timeout=self.timeout)

    async def ask(self, worker: Worker, path: str, data: bytes, headers: Headers) -> Response | BaseException:
        """One POST to ``worker`` outside any request's legs (no claim: not counted in its load),
        whole: its Response, or the exception that ended it. Cancelling the caller closes it."""
        got: asyncio.Future[Response | BaseException] = self.loop.create_future()

        def answered(answer: Response | BaseException) -> None:
            if not got.done():
                got.set_result(answer)

        sending = self.upstream.send(worker.url + path, data, _sent(worker, headers), answered, timeout=self.timeout)
        try:
            return await got
        except asyncio.CancelledError:
            sending.cancel()
            raise

    def start(self, claim: Claim, path: str, data: bytes, headers: Headers) -> asyncio.Future[Leg]:
        """``claim``'s worker's whole answer, as a future that its connection completes; the claim
        is released when it is done (a regular engine's leg). Cancelling it closes the
        connection: the engine aborts the request. ``close()`` cancels every leg still running."""
        epoch = self.gate.epoch
        leg: asyncio.Future[Leg] = self.loop.create_future()

        def answered(got: Response | BaseException) -> None:
            if not leg.done():
                leg.set_result(Leg.of(got, epoch))  # (an exception that is a bug: ``verdict`` raises it)

        sending = self.send(claim, path, data, headers, answered)
        legs = self._legs
        legs.add(leg)

        def ended(done: asyncio.Future[Leg]) -> None:
            legs.discard(done)
            claim.release()
            if done.cancelled():
                sending.cancel()

        leg.add_done_callback(ended)
        return leg

    async def open_one(self, claim: Claim, path: str, data: bytes, headers: Headers) -> StreamLeg | Leg:
        """A regular engine's stream once its first block came, else a Leg saying why not."""
        opened: asyncio.Future[StreamLeg | Leg] = self.loop.create_future()
        leg = StreamLeg(self, claim, path, data, headers, opened.set_result)
        try:
            return await opened
        except BaseException:
            leg.cancel()
            raise

    def verdict(self, claim: Claim, leg: Leg, code: str) -> Retry | Stop | None:
        """What the answer of ``claim``'s worker means for the request (module docstring), judged
        on the claim: None when it answered (a 2xx to 4xx but 429: the answer goes to the client;
        ok for the breaker). An exception that is no connection's failure is a bug: raised."""
        worker = claim.worker
        error = leg.error
        if error is not None and not isinstance(error, (UpstreamError, OSError)):
            raise error
        failed = error is not None or leg.status >= 500
        if failed and not isinstance(error, UpstreamTimeout) and self.interrupted(leg):
            return Retry(f"{worker.role} {worker.url}: interrupted by a weight update", errors.INTERRUPTED, busy=True)
        if error is not None:
            claim.judge(False)
            if isinstance(error, UpstreamTimeout):
                return Stop(504, errors.TIMEOUT, f"{worker.role} {worker.url}: {error}")
            self.registry.mark_failed(worker, error)
            return Retry(f"{worker.role} {worker.url} failed: {type(error).__name__}: {error}", code)
        if leg.status in BACKPRESSURE:
            return Retry(f"{worker.role} {worker.url} is busy ({leg.status}): {leg.body[:200]!r}", code, busy=True)
        claim.judge(leg.status < 500, answered=True)
        if leg.status >= 500:
            answer = Reply(leg.status, leg.body, leg.content_type)
            return Retry(f"{worker.role} {worker.url} answered {leg.status}: {leg.body[:300]!r}", code, answer=answer)
        return None

    def hand_off(self, worker: Worker) -> int:
        """Take back the PD attempts whose prefill is ``worker`` and that have made nothing yet: no
        prefill answer, no decode answer or stream (module docstring); each is sent to another
        pair by its attempt loop. Returns how many. A switch's drain of a prefill waited for its
        queue, which waits for rooms at the decodes when they are short, as when the prefill is
        moved to decode. A decode's attempts are not handed off: those waiting for their KV may
        be mid-prefill, and cancelling them threw that work away and sent them to the back of the
        prefills' queues (a benchmark run that handed off 49 such requests in a long-prompt phase
        finished no sooner and missed TTFT on 268 more requests)."""
        if worker.role is not Role.PREFILL:
            return 0
        pairs = [p for p in self.undecided if p.prefill is worker and p.waits_for_decode]
        for pair in pairs:
            pair.hand_off()
        return len(pairs)

    def interrupted(self, leg: Leg) -> bool:
        """Whether a weight update began after ``leg`` was sent."""
        return leg.epoch is not None and self.gate.interrupted_since(leg.epoch)

    # -- prefills the reply went out without -------------------------------------------------------
    def grace(self, pair: PairAttempt) -> None:
        """``pair``'s prefill may run on for ``grace_secs``; then it is cancelled. One timer for
        all the prefills in their grace, not one each (a timer armed and cancelled per request
        cost microseconds): they end in the order they began it."""
        self._graced[pair] = self.loop.time() + self.grace_secs
        if self._grace_timer is None:
            self._grace_timer = self.loop.call_later(self.grace_secs, self._end_grace)

    def ungrace(self, pair: PairAttempt) -> None:
        """``pair``'s prefill is no longer cancelled when its grace is over; no effect if it had none."""
        self._graced.pop(pair, None)

    def _end_grace(self) -> None:
        """Cancel the prefills whose grace is over; wait on for the next one's."""
        now = self.loop.time()
        over = []
        for pair, deadline in self._graced.items():
            if deadline > now:
                self._grace_timer = self.loop.call_at(deadline, self._end_grace)
                break
            over.append(pair)
        else:
            self._grace_timer = None
        for pair in over:
            del self._graced[pair]
            pair.cancel_prefill()


# What an attempt's task waits for (PairAttempt._awaits).
_NOTHING, _DECODE, _PREFILL = 0, 1, 2


class PairAttempt:
    """Both legs of one PD attempt, from start to finish. The prefill is sent when the attempt is
    made; ``whole`` or ``open`` sends the decode and waits (in the caller's task, woken once) for
    what decides the attempt: the decode's answer, or the prefill ending the request first (then
    the decode is cancelled at once: its KV will never come). Both legs' answers come in through
    the connections' callbacks (``_prefill_answered``, ``_decode_answered``, ``_decode_opened``).

    Closing the attempt (``close``: ``whole`` does it itself, a stream's holder once the stream
    ends) cancels what still runs, the prefill too unless ``keep_prefill`` handed it over (the
    reply does not need it: its outcome is recorded when it comes, within ``Legs.grace_secs``).

        outcome = await PairAttempt(legs, prefill, decode, path, wire, headers).whole(with_logprobs)
    """

    __slots__ = (
        "_awaits",
        "_d",
        "_d_send",
        "_d_stream",
        "_kept",
        "_p",
        "_p_send",
        "_wake",
        "d_got",
        "decode",
        "epoch",
        "handed",
        "headers",
        "legs",
        "opened",
        "p_got",
        "path",
        "prefill",
        "wire",
    )

    def __init__(self, legs: Legs, prefill: Worker, decode: Worker, path: str, wire: bytes, headers: Headers):
        self.legs, self.prefill, self.decode = legs, prefill, decode
        self.path, self.wire, self.headers = path, wire, headers
        self.epoch = legs.gate.epoch
        self.p_got: Response | BaseException | None = None  # the prefill's answer, once in
        self.d_got: Response | BaseException | Leg | None = None  # the decode's, or why its stream did not open
        self.opened: StreamLeg | None = None  # the decode's stream, once its first block came
        self._d_send: Sending | None = None
        self._d_stream: StreamLeg | None = None
        self._kept = False
        self.handed = False  # taken back by ``Legs.hand_off``
        self._wake: asyncio.Future[None] | None = None
        self._awaits = _NOTHING
        legs.undecided.add(self)
        self._p = legs.claim(prefill)  # released when its answer is in, or by close (kept: within its grace)
        self._d = legs.claim(decode)  # released when its answer is in, its stream ends, or by close
        self._p_send: Sending | None = legs.send(self._p, path, wire, headers, self._prefill_answered)

    # -- the legs' answers (connection callbacks) ----------------------------------------------------
    def _prefill_answered(self, got: Response | BaseException) -> None:
        self.legs.undecided.discard(self)
        self._p_send = None
        self._p.release()
        self.p_got = got
        if self._kept:
            self.legs.ungrace(self)
            self._record_kept(got)
            return
        awaits = self._awaits
        if awaits is _PREFILL:
            self._wake_up()
        elif awaits is _DECODE and _ends_request(got):
            self._cancel_decode()  # its KV will never come
            self._wake_up()

    def _decode_answered(self, got: Response | BaseException) -> None:
        self.legs.undecided.discard(self)
        self._d_send = None
        self._d.release()
        self.d_got = got
        if self._awaits is _DECODE:
            self._wake_up()

    def _decode_opened(self, got: StreamLeg | Leg) -> None:
        self.legs.undecided.discard(self)
        if isinstance(got, StreamLeg):
            self.opened = got
        else:
            self._d_stream = None  # (its claim is released: the StreamLeg ended)
            self.d_got = got
        if self._awaits is _DECODE:
            self._wake_up()

    # The answers as Legs, made when a verdict needs them (the common case reads the Response).
    @property
    def p_leg(self) -> Leg | None:
        """The prefill's answer as a Leg; None until it has one."""
        got = self.p_got
        return None if got is None else Leg.of(got, self.epoch)

    @property
    def d_leg(self) -> Leg | None:
        """The decode's answer as a Leg; None until it has one."""
        got = self.d_got
        return got if got is None or isinstance(got, Leg) else Leg.of(got, self.epoch)

    @property
    def waits_for_decode(self) -> bool:
        """Whether the attempt's task waits for the decode's answer, which has not begun."""
        return self._awaits is _DECODE and self.d_got is None and self.opened is None

    def hand_off(self) -> None:
        """Taken back (``Legs.hand_off``): both legs cancelled, the task woken to a ``HANDED_OFF`` retry."""
        self.legs.undecided.discard(self)
        self.handed = True
        self._cancel_decode()
        self.cancel_prefill()
        self._wake_up()

    def _handed_off(self) -> Retry:
        where = f"prefill {self.prefill.url}, decode {self.decode.url}"
        return Retry(f"{where}: taken back from an engine drained for a role switch", errors.HANDED_OFF, busy=True)

    def _wake_up(self) -> None:
        """What the task waits for came: the attempt is decided (a later answer changes nothing)."""
        self._awaits = _NOTHING
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    def _until(self, what: int) -> asyncio.Future[None]:
        """What the attempt's task awaits until the leg ``what`` names answers (the decode's wait
        ends early when the prefill ends the request). Not a coroutine: a layer less per request."""
        self._awaits = what
        wake = self._wake = self.legs.loop.create_future()
        return wake

    # -- the two shapes of an attempt ------------------------------------------------------------
    async def whole(self, with_logprobs: bool) -> Outcome:
        """Both answers, buffered: the client's Reply, or why not. This is the attempt's whole
        life: the pair is closed when it returns, however it ends."""
        legs = self.legs
        try:
            if self.p_got is None or not _ends_request(self.p_got):
                self._d_send = legs.send(self._d, self.path, self.wire, self.headers, self._decode_answered)
                await self._until(_DECODE)
                if self.handed:
                    return self._handed_off()
            got = self.d_got
            if type(got) is Response and got.status < 400 and not with_logprobs:  # the common case
                self._d.judge(True)
                self.keep_prefill()
                return Reply(got.status, got.body, got.content_type, self.headers)
            d_leg = self.d_leg
            if d_leg is None:  # the prefill ended the request first
                assert self.p_leg is not None
                return self.prefill_ended(self.p_leg)
            if d_leg.server_failed or d_leg.status in BACKPRESSURE:
                return await self.decode_failed(d_leg)
            self._d.judge(True)
            if d_leg.status >= 400 or not with_logprobs:
                self.keep_prefill()
                return d_leg.reply(self.headers)
            p_leg = await self.prefill_answer()
            if p_leg.ends_request:
                return self.prefill_ended(p_leg)
            return Reply(d_leg.status, merged_logprobs(p_leg.body, d_leg.body), d_leg.content_type, self.headers)
        finally:
            self.close()

    async def open(self) -> StreamLeg | Outcome:
        """Decode's stream once its first block came (handed over: its holder closes it), else
        why not (a Reply for an answer that is not a stream: an error status or the prefill's 4xx
        or abort).

        SGLang sends a stream's head before the request even reaches the scheduler, so the
        head proves nothing: the first event does (it comes once the KV did). Until then the
        prefill can still end the request, and nothing has reached the client, so a failure
        is still retried on another pair."""
        legs = self.legs
        if self.p_got is None or not _ends_request(self.p_got):
            self._d_stream = StreamLeg(legs, self._d, self.path, self.wire, self.headers, self._decode_opened)
            await self._until(_DECODE)
            if self.handed:
                return self._handed_off()
        opened = self.opened
        if opened is not None:
            self._d_stream = None  # handed over
            return opened
        d_leg = self.d_leg
        if d_leg is None:  # the prefill ended the request first (the stream was cancelled)
            assert self.p_leg is not None
            return self.prefill_ended(self.p_leg)
        if d_leg.server_failed or d_leg.status in BACKPRESSURE:
            return await self.decode_failed(d_leg)
        self._d.judge(True)
        return d_leg.reply(self.headers)

    async def input_logprobs(self) -> list | Outcome:
        """The prefill's input logprobs (a stream that asked for them shows them first), or the
        outcome when the prefill ended the request."""
        p_leg = await self.prefill_answer()
        return self.prefill_ended(p_leg) if p_leg.ends_request else first_input_logprobs(p_leg.body)

    async def prefill_answer(self) -> Leg:
        """The prefill's answer, waited for."""
        if self.p_got is None:
            assert self._p_send is not None, "the prefill leg was cancelled"
            await self._until(_PREFILL)
        p_leg = self.p_leg
        assert p_leg is not None
        return p_leg

    # -- the end of an attempt -------------------------------------------------------------------
    def keep_prefill(self) -> None:
        """The reply does not need the prefill's answer: its outcome is recorded when it comes
        (without holding the reply), and it is cancelled if it takes longer than the grace."""
        if self._kept:
            return
        self._kept = True
        if self.p_got is not None:  # the common case: prefill answered first
            self._record_kept(self.p_got)
        elif self._p_send is not None:
            self.legs.grace(self)

    def _record_kept(self, got: Response | BaseException) -> None:
        if not isinstance(got, Response):
            self._p.judge(False)
        elif got.status not in BACKPRESSURE:
            self._p.judge(got.status < 500, answered=True)

    def close(self) -> None:
        """Cancel the legs that still run: the decode's, and the prefill's unless kept; release
        their claims (a decode stream handed on is closed only once it ended)."""
        self.legs.undecided.discard(self)
        if self._d_send is not None or self._d_stream is not None:
            self._cancel_decode()
        self._d.release()
        if not self._kept:
            self.cancel_prefill()

    def cancel_prefill(self) -> None:
        """Cancel the prefill's send if it still runs (the engine sees the client go away) and release its claim;
        calling it again does nothing more."""
        sending, self._p_send = self._p_send, None
        if sending is not None:
            sending.cancel()  # the engine sees the client go away
        self._p.release()

    def _cancel_decode(self) -> None:
        sending, self._d_send = self._d_send, None
        if sending is not None:
            sending.cancel()
        self._d.release()
        stream, self._d_stream = self._d_stream, None
        if stream is not None:
            stream.cancel()

    # -- verdicts --------------------------------------------------------------------------------
    async def decode_failed(self, d_leg: Leg) -> Outcome:
        """Decide which leg failed (module docstring): the prefill, when its answer ended the
        request or the decode's error names its bootstrap server (SGLang 0.5.23's "Lost
        connection with prefill instance (bootstrap_addr: HOST:PORT)"), else the decode.
        Blaming the decode for a dead prefill opened the circuit of a healthy decode, the
        fleet's only one in a bench_serving run."""
        prefill = self.prefill
        if self.p_got is None and self._p_send is not None:
            timer = self.legs.loop.call_later(VERDICT_GRACE_SECS, self._wake_up)
            try:
                await self._until(_PREFILL)
            finally:
                timer.cancel()
        p_leg = self.p_leg
        if p_leg is not None and p_leg.ends_request:
            return self.prefill_ended(p_leg)
        legs = self.legs
        if (
            d_leg.error is None
            and d_leg.status >= 500
            and names_bootstrap(d_leg.body, prefill.bootstrap_host, prefill.bootstrap_port)
        ):
            lost = UpstreamError(f"decode {self.decode.url} lost it: {d_leg.body[:300]!r}")
            verdict = legs.verdict(self._p, Leg(error=lost, epoch=d_leg.epoch), errors.PREFILL_FAILED)
        else:
            verdict = legs.verdict(self._d, d_leg, errors.DECODE_FAILED)
        return verdict or d_leg.reply(self.headers)

    def prefill_ended(self, p_leg: Leg) -> Outcome:
        """The prefill ended the request: its failure is retried, its abort or 4xx answered as is;
        an abort that a weight update caused (refit ``interrupt``) is retried once the update is
        released (no token was generated, nothing reached the client)."""
        legs = self.legs
        if legs.interrupted(p_leg) and aborted(p_leg.body):
            return Retry(f"prefill {self.prefill.url}: interrupted by a weight update", errors.INTERRUPTED, busy=True)
        return legs.verdict(self._p, p_leg, errors.PREFILL_FAILED) or p_leg.reply(self.headers)


class StreamLeg:
    """One worker's streamed answer (the ``StreamSink`` of ``Upstream.stream``), cut into *blocks*
    of whole SSE events: what arrived, up to its last event boundary (the rest waits for the next
    read), so that the client never gets half an event and no event is parsed on the common path.

    It is *opening* until its first block came: then ``on_open`` is called, once, with the leg
    itself (``first`` holds that block), or with a Leg saying why there is no stream (an error
    status with its body, a failure, a stream that ended with no event, or a first event that is
    a server-side abort, with its status: nothing was sent on yet, so it is retried). From then
    on the blocks go to the reader that ``attach`` names as they come (``reader.block(block,
    end)``, ``reader.broke(error)``). Its ``claim`` is released when it ends or is cancelled."""

    __slots__ = (
        "_body",
        "_end",
        "_error",
        "_held",
        "_on_open",
        "_pending",
        "_reader",
        "_unread",
        "claim",
        "epoch",
        "first",
        "over",
        "response",
        "streaming",
        "worker",
    )

    def __init__(
        self,
        legs: Legs,
        claim: Claim,
        path: str,
        data: bytes,
        headers: Headers,
        on_open: Callable[[StreamLeg | Leg], None],
    ):
        self.claim = claim
        self.worker = worker = claim.worker
        self.epoch = legs.gate.epoch
        self._on_open: Callable[[StreamLeg | Leg], None] | None = on_open
        self.response: Response | None = None
        self.first = b""
        self.over = False  # its answer ended (whole or not) or it was cancelled: its claim is released
        self._held = b""  # what came after the last event boundary
        self._body: list[bytes] | None = None  # an error status's body, read whole
        self._pending: list[bytes] = []  # blocks that came after the first, before a reader
        self._unread = 0  # their bytes (the stream is paused past UNREAD_LIMIT until attached)
        self._end = False  # ... and the stream's end came with them
        self._error: BaseException | None = None  # ... or the failure that ended it
        self._reader: StreamReader | None = None
        to = _sent(worker, headers)
        self.streaming: Streaming = legs.upstream.stream(worker.url + path, data, to, self, timeout=legs.timeout)

    # -- StreamSink --------------------------------------------------------------------------------
    def head(self, response: Response) -> None:
        """``StreamSink.head``: keep the answer's status; an error status's body is then read whole instead of as a
        stream."""
        self.response = response
        if response.status >= 400:
            self._body = []  # not a stream: an error's body, read whole

    def data(self, chunk: bytes, end: bool) -> None:
        """``StreamSink.data``: pass on whole events only (what follows the last boundary waits for more), to the reader
        once one is attached, kept until then, or as the first block that opens the leg."""
        if end:
            self._ended()
        if self._body is not None:
            self._body.append(chunk)
            if end:
                r = self.response
                assert r is not None
                self._opened(Leg(r.status, b"".join(self._body), r.content_type, None, self.epoch))
            return
        held = self._held + chunk if self._held else chunk
        cut = held.rfind(b"\n\n") + 2
        if end or cut == len(held):  # (at the end a tail with no boundary goes too)
            block, self._held = held, b""
        elif cut < 2:
            self._held = held
            return
        else:
            block, self._held = held[:cut], held[cut:]
        reader = self._reader
        if reader is not None:
            reader.block(block, end)
        elif self._on_open is None:  # opened: kept for the reader
            self._pending.append(block)
            self._end = end
            self._unread += len(block)
            if self._unread > UNREAD_LIMIT and not end:
                self.streaming.pause()  # (resumed when a reader attaches)
        elif block:
            self._first(block, end)
        else:
            self._opened(Leg(error=UpstreamError("the stream ended before its first event"), epoch=self.epoch))

    def failed(self, error: BaseException) -> None:
        """``StreamSink.failed``: the stream ended early; before it opened, the leg opens as a failed Leg, after it the
        reader hears it now or when it attaches."""
        self._ended()
        if self._on_open is not None:
            self._opened(Leg(error=error, epoch=self.epoch))
        elif self._reader is not None:
            self._reader.broke(error)
        else:
            self._error = error

    # -- opening -----------------------------------------------------------------------------------
    def _first(self, block: bytes, end: bool) -> None:
        self.streaming.disarm()  # the rest of a stream may take longer than the request timeout
        status = server_abort(block)
        if status is not None:
            self._stop()
            self._opened(Leg(status, block + DONE, "text/event-stream", None, self.epoch))
            return
        self.first = block
        self._end = end
        self._opened(self)

    def _opened(self, got: StreamLeg | Leg) -> None:
        on_open, self._on_open = self._on_open, None
        if on_open is not None:
            on_open(got)

    # -- reading ------------------------------------------------------------------------------------
    def attach(self, reader: StreamReader) -> None:
        """From now on ``reader`` gets the blocks as they come; those already in go to it now (the
        first one and any after it, joined into one block)."""
        self._reader = reader
        pending = self._pending
        block = self.first + b"".join(pending) if pending else self.first
        self.first = b""
        pending.clear()
        if self._unread > UNREAD_LIMIT:
            self.resume()  # (the reader pauses it again if its client does not read)
        self._unread = 0
        if block or self._end:
            reader.block(block, self._end)
        if self._error is not None:
            reader.broke(self._error)

    def pause(self) -> None:
        """Stop reading from the engine until ``resume``; nothing once the stream is over."""
        if not self.over:
            self.streaming.pause()

    def resume(self) -> None:
        """Read from the engine again after ``pause``; nothing once the stream is over."""
        if not self.over:
            self.streaming.resume()

    def cancel(self) -> None:
        """Stop reading (the engine sees the reader go away); nothing more goes to the reader."""
        self._on_open = None
        self._reader = None
        self._stop()

    def _stop(self) -> None:
        if not self.over:
            self.streaming.cancel()
            self._ended()

    def _ended(self) -> None:
        if not self.over:
            self.over = True
            self.claim.release()


@dataclass(eq=False, slots=True)
class Live:
    """A stream that opened (its first block is in) and has not been sent on yet (its worker,
    and the refit gate's epoch when it was sent, are its leg's): a PD attempt's decode stream
    with its ``pair``, or a regular engine's stream."""

    leg: StreamLeg
    pair: PairAttempt | None = None
    prefix: list | None = None
    """The prefill's input logprobs, shown in front of decode's (asked for with ``return_logprob``)."""

    def finished(self) -> None:
        """The stream ended: the prefill leg may finish on its own (its outcome is recorded)."""
        if self.pair is not None:
            self.pair.keep_prefill()

    def close(self) -> None:
        """Cancel the stream (its claim released) and close its pair's legs, if it has a pair."""
        self.leg.cancel()
        if self.pair is not None:
            self.pair.close()


class StreamReader(Protocol):
    """Who ``StreamLeg.attach`` hands a stream's blocks to, as they come (pdctl.router.relay)."""

    def block(self, block: bytes, end: bool) -> None:
        """``block``: whole events (empty only with ``end``); ``end``: the engine's stream ended with it."""

    def broke(self, error: BaseException) -> None:
        """The engine's stream ended before it was complete."""


def _ends_request(got: Response | BaseException) -> bool:
    """``Leg.ends_request`` of a prefill's answer, with no Leg made (the hot path's test)."""
    return not isinstance(got, Response) or got.status >= 400 or aborted(got.body)


def _sent(worker: Worker, headers: Headers) -> dict[str, str]:
    """The headers sent to ``worker``: the forwarded client headers and the worker's own key; to a
    worker the router holds no key for, the client's own ``Authorization`` (a standalone router in
    front of engines started with the clients' key, as sglang-router and smg pass it on)."""
    return {**headers.upstream, **worker.auth} if worker.auth else headers.keyless
