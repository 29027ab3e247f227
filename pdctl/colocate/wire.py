"""One step on the wire between an engine rank and its trainer rank.

``gloo`` (everything through the gloo group; each message's tag in brackets):

1. engine -> trainer: the header, int64 ``[HEADER_LEN]`` (``Header``, ``status`` ``FOLLOWS``),
   as soon as the engine has the step [0];
2. trainer -> engine: ``READY`` int64 ``[step]`` once the trainer has posted its receives of 3
   and 4, or ``[REFUSED]`` when it cannot take the step (a header it does not expect: the engine
   fails the step and keeps serving, rather than waiting for a ready while the trainer lives) [0];
3. engine -> trainer: int64 ``[n_tokens + n_seqs + n_tokens]``: input ids, sequence lengths,
   loss mask [1];
4. engine -> trainer: the final hidden states ``[n_tokens, hidden]`` [2], then each auxiliary
   layer's ``[n_tokens, hidden]``, in ``aux_layers`` order [3, 4, ...].

The header comes first so that the trainer can post its receives, of the sizes it names, before
the tensors are sent: gloo sends a message only once the peer has announced the receive for it
(a send made earlier waits for that notice, and its bytes then go from gloo's own thread after a
wake-up); one whose receive is already posted goes at once from the sending thread. Measured on
CPU, a bare send/recv of 16 MB whose receive was posted first took 0.5-0.7x the time of one whose
receive was posted as the send began.

``cuda_ipc`` (two small messages; the bytes go through the GPU's memory):

1. trainer -> engine: ``IpcReady`` int64 ``[step, generation, capacity, n]``: the step, and the
   trainer's receive buffer on their GPU (``capacity`` bytes; none yet at step 0), followed, when
   the engine has not opened that generation of it yet (``n > 0``), by its
   ``pdctl.colocate.ipc.Handle`` as ``n`` bytes of uint8;
2. the engine writes the step into the buffer (``IpcLayout``: the hidden states as in gloo's 4,
   then gloo's 3), waits for the copies, and sends the header with ``status`` ``WRITTEN``; or,
   when the step does not fit, sends it with ``TOO_SMALL`` and writes nothing; the trainer then
   sends another ``IpcReady`` naming a buffer that fits, and the engine writes and answers again.

The engine sends no step's tensors (only its header) until the trainer says it is ready for
exactly that step, so neither side runs ahead; the trainer checks the step number it gets, so no
step is taken twice or skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

HEADER_LEN = 8
READY_TAG = HEADER_TAG = 0
"""gloo tags: the ready and the header (opposite directions); the meta and the hidden states
follow the header's (module docstring). cuda_ipc sends everything with tag 0."""
REFUSED = -1
"""gloo: the trainer's ready for a step whose header it cannot take."""
IPC_READY_LEN = 4
FOLLOWS, WRITTEN, TOO_SMALL = 0, 1, 2
"""A header's ``status``: gloo: the step's tensors follow; cuda_ipc: written into the trainer's
buffer, or not, the buffer being too small."""
ALIGN = 256
"""Byte alignment of each region of a cuda_ipc buffer (any dtype's view of it is aligned)."""
MAGIC = 0x70646370  # "pdcp": a header that is not one fails loudly instead of sizing buffers

DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
"""Hidden-state dtypes by wire code (the index)."""


