"""How a request goes on after it was cut: the one ``Continuation`` for every way that happens.

- A stream's answers that a weight update interrupted (refit ``interrupt``: the engines abort
  what they run, the relay catches the asked-for aborts) go on on the new weights once the
  update is released (``stream``, ``interrupted``).
- A one-answer /generate stream whose decode died mid-stream goes on on a fresh pair, on the
  same weight version (``stream``).
- A whole (non-streamed) answer whose items an update interrupted is continued item by item
  before the client gets it, or sent again whole when it cannot be (``whole``).

Each continuation is sent through the attempt loop (pdctl.router.attempts) under the request's
own retry policy; what can be continued, and the continuation's body and spans, are resume.py's.
"""

from __future__ import annotations

from typing import Any

from pdctl.roles import ENGINE_ROLES
from pdctl.router import errors
from pdctl.router.attempts import INTERRUPT, Attempts
from pdctl.router.errors import RouteError
from pdctl.router.jsonutil import dumps, loads
from pdctl.router.legs import Live
from pdctl.router.openai_resume import OpenAIResume
from pdctl.router.reply import Reply
from pdctl.router.request import ClientRequest
from pdctl.router.resume import Job, Piece, asked_abort, settle
from pdctl.router.retry import Retry, Tries
from pdctl.router.shaping import interrupted_answer, items
from pdctl.router.streaming import DONE, Continued, Interrupted, error_event
from pdctl.sglang import Endpoint, batch_size_of

TOKENIZE = Endpoint.TOKENIZE.value


