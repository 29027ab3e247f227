"""Cutting forwards into steps: which rows of a forward are whole prompts, and which of them
belong to which TP rank's shard of which step. No I/O.

A forward's rows are cut where a position is 0; a segment is a prompt only when its positions are
exactly ``0..n-1`` (decode rows mixed into a prefill are not; a longer prompt's first chunk is
indistinguishable from a whole prompt, and its later chunks start at no position 0). The
health probe's one-token ``input_ids [0]`` is not data. ``batch_size`` prompts make a step, in
the order the engine prefilled them; TP rank ``j`` owns prompts ``j*B/TP .. (j+1)*B/TP`` of it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

log = logging.getLogger("pdctl.colocate")

HEALTH_PROBE_ID = 0
"""``GET /health`` prefills ``input_ids=[0]`` (sglang-protocol.md 5): such a one-token sequence is
dropped. The plan adds ``--skip-server-warmup`` so that the warm-up prompt is not sent either."""

Shards = dict[int, list["Prefilled"]]
"""A complete step: each TP rank this process plays -> its sequences, in step order."""


@dataclass(frozen=True, slots=True)
class Prefilled:
    """One prefilled sequence, as the forward left it (views, where the forward's output allows;
    the ids in host memory)."""

    input_ids: torch.Tensor
    final: torch.Tensor
    aux: tuple[torch.Tensor, ...]


class StepCutter:
    """Gathers steps of ``batch_size`` prompts, keeping only the shards of ``tp_ranks`` (the
    others are counted, not held)."""

    def __init__(self, batch_size: int, tp: int, tp_ranks: Sequence[int], *, name: str = ""):
        self.batch_size = batch_size
        self.shard_size = batch_size // tp
        self.tp_ranks = list(tp_ranks)
        self.name = name
        self.in_step = 0
        """Prompts of the step being gathered so far (every shard's, kept or not)."""
        self._shards: Shards = {j: [] for j in self.tp_ranks}
        self._warned_partial = False

    def add(self, input_ids: torch.Tensor, positions: torch.Tensor, final: Any, aux: tuple[Any, ...]) -> list[Shards]:
        """One forward's rows; returns the steps they complete (usually none or one).

        ``final`` and each of ``aux`` are a tensor ``[rows, hidden]`` or SGLang's ``(hidden,
        residual)`` pair of a decoder layer (the residual stream is their sum)."""
        if capturing():
            return []  # (see capturing)
        done = []
        prompts, host_ids = _prompts(input_ids, positions, self._warn_partial)
        for start, end in prompts:
            owner = self.in_step // self.shard_size
            if owner in self._shards:
                rows = tuple(_rows(a, start, end) for a in aux)
                self._shards[owner].append(Prefilled(host_ids[start:end], _rows(final, start, end), rows))
            self.in_step += 1
            if self.in_step == self.batch_size:
                done.append(self._shards)
                self.clear()
        return done

    def clear(self) -> None:
        """Drop whatever the step being gathered holds and start the next one empty."""
        self.in_step = 0
        self._shards = {j: [] for j in self.tp_ranks}

    def _warn_partial(self, rows: int) -> None:
        if not self._warned_partial:
            self._warned_partial = True
            log.warning(
                "data plane of engine %s: a prefill segment of %d rows is not positions 0..%d (a chunked "
                "prefill, or decode rows mixed into a prefill): not sent; prompts must be prefilled whole",
                self.name,
                rows,
                rows - 1,
            )


def capturing() -> bool:
    """Whether a CUDA graph is being captured on this thread's stream: SGLang captures its decode
    graphs at start by running forwards of dummy rows, which reach the hooks; they are not data,
    and the host copy that cutting a forward takes would break the capture."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _prompts(
    input_ids: torch.Tensor, positions: torch.Tensor, partial: Callable[[int], None]
) -> tuple[list[tuple[int, int]], torch.Tensor]:
    """``(start, end)`` of each whole prompt of a forward (positions exactly ``0..n-1``), the
    health probe's left out, and the forward's ids in host memory; ``partial(rows)`` for each
    other segment that starts at position 0. Ids and positions are copied to the host once and
    cut there with numpy: on a GPU each small kernel and host sync costs tens of microseconds,
    and torch's CPU ops cost several each."""
    host = torch.stack([positions.to(torch.int64), input_ids.to(torch.int64)]).cpu()
    at, ids = host[0].numpy(), host[1]
    starts = np.flatnonzero(at == 0)
    if starts.size == 0:
        return [], ids  # a decode step
    ends = np.append(starts[1:], at.size)
    first = int(starts[0])
    expected = np.arange(first, at.size) - np.repeat(starts, ends - starts)
    wrong = np.add.reduceat((at[first:] != expected).astype(np.int64), starts - first)
    firsts = ids.numpy()[starts]
    out = []
    for start, end, bad, first_id in zip(starts.tolist(), ends.tolist(), wrong.tolist(), firsts.tolist(), strict=True):
        if end - start == 1 and first_id == HEALTH_PROBE_ID:
            continue
        if bad:
            partial(end - start)
            continue
        out.append((start, end))
    return out, ids


def _rows(output: Any, start: int, end: int) -> torch.Tensor:
    """Rows ``start:end`` of a hooked module's output: a tensor, or SGLang's ``(hidden,
    residual)`` pair of a decoder layer, whose residual stream is their sum."""
    if isinstance(output, tuple):
        hidden, residual = output[0], output[1] if len(output) > 1 else None
        return hidden[start:end] + residual[start:end] if residual is not None else hidden[start:end]
    return output[start:end]
