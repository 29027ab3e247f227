"""The sim's model runner: a request's prefill, one batched decode step, and each new token's
delivery and finish check (SGLang's model runner and the scheduler's ``process_batch_result``).

Only the scheduler thread (pdctl.sim.scheduler) calls it, between rounds of its queues
(pdctl.sim.queues). Running requests sit in dense KV slots 0..n-1, so a step reads the KV pool
as a view instead of gathering it. A PD prefill publishes its KV under the request's bootstrap
room (pdctl.sim.kv serves it); a PD decode starts from that KV instead of a prefill.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Any

import torch

from pdctl.errors import SimError
from pdctl.sim.costed import StandInForward
from pdctl.sim.engine_request import KVPayload, Mode, Request, abort_reason
from pdctl.sim.model import EOS_ID, KVPool, TinyLM, decode
from pdctl.sim.queues import RequestQueues
from pdctl.sim.sampling import sample, sample_plain

__all__ = ["TOP_LOGPROBS_SENT", "ModelRunner"]

log = logging.getLogger("pdctl.sim")


TOP_LOGPROBS_SENT = 20
"""Top logprobs a prefill computes for the first token, for a decode that asks (OpenAI's maximum)."""


def _top(logps: torch.Tensor, k: int) -> list[tuple[float, int]]:
    if k <= 0:
        return []
    values, ids = torch.topk(logps, min(k, logps.numel()))
    return list(zip(values.tolist(), ids.tolist(), strict=True))


class ModelRunner:
    """Runs the model for the scheduler: ``start`` one admitted request, ``step`` the running
    batch. Each new token goes to the request's ``emit``; a request that ends is finished through
    the queues. ``weight_version`` is the version of the weights it runs (stamped on the KV a
    prefill publishes); the engine sets it. ``capture_hidden_of``: the model whose final hidden
    states (``model.norm``'s output) requests may ask for, or None when none are kept."""

    def __init__(
        self,
        forward: TinyLM | StandInForward,
        pool: KVPool,
        queues: RequestQueues,
        *,
        capture_hidden_of: TinyLM | None,
        prefill_ms_per_token: float,
        decode_ms_per_step: float,
        publish_kv: Callable[[int, KVPayload | str], None] | None,
        weight_version: str,
    ):
        self._forward = forward
        self.pool = pool
        self._queues = queues
        self.prefill_ms_per_token = prefill_ms_per_token
        self.decode_ms_per_step = decode_ms_per_step
        self.publish_kv = publish_kv
        self.weight_version = weight_version
        self._hidden: torch.Tensor | None = None
        """The latest forward's final hidden states (``model.norm``'s output), when captured."""
        if capture_hidden_of is not None:  # (--enable-return-hidden-states: a forward hook)
            capture_hidden_of.model["norm"].register_forward_hook(self._keep_hidden)

    @property
    def context(self) -> int:
        """Positions a request may hold (prompt plus output)."""
        return self._forward.config.context

    def start(self, req: Request) -> None:
        """Start an admitted request (its slot given): write a PD decode's fetched KV and deliver
        its first token, or prefill it. A failure ends this request alone (a SimError with its
        status, anything else with a 500); either way it then moves to the running set."""
        if req.finished:  # aborted while it was being admitted (its client left): no prefill for it
            self._queues.started(req)
            return
        try:
            if req.mode is Mode.DECODE and req.kv is not None and req.retractions == 0:
                assert req.slot is not None  # given by the caller before start
                self.pool.write(req.slot, req.kv.kv)
                if req.top_logprobs_num:
                    req.output_top_logprobs.append(req.kv.first_top[: req.top_logprobs_num])
                self._emit_token(req, req.kv.first_token, req.kv.first_logprob)
            else:
                self._prefill(req)
        except SimError as exc:
            self._queues.finish(req, abort_reason(str(exc), exc.status))
        except Exception as exc:  # this request's fault or a bug it hit: it ends, the others go on
            log.error("request %s failed in the scheduler: %s: %s", req.rid, type(exc).__name__, exc)
            self._queues.finish(req, abort_reason(f"internal error: {type(exc).__name__}: {exc}", 500))
        self._queues.started(req)  # finished ones are reaped next iteration, keeping slots dense

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
            self._queues.finish(req, {"type": "length", "length": 0})
            return
        token = sample(logits[-1], req.sampling, _draw(req, len(ids) - 1))
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
            self._queues.finish(req, {"type": "length", "length": 1})
            return
        self._emit_token(req, token, logprob)

    def step(self, batch: list[Request]) -> None:
        """One decode step over ``batch`` (the running set: ``batch[i].slot == i``), each request
        not finished meanwhile getting its next token."""
        if self.decode_ms_per_step:
            time.sleep(self.decode_ms_per_step / 1000)
        # (a request aborted before its prefill ran has no token: its row is computed and dropped)
        ids = torch.tensor([r.output_ids[-1] if r.output_ids else 0 for r in batch])
        positions = torch.tensor([len(r.input_ids) + max(len(r.output_ids), 1) - 1 for r in batch])
        logits = self._forward.decode_step(ids, positions, self.pool)
        # log_softmax over [B, V] costs as much as a layer; only pay it when someone asked.
        logps = (
            torch.log_softmax(logits, dim=-1) if any(r.return_logprob or r.top_logprobs_num for r in batch) else None
        )
        emit = self._emit_token
        hidden = self._hidden
        for row, (req, token) in enumerate(zip(batch, _next_tokens(batch, logits), strict=True)):
            if token is None or req.finish is not None:  # aborted meanwhile; reaped next iteration
                continue
            if req.return_hidden_states and hidden is not None:
                req.hidden_states.append(hidden[row].tolist())
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
            self._queues.finish(req, reason)
            return
        every = req.stream_interval
        unsent = len(req.output_ids) - req.emitted
        if every == 1 or (every > 1 and (unsent >= every or req.emitted == 0)):
            req.emitted = len(req.output_ids)
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


def _next_tokens(batch: list[Request], logits: torch.Tensor) -> list[int | None]:
    """Each request's next token from its row of ``logits`` (None for one finished meanwhile):
    the greedy ones from one argmax, those that set only a temperature from one batched draw
    (``sample_plain``), the rest one by one. Each draw is the request's own (``_draw``)."""
    live = [row for row, req in enumerate(batch) if req.finish is None]
    out: list[int | None] = [None] * len(batch)
    greedy = [row for row in live if batch[row].sampling.greedy]
    if greedy:
        for row, token in zip(greedy, torch.argmax(_rows(logits, greedy), dim=-1).tolist(), strict=True):
            out[row] = token
    plain = [row for row in live if batch[row].sampling.plain]
    if plain:
        temperatures = [batch[row].sampling.temperature for row in plain]
        draws = [_draw(batch[row], _position(batch[row])) for row in plain]
        for row, token in zip(plain, sample_plain(_rows(logits, plain), temperatures, draws), strict=True):
            out[row] = token
    for row in live:
        if out[row] is None:
            req = batch[row]
            out[row] = sample(logits[row], req.sampling, _draw(req, _position(req)))
    return out


def _rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``logits[rows]``, without the copy when ``rows`` are all of them."""
    return logits if len(rows) == logits.shape[0] else logits[rows]


def _position(req: Request) -> int:
    """The position of the token a decode step draws for ``req``."""
    return len(req.input_ids) + len(req.output_ids) - 1


def _draw(req: Request, position: int) -> float:
    """The request's next uniform draw in [0, 1): from (sampling_seed, position) when it has a
    seed, as SGLang's seeded sampler hashes the seed with the position, so the token drawn at a
    position does not depend on which engine drew the earlier ones (PD equals non-PD); else the
    next of its own random stream (seeded from the engine's ``--random-seed``)."""
    seed = req.sampling.sampling_seed
    if seed is not None:
        return random.Random((int(seed) * 1_000_003 + position) % 2**63).random()
    if req.rng is None:  # (submitted without the engine: a stream of its own)
        req.rng = random.Random()
    return req.rng.random()
