"""One step on the wire between an engine rank and its trainer rank, in this order:

1. trainer -> engine, meta group: ``READY`` int64 ``[step]`` (the step the trainer will take next);
2. engine -> trainer, meta group: the header, int64 ``[HEADER_LEN]`` (``Header``);
3. engine -> trainer, meta group: int64 ``[n_tokens + n_seqs + n_tokens]``: input ids, sequence
   lengths, loss mask;
4. engine -> trainer, data group: the final hidden states ``[n_tokens, hidden]``, then each
   auxiliary layer's ``[n_tokens, hidden]``, in ``aux_layers`` order.

The engine sends nothing until the trainer says it is ready for exactly that step, so neither
side runs ahead; the trainer checks the step number it gets, so no step is taken twice or
skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

HEADER_LEN = 8
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
    step: int
    n_seqs: int
    n_tokens: int
    hidden: int
    n_aux: int
    dtype: torch.dtype

    def encode(self) -> torch.Tensor:
        return torch.tensor(
            [MAGIC, self.step, self.n_seqs, self.n_tokens, self.hidden, self.n_aux, DTYPES.index(self.dtype), 0],
            dtype=torch.int64,
        )

    @classmethod
    def decode(cls, raw: torch.Tensor) -> Header:
        magic, step, n_seqs, n_tokens, hidden, n_aux, code, _ = (int(v) for v in raw.tolist())
        if magic != MAGIC or not 0 <= code < len(DTYPES) or min(n_seqs, n_tokens, hidden, n_aux) < 0:
            raise ValueError(f"not a data plane header: {raw.tolist()}")
        return cls(step, n_seqs, n_tokens, hidden, n_aux, DTYPES[code])

    @property
    def meta_len(self) -> int:
        return 2 * self.n_tokens + self.n_seqs


def pack_meta(input_ids: list[torch.Tensor]) -> torch.Tensor:
    """Ids, lengths and loss mask of a shard's sequences as one int64 tensor (``Header.meta_len``).

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
