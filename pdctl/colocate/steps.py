"""Cutting forwards into steps: which rows of a forward are whole prompts, and which of them
belong to which TP rank's shard of which step. No I/O.

A forward's rows are cut where a position is 0; a segment is a prompt only when its positions are
exactly ``0..n-1`` (a chunk of a longer prompt, or decode rows mixed into a prefill, is not). The
health probe's one-token ``input_ids [0]`` is not data. ``batch_size`` prompts make a step, in
the order the engine prefilled them; TP rank ``j`` owns prompts ``j*B/TP .. (j+1)*B/TP`` of it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger("pdctl.colocate")

HEALTH_PROBE_ID = 0
"""``GET /health`` prefills ``input_ids=[0]`` (sglang-protocol.md 5): such a one-token sequence is
dropped. The plan adds ``--skip-server-warmup`` so that the warm-up prompt is not sent either."""

Shards = dict[int, list["Prefilled"]]
"""A complete step: each TP rank this process plays -> its sequences, in step order."""


@dataclass(frozen=True, slots=True)
class Prefilled:
    """One prefilled sequence, as the forward left it (views, where the forward's output allows)."""

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
        starts = (positions == 0).nonzero().flatten().tolist()
        if not starts:
            return []  # a decode step
        done = []
        for start, end in zip(starts, [*starts[1:], len(positions)], strict=True):
            if end - start == 1 and int(input_ids[start]) == HEALTH_PROBE_ID:
                continue
            if not torch.equal(positions[start:end], torch.arange(end - start, device=positions.device)):
                self._warn_partial(end - start)
                continue
            owner = self.in_step // self.shard_size
            if owner in self._shards:
                rows = tuple(_rows(a, start, end) for a in aux)
                self._shards[owner].append(Prefilled(input_ids[start:end], _rows(final, start, end), rows))
            self.in_step += 1
            if self.in_step == self.batch_size:
                done.append(self._shards)
                self.clear()
        return done

    def clear(self) -> None:
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


def _rows(output: Any, start: int, end: int) -> torch.Tensor:
    """Rows ``start:end`` of a hooked module's output: a tensor, or SGLang's ``(hidden,
    residual)`` pair of a decoder layer, whose residual stream is their sum."""
    if isinstance(output, tuple):
        hidden, residual = output[0], output[1] if len(output) > 1 else None
        return hidden[start:end] + residual[start:end] if residual is not None else hidden[start:end]
    return output[start:end]
