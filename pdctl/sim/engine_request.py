"""What flows through the sim's engine: one ``Request`` (SGLang's ``Req``), its PD leg (``Mode``),
the KV a prefill hands to a decode (``KVPayload``), and SGLang's abort finish reasons.

The engine (pdctl.sim.engine) re-exports every name here; its parts use them: the queues
(pdctl.sim.queues), the scheduler (pdctl.sim.scheduler), the model runner (pdctl.sim.runner) and
the KV budget (pdctl.sim.kv_budget).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from pdctl.choices import Choice
from pdctl.sim.costed import Held
from pdctl.sim.model import decode
from pdctl.sim.sampling import SamplingOptions

__all__ = ["KVPayload", "Mode", "Request", "abort_reason", "failure_of", "first_failure"]


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
    """Called at the end, and after new tokens as ``stream_interval`` says (scheduler or caller
    thread); must not block."""
    stream_interval: int = 1
    """When ``emit`` hears of new tokens, as SGLang's output streamer sends a request's output:
    1, after every token; N, after the first token and then whenever N or more are unsent; 0,
    only at the end (a non-streamed answer, which nothing reads before it is whole)."""
    emitted: int = 0
    """Output tokens ``emit`` was last told of (``stream_interval``'s count of unsent ones)."""
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
    rng: random.Random | None = None
    """Its own random stream, when it samples without a seed (the engine seeds it)."""
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
