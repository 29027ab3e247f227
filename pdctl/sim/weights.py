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
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from multiprocessing.connection import Connection
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from pdctl.errors import SimError
from pdctl.sglang import DEFAULT_GROUP_NAME
from pdctl.sglang.control import NO_GROUP_TO_DESTROY, missing_group
from pdctl.sglang.group import destroy_group, init_custom_process_group

log = logging.getLogger("pdctl.sim.weights")


@dataclass(frozen=True)
class GroupSpec:
    """An ``/init_weights_update_group`` body: where the group's rendezvous is, this engine's first rank, the world
    size, the group's name and backend."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> GroupSpec:
        """The spec in ``body`` (``group_name`` and ``backend`` default to SGLang's). Raises SimError for a missing or
        malformed field, and for backend ``nccl`` without CUDA."""
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
    group: dist.ProcessGroup,
    specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
    load_format: str | None,
    destination: Mapping[str, torch.Tensor] | None = None,
    digest_mode: str = "full",
) -> Received:
    """Receive one update's tensors from rank 0, in order, and their digest. Blocks until
    rank 0 sends.

    With ``flattened_bucket`` the tensors are views of a buffer reused by the next call: copy
    them (``load_weights`` does) before receiving again. One broadcast per tensor (``names``
    order) lands directly in ``destination[name]`` where that tensor has the same dtype and
    shape (the model's parameters: no copy afterwards), else in a view of the reused buffer;
    each tensor is digested while the next one is still arriving."""
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
        return Received(out, checksum(out, digest_mode))
    if load_format not in (None, "auto"):
        raise SimError(f"load_format {load_format!r} is not supported; use null or flattened_bucket")
    destination = destination or {}
    direct = {
        name
        for name, dtype, shape in specs
        if name in destination and destination[name].dtype == dtype and tuple(destination[name].shape) == shape
    }
    spare = _receive_buffer(sum(_aligned(_nbytes(d, s)) for n, d, s in specs if n not in direct))
    tensors, offset = [], 0
    for name, dtype, shape in specs:
        if name in direct:
            tensors.append((name, destination[name]))
            continue
        size = _nbytes(dtype, shape)
        tensors.append((name, spare[offset : offset + size].view(dtype).view(shape)))
        offset += _aligned(size)
    digest = Digest(digest_mode)
    with torch.no_grad():  # parameters are received into in place
        handles = [dist.broadcast(t, src=0, group=group, async_op=True) for _, t in tensors]
        for (name, tensor), handle in zip(tensors, handles, strict=True):
            handle.wait()
            digest.update(name, tensor)
    return Received(tensors, digest.hexdigest())


def _aligned(nbytes: int) -> int:
    return (nbytes + 63) // 64 * 64


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    numel = 1
    for s in shape:
        numel *= s
    return numel * torch.empty((), dtype=dtype).element_size()


EDGE_BYTES = 4096
"""Bytes at each end of a tensor that the checksum hashes by CRC (order and boundaries)."""


DIGEST_MODES = ("full", "sample")
SAMPLE_WORDS = 64


class Digest:
    """A digest of names and bytes that tells TP ranks which received different data.

    ``full``: every byte counts: the 8-byte words of each tensor are summed modulo 2**64
    (numpy's uint64 sum, about 5x the speed of CRC-32 here; this runs inside every update
    call, on every rank, on the same cores as the broadcast). Both modes put names, sizes,
    each tensor's first and last ``EDGE_BYTES`` and its unaligned ends through CRC-32, so a
    missing, truncated, misordered or stale tensor changes the digest as surely as a changed
    byte does; ``sample`` adds ``SAMPLE_WORDS`` evenly spaced words instead of the sum (its
    cost does not grow with size; a change between them goes unseen). It is no defence
    against a forger, which the weight group is not."""

    def __init__(self, mode: str = "full") -> None:
        if mode not in DIGEST_MODES:
            raise SimError(f"weight digest must be full or sample, not {mode!r}")
        self.mode = mode
        self._crc = 0
        self._total = 0

    def update(self, name: str, tensor: torch.Tensor) -> None:
        """Fold ``name`` and ``tensor``'s bytes into the digest; the order of updates matters."""
        data = tensor.detach().contiguous().view(-1).view(torch.uint8).numpy()
        crc = zlib.crc32(f"{name}:{data.size}".encode(), self._crc)
        crc = zlib.crc32(data[:EDGE_BYTES].tobytes(), crc)
        crc = zlib.crc32(data[-EDGE_BYTES:].tobytes(), crc)
        head = -data.ctypes.data % 8  # torch's allocations are 64-byte aligned: the same split on every rank
        words = (data.size - head) // 8 if data.size > head else 0
        crc = zlib.crc32(data[:head].tobytes(), crc)
        self._crc = zlib.crc32(data[head + words * 8 :].tobytes(), crc)
        if not words:
            return
        aligned = data[head : head + words * 8].view(np.uint64)
        if self.mode == "sample" and words > SAMPLE_WORDS:
            aligned = aligned[np.linspace(0, words - 1, SAMPLE_WORDS).astype(np.int64)]
        self._total = (self._total + int(aligned.sum(dtype=np.uint64))) % 2**64

    def hexdigest(self) -> str:
        """The digest so far, as 24 hex digits; equal on ranks that fed equal tensors in the same order."""
        return f"{self._crc:08x}{self._total:016x}"


def checksum(tensors: list[tuple[str, torch.Tensor]], mode: str = "full") -> str:
    """``Digest`` of ``tensors`` in order."""
    digest = Digest(mode)
    for name, tensor in tensors:
        digest.update(name, tensor)
    return digest.hexdigest()


@dataclass(frozen=True)
class Received:
    """One update's tensors as this rank received them, and their ``Digest``."""

    tensors: list[tuple[str, torch.Tensor]]
    digest: str


class Peer(Protocol):
    """Ranks of this engine that live in another process: ``ranks`` of them, driven by
    command dicts (``init``/``recv``/``destroy``) answered with ``(ok, value)``."""

    ranks: int

    def send(self, command: dict[str, Any]) -> None: ...

    def recv(self) -> tuple[bool, Any]: ...

    def close(self) -> None: ...


def init_command(spec: GroupSpec, rank: int, timeout_secs: float) -> dict[str, Any]:
    return {"op": "init", "spec": asdict(spec), "rank": rank, "timeout": timeout_secs}


def recv_command(
    specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
    load_format: str | None,
    digest_mode: str,
    group_name: str = DEFAULT_GROUP_NAME,
) -> dict[str, Any]:
    """A receive command in the update body's own JSON shape (parsed back by ``tensor_specs``)."""
    return {
        "op": "recv",
        "group_name": group_name,
        "digest": digest_mode,
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
        """Send ``command`` to the helper process."""
        self._conn.send(command)

    def recv(self) -> tuple[bool, Any]:
        """The helper's next ``(ok, value)`` reply; ``(False, message)`` when the process died."""
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            return False, f"TP helper process {self._proc.pid} died"

    def close(self) -> None:
        """Ask the helper to exit and wait up to 5 seconds, then kill it if it is still alive."""
        with contextlib.suppress(OSError, BrokenPipeError):
            self._conn.send({"op": "exit"})
        self._proc.join(timeout=5)
        if self._proc.is_alive():
            self._proc.kill()


class WeightGroupMember:
    """This engine's ranks in the weight groups it joined, in TP-rank order: this process, then
    ``local_ranks - 1`` helper processes, then the ``peers`` (other nodes of a multi-node
    engine, each taking its node's share of the TP ranks). Groups are named, several at once,
    as SGLang keeps them (``model_runner_components/weight_updater.py``: a dict by group name;
    joining a name again replaces that group)."""

    def __init__(
        self, local_ranks: int, peers: Sequence[Peer] = (), digest_mode: str = "full", timeout_secs: float = 300.0
    ):
        """``timeout_secs``: how long each rank waits in a group's rendezvous and collectives."""
        Digest(digest_mode)  # refuses an unknown mode before any process starts
        self.digest_mode = digest_mode
        self.timeout_secs = timeout_secs
        ctx = mp.get_context("spawn")
        self._peers: list[Peer] = [HelperProcess(ctx) for _ in range(local_ranks - 1)] + list(peers)
        self._owed = [0] * len(self._peers)
        """Replies each peer still owes to commands this rank stopped waiting for (see ``receive``)."""
        self.tp_size = local_ranks + sum(p.ranks for p in peers)
        self.groups: dict[str, tuple[dist.ProcessGroup, GroupSpec]] = {}

    def init(self, spec: GroupSpec, timeout_secs: float | None = None) -> None:
        """Join ``spec.group_name`` as ranks rank_offset .. rank_offset + tp_size - 1 (blocks until
        all ranks join); a group of that name already joined is left first."""
        if spec.rank_offset < 1 or spec.rank_offset + self.tp_size > spec.world_size:
            raise SimError(
                f"ranks {spec.rank_offset}..{spec.rank_offset + self.tp_size - 1} "
                f"do not fit world_size {spec.world_size}"
            )
        if spec.group_name in self.groups:
            self.destroy(spec.group_name)
        timeout_secs = self.timeout_secs if timeout_secs is None else timeout_secs
        rank = spec.rank_offset + 1
        for peer in self._peers:  # every other rank joins concurrently with this one (or none can)
            peer.send(init_command(spec, rank, timeout_secs))
            rank += peer.ranks
        try:
            group = init_custom_process_group(
                backend=spec.backend,
                master_address=spec.master_address,
                master_port=spec.master_port,
                world_size=spec.world_size,
                rank=spec.rank_offset,
                group_name=spec.group_name,
                timeout_secs=timeout_secs,
            )
        finally:
            self._collect("init")
        self.groups[spec.group_name] = (group, spec)

    def receive(
        self,
        specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
        load_format: str | None,
        destination: Mapping[str, torch.Tensor] | None = None,
        digest_mode: str | None = None,
        group_name: str = DEFAULT_GROUP_NAME,
    ) -> Received:
        """This engine's ranks receive one update over ``group_name``; this process's tensors
        land in ``destination`` where they fit (see ``receive``). Fails if any rank's digest
        differs from this one's. ``digest_mode``: node 0's, for a node of a multi-node engine;
        else this engine's own."""
        if group_name not in self.groups:
            raise SimError(missing_group(group_name, list(self.groups)))
        group, spec = self.groups[group_name]
        mode = digest_mode or self.digest_mode
        command = recv_command(specs, load_format, mode, group_name)
        started = time.perf_counter()
        for peer in self._peers:
            peer.send(command)
        try:
            received = receive(group, specs, load_format, destination, mode)
        except BaseException:
            # This rank answers its failure now, as SGLang's TP rank 0 does; the other ranks may still
            # wait in the broadcast (one fed through another rank waits out the group's timeout). Their
            # replies are owed: the next command reads and drops them first, so that none is taken for
            # its own answer (every later update failed 'TP ranks received different tensors').
            self._owed = [n + 1 for n in self._owed]
            raise
        done = time.perf_counter()
        sums = self._collect("recv")
        mine = received.digest
        if any(s != mine for s in sums):
            raise SimError("TP ranks received different tensors")
        log.info(
            "weight update over %s: %d tensors, digest %s, on ranks %d..%d (received and digested in %.3fs, "
            "peers %.3fs)",
            group_name,
            len(received.tensors),
            mine,
            spec.rank_offset,
            spec.rank_offset + self.tp_size - 1,
            done - started,
            time.perf_counter() - done,
        )
        return received

    def destroy(self, group_name: str = DEFAULT_GROUP_NAME) -> None:
        """Leave ``group_name`` on every rank of this engine. Raises SimError when no such group was joined (SGLang's
        message) or when another rank fails to leave."""
        if group_name not in self.groups:
            raise SimError(NO_GROUP_TO_DESTROY)
        group, _ = self.groups.pop(group_name)
        for peer in self._peers:
            peer.send({"op": "destroy", "group_name": group_name})
        destroy_group(group)
        self._collect("destroy")

    def close(self) -> None:
        """Close every peer: helper processes exit; a remote node's link stays with the hub."""
        for peer in self._peers:
            peer.close()

    def _collect(self, what: str) -> list[Any]:
        results: list[Any] = []
        failures: list[Any] = []
        for i, peer in enumerate(self._peers):  # every peer answers before we judge, so none is left mid-command
            while self._owed[i]:  # (it answers in order: first what an earlier, failed command still owed)
                ok, value = peer.recv()
                self._owed[i] -= 1
                log.info("TP rank %d's late answer to a failed command: %s", i + 1, value if not ok else "done")
            ok, value = peer.recv()
            (results if ok else failures).append(value)
        if failures:
            raise SimError(f"TP rank failed during {what}: {failures[0]}")
        return results


def run_command(member: WeightGroupMember | None, groups: dict[str, Any], command: dict[str, Any]) -> Any:
    """Carry out one peer command; returns the reply value.

    With ``member`` (a node of a multi-node engine) the command drives that node's own
    ranks; without it, the bare ``groups`` (by name) of a single helper rank."""
    op = command["op"]
    name = str(command.get("group_name") or command.get("spec", {}).get("group_name") or DEFAULT_GROUP_NAME)
    if op == "init":
        spec = GroupSpec(**command["spec"])
        if member is not None:
            member.init(replace(spec, rank_offset=int(command["rank"])), float(command["timeout"]))
            return None
        if name in groups:
            destroy_group(groups.pop(name))
        groups[name] = init_custom_process_group(
            backend=spec.backend,
            master_address=spec.master_address,
            master_port=spec.master_port,
            world_size=spec.world_size,
            rank=int(command["rank"]),
            group_name=spec.group_name,
            timeout_secs=float(command["timeout"]),
        )
        return None
    if op == "recv":
        specs = tensor_specs(command)
        mode = command.get("digest", "full")
        if member is not None:  # a node of a multi-node engine follows node 0's digest mode
            return member.receive(specs, command["load_format"], digest_mode=mode, group_name=name).digest
        if name not in groups:
            raise SimError(missing_group(name, list(groups)))
        return receive(groups[name], specs, command["load_format"], digest_mode=mode).digest
    if op == "destroy":
        if member is not None:
            member.destroy(name)
        elif name in groups:
            destroy_group(groups.pop(name))
        return None
    raise SimError(f"unknown command {op!r}")


def _helper_main(conn: Connection) -> None:  # pragma: no cover - runs in a child process
    torch.set_num_threads(1)
    groups: dict[str, Any] = {}
    while True:
        try:
            command = conn.recv()
        except EOFError:
            return
        if command["op"] == "exit":
            return
        try:
            value = run_command(None, groups, command)
            conn.send((True, value))
        except Exception as exc:  # report to the parent, keep serving
            conn.send((False, f"{type(exc).__name__}: {exc}"))
