"""The trainer side of the data plane: ``DataPlane.from_env()`` on every trainer rank, then
``recv()`` once per step.

Trainer rank ``i`` receives what the engine rank on its GPU sends (``pdctl.colocate.engine``):
its shard of each step's sequences, packed (``[n_tokens, hidden]`` with the sequence lengths),
into buffers allocated once and grown only when a step is larger than every one before. The
tensors of a ``Step`` are views of those buffers: the next ``recv`` overwrites them. With
``cuda_ipc`` they are on this rank's GPU (the ids, lengths and mask too), written there by the
engine rank (one device-to-device copy each); ``recv`` waits for this process's GPU work first
(every stream), so that work still queued on the last step's views is done before they are
overwritten. With
``gloo`` they are in host memory.
``trainer_group`` is the trainer ranks' own world (torchrun's), for FSDP or DDP.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pdctl.colocate import ipc
from pdctl.colocate.env import DataPlaneSpec
from pdctl.colocate.wire import (
    HEADER_LEN,
    HEADER_TAG,
    READY_TAG,
    REFUSED,
    TOO_SMALL,
    WRITTEN,
    Header,
    IpcLayout,
    IpcReady,
    unpack_meta,
)
from pdctl.colocate.world import join
from pdctl.errors import DataPlaneError


@dataclass(frozen=True, slots=True)
class Step:
    """One step's shard. ``loss_mask`` is 1 where a token has a next token in its sequence."""

    step: int
    engine: str
    tp_rank: int
    input_ids: torch.Tensor
    seq_lens: torch.Tensor
    loss_mask: torch.Tensor
    hidden: torch.Tensor
    """``[n_tokens, hidden]``: the final hidden states (``model.norm``'s output)."""
    aux: tuple[torch.Tensor, ...]
    """``[n_tokens, hidden]`` per auxiliary layer, in ascending layer order (``aux_layers`` sorted)."""


