"""The engine side of the data plane: forward hooks that SGLang's ``--forward-hooks`` (or the
sim's) loads by import path, ``pdctl.colocate.engine:hook_factory``.

The plan registers one hook per ``Tap`` (``pdctl.colocate.env.hook_specs``): the embedding's
input (token ids), a module whose first input is the positions, optional auxiliary layers, and
``model.norm`` (the final hidden states), where a forward ends. ``pdctl.colocate.steps`` cuts
the forward into whole prompts and steps of ``batch_size``; then TP rank ``j`` sends sequences
``j*B/TP .. (j+1)*B/TP`` of a step to its trainer rank (``pdctl.colocate.wire``), inside the
forward: the engine waits for its trainer rank's "ready" as long as that one lives (backpressure:
a step the trainer has not taken holds the engine's scheduler, so a trainer must not wait on
that engine meanwhile, for instance to push weights into it).

Under SGLang every TP rank is a process that runs this hook on the same (replicated) hidden
states and sends its own shard; the sim runs all TP ranks of an engine in one process, which then
plays every rank (``local_tp_ranks``). Requirements on the engine: every prompt prefilled whole
and from position 0 (SGLang: ``--disable-radix-cache``, which the plan adds, and prompts within
``--chunked-prefill-size``); a request retracted and prefilled again is sent again.

With ``cuda_ipc`` each TP rank writes its shard straight into its trainer rank's buffer on their
GPU (``pdctl.colocate.ipc``; the copies are waited for before the trainer is told); with ``gloo``
the rows go through host memory.

A failure (the trainer gone, an error) is logged once, naming the trainer rank, and stops the
data plane of this engine; the engine keeps serving.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from pdctl.colocate import ipc
from pdctl.colocate.env import DataPlaneSpec, Tap
from pdctl.colocate.steps import Prefilled, StepCutter
from pdctl.colocate.wire import (
    HEADER_TAG,
    IPC_READY_LEN,
    READY_TAG,
    REFUSED,
    TOO_SMALL,
    WRITTEN,
    Header,
    IpcLayout,
    IpcReady,
    dtype_named,
    pack_meta,
)
from pdctl.colocate.world import READY_WAIT, UnionRank, join

log = logging.getLogger("pdctl.colocate")

Hook = Callable[[nn.Module, tuple[Any, ...], Any], None]

_producers: dict[str, Producer] = {}
_producers_lock = threading.Lock()


def hook_factory(config: dict[str, Any]) -> Hook:
    """SGLang's hook factory contract: called once per hook spec with its ``config``
    (``{"tap": ..., "engine": ENGINE_ID}``); the data plane itself comes from
    ``PDCTL_DATA_PLANE``. All taps of one engine share one ``Producer``."""
    tap = Tap(config["tap"])
    engine_id = str(config["engine"])
    with _producers_lock:
        producer = _producers.get(engine_id)
        if producer is None:
            producer = _producers[engine_id] = Producer(DataPlaneSpec.from_env(), engine_id)
    return producer.hook(tap)


def local_tp_ranks(tp: int) -> list[int]:
    """The TP ranks this process plays: its own under SGLang (one process per TP rank, whose
    model runner has set up its parallel state before it registers hooks), all of them elsewhere
    (the sim). Nothing is imported: SGLang's state module is looked up where it already is."""
    state = sys.modules.get("sglang.srt.distributed.parallel_state")
    if state is not None and state.model_parallel_is_initialized():
        return [int(state.get_tensor_model_parallel_rank())]
    return list(range(tp))