class Continuation:
    """Continues requests through ``attempts`` (module docstring)."""

    def __init__(self, attempts: Attempts):
        self.attempts = attempts
        self.gate = attempts.gate
        self.metrics = attempts.metrics

    def rule(self, epoch: int, request: ClientRequest) -> Interrupted:
        """The rule that catches a stream's answers that a weight update begun after ``epoch``
        interrupted, when the request can be continued (a /generate job)."""
        gate = self.gate
        return Interrupted(lambda: gate.interrupted_since(epoch) and request.job is not None)

    # -- streams --------------------------------------------------------------------------------------
    async def stream(
        self,
        request: ClientRequest,
        job: Job,
        pending: dict[int, Piece],
        tries: Tries,
        why: str,
        *,
        interrupted: bool = False,
        version: str | None = None,
    ) -> tuple[bytes, Live | None, Continued | None]:
        """Continue a stream's ``pending`` answers (each, by its index, with what the client has
        of it) on fresh legs: the bytes to send first, and the continuation's stream with how its
        events show (None when the client's stream ends with those bytes).

        After a weight update interrupted them (``interrupted``), on the new weights once the
        update is released: an answer interrupted more than ``max_staleness`` times ends with its
        tokens so far, one whose budget is spent simply ends. After its decode died (a one-answer
        stream, ``pending`` {0: ...}; ``why`` says how it died), on the same weight ``version``,
        as a retry of the request. The stream ends with ``why`` (as an error event) when the
        retry policy says stop."""
        attempts = self.attempts
        out = b""
        if not interrupted:
            delay = tries.next(Retry(why, errors.DECODE_FAILED))
            if delay is None:
                return error_event(why), None, None
            await attempts.retry.sleep(delay)
            if job.remaining(0, pending[0]) <= 0:
                return DONE, None, None
        first = True
        while True:
            if interrupted:
                pending, ended = settle(job, pending, self.gate.max_staleness)
                out += b"".join(Continued(job, tuple(ended), {}).event(k, item) for k, item in ended.items())
                if not pending:
                    return out + DONE, None, None
                version = None
            if first and (interrupted or self.gate.interrupting):  # (later holds: the attempt loop's)
                try:
                    await attempts.held(tries)
                except RouteError as exc:
                    return out + error_event(f"{why}; then {exc}"), None, None
            first = False
            order = tuple(pending)
            body = job.continuation([(k, pending[k]) for k in order])
            self.metrics.retried(errors.INTERRUPTED if interrupted else "stream_resumed")
            try:
                got = await attempts.run(
                    request, body, None, tries, version=version, continuation=True, interrupts=True
                )
            except RouteError as exc:
                return out + error_event(f"{why}; then {exc}"), None, None
            if got is INTERRUPT:  # the next update stopped it before its first token
                interrupted = True
                continue
            if isinstance(got, Live):
                return out, got, Continued(job, order, pending)
            return out + error_event(why), None, None  # the retries are spent

    async def counted(self, request: ClientRequest, resume: OpenAIResume) -> OpenAIResume:
        """``resume`` with its text's tokens as an engine in rotation counts them (``/v1/tokenize``;
        the chunks sent are no count: module pdctl.router.openai_resume); as it is when none answers."""
        registry = self.attempts.registry
        worker = next((w for role in ENGINE_ROLES for w in registry.routable(role)), None)
        if worker is None or not resume.text:
            return resume
        got = await self.attempts.legs.ask(worker, TOKENIZE, dumps(resume.tokenize_body()), request.headers)
        if isinstance(got, BaseException) or got.status != 200:
            return resume
        try:
            count = loads(got.body).get("count")
        except (ValueError, AttributeError):
            return resume
        return resume.counted(count) if isinstance(count, int) and not isinstance(count, bool) else resume

    async def openai(
        self, request: ClientRequest, resume: OpenAIResume, tries: Tries, why: str
    ) -> tuple[bytes, Live | None]:
        """Continue a one-choice OpenAI stream whose decode died (pdctl.router.openai_resume), as a
        retry of the request: the bytes to send first, and the continuation's stream (None when the
        client's stream ends with those bytes: its budget was spent, or the retry policy says stop)."""
        delay = tries.next(Retry(why, errors.DECODE_FAILED))
        if delay is None:
            return error_event(why), None
        await self.attempts.retry.sleep(delay)
        if resume.spent:
            return resume.end(), None
        self.metrics.retried("stream_resumed")
        try:
            got = await self.attempts.run(request, resume.continuation(), None, tries, continuation=True)
        except RouteError as exc:
            return error_event(f"{why}; then {exc}"), None
        if isinstance(got, Live):
            return b"", got
        return error_event(why), None  # the retries are spent

    # -- whole answers --------------------------------------------------------------------------------
    async def whole(self, request: ClientRequest, first: Reply, tries: Tries) -> Reply:
        """A non-streamed answer whose items a weight update interrupted (an asked-for abort,
        pdctl.refit ``interrupt``): each such item is continued on the new weights once the
        update is released, for its remaining tokens, until it finishes, its budget is spent or
        it would span more than ``max_staleness`` + 1 weight versions; the client gets one answer.
        An answer that cannot be continued item by item (the OpenAI routes, constrained decoding,
        ...) has reached no client yet: it is sent again whole on the new weights instead."""
        if first.status != 200 or b'"abort"' not in first.body:
            return first
        job = request.job
        if job is None:
            return await self._again(request, first, tries)
        answers = items(first.body, job.answers)
        if answers is None:
            return first
        attempts = self.attempts
        final: list[Any] = list(answers)
        raw = {k: item for k, item in enumerate(answers) if asked_abort(item)}
        bases = {k: Piece() for k in raw}
        while raw:
            for _ in raw:
                self.metrics.retried(errors.INTERRUPTED)
            pieces = {k: bases[k].advanced(answer) for k, answer in raw.items()}
            going, ended = settle(job, pieces, self.gate.max_staleness)
            for k, item in ended.items():
                final[k] = item
            bases.update(pieces)
            going_on = list(going)
            raw = {}
            if not going_on:
                break
            await attempts.wait_open()
            cont = job.continuation([(k, bases[k]) for k in going_on])
            reply = await attempts.run(request, cont, batch_size_of(cont), tries)
            assert isinstance(reply, Reply)  # a continuation of a whole answer is not streamed
            got = items(reply.body, len(going_on)) if reply.status == 200 else None
            if got is None:
                message = f"the continuation after a weight update failed ({reply.status}): {reply.body[:300]!r}"
                raise RouteError(reply.status if reply.status >= 400 else 502, errors.CONTINUATION_FAILED, message)
            for k, answer in zip(going_on, got, strict=True):
                if asked_abort(answer) and self.gate.interrupted_since(request.sent):
                    raw[k] = answer
                else:
                    final[k] = bases[k].view(answer)
        for k, item in enumerate(final):  # every item of a continued answer shows its spans
            if k not in bases:
                final[k] = Piece().view(item)
        return Reply(200, dumps(final[0] if job.single else final), first.content_type, first.headers)

    async def _again(self, request: ClientRequest, reply: Reply, tries: Tries) -> Reply:
        """Send the request again, once the update is released, for as long as updates interrupt it."""
        while reply.status == 200 and interrupted_answer(reply.body) and self.gate.interrupted_since(request.sent):
            self.metrics.retried(errors.INTERRUPTED)
            await self.attempts.wait_open()
            again = await self.attempts.run(request, request.body, request.batch, tries)
            assert isinstance(again, Reply)
            reply = again
        return reply