class DataPlane:
    """Trainer rank ``rank``'s end of the union world; ``recv`` takes steps 0, 1, 2, ... in order."""

    def __init__(self, spec: DataPlaneSpec, rank: int, *, device: torch.device | str | None = None):
        self.spec = spec
        self.rank = rank
        engine, self.tp_rank = spec.pair_of_trainer(rank)
        self.engine = engine.id
        self.peer = spec.trainer_ranks + rank
        self.device = _device(spec.backend, device)
        self.next_step = 0
        self.failure: DataPlaneError | None = None
        """Set by the first failed ``recv``: the wire is then out of step, so later calls raise it again."""
        self._ready = torch.empty(1, dtype=torch.int64)
        self._header = torch.empty(HEADER_LEN, dtype=torch.int64)
        self._meta = torch.empty(0, dtype=torch.int64)
        self._hidden = torch.empty(0, device=self.device)
        """gloo: the hidden states' buffer."""
        self._buffer = torch.empty(0, dtype=torch.uint8, device=self.device)
        """cuda_ipc: the buffer the engine writes a step into (``IpcLayout``), on this rank's GPU."""
        self._generation = 0
        """cuda_ipc: bumped each time ``_buffer`` is allocated anew (the engine opens each once)."""
        self._shared_generation = -1
        self._member = join(spec, [rank])[0]

    @classmethod
    def from_env(cls, *, rank: int | None = None, device: torch.device | str | None = None) -> DataPlane:
        """This process's end, from ``PDCTL_DATA_PLANE`` and torchrun's ``RANK`` (or ``rank``).
        Blocks until every rank of the union world (every engine rank) has joined.

        Raises:
            DataPlaneError: no data plane in the environment, or no rank.
        """
        try:
            spec = DataPlaneSpec.from_env()
        except ValueError as exc:
            raise DataPlaneError(str(exc)) from None
        if rank is None:
            if "RANK" not in os.environ:
                raise DataPlaneError("no trainer rank: run under torchrun (RANK) or pass rank=")
            rank = int(os.environ["RANK"])
        if not 0 <= rank < spec.trainer_ranks:
            raise DataPlaneError(f"trainer rank {rank} is outside the data plane's {spec.trainer_ranks} trainer ranks")
        try:
            return cls(spec, rank, device=device)
        except (RuntimeError, ValueError, KeyError) as exc:  # the store or a group could not be made
            where = f"{spec.master_address}:{spec.master_port}"
            raise DataPlaneError(f"trainer rank {rank} could not join the data plane at {where}: {exc}") from exc

    @property
    def trainer_group(self) -> dist.ProcessGroup | None:
        """The trainer ranks' own group (torchrun's world, initialised by the trainer) for FSDP or
        DDP; None when the default group is not initialised."""
        if not dist.is_initialized():
            return None
        if dist.get_world_size() != self.spec.trainer_ranks:
            raise DataPlaneError(
                f"the default group has {dist.get_world_size()} ranks, "
                f"the data plane {self.spec.trainer_ranks} trainer ranks"
            )
        return dist.group.WORLD

    def recv(self) -> Step:
        """The next step's shard from this rank's engine rank. The engine sends it only once
        this rank says "ready" for it (with ``gloo``, after the step's header), so it never runs
        ahead; a header this rank cannot take is answered with a refusal (the engine fails that
        step and keeps serving).

        Raises:
            DataPlaneError: the engine rank sent nothing within ``timeout_secs``, closed the
            connection (it died), or sent another step than the one asked for.
        """
        if self.failure is not None:
            raise self.failure
        try:
            return self._recv()
        except DataPlaneError as exc:
            self.failure = exc
            raise

    def _recv(self) -> Step:
        step = self.next_step
        try:
            if self.spec.backend == "cuda_ipc":
                header, views, meta = self._recv_by_ipc(step)
            else:
                header, views, meta = self._recv_by_gloo(step)
        except (RuntimeError, ValueError) as exc:
            raise self._error(step, _why(exc, self.spec.timeout_secs)) from exc
        self.next_step += 1
        ids, lens, mask = unpack_meta(meta, header)
        return Step(step, self.engine, self.tp_rank, ids, lens, mask, views[0], tuple(views[1:]))

    def _recv_by_gloo(self, step: int) -> tuple[Header, list[torch.Tensor], torch.Tensor]:
        group = self._member.group
        group.recv([self._header], self.peer, HEADER_TAG).wait()
        try:
            header = self._checked_header(step)
            meta, views = self._buffer_meta(header.meta_len), self._buffer_hidden(header)
            # Every receive is posted before the ready goes out: the engine's sends find them
            # posted and go at once (each tensor has its own tag: their matching is explicit).
            received = [group.recv([t], self.peer, tag) for tag, t in enumerate([meta, *views], HEADER_TAG + 1)]
        except BaseException:
            # The engine waits for a ready as long as this process lives: tell it the step is
            # refused, or its forward (and its scheduler) would hang until this process ends.
            self._ready[0] = REFUSED
            with contextlib.suppress(RuntimeError):
                group.send([self._ready], self.peer, READY_TAG).wait()
            raise
        self._ready[0] = step
        group.send([self._ready], self.peer, READY_TAG).wait()
        for work in received:
            work.wait()
        return header, views, meta

    def _recv_by_ipc(self, step: int) -> tuple[Header, list[torch.Tensor], torch.Tensor]:
        """Ready (naming the buffer), then the header once the engine has written into it; a
        buffer too small for the step is replaced by one that fits and named again."""
        if self._buffer.numel():
            torch.cuda.synchronize(self.device)  # (every stream of this process: see the module's docstring)
        self._send_ipc_ready(step)
        header = self._header_of(step)
        if header.status == TOO_SMALL:
            # Grown by half again at least: prompts of varying lengths do not cost a new buffer
            # (and a new IPC open in the engine) at each new longest step.
            size = max(IpcLayout.of(header).size, self._buffer.numel() * 3 // 2)
            self._buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
            self._generation += 1
            self._send_ipc_ready(step)
            header = self._header_of(step)
        if header.status != WRITTEN:
            raise self._error(step, f"answered status {header.status} to a cuda_ipc ready")
        layout = IpcLayout.of(header)
        if layout.size > self._buffer.numel():
            raise self._error(step, f"wrote {layout.size} bytes into a buffer of {self._buffer.numel()}")
        views, meta = layout.views(self._buffer, header)
        return header, views, meta

    def _send_ipc_ready(self, step: int) -> None:
        group = self._member.group
        handle = b""
        if self._buffer.numel() and self._shared_generation != self._generation:
            handle = ipc.share(self._buffer).encode()
        ready = IpcReady(step, self._generation, self._buffer.numel(), len(handle))
        group.send([ready.encode()], self.peer, 0).wait()
        if handle:
            group.send([torch.frombuffer(bytearray(handle), dtype=torch.uint8)], self.peer, 0).wait()
            self._shared_generation = self._generation

    def _header_of(self, step: int) -> Header:
        self._member.group.recv([self._header], self.peer, HEADER_TAG).wait()
        return self._checked_header(step)

    def _checked_header(self, step: int) -> Header:
        """The header just received, checked against ``step`` and the spec."""
        header = Header.decode(self._header)
        if header.step != step:
            raise self._error(step, f"sent step {header.step} when step {step} was asked for")
        if header.n_aux != len(self.spec.aux_layers):
            raise self._error(
                step,
                f"sent {header.n_aux} auxiliary layer(s) for aux_layers {list(self.spec.aux_layers)}: a layer "
                "the model does not have matches no module (the engine's log names the hook spec)",
            )
        return header

    def _buffer_meta(self, n: int) -> torch.Tensor:
        if self._meta.numel() < n:
            self._meta = torch.empty(n, dtype=torch.int64)
        return self._meta[:n]

    def _buffer_hidden(self, header: Header) -> list[torch.Tensor]:
        per = header.n_tokens * header.hidden
        need = per * (1 + header.n_aux)
        if self._hidden.dtype != header.dtype or self._hidden.numel() < need:
            self._hidden = torch.empty(need, dtype=header.dtype, device=self.device)
        shape = (header.n_tokens, header.hidden)
        return [self._hidden[k * per : (k + 1) * per].view(shape) for k in range(1 + header.n_aux)]

    def _error(self, step: int, why: str) -> DataPlaneError:
        return DataPlaneError(
            f"data plane: engine {self.engine} TP rank {self.tp_rank} (union rank {self.peer}) -> trainer rank "
            f"{self.rank}, step {step}: {why}",
            engine=self.engine,
            rank=self.peer,
            step=step,
        )

    def close(self) -> None:
        """Drop the groups (the engine ranks see the connection close); ``recv`` then raises."""
        if self.failure is None:
            self.failure = DataPlaneError(f"data plane of trainer rank {self.rank} is closed")
        self.__dict__.pop("_member", None)

    def __enter__(self) -> DataPlane:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def _device(backend: str, device: torch.device | str | None) -> torch.device:
    """gloo: host memory (gloo reads only host pointers); cuda_ipc: the given device, else this
    rank's (torchrun's LOCAL_RANK among the visible GPUs, else the current one)."""
    if backend == "gloo":
        if device is not None and torch.device(device).type != "cpu":
            raise DataPlaneError(f"backend gloo receives into host memory, not {device}")
        return torch.device("cpu")
    if device is None:
        local = os.environ.get("LOCAL_RANK")
        device = torch.device("cuda", int(local) if local is not None else torch.cuda.current_device())
    if torch.device(device).type != "cuda":
        raise DataPlaneError(f"backend {backend} receives on this rank's GPU, not {device}")
    return torch.device(device)


def _why(exc: BaseException, timeout_secs: float) -> str:
    text = str(exc)
    if "Timed out" in text or "timed out" in text:
        return f"nothing sent within {timeout_secs:g} s (timeout_secs)"
    if "Connection closed" in text or "Connection reset" in text:
        return "the engine rank closed the connection (it died or stopped): see its log (pdctl logs)"
    return text.splitlines()[0] if text else type(exc).__name__