class Producer:
    """One engine's end of the data plane in this process (one or more of its TP ranks).

    Joins the union world in a background thread at once (the engine's start does not wait
    for the trainer); the first step waits for that join. Only the sequences of this process's
    own shards are kept until their step is sent."""

    def __init__(self, spec: DataPlaneSpec, engine_id: str, *, tp_ranks: Sequence[int] | None = None):
        self.spec = spec
        self.engine = spec.engine(engine_id)
        self.tp_ranks = list(tp_ranks) if tp_ranks is not None else local_tp_ranks(self.engine.tp)
        self.dtype = dtype_named(spec.dtype) if spec.dtype else None
        self.shard_size = spec.batch_size // self.engine.tp
        self.steps_sent = 0
        self.failure: str | None = None
        self._ids: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self._aux: list[Any] = []
        self._cutter = StepCutter(spec.batch_size, self.engine.tp, self.tp_ranks, name=engine_id)
        self._members: list[UnionRank] = []
        self._opened: dict[int, tuple[int, torch.Tensor]] = {}
        """cuda_ipc: union rank -> (generation, its trainer rank's buffer opened here)."""
        self._pinned = torch.empty(0, dtype=torch.int64)
        self._join_error: BaseException | None = None
        self._joined = threading.Event()
        threading.Thread(target=self._join, name=f"data-plane-{engine_id}", daemon=True).start()

    def _join(self) -> None:
        try:
            self._members = join(self.spec, [self.engine.first_rank + j for j in self.tp_ranks])
            log.info("data plane: engine %s joined as union ranks %s", self.engine.id, [m.rank for m in self._members])
        except BaseException as exc:  # reported by the first step that needs the groups
            self._join_error = exc
        finally:
            self._joined.set()

    # -- hooks -----------------------------------------------------------------------------
    def hook(self, tap: Tap) -> Hook:
        """The forward hook for ``tap``; any tap but INPUT_IDS, POSITIONS and AUX gets the final-states hook."""
        if tap is Tap.INPUT_IDS:
            return self._on_input_ids
        if tap is Tap.POSITIONS:
            return self._on_positions
        if tap is Tap.AUX:
            return self._on_aux
        return self._on_final

    def _on_input_ids(self, _module: nn.Module, inputs: tuple[Any, ...], _output: Any) -> None:
        # The embedding runs first in a forward: whatever an interrupted forward left is dropped.
        self._ids, self._positions, self._aux = inputs[0], None, []

    def _on_positions(self, _module: nn.Module, inputs: tuple[Any, ...], _output: Any) -> None:
        self._positions = inputs[0]

    def _on_aux(self, _module: nn.Module, _inputs: tuple[Any, ...], output: Any) -> None:
        self._aux.append(output)  # (reduced to rows only for the sequences kept: see _rows)

    def _on_final(self, _module: nn.Module, _inputs: tuple[Any, ...], output: Any) -> None:
        # SGLang's final norm returns (normed, residual): the first is the final hidden states.
        final = output[0] if isinstance(output, tuple) else output
        ids, positions, aux = self._ids, self._positions, tuple(self._aux)
        self._ids, self._positions, self._aux = None, None, []
        if ids is None or positions is None:
            return
        self.add_forward(ids, positions, final, aux)

    # -- steps -------------------------------------------------------------------------------
    def add_forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, final: Any, aux: tuple[Any, ...] = ()
    ) -> None:
        """One forward's rows; sends every step that is complete (blocking until its trainer
        ranks take it). ``final`` and each of ``aux`` are a tensor ``[rows, hidden]`` or SGLang's
        ``(hidden, residual)`` pair (the residual stream is their sum). Never raises: a failure
        stops this engine's data plane and is logged."""
        if self.failure is not None:
            return
        try:
            self._add_forward(input_ids, positions, final, aux)
        except Exception as exc:  # the forward (and the engine) must go on
            self._fail(self.steps_sent, None, f"{type(exc).__name__}: {exc}")

    def _add_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, final: Any, aux: tuple[Any, ...]) -> None:
        for shards in self._cutter.add(input_ids, positions, final, aux):
            self._send_step(shards)
            if self.failure is not None:
                return

    def _send_step(self, shards: dict[int, list[Prefilled]]) -> None:
        step = self.steps_sent
        if not self._joined.wait(self.spec.join_timeout_secs) or self._join_error is not None:
            self._fail(step, None, f"could not join the union world: {self._join_error or 'timed out'}")
            return
        for tp_rank, member in zip(self.tp_ranks, self._members, strict=True):
            trainer = self.spec.trainer_of(self.engine, tp_rank)
            try:
                self._send_shard(member, trainer, step, shards[tp_rank])
            except (RuntimeError, ValueError) as exc:
                self._fail(step, trainer, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                return
        self.steps_sent += 1

    def _send_shard(self, member: UnionRank, trainer: int, step: int, shard: list[Prefilled]) -> None:
        # One list of row blocks per tensor sent: the final hidden states, then each aux layer.
        blocks = [[s.final for s in shard], *([s.aux[k] for s in shard] for k in range(len(shard[0].aux)))]
        if self.spec.backend == "cuda_ipc":
            self._write_shard(member, trainer, step, shard, blocks)
            return
        # The header goes out as soon as the step is cut; the trainer posts its receives for the
        # sizes it names before it says ready, so the tensors' sends go at once (pdctl.colocate.wire).
        tensors = [self._joined_rows(parts) for parts in blocks]
        final = tensors[0]
        header = Header(step, len(shard), final.shape[0], final.shape[1], len(tensors) - 1, final.dtype)
        group = member.group
        header_sent = group.send([header.encode()], trainer, HEADER_TAG)
        meta = pack_meta([s.input_ids for s in shard])
        ready = torch.empty(1, dtype=torch.int64)
        group.recv([ready], trainer, READY_TAG).wait(READY_WAIT)
        header_sent.wait()
        if int(ready) == REFUSED:
            raise ValueError(f"trainer rank {trainer} refused step {step}'s header (its error says why)")
        if int(ready) != step:
            raise ValueError(f"trainer rank {trainer} is ready for step {int(ready)}, this engine sends step {step}")
        sent = [group.send([message], trainer, tag) for tag, message in enumerate([meta, *tensors], HEADER_TAG + 1)]
        for work in sent:  # (sent together: one wait for them all, not one hand-off to gloo's thread each)
            work.wait()

    def _write_shard(
        self, member: UnionRank, trainer: int, step: int, shard: list[Prefilled], blocks: list[list[torch.Tensor]]
    ) -> None:
        """cuda_ipc: the shard written into the trainer rank's buffer on their GPU (the hidden
        states cast to the plane's dtype by the copy), then the header says so; a buffer too
        small is answered TOO_SMALL, and the one that replaces it is written."""
        rows, hidden = sum(p.shape[0] for p in blocks[0]), blocks[0][0].shape[1]
        dtype = self.dtype or blocks[0][0].dtype
        header = Header(step, len(shard), rows, hidden, len(blocks) - 1, dtype, WRITTEN)
        layout = IpcLayout.of(header)
        buffer = self._opened_buffer(member, trainer, step, READY_WAIT)
        if buffer is None or buffer.numel() < layout.size:
            member.group.send([replace(header, status=TOO_SMALL).encode()], trainer, 0).wait()
            buffer = self._opened_buffer(member, trainer, step, None)
            if buffer is None or buffer.numel() < layout.size:
                raise ValueError(f"trainer rank {trainer} named a buffer too small for step {step} again")
        if blocks[0][0].device != buffer.device:
            raise ValueError(
                f"this engine rank's hidden states are on {blocks[0][0].device}, trainer rank {trainer}'s buffer on "
                f"{buffer.device}: cuda_ipc pairs ranks on one GPU"
            )
        targets, meta = layout.views(buffer, header)
        for target, parts in zip(targets, blocks, strict=True):
            span = _adjacent_span(parts)
            if span is not None:  # (SGLang's batched prefill: one copy)
                target.copy_(span)
                continue
            row = 0
            for part in parts:
                target[row : row + part.shape[0]].copy_(part)
                row += part.shape[0]
        packed = pack_meta([s.input_ids for s in shard])  # (in host memory: one copy up, from pinned memory)
        staging = self._staging(packed.numel())
        staging.copy_(packed)
        meta.copy_(staging, non_blocking=True)
        torch.cuda.current_stream(buffer.device).synchronize()  # (the staging is free again after this)
        member.group.send([header.encode()], trainer, 0).wait()

    def _staging(self, n: int) -> torch.Tensor:
        """``n`` int64 of pinned host memory (an asynchronous copy to the GPU; pageable memory
        makes it a synchronous one through CUDA's own staging), grown when a step needs more."""
        if self._pinned.numel() < n:
            self._pinned = torch.empty(max(n, 2 * self._pinned.numel()), dtype=torch.int64, pin_memory=True)
        return self._pinned[:n]

    def _opened_buffer(self, member: UnionRank, trainer: int, step: int, wait: timedelta | None) -> torch.Tensor | None:
        """The trainer rank's ready for ``step`` and the buffer it names (opened here once per
        generation), None while it has none."""
        raw = torch.empty(IPC_READY_LEN, dtype=torch.int64)
        work = member.group.recv([raw], trainer, 0)
        if wait is None:
            work.wait()  # (the group's timeout)
        else:
            work.wait(wait)
        ready = IpcReady.decode(raw)
        if ready.step != step:
            raise ValueError(f"trainer rank {trainer} is ready for step {ready.step}, this engine sends step {step}")
        if ready.handle_len > ipc.MAX_HANDLE_BYTES:
            raise ValueError(f"trainer rank {trainer} announced a buffer handle of {ready.handle_len} bytes")
        if ready.handle_len > 0:
            encoded = torch.empty(ready.handle_len, dtype=torch.uint8)
            member.group.recv([encoded], trainer, 0).wait()
            self._opened.pop(member.rank, None)  # (drops the last buffer: its trainer may free it)
            try:
                opened = ipc.open_shared(ipc.Handle.decode(encoded.numpy().tobytes()))
            except (TypeError, RuntimeError) as exc:  # (CUDA refused it)
                raise ValueError(f"trainer rank {trainer}'s buffer could not be opened: {exc}") from exc
            self._opened[member.rank] = (ready.generation, opened)
        if ready.capacity == 0:
            return None
        generation, buffer = self._opened.get(member.rank, (-1, None))
        if buffer is None or generation != ready.generation:
            raise ValueError(f"trainer rank {trainer} named buffer {ready.generation} without its handle")
        return buffer

    def _joined_rows(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The shard's rows as one tensor: a view when they lie back to back in one forward's
        output (SGLang's batched prefill: no copy), else a concatenation (the sim prefills one
        sequence per forward); cast to the plane's dtype where it sets one; in host memory
        (gloo reads only host pointers)."""
        rows = _adjacent_span(parts)
        if rows is None:
            rows = torch.cat(parts)
        if self.dtype is not None and rows.dtype != self.dtype:
            rows = rows.to(self.dtype)
        if rows.device.type != "cpu":
            rows = rows.cpu()
        return rows.contiguous()

    def _fail(self, step: int, trainer: int | None, why: str) -> None:
        peer = f"trainer rank {trainer}" if trainer is not None else "the trainer"
        self.failure = f"data plane of engine {self.engine.id}: step {step} to {peer} failed: {why}"
        self._cutter.clear()
        log.error("%s; this engine sends no more steps (it keeps serving)", self.failure)


def _adjacent_span(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """One view over row-contiguous ``parts`` that follow each other in the same storage, or None."""
    first = parts[0]
    if len(parts) == 1:
        return first
    if not all(p.is_contiguous() for p in parts):
        return None
    storage = first.untyped_storage().data_ptr()
    end = first.data_ptr() + first.numel() * first.element_size()
    for part in parts[1:]:
        if part.untyped_storage().data_ptr() != storage or part.data_ptr() != end or part.shape[1:] != first.shape[1:]:
            return None
        end += part.numel() * part.element_size()
    return first.as_strided((sum(p.shape[0] for p in parts), *first.shape[1:]), first.stride())
