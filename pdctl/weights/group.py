"""The flat broadcast group between trainer rank 0 and every engine (sglang-protocol.md 4.2-4.3).

The trainer is rank 0; engine i takes ranks ``rank_offset_i .. rank_offset_i + gpus_i - 1`` with
``rank_offset_i = 1 + GPUs of the engines before it``, prefill and decode alike, so engines of
different TP share one group. NCCL on CUDA, gloo on CPU: the same code with another backend.

``BroadcastGroup.build`` forms it: every engine's ``/init_weights_update_group`` call blocks
inside the rendezvous until rank 0 joins, so rank 0's join runs as a future beside those calls and
the build waits on whichever of them ends first (no polling). A collective that fails leaves the
group unusable on every rank; ``abandon`` keeps a group whose operation is still pending alive
(destroying it would crash the process) and the next build takes a new name.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

import torch
import torch.distributed as dist

from pdctl.errors import WeightSyncError
from pdctl.sglang import Endpoint, destroy_weights_update_group_body, init_weights_update_group_body
from pdctl.sglang.group import init_custom_process_group
from pdctl.weights.client import CallFailure
from pdctl.weights.fleet import EngineTarget, Fleet, Member
from pdctl.weights.phase import Phase

log = logging.getLogger("pdctl.weights")


class BroadcastGroup:
    """The group over the engines that answered the last build (``members``), or none."""

    def __init__(
        self,
        fleet: Fleet,
        *,
        master_address: str,
        master_port: int,
        backend: str,
        group_name: str,
        timeout_secs: float,
    ):
        self.fleet = fleet
        self.master_address = master_address
        self.master_port = master_port
        self.backend = backend
        self.group_name = group_name
        self.timeout_secs = timeout_secs
        self.process_group: dist.ProcessGroup | None = None
        self.members: tuple[Member, ...] = ()
        self.name = group_name
        """The name the current group was built under (a new one after an abandoned group)."""
        self.pending: list[Any] = []
        """The last bucket's broadcasts, while a failure may have left them unfinished."""
        self._abandoned: list[Any] = []  # groups and works left pending by a failure; kept alive on purpose
        self._signature: tuple = ()
        self._staging: torch.Tensor | None = None

    @staticmethod
    def signature(live: list[EngineTarget], infos: dict[str, dict[str, Any]]) -> tuple:
        """What makes a group current: the engines and when each started (a restart needs a new group)."""
        return tuple((e.url, infos[e.id].get("startup_time")) for e in live)

    def is_current(self, live: list[EngineTarget], infos: dict[str, dict[str, Any]]) -> bool:
        """Whether a group is built and was built for ``live`` as they answer now (same engines, none
        restarted)."""
        return self.process_group is not None and self.signature(live, infos) == self._signature

    def build(self, live: list[EngineTarget], infos: dict[str, dict[str, Any]]) -> None:
        """(Re)build the group over ``live``; WeightSyncError (phase ``connect``) naming an engine
        that does not join, or rank 0's own failure."""
        self.drop()
        self.fleet.refuse_if_held()  # another transaction's open sessions on the engines are not ours to close
        # This trainer's old group, or whatever an earlier trainer left open: a session (it died mid-push), its group.
        if self.fleet.router_url:  # the router forgets the groups it joined for this trainer
            for stale in {self.group_name, self.name}:
                self.fleet.client.post(
                    self.fleet.router_url + Endpoint.DESTROY_WEIGHTS_UPDATE_GROUP.value,
                    destroy_weights_update_group_body(stale),
                    timeout_secs=30,
                )
        self.fleet.fanout_quiet(live, Endpoint.END_WEIGHT_UPDATE, {})
        for stale in {self.group_name, self.name}:
            self.fleet.fanout_quiet(
                live, Endpoint.DESTROY_WEIGHTS_UPDATE_GROUP, destroy_weights_update_group_body(stale)
            )
        members, offset = [], 1
        for engine in live:
            members.append(Member.of(engine, offset, infos[engine.id]))
            offset += engine.gpus
        world_size = offset
        port = self._rendezvous_port()
        # A group left with a pending collective keeps its name registered in torch: a new name.
        name = self.group_name if not self._abandoned else f"{self.group_name}-{len(self._abandoned)}"
        self.name = name
        client = self.fleet.client
        router = self.fleet.router_url
        if router:  # the router joins them (its weight order), as for a framework: it forwards the updates
            body = init_weights_update_group_body(
                master_address=self.master_address,
                master_port=port,
                rank_offset=1,
                world_size=world_size,
                group_name=name,
                backend=self.backend,
            )
            body["pdctl_engines"] = [m.url for m in members]
            engines = {client.submit("POST", router + Endpoint.INIT_WEIGHTS_UPDATE_GROUP.value, body): "router"}
        else:
            engines = {
                client.submit(
                    "POST",
                    m.url + Endpoint.INIT_WEIGHTS_UPDATE_GROUP.value,
                    init_weights_update_group_body(
                        master_address=self.master_address,
                        master_port=port,
                        rank_offset=m.rank_offset,
                        world_size=world_size,
                        group_name=name,
                        backend=self.backend,
                    ),
                ): m.id
                for m in members
            }
        rank0 = client.pool.submit(
            init_custom_process_group,
            backend=self.backend,
            master_address=self.master_address,
            master_port=port,
            world_size=world_size,
            rank=0,
            group_name=name,
            timeout_secs=self.timeout_secs,
        )
        self.process_group = self._joined(rank0, engines, port)
        self.members = tuple(members)
        self._signature = self.signature(live, infos)
        log.info("weights: group %s of %d ranks over %d engines (port %d)", name, world_size, len(members), port)

    def _joined(self, rank0: Future, engines: dict[Future, str], port: int) -> dist.ProcessGroup:
        """Rank 0's group once it and every engine's call have ended well; raises on the first failure."""
        pending: set[Future] = {rank0, *engines}
        deadline = time.monotonic() + self.timeout_secs + 5
        while pending:
            done, pending = wait(pending, timeout=max(0.0, deadline - time.monotonic()), return_when=FIRST_COMPLETED)
            if not done:
                waiting = [engines[f] for f in pending if f in engines]
                raise WeightSyncError(
                    f"the weight group did not form within {self.timeout_secs:.0f}s "
                    f"(waiting for {waiting or 'rank 0'})",
                    engine=waiting[0] if waiting else None,
                    phase=Phase.CONNECT,
                )
            for future in done:
                if future is rank0 and future.exception() is not None:
                    # the engines' calls now wait for a rank 0 that never comes: abandon them
                    raise WeightSyncError(
                        f"rank 0 could not join the weight group on port {port}: {future.exception()}",
                        phase=Phase.CONNECT,
                    ) from future.exception()
                answer = None if future is rank0 else future.result()
                if isinstance(answer, CallFailure):
                    self._abandoned.append(rank0)  # its rendezvous times out on its own
                    engine = engines[future]
                    if engine == "router":
                        engine = next(iter(self.fleet.blame(answer)))
                    if engine == "router":
                        raise WeightSyncError(
                            f"the router did not join the engines to the weight group: {answer}", phase=Phase.CONNECT
                        )
                    raise WeightSyncError(
                        f"engine {engine} did not join the weight group: {answer}", engine=engine, phase=Phase.CONNECT
                    )
        return rank0.result()

    def _rendezvous_port(self) -> int:
        """The planned port while it is free; else a free one (an abandoned rendezvous may hold it)."""
        for port in (self.master_port, 0):
            with socket.socket(socket.AF_INET6 if ":" in self.master_address else socket.AF_INET) as s:
                try:
                    s.bind((self.master_address, port))
                except OSError:
                    continue
                return port or s.getsockname()[1]
        raise WeightSyncError(f"no free port on {self.master_address} for the weight group", phase=Phase.CONNECT)

    def staging(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A uint8 buffer of at least ``nbytes`` on ``device`` to flatten buckets into, kept
        between buckets and pushes (grown as needed)."""
        buf = self._staging
        if buf is None or buf.numel() < nbytes or buf.device != device:
            self._staging = None  # free the old one before allocating the new one
            self._staging = buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf

    def info(self) -> dict[str, Any]:
        """The group as the router keeps it for ``pdctl weights status``."""
        return {
            "name": self.name,
            "backend": self.backend,
            "world_size": 1 + sum(m.target.gpus for m in self.members),
            "ranks": {m.url: [m.rank_offset, m.rank_offset + m.target.gpus - 1] for m in self.members},
        }

    def destroy_on_engines(self) -> None:
        """The group goes from the engines (through the router, which joined them, if there is one)."""
        if not self.members:
            return
        body = destroy_weights_update_group_body(self.name)
        if self.fleet.router_url:
            self.fleet.client.post(
                self.fleet.router_url + Endpoint.DESTROY_WEIGHTS_UPDATE_GROUP.value, body, timeout_secs=30
            )
        else:
            self.fleet.fanout_quiet(self.members, Endpoint.DESTROY_WEIGHTS_UPDATE_GROUP, body)

    def drop(self) -> None:
        """Destroy this side's process group, ignoring errors, and forget the members; the engines are
        not told."""
        if self.process_group is not None:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(self.process_group)
        self.process_group = None
        self.members = ()

    def abandon(self) -> None:
        """After a failed collective: destroy the group, unless an op is still pending on it (a
        live rank that never received): then keep it alive until that op times out on its own."""
        if any(not w.is_completed() for w in self.pending):
            if self.process_group is not None:
                self._abandoned.append((self.process_group, self.pending))
            self.process_group = None
            self._staging = None  # the pending op may still read it: the next push takes a new one
        self.pending = []
        self.drop()
