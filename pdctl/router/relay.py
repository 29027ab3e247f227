"""The relay: a stream as the client gets it (a ``StreamReply``'s body).

The engine's blocks go on as they come, then the stream's tail: what the router adds when the
engine's stream does not end it (the continuation of answers a weight update interrupted, or of
a one-answer /generate stream whose engine died mid-stream, on fresh legs under the request's
retry policy; else an SGLang-shaped error event and ``[DONE]``, never a broken transfer
encoding).

A relay is a ``Pipe`` (pdctl.router.reply): the server hands it the client's connection as an
``Outlet`` and each block is written there from the engine connection's read callback
(``block``), shaped on the way when it must be (logprobs in front, a continuation's events
shown as the client's, an interrupted answer caught). The relay's coroutine (``pipe``) wakes
only when an engine's stream ends: to record the outcome and, rarely, to continue the stream.
The client's stream usually ends inside that callback too (its last block and the end of the
body in one write). It is also an async iterator of the same bytes, for readers with no outlet.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging

from pdctl.router.continuation import Continuation
from pdctl.router.legs import Live
from pdctl.router.openai_resume import ROUTES as OPENAI_ROUTES
from pdctl.router.openai_resume import OpenAIResume, StreamLog
from pdctl.router.reply import Flow, Outlet
from pdctl.router.request import ClientRequest
from pdctl.router.resume import GENERATE, Piece
from pdctl.router.retry import Tries
from pdctl.router.shaping import ABORT, prepend_logprobs, with_input_logprobs
from pdctl.router.streaming import Continued, Interrupted, Transform, error_event, last_data, shaped

log = logging.getLogger("pdctl.router")


class Relay:
    """The client's stream over ``live`` and whatever continues it (module docstring)."""

    def __init__(self, continuation: Continuation, request: ClientRequest, live: Live, tries: Tries):
        self.continuation = continuation
        self.request = request
        self.tries = tries
        self.prefix = live.prefix
        self.current: Live | None = live
        self.transform: Transform | None = (
            functools.partial(prepend_logprobs, prefix=live.prefix) if live.prefix is not None else None
        )
        self.rule: Interrupted | None = None  # the current stream's (only /generate can be continued)
        self.last: bytes | None = None  # the current stream's last block with data, as the engine sent it
        self.outlet: Outlet | None = None
        self._ended: asyncio.Future[BaseException | None] | None = None  # the current stream's end
        self._pull: _Pull | None = None
        # An OpenAI stream's events as the client got them: the only record of its text (its chunks
        # are deltas), read only if its decode dies (pdctl.router.openai_resume)
        self.openai: StreamLog | None = StreamLog() if request.path in OPENAI_ROUTES else None

    # -- the current stream's blocks (the engine connection's callbacks) ----------------------------
    def block(self, block: bytes, end: bool) -> None:
        """``StreamReader.block``: pass the current stream's block on to the client, shaped (logprobs prefix, a caught
        interruption) and logged for an OpenAI stream; at ``end`` the current stream has ended."""
        if block.find(b"data: {") >= 0:  # (find, not in: see shaping.ABORT)
            self.last = block
        rule = self.rule
        if rule is not None and (rule.caught or block.find(ABORT) >= 0) and rule.reads(block):
            block = rule.passed(block, self.transform)
            if rule.over:  # a one-answer stream caught: nothing after it goes on
                assert self.current is not None
                self.current.leg.cancel()
                end = True
        elif self.transform is not None:
            block = shaped(block, self.transform)
        if self.openai is not None:
            self.openai.add(block)
        outlet = self.outlet
        assert outlet is not None
        if not end:
            outlet.write(block)
            return
        outlet.write(block, rule is None or not rule.caught)  # (the client's stream ends here unless continued)
        self._settle(None)

    def broke(self, error: BaseException) -> None:
        """``StreamReader.broke``: the current stream ended before it was complete, with ``error``."""
        self._settle(error)

    def _settle(self, error: BaseException | None) -> None:
        ended = self._ended
        if ended is not None and not ended.done():
            ended.set_result(error)

    # -- flow control (the outlet's) ------------------------------------------------------------------
    def pause(self) -> None:
        """``Flow.pause``: the client stopped reading; stop reading the current stream."""
        if self.current is not None:
            self.current.leg.pause()

    def resume(self) -> None:
        """``Flow.resume``: the client reads again; read the current stream again."""
        if self.current is not None:
            self.current.leg.resume()

    # -- the stream's life --------------------------------------------------------------------------
    def _follow(self, current: Live) -> asyncio.Future[BaseException | None]:
        """Take ``current``'s blocks from now on (``block``), with its own rule and no last block
        yet; the future its end sets."""
        self.rule = self.continuation.rule(current.leg.epoch, self.request) if self.request.path == GENERATE else None
        self.last = None
        ended = self._ended = self.continuation.attempts.legs.loop.create_future()
        current.leg.attach(self)
        assert self.outlet is not None
        if self.outlet.paused:
            current.leg.pause()
        return ended

    async def pipe(self, outlet: Outlet) -> None:
        """Write the whole stream into ``outlet``, its end included (reply.Pipe)."""
        c = self.continuation
        registry = c.attempts.registry
        request, tries = self.request, self.tries
        self.outlet = outlet
        outlet.flow = self
        shown: Continued | None = None  # how the current continuation's events show in the client's stream
        try:
            while self.current is not None:
                current = self.current
                claim = current.leg.claim
                error = await self._follow(current)
                self._ended = None
                current.finished()
                current.close()  # not held open through an update or a continuation
                self.current = None
                rule, last = self.rule, self.last
                if last is not None:
                    tries.progressed()
                if rule is not None and rule.caught and (error is None or rule.over):
                    claim.judge(True)
                    if shown is not None:
                        pending = shown.caught(rule)
                    else:
                        pending = {
                            k: with_input_logprobs(Piece().advanced(v), self.prefix) for k, v in rule.caught.items()
                        }
                    job = request.job
                    assert job is not None  # the rule catches answers of /generate jobs only
                    why = "the stream could not be continued after a weight update"
                    tail, self.current, shown = await c.stream(request, job, pending, tries, why, interrupted=True)
                elif error is None:
                    claim.judge(True)
                    return
                else:
                    claim.judge(False)
                    worker = claim.worker
                    registry.mark_failed(worker)
                    why = f"{worker.role} {worker.url} failed mid-stream: {error}"
                    data = last_data(last)
                    job = request.job if rule is not None else None  # parsed only now: rarely needed
                    resume = OpenAIResume.of(request.path, request.body, self.openai) if self.openai else None
                    if resume is not None:
                        resume = await c.counted(request, resume)
                        tail, self.current = await c.openai(request, resume, tries, why)
                        if self.current is not None:
                            log.warning("stream %s: %s; continuing on %s after %d tokens", resume.id, why,
                                        self.current.leg.worker.url, resume.tokens)  # fmt: skip
                            self.transform = resume.rewrite
                        outlet.write(tail, self.current is None)
                        continue
                    if job is None or not job.single or data is None:
                        outlet.write(error_event(why), True)
                        return
                    if shown is None:
                        done = with_input_logprobs(Piece().advanced(data), self.prefix)
                    else:
                        done = shown.pieces[shown.order[0]].advanced(data)
                    tail, self.current, shown = await c.stream(
                        request, job, {0: done}, tries, why, version=done.version
                    )
                    if self.current is not None:
                        log.warning(
                            "stream %s: %s; continuing on %s after %d tokens",
                            done.meta.get("id"),
                            why,
                            self.current.leg.worker.url,
                            done.tokens,
                        )
                outlet.write(tail, self.current is None)  # a tail with no continuation ends the stream
                if self.current is not None:
                    assert shown is not None
                    self.transform = shown.rewrite
        finally:
            self._drop()
            outlet.flow = self.outlet = self.rule = None  # (no cycle left: the router rarely runs the GC)

    def _drop(self) -> None:
        current, self.current = self.current, None
        if current is not None:
            current.close()

    async def aclose(self) -> None:
        """End the stream wherever it is: its legs are cancelled (the engines abort them)."""
        pull, self._pull = self._pull, None
        if pull is not None and not pull.task.done():
            pull.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pull.task
        self._drop()

    # -- as an async iterator -------------------------------------------------------------------------
    def __aiter__(self) -> Relay:
        return self

    async def __anext__(self) -> bytes:
        pull = self._pull
        if pull is None:
            pull = self._pull = _Pull()
            pull.task = asyncio.ensure_future(self.pipe(pull))
        return await pull.next()


class _Pull:
    """An outlet that keeps what is written until the relay's reader takes it (``next``)."""

    def __init__(self) -> None:
        self.paused = False
        self.flow: Flow | None = None
        self.chunks: list[bytes] = []
        self.ended = False
        self.task: asyncio.Future[None] = asyncio.get_running_loop().create_future()  # the pipe's, once it runs
        self._wake: asyncio.Future[None] | None = None

    def write(self, chunk: bytes, end: bool = False) -> None:
        if self.ended:
            return
        if chunk:
            self.chunks.append(chunk)
        self.ended = end
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def next(self) -> bytes:
        while True:
            if self.chunks:
                out = b"".join(self.chunks)
                self.chunks.clear()
                return out
            if self.task.done():
                self.task.result()  # what broke the stream, if anything
                raise StopAsyncIteration
            if self.ended:
                await asyncio.wait({self.task})
                continue
            wake = self._wake = asyncio.get_running_loop().create_future()
            await asyncio.wait({wake, self.task}, return_when=asyncio.FIRST_COMPLETED)
