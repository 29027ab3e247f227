"""Joining the union world: one TCP store hosted by trainer rank 0, one gloo group per rank.

Every message of the data plane goes through that group, the hidden states too with ``gloo``;
with ``cuda_ipc`` they go through the GPU's memory (``pdctl.colocate.ipc``) and the group carries
only the handshakes (NCCL cannot be used: it refuses two ranks of one communicator on one GPU).
The groups are made as ``ProcessGroupGloo`` objects and used through their own ``send``/``recv``,
never registered as torch's default group: a trainer under torchrun keeps
its own world for FSDP, and an engine process that plays several TP ranks (the sim runs every TP
rank of its engine in one process) holds one group per rank. Every rank must join concurrently:
a group's construction blocks until all ``world_size`` ranks have connected.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol, cast

import torch
import torch.distributed as dist

from pdctl.colocate.env import DataPlaneSpec
from pdctl.sglang.group import GLOO_IFNAME_ENV, interface_towards


class PointToPoint(Protocol):
    """What the data plane uses of a process group backend (torch's stubs leave these out)."""

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work: ...

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work: ...


READY_WAIT = timedelta(days=7)
"""How long an engine rank waits for its trainer rank's "ready": as long as the trainer lives (a
dead trainer closes the connection, which ends the wait at once); a slow step, a checkpoint or
an evaluation on the trainer is not a failure."""


@dataclass(frozen=True, slots=True)
class UnionRank:
    """One rank's membership of the union world: its gloo ``group`` (and the store it holds)."""

    rank: int
    group: PointToPoint
    store: dist.TCPStore


def join(spec: DataPlaneSpec, ranks: list[int]) -> list[UnionRank]:
    """Join the union world as each of ``ranks`` (in parallel threads); blocks until every rank
    of the world has joined, up to ``spec.join_timeout_secs`` (engines start after the trainer
    and load their model first). Operations time out after ``spec.timeout_secs`` unless they say
    otherwise."""
    results: dict[int, UnionRank] = {}
    errors: list[BaseException] = []
    # Gloo binds where the host name resolves, often 127.0.0.1 (and in network namespaces):
    # peers on other hosts would be told to connect to their own loopback. Bind the interface
    # that routes to the master instead, unless GLOO_SOCKET_IFNAME says otherwise.
    interface = None if os.environ.get(GLOO_IFNAME_ENV) else interface_towards(spec.master_address)

    def one(rank: int) -> None:
        try:
            results[rank] = _join_rank(spec, rank, interface)
        except BaseException as exc:  # re-raised on the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(r,), name=f"data-plane-join-{r}") for r in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return [results[r] for r in ranks]


def _join_rank(spec: DataPlaneSpec, rank: int, interface: str | None) -> UnionRank:
    join_timeout = timedelta(seconds=spec.join_timeout_secs)
    store = dist.TCPStore(
        spec.master_address,
        spec.master_port,
        spec.world_size,
        is_master=rank == 0,
        timeout=join_timeout,
        wait_for_workers=False,
    )
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # (left out of torch's stubs)
    options._timeout = timedelta(seconds=spec.timeout_secs)
    device = dist.ProcessGroupGloo.create_device(interface=interface) if interface else None
    options._devices = [device or dist.ProcessGroupGloo.create_default_device()]
    # A group's construction waits for every rank under its operations' timeout: an engine that
    # loads its model for longer than timeout_secs failed the trainer's join. Every rank first
    # says it is here and waits for all the others under the join's timeout; by then the group's
    # own rendezvous only connects ranks that are all present.
    present = dist.PrefixStore(f"{spec.group_name}/present", store)
    if present.add(str(rank), 1) > 1:  # the world formed (or was forming) with this rank once
        raise RuntimeError(f"{_who(spec, rank)} already joined this union world: restart the trainer job with it")
    try:
        present.wait([str(r) for r in range(spec.world_size)], join_timeout)
    except dist.DistStoreError:
        missing = [_who(spec, r) for r in range(spec.world_size) if not present.check([str(r)])]
        raise RuntimeError(
            f"{', '.join(missing) or 'a rank'} did not join within {spec.join_timeout_secs:g} s (join_timeout_secs)"
        ) from None
    group_store = dist.PrefixStore(f"{spec.group_name}/meta", store)
    gloo = dist.ProcessGroupGloo(group_store, rank, spec.world_size, options)
    return UnionRank(rank=rank, group=cast(PointToPoint, gloo), store=store)


def _who(spec: DataPlaneSpec, union_rank: int) -> str:
    """``union_rank`` by its role: trainer rank r, or engine E's TP rank j."""
    if union_rank < spec.trainer_ranks:
        return f"trainer rank {union_rank}"
    for engine in spec.engines:
        if union_rank in engine.ranks:
            return f"engine {engine.id} TP rank {union_rank - engine.first_rank}"
    return f"union rank {union_rank}"
