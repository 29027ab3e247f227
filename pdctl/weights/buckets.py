"""Buckets of named tensors, flattened as SGLang's ``flattened_bucket`` expects, and checksums.

A bucket holds tensors of one dtype in the caller's order, up to ``bucket_bytes`` (a tensor
larger than that is a bucket of its own). One dtype per bucket keeps every tensor's byte
offset a multiple of its itemsize, the alignment SGLang's receiver checks
(``Unaligned received tensor``, sglang-protocol.md 4.4).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

SAMPLE_POINTS = 64
"""Elements read per tensor by the ``sample`` checksum."""


@dataclass(frozen=True)
class Bucket:
    """Tensors of one dtype that go in one update call, with their names, in the caller's order."""

    names: tuple[str, ...]
    tensors: tuple[torch.Tensor, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of all its tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @property
    def dtypes(self) -> list[str]:
        """Torch attribute names, as the update body wants them (``bfloat16``)."""
        return [str(t.dtype).removeprefix("torch.") for t in self.tensors]

    @property
    def shapes(self) -> list[list[int]]:
        """Each tensor's shape as a list, as the update body wants them."""
        return [list(t.shape) for t in self.tensors]

    def flat(self, staging: torch.Tensor | None = None) -> torch.Tensor:
        """All tensors' bytes in ``names`` order: one uint8 tensor for one broadcast. Written
        into ``staging`` (a uint8 buffer of at least ``nbytes``) when given, so that a push
        does not allocate, and page-fault in, a new buffer per bucket."""
        parts = [t.contiguous().view(-1).view(torch.uint8) for t in self.tensors]
        if len(parts) == 1:
            return parts[0]
        if staging is None:
            return torch.cat(parts)
        return torch.cat(parts, out=staging[: self.nbytes])


def buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Group ``(name, tensor)`` pairs into buckets of one dtype and one device, lazily: only one
    bucket is held at a time."""
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    size = 0
    for name, tensor in named_tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
        nbytes = tensor.numel() * tensor.element_size()
        first = tensors[0] if tensors else None
        if first is not None and (
            tensor.dtype != first.dtype or tensor.device != first.device or size + nbytes > bucket_bytes
        ):
            yield Bucket(tuple(names), tuple(tensors))
            names, tensors, size = [], [], 0
        names.append(name)
        tensors.append(tensor.detach())
        size += nbytes
    if tensors:
        yield Bucket(tuple(names), tuple(tensors))


def tensor_checksum(name: str, tensor: torch.Tensor, mode: str) -> str:
    """A tensor's checksum as the sim's ``/weights_checker`` computes it for the same values.

    Values are compared as float64 (exact for every float dtype up to float64), so a trainer
    holding bfloat16 and an engine holding float64 agree. ``full`` hashes every element;
    ``sample`` hashes the shape and ``SAMPLE_POINTS`` evenly spaced elements, which catches a
    missing, misordered, stale or wrongly shaped tensor at a cost that does not grow with size.
    """
    flat = tensor.detach().reshape(-1)
    digest = hashlib.sha256(name.encode())
    digest.update(repr(tuple(tensor.shape)).encode())
    if mode == "sample" and flat.numel() > SAMPLE_POINTS:
        index = torch.linspace(0, flat.numel() - 1, SAMPLE_POINTS, dtype=torch.float64).round().long()
        flat = flat[index.to(flat.device)]
    elif mode not in ("sample", "full"):
        raise ValueError(f"checksum mode must be sample or full, not {mode!r}")
    digest.update(flat.to(device="cpu", dtype=torch.float64).contiguous().numpy().tobytes())
    return digest.hexdigest()
