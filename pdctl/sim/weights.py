"""Weight updates from distributed on the sim, as SGLang does them (sglang-protocol.md 4).

An engine of ``--tp-size N`` is N ranks in the flat group: this process is
``rank_offset`` and N-1 helper processes (the sim's stand-in for SGLang's TP workers) are
``rank_offset + 1 .. + N-1``. Every rank receives every broadcast, in ``names`` order;
only this process loads the tensors into the model (helpers check and drop them).
``load_format: flattened_bucket`` is one uint8 broadcast per call, unpacked with SGLang's
alignment rule.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import zlib
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from pdctl.errors import SimError
from pdctl.sglang.group import destroy_group, init_custom_process_group

log = logging.getLogger("pdctl.sim.weights")


@dataclass(frozen=True)
class GroupSpec:
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> GroupSpec:
        try:
            spec = cls(
                master_address=str(body["master_address"]),
                master_port=int(body["master_port"]),
                rank_offset=int(body["rank_offset"]),
                world_size=int(body["world_size"]),
                group_name=str(body.get("group_name", "weight_update_group")),
                backend=str(body.get("backend", "nccl")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise SimError(f"bad init_weights_update_group body: {exc}") from exc
        if spec.backend == "nccl" and not torch.cuda.is_available():
            # NOTE: the sim runs on CPU; a trainer that asks for nccl gets gloo semantics
            # only if it also uses gloo, so refuse clearly instead of hanging in rendezvous.
            raise SimError("backend nccl needs CUDA; the sim on CPU joins gloo groups (weights.backend: gloo)")
        return spec


def tensor_specs(body: dict[str, Any]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) per tensor of an update body; dtypes are torch names (``bfloat16``)."""
    try:
        names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
    except KeyError as exc:
        raise SimError(f"update_weights_from_distributed needs {exc.args[0]}") from exc
    if not (len(names) == len(dtypes) == len(shapes)):
        raise SimError("names, dtypes and shapes must have the same length")
    out = []
    for name, dtype_name, shape in zip(names, dtypes, shapes, strict=True):
        dtype = getattr(torch, str(dtype_name).replace("torch.", ""), None)
        if not isinstance(dtype, torch.dtype):
            raise SimError(f"unknown dtype {dtype_name!r} for {name}")
        out.append((str(name), dtype, tuple(int(s) for s in shape)))
    return out


_staging: dict[int, torch.Tensor] = {}
"""One receive buffer per process, kept between updates as CUDA's caching allocator keeps
SGLang's: a fresh CPU buffer per update would page-fault every byte in again."""


def _receive_buffer(nbytes: int) -> torch.Tensor:
    buf = _staging.get(0)
    if buf is None or buf.numel() < nbytes:
        _staging.clear()  # drop the old one first: never two at once
        buf = _staging[0] = torch.empty(nbytes, dtype=torch.uint8)
    return buf[:nbytes]


def receive(
    group: dist.ProcessGroup, specs: list[tuple[str, torch.dtype, tuple[int, ...]]], load_format: str | None
) -> list[tuple[str, torch.Tensor]]:
    """Receive one update's tensors from rank 0, in order. Blocks until rank 0 sends.

    With ``flattened_bucket`` the tensors are views of a buffer reused by the next call: copy
    them (``load_weights`` does) before receiving again."""
    if load_format == "flattened_bucket":
        total = sum(_nbytes(dtype, shape) for _, dtype, shape in specs)
        flat = _receive_buffer(total)
        dist.broadcast(flat, src=0, group=group)
        out, offset = [], 0
        for name, dtype, shape in specs:
            size = _nbytes(dtype, shape)
            itemsize = torch.empty((), dtype=dtype).element_size()
            if offset % itemsize:
                raise SimError(
                    f"Unaligned received tensor {name}: byte offset {offset} is not a multiple of {itemsize}"
                )
            out.append((name, flat[offset : offset + size].view(dtype).view(shape)))
            offset += size
        return out
    if load_format not in (None, "auto"):
        raise SimError(f"load_format {load_format!r} is not supported; use null or flattened_bucket")
    tensors = [(name, torch.empty(shape, dtype=dtype)) for name, dtype, shape in specs]
    handles = [dist.broadcast(t, src=0, group=group, async_op=True) for _, t in tensors]
    for handle in handles:
        handle.wait()
    return tensors


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    numel = 1
    for s in shape:
        numel *= s
    return numel * torch.empty((), dtype=dtype).element_size()


def checksum(tensors: list[tuple[str, torch.Tensor]]) -> str:
    """CRC-32 of names and bytes: enough to tell TP ranks that received different data, and
    several times cheaper than a cryptographic hash (it runs inside every update call)."""
    crc = 0
    for name, t in tensors:
        crc = zlib.crc32(name.encode(), crc)
        crc = zlib.crc32(t.contiguous().view(-1).view(torch.uint8).numpy(), crc)
    return f"{crc:08x}"


class WeightGroupMember:
    """This engine's ranks in the weight group: itself plus tp_size - 1 helper processes."""

    def __init__(self, tp_size: int):
        self.tp_size = tp_size
        self.group: dist.ProcessGroup | None = None
        self.spec: GroupSpec | None = None
        ctx = mp.get_context("spawn")
        self._helpers: list[tuple[Any, Connection]] = []
        for _ in range(tp_size - 1):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_helper_main, args=(child,), daemon=True, name="sim-tp-rank")
            proc.start()
            self._helpers.append((proc, parent))

    def init(self, spec: GroupSpec, timeout_secs: float = 300.0) -> None:
        """Join as ranks rank_offset .. rank_offset + tp_size - 1 (blocks until all ranks join)."""
        if self.group is not None:
            raise SimError(f"weight update group {self.spec.group_name!r} already exists; destroy it first")  # type: ignore[union-attr]
        if spec.rank_offset < 1 or spec.rank_offset + self.tp_size > spec.world_size:
            raise SimError(
                f"ranks {spec.rank_offset}..{spec.rank_offset + self.tp_size - 1} "
                f"do not fit world_size {spec.world_size}"
            )
        for i, (_, conn) in enumerate(self._helpers, start=1):
            conn.send(("init", spec, spec.rank_offset + i, timeout_secs))
        group = init_custom_process_group(
            backend=spec.backend,
            master_address=spec.master_address,
            master_port=spec.master_port,
            world_size=spec.world_size,
            rank=spec.rank_offset,
            group_name=spec.group_name,
            timeout_secs=timeout_secs,
        )
        self._collect("init")
        self.group, self.spec = group, spec

    def receive(self, specs: list[tuple[str, torch.dtype, tuple[int, ...]]], load_format: str | None) -> list:
        if self.group is None:
            raise SimError("no weight update group; call /init_weights_update_group first")
        for _, conn in self._helpers:
            conn.send(("recv", specs, load_format))
        tensors = receive(self.group, specs, load_format)
        sums = self._collect("recv")
        mine = checksum(tensors)
        if any(s != mine for s in sums):
            raise SimError("TP ranks received different tensors")
        return tensors

    def destroy(self) -> None:
        if self.group is None:
            raise SimError("no weight update group to destroy")
        for _, conn in self._helpers:
            conn.send(("destroy",))
        destroy_group(self.group)
        self._collect("destroy")
        self.group = self.spec = None

    def close(self) -> None:
        for proc, conn in self._helpers:
            try:
                conn.send(("exit",))
            except (OSError, BrokenPipeError):
                pass
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()

    def _collect(self, what: str) -> list[Any]:
        results = []
        for _, conn in self._helpers:
            ok, value = conn.recv()
            if not ok:
                raise SimError(f"TP helper rank failed during {what}: {value}")
            results.append(value)
        return results


def _helper_main(conn: Connection) -> None:  # pragma: no cover - runs in a child process
    torch.set_num_threads(1)
    group = None
    while True:
        try:
            cmd = conn.recv()
        except EOFError:
            return
        try:
            if cmd[0] == "init":
                _, spec, rank, timeout = cmd
                group = init_custom_process_group(
                    backend=spec.backend,
                    master_address=spec.master_address,
                    master_port=spec.master_port,
                    world_size=spec.world_size,
                    rank=rank,
                    group_name=spec.group_name,
                    timeout_secs=timeout,
                )
                conn.send((True, None))
            elif cmd[0] == "recv":
                conn.send((True, checksum(receive(group, cmd[1], cmd[2]))))
            elif cmd[0] == "destroy":
                destroy_group(group)
                group = None
                conn.send((True, None))
            elif cmd[0] == "exit":
                return
        except Exception as exc:  # report to the parent, keep serving
            conn.send((False, f"{type(exc).__name__}: {exc}"))
