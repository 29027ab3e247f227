"""CUDA IPC between two processes on one GPU: the ``cuda_ipc`` data plane's transport.

NCCL refuses a communicator with two ranks on one GPU ("Duplicate GPU detected": seen with NCCL
2.28.9 on an H100), and an engine TP rank and its trainer rank always share one GPU, so the
same-device path is CUDA IPC: the trainer rank shares its receive buffer once (and again only when
it grows), the engine rank opens it and writes its shard into it with one device-to-device copy.
The peer is trusted as a member of the union world (whose rendezvous, like torch.distributed's,
is not authenticated): a handle is checked for form (``Handle.decode``), not for the sizes of the
allocation it names, which this process cannot see.

A shared buffer travels as a ``Handle``: JSON of plain fields (no pickle: the bytes come off a
socket), with the GPU named by UUID, because the trainer and the engine number the GPUs they see
differently (each has its own ``CUDA_VISIBLE_DEVICES``). The handles, the reference counting that
keeps a buffer alive while the engine still holds it, and the event that orders its first use are
torch's own (the calls ``torch.multiprocessing`` makes to send a CUDA tensor to another process).
"""

from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass
from typing import Any

import torch

REF_COUNTER_NAME = re.compile(rb"/torch_[0-9]+_[0-9]+_[0-9]+")
"""The shared-memory name torch gives an IPC reference counter (``at::NewProcessWideShmHandle``):
the opener increments a counter in that file, so a handle naming any other file is refused."""
REF_COUNTER_SLOTS = 10000
"""int64 counters in one such file (torch's CUDA_IPC_REF_COUNTER_FILE_SIZE): a slot past them
would be a write outside the mapping."""
MAX_HANDLE_BYTES = 4096
"""An encoded handle is a few hundred bytes; a longer one is not read (nor allocated for)."""


@dataclass(frozen=True, slots=True)
class Handle:
    """A CUDA buffer of ``nbytes`` bytes that another process on its GPU can open."""

    gpu_uuid: str
    nbytes: int
    ipc_handle: bytes
    storage_bytes: int
    offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool

    def encode(self) -> bytes:
        """Compact JSON bytes, which ``decode`` reads back."""
        fields = {
            "gpu_uuid": self.gpu_uuid,
            "nbytes": self.nbytes,
            "ipc_handle": _b64(self.ipc_handle),
            "storage_bytes": self.storage_bytes,
            "offset_bytes": self.offset_bytes,
            "ref_counter_handle": _b64(self.ref_counter_handle),
            "ref_counter_offset": self.ref_counter_offset,
            "event_handle": _b64(self.event_handle) if self.event_handle is not None else None,
            "event_sync_required": self.event_sync_required,
        }
        return json.dumps(fields, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Handle:
        """Raises ValueError when ``raw`` is not an encoded handle: every field of its type, the
        reference counter one of torch's own names and inside its file (the opener writes there),
        the handles of their sizes."""
        if len(raw) > MAX_HANDLE_BYTES:
            raise ValueError(f"not a CUDA IPC handle: {len(raw)} bytes")
        try:
            f = json.loads(raw)
            if not isinstance(f, dict):
                raise TypeError("not an object")
            event = f["event_handle"]
            handle = cls(
                gpu_uuid=_typed(f, "gpu_uuid", str),
                nbytes=_typed(f, "nbytes", int),
                ipc_handle=base64.b64decode(_typed(f, "ipc_handle", str), validate=True),
                storage_bytes=_typed(f, "storage_bytes", int),
                offset_bytes=_typed(f, "offset_bytes", int),
                ref_counter_handle=base64.b64decode(_typed(f, "ref_counter_handle", str), validate=True),
                ref_counter_offset=_typed(f, "ref_counter_offset", int),
                event_handle=None if event is None else base64.b64decode(_typed(f, "event_handle", str), validate=True),
                event_sync_required=_typed(f, "event_sync_required", bool),
            )
        except (KeyError, TypeError, ValueError, RecursionError) as exc:  # (JSONDecodeError is a ValueError)
            raise ValueError(f"not a CUDA IPC handle: {type(exc).__name__}: {exc}") from None
        if not REF_COUNTER_NAME.fullmatch(handle.ref_counter_handle):
            raise ValueError(f"not a CUDA IPC handle: reference counter {handle.ref_counter_handle!r}")
        if not 0 <= handle.ref_counter_offset < REF_COUNTER_SLOTS:
            raise ValueError(f"not a CUDA IPC handle: reference counter slot {handle.ref_counter_offset}")
        if min(handle.nbytes, handle.storage_bytes, handle.offset_bytes) < 0:
            raise ValueError("not a CUDA IPC handle: a negative size or offset")
        if not handle.ipc_handle or (handle.event_handle is None and handle.event_sync_required):
            raise ValueError("not a CUDA IPC handle: no memory handle, or an event required and none given")
        return handle


def _typed(fields: dict, key: str, kind: type) -> Any:
    """``fields[key]``, which must be a ``kind`` (a bool is no int here, a float no int)."""
    value = fields[key]
    if type(value) is not kind:
        raise TypeError(f"{key} is {type(value).__name__}, not {kind.__name__}")
    return value


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def gpu_uuid(device: torch.device) -> str:
    """The GPU's UUID: the same in every process, whatever ``CUDA_VISIBLE_DEVICES`` numbers it."""
    return str(torch.cuda.get_device_properties(device).uuid)


def share(buffer: torch.Tensor) -> Handle:
    """A handle to the bytes of ``buffer`` (contiguous, on a CUDA device, at the start of its
    storage) for another process on its GPU.

    The buffer's memory stays allocated while an opened copy lives, even after this process
    drops it (torch's IPC reference counter)."""
    if buffer.device.type != "cuda" or not buffer.is_contiguous():
        raise ValueError(f"only a contiguous CUDA tensor can be shared, not one on {buffer.device}")
    if buffer.storage_offset() != 0:  # (the buffers here are whole storages: keep the decoder simple)
        raise ValueError("only a tensor that starts its storage can be shared")
    storage = buffer.untyped_storage()
    _device, handle, size, offset, ref_handle, ref_offset, event, event_sync = storage._share_cuda_()
    return Handle(
        gpu_uuid=gpu_uuid(buffer.device),
        nbytes=buffer.numel() * buffer.element_size(),
        ipc_handle=handle,
        storage_bytes=size,
        offset_bytes=offset,
        ref_counter_handle=ref_handle,
        ref_counter_offset=ref_offset,
        event_handle=event,
        event_sync_required=bool(event_sync),
    )


def open_shared(handle: Handle) -> torch.Tensor:
    """The buffer behind ``handle`` as a 1-d uint8 tensor on this process's index of the same GPU.

    Raises:
        ValueError: no GPU this process sees has the handle's UUID (the two processes are not on
        one GPU), or the handle does not fit the buffer it names.
    """
    device = local_device(handle.gpu_uuid)
    if not 0 <= handle.nbytes <= handle.storage_bytes:
        raise ValueError(f"a handle of {handle.storage_bytes} bytes cannot hold {handle.nbytes}")
    torch.cuda.init()
    storage = torch.UntypedStorage._new_shared_cuda(
        device.index,
        handle.ipc_handle,
        handle.storage_bytes,
        handle.offset_bytes,
        handle.ref_counter_handle,
        handle.ref_counter_offset,
        handle.event_handle,
        handle.event_sync_required,
    )
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (handle.nbytes,), (1,))


def local_device(uuid: str) -> torch.device:
    """This process's index of the GPU with ``uuid``; raises ValueError naming the ones it sees."""
    seen = []
    for index in range(torch.cuda.device_count()):
        device = torch.device("cuda", index)
        seen.append(gpu_uuid(device))
        if seen[-1] == uuid:
            return device
    raise ValueError(
        f"the trainer rank's GPU {uuid} is not one this engine rank sees ({', '.join(seen) or 'none'}): "
        "cuda_ipc needs each trainer rank on its engine rank's GPU (the colocate pairing)"
    )
