"""Weight updates from distributed on the sim, as SGLang does them (sglang-protocol.md 4).

An engine of ``--tp-size N`` is N ranks in the flat group: this process is
``rank_offset`` and N-1 helper processes (the sim's stand-in for SGLang's TP workers) are
``rank_offset + 1 .. + N-1``. A multi-node engine's node k runs its share of those ranks
(``rank_offset + k * N / nnodes`` onwards), driven by node 0 over the dist-init link
(multinode.py). Every rank receives every broadcast, in ``names`` order; only node 0's
process loads the tensors into the model (the other ranks check and drop them).
``load_format: flattened_bucket`` is one uint8 broadcast per call, unpacked with SGLang's
alignment rule.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from multiprocessing.connection import Connection
from typing import Any, Protocol

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


class Peer(Protocol):
    """Ranks of this engine that live in another process: ``ranks`` of them, driven by
    command dicts (``init``/``recv``/``destroy``) answered with ``(ok, value)``."""

    ranks: int

    def send(self, command: dict[str, Any]) -> None: ...

    def recv(self) -> tuple[bool, Any]: ...

    def close(self) -> None: ...


def init_command(spec: GroupSpec, rank: int, timeout_secs: float) -> dict[str, Any]:
    return {"op": "init", "spec": asdict(spec), "rank": rank, "timeout": timeout_secs}


def recv_command(specs: list[tuple[str, torch.dtype, tuple[int, ...]]], load_format: str | None) -> dict[str, Any]:
    """A receive command in the update body's own JSON shape (parsed back by ``tensor_specs``)."""
    return {
        "op": "recv",
        "names": [name for name, _, _ in specs],
        "dtypes": [str(dtype).removeprefix("torch.") for _, dtype, _ in specs],
        "shapes": [list(shape) for _, _, shape in specs],
        "load_format": load_format,
    }


class HelperProcess:
    """One TP rank in a spawned child process (the sim's stand-in for an SGLang TP worker)."""

    ranks = 1

    def __init__(self, ctx: Any):
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_helper_main, args=(child,), daemon=True, name="sim-tp-rank")
        self._proc.start()

    def send(self, command: dict[str, Any]) -> None:
        self._conn.send(command)

    def recv(self) -> tuple[bool, Any]:
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            return False, f"TP helper process {self._proc.pid} died"

    def close(self) -> None:
        with contextlib.suppress(OSError, BrokenPipeError):
            self._conn.send({"op": "exit"})
        self._proc.join(timeout=5)
        if self._proc.is_alive():
            self._proc.kill()


class WeightGroupMember:
    """This engine's ranks in the weight group, in TP-rank order: this process, then
    ``local_ranks - 1`` helper processes, then the ``peers`` (other nodes of a multi-node
    engine, each taking its node's share of the TP ranks)."""

    def __init__(self, local_ranks: int, peers: Sequence[Peer] = ()):
        ctx = mp.get_context("spawn")
        self._peers: list[Peer] = [HelperProcess(ctx) for _ in range(local_ranks - 1)] + list(peers)
        self.tp_size = local_ranks + sum(p.ranks for p in peers)
        self.group: dist.ProcessGroup | None = None
        self.spec: GroupSpec | None = None

    def init(self, spec: GroupSpec, timeout_secs: float = 300.0) -> None:
        """Join as ranks rank_offset .. rank_offset + tp_size - 1 (blocks until all ranks join)."""
        if self.spec is not None:
            raise SimError(f"weight update group {self.spec.group_name!r} already exists; destroy it first")
        if spec.rank_offset < 1 or spec.rank_offset + self.tp_size > spec.world_size:
            raise SimError(
                f"ranks {spec.rank_offset}..{spec.rank_offset + self.tp_size - 1} "
                f"do not fit world_size {spec.world_size}"
            )
        rank = spec.rank_offset + 1
        for peer in self._peers:  # every other rank joins concurrently with this one (or none can)
            peer.send(init_command(spec, rank, timeout_secs))
            rank += peer.ranks
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
        command = recv_command(specs, load_format)
        for peer in self._peers:
            peer.send(command)
        tensors = receive(self.group, specs, load_format)
        sums = self._collect("recv")
        mine = checksum(tensors)
        if any(s != mine for s in sums):
            raise SimError("TP ranks received different tensors")
        first = self.spec.rank_offset if self.spec else 0
        log.info(
            "weight update: %d tensors, crc %s, on ranks %d..%d", len(tensors), mine, first, first + self.tp_size - 1
        )
        return tensors

    def destroy(self) -> None:
        if self.group is None:
            raise SimError("no weight update group to destroy")
        for peer in self._peers:
            peer.send({"op": "destroy"})
        destroy_group(self.group)
        self._collect("destroy")
        self.group = self.spec = None

    def close(self) -> None:
        for peer in self._peers:
            peer.close()

    def _collect(self, what: str) -> list[Any]:
        results, failures = [], []
        for peer in self._peers:  # every peer answers before we judge, so none is left mid-command
            ok, value = peer.recv()
            (results if ok else failures).append(value)
        if failures:
            raise SimError(f"TP rank failed during {what}: {failures[0]}")
        return results


def run_command(member: WeightGroupMember | None, group: Any, command: dict[str, Any]) -> tuple[Any, Any]:
    """Carry out one peer command; returns (the new group, the reply value).

    With ``member`` (a node of a multi-node engine) the command drives that node's own
    ranks; without it, the bare ``group`` of a single helper rank."""
    op = command["op"]
    if op == "init":
        spec = GroupSpec(**command["spec"])
        if member is not None:
            member.init(replace(spec, rank_offset=int(command["rank"])), float(command["timeout"]))
            return None, None
        new = init_custom_process_group(
            backend=spec.backend,
            master_address=spec.master_address,
            master_port=spec.master_port,
            world_size=spec.world_size,
            rank=int(command["rank"]),
            group_name=spec.group_name,
            timeout_secs=float(command["timeout"]),
        )
        return new, None
    if op == "recv":
        specs = tensor_specs(command)
        tensors = (
            member.receive(specs, command["load_format"]) if member else receive(group, specs, command["load_format"])
        )
        return group, checksum(tensors)
    if op == "destroy":
        if member is not None:
            member.destroy()
        else:
            destroy_group(group)
        return None, None
    raise SimError(f"unknown command {op!r}")


def _helper_main(conn: Connection) -> None:  # pragma: no cover - runs in a child process
    torch.set_num_threads(1)
    group = None
    while True:
        try:
            command = conn.recv()
        except EOFError:
            return
        if command["op"] == "exit":
            return
        try:
            group, value = run_command(None, group, command)
            conn.send((True, value))
        except Exception as exc:  # report to the parent, keep serving
            conn.send((False, f"{type(exc).__name__}: {exc}"))