def dtype_named(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if dtype not in DTYPES:
        known = ", ".join(str(d).removeprefix("torch.") for d in DTYPES)
        raise ValueError(f"data plane dtype {name!r}: one of {known}")
    return dtype


@dataclass(frozen=True, slots=True)
class Header:
    """One step's header on the wire: its number, sizes, dtype and ``status``."""

    step: int
    n_seqs: int
    n_tokens: int
    hidden: int
    n_aux: int
    dtype: torch.dtype
    status: int = FOLLOWS

    def encode(self) -> torch.Tensor:
        """As an int64 tensor of 8 values, the magic first."""
        code = DTYPES.index(self.dtype)
        fields = [MAGIC, self.step, self.n_seqs, self.n_tokens, self.hidden, self.n_aux, code, self.status]
        return torch.tensor(fields, dtype=torch.int64)

    @classmethod
    def decode(cls, raw: torch.Tensor) -> Header:
        """The header ``raw`` holds; ValueError when it is not one (magic, dtype code, sizes or status)."""
        magic, step, n_seqs, n_tokens, hidden, n_aux, code, status = (int(v) for v in raw.tolist())
        if (
            magic != MAGIC
            or not 0 <= code < len(DTYPES)
            or min(n_seqs, n_tokens, hidden, n_aux) < 0
            or status not in (FOLLOWS, WRITTEN, TOO_SMALL)
        ):
            raise ValueError(f"not a data plane header: {raw.tolist()}")
        return cls(step, n_seqs, n_tokens, hidden, n_aux, DTYPES[code], status)

    @property
    def meta_len(self) -> int:
        """int64 values of the step's meta (``pack_meta``): ids, lengths and loss mask."""
        return 2 * self.n_tokens + self.n_seqs


def pack_meta(input_ids: list[torch.Tensor]) -> torch.Tensor:
    """Ids, lengths and loss mask of a shard's sequences as one int64 tensor (``Header.meta_len``)
    in host memory.

    The loss mask is 1 on every token that has a next token in its sequence (all but each
    sequence's last): the positions a next-token draft head can be trained on."""
    lengths = torch.tensor([len(ids) for ids in input_ids], dtype=torch.int64)
    ids = torch.cat(input_ids).to(device="cpu", dtype=torch.int64) if input_ids else torch.empty(0, dtype=torch.int64)
    mask = torch.ones_like(ids)
    mask[torch.cumsum(lengths, 0) - 1] = 0
    return torch.cat([ids, lengths, mask])


def unpack_meta(meta: torch.Tensor, header: Header) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, s = header.n_tokens, header.n_seqs
    return meta[:n], meta[n : n + s], meta[n + s : 2 * n + s]


@dataclass(frozen=True, slots=True)
class IpcReady:
    """cuda_ipc, trainer -> engine: ready for ``step``, into buffer ``generation`` of ``capacity``
    bytes (``handle_len`` bytes of its handle follow when > 0)."""

    step: int
    generation: int
    capacity: int
    handle_len: int

    def encode(self) -> torch.Tensor:
        """As an int64 tensor of 4 values."""
        return torch.tensor([self.step, self.generation, self.capacity, self.handle_len], dtype=torch.int64)

    @classmethod
    def decode(cls, raw: torch.Tensor) -> IpcReady:
        """The message ``raw`` holds; ValueError when a value is negative."""
        step, generation, capacity, handle_len = (int(v) for v in raw.tolist())
        if min(step, generation, capacity, handle_len) < 0:
            raise ValueError(f"not a data plane ready: {raw.tolist()}")
        return cls(step, generation, capacity, handle_len)


@dataclass(frozen=True, slots=True)
class IpcLayout:
    """Where a step lies in a cuda_ipc buffer (bytes): ``1 + n_aux`` blocks of hidden states
    from 0, then the meta (``pack_meta``) from ``meta_offset``; each region starts aligned."""

    block_bytes: int
    meta_offset: int
    size: int

    @classmethod
    def of(cls, header: Header) -> IpcLayout:
        """The layout of ``header``'s step."""
        block = header.n_tokens * header.hidden * header.dtype.itemsize
        meta_offset = _aligned(block) * (1 + header.n_aux)
        return cls(block, meta_offset, _aligned(meta_offset + header.meta_len * 8))

    def views(self, buffer: torch.Tensor, header: Header) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The hidden-state blocks ``[n_tokens, hidden]`` and the meta of a uint8 ``buffer``."""
        shape, stride = (header.n_tokens, header.hidden), _aligned(self.block_bytes)
        blocks = [
            buffer[k * stride : k * stride + self.block_bytes].view(header.dtype).view(shape)
            for k in range(1 + header.n_aux)
        ]
        meta = buffer[self.meta_offset : self.meta_offset + header.meta_len * 8].view(torch.int64)
        return blocks, meta


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN
