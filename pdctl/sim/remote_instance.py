"""Engine-to-engine weights on the sim, as SGLang 0.5.23 moves them (sglang-protocol.md 7.3).

The seed (a serving engine) answers two routes, each run where SGLang runs it, inside the
scheduler, so the seed's running requests stall meanwhile (none is aborted):

- ``POST /init_weights_send_group_for_remote_instance`` {master_address, ports "p0,p1,...",
  group_rank, world_size, group_name, backend}: join the group of TP rank r over
  ``tcp://master_address:ports[r]`` as ``group_rank`` (``weight_exporter.py``); it blocks until
  the receiver joins. One port per TP rank: any other count is an uncaught assert in SGLang's
  scheduler, which ends the seed, and so it ends the sim;
- ``POST /send_weights_to_remote_instance`` {master_address, ports, group_name}: broadcast every
  ``named_parameters()`` tensor in order from rank 0, then destroy the group (every transfer needs
  a new init). A send with no init is a KeyError in SGLang's scheduler: the seed ends here too.

The receiver starts with ``--load-format remote_instance`` and the seed's address
(``RemoteSource``); incomplete settings fall back to a load from disk with SGLang's warning. At
load its TP rank 0 POSTs the init to the seed in a thread, without a key and without reading the
answer; it joins as rank 1 of world 2, POSTs the send in another thread, and receives each of its
own parameters in order (``loader.py`` ``load_model_from_remote_instance_by_nccl``).

What differs from SGLang, on CPU: the groups are gloo (SGLang's receiver hard-codes nccl and the
seed is asked for nccl), and the sim's TP helper ranks hold no model shard, so the pair of TP
rank 0 carries the whole model; the port count is still checked against ``--tp-size``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from typing import Any

import torch
import torch.distributed as dist
from aiohttp import web

from pdctl.jsonhttp import exchange
from pdctl.sglang import Endpoint
from pdctl.sglang.group import destroy_group, init_custom_process_group
from pdctl.sim.body import read_object
from pdctl.sim.config import RemoteSource
from pdctl.sim.service import SimService

log = logging.getLogger("pdctl.sim.remote_instance")

SIM_BACKEND = "gloo"
"""The sim's groups on CPU, whatever backend a body names."""


def instance_ip() -> str:
    """The receiver's own address as SGLang names it in the group name (its host name's)."""
    return socket.gethostbyname(socket.gethostname())


# -- the receiver ---------------------------------------------------------------------------------
def receive_from_seed(model: torch.nn.Module, source: RemoteSource, timeout_secs: float) -> None:
    """Fill ``model``'s parameters from the seed, as SGLang's TP rank 0 does at load. Raises
    (RuntimeError, OSError) when the group or a broadcast fails: the engine does not start."""
    me = instance_ip()
    group_name = f"send_weights_{me}"
    ports = ",".join(str(p) for p in source.ports)
    url = f"http://{source.seed_ip}:{source.service_port}"
    init_body = {
        "master_address": source.seed_ip,
        "ports": ports,
        "group_rank": 0,
        "world_size": 2,
        "group_name": group_name,
        "backend": "nccl",
    }
    init_url = url + Endpoint.INIT_WEIGHTS_SEND_GROUP_FOR_REMOTE_INSTANCE
    threading.Thread(target=_post_unchecked, args=(init_url, init_body), daemon=True).start()
    group = init_custom_process_group(
        backend=SIM_BACKEND,
        master_address=source.seed_ip,
        master_port=source.ports[0],
        world_size=2,
        rank=1,
        group_name=group_name,
        timeout_secs=timeout_secs,
    )
    try:
        dist.barrier(group=group)  # as SGLang's receiver (RemoteInstanceClient.build_group) and its seed
        send_body = {"master_address": source.seed_ip, "ports": ports, "group_name": group_name}
        send_url = url + Endpoint.SEND_WEIGHTS_TO_REMOTE_INSTANCE
        threading.Thread(target=_post_unchecked, args=(send_url, send_body), daemon=True).start()
        with torch.no_grad():
            for _, tensor in model.named_parameters():
                dist.broadcast(tensor.data, src=0, group=group)
    finally:
        destroy_group(group)
    log.info("loaded the weights from the seed instance %s", url)


def _post_unchecked(url: str, body: dict[str, Any]) -> None:
    """SGLang's ``requests.post`` of the receiver's triggers: no key, no timeout, the answer
    unread; a failure is logged (the group then waits for a seed that never joins)."""
    headers = {"Content-Type": "application/json"}
    try:
        answer = exchange("POST", url, body, headers=headers, timeout_secs=None)
    except (OSError, ValueError) as exc:
        log.error("Failed to trigger %s: %s.", url, exc)
        return
    if not answer.ok:
        log.info("%s answered %d (unread, as SGLang's receiver leaves it)", url, answer.status)


# -- the seed -------------------------------------------------------------------------------------
def add_routes(app: web.Application, service: SimService) -> None:
    """Serve ``service``'s seed side: SGLang's remote-instance init and send routes."""
    seed = SeedRoutes(service)
    app.router.add_post(Endpoint.INIT_WEIGHTS_SEND_GROUP_FOR_REMOTE_INSTANCE.value, seed.init)
    app.router.add_post(Endpoint.SEND_WEIGHTS_TO_REMOTE_INSTANCE.value, seed.send)


class SeedRoutes:
    """A seed engine's side of SGLang's remote-instance weight loading: the init and send routes, run one at a time with
    the engine's batches stalled, as SGLang's scheduler runs them."""

    def __init__(self, service: SimService):
        self.s = service
        self.groups: dict[str, dist.ProcessGroup] = {}
        """SGLang's ``_weights_send_group``: by ``{group_name}_{port}_{tp_rank}``."""
        self.serial = asyncio.Lock()
        """SGLang's scheduler takes control requests one at a time, in order: a send that comes
        while its init still completes waits for it (the receiver posts it as soon as it joined)."""

    def _fatal(self, reason: str) -> web.Response:
        """An uncaught raise in SGLang's scheduler: the engine ends (the sim exits 1)."""
        log.error("Scheduler hit an exception: %s", reason)
        on_fatal = self.s.engine.on_fatal
        if on_fatal is not None:
            on_fatal(reason)
        return web.json_response({"error": {"message": reason}}, status=500)

    async def init(self, request: web.Request) -> web.Response:
        """``POST /init_weights_send_group_for_remote_instance``: join the receiver's group (blocks until the receiver
        joins). 400 for a bad body or a failed rendezvous; a port count other than the TP size ends the engine with a
        500, as SGLang's assert ends the seed."""
        body = await read_object(request)
        try:
            ports = [int(p) for p in str(body["ports"]).split(",")]
            master, rank, world = str(body["master_address"]), int(body["group_rank"]), int(body["world_size"])
        except (KeyError, TypeError, ValueError) as exc:
            return web.json_response({"success": False, "message": f"Failed to init group: {exc}."}, status=400)
        tp = self.s.config.tp_size
        if len(ports) != tp:
            return self._fatal(f"AssertionError: Expected {tp} ports, but got {len(ports)} ports.")
        key = f"{body.get('group_name', 'weight_send_group')}_{ports[0]}_0"

        def run() -> None:
            with self.s.engine.stalled():  # SGLang's scheduler runs this handler: no batch meanwhile
                self.groups[key] = init_custom_process_group(
                    backend=SIM_BACKEND,
                    master_address=master,
                    master_port=ports[0],
                    world_size=world,
                    rank=rank,
                    group_name=str(body.get("group_name", "weight_send_group")),
                    timeout_secs=self.s.config.dist_timeout_secs,
                )
                dist.barrier(group=self.groups[key])  # as SGLang's WeightExporter (kept: as SGLang keeps it)

        try:
            async with self.serial:
                await asyncio.to_thread(run)
        except (RuntimeError, ValueError, OSError) as exc:
            return web.json_response({"success": False, "message": f"Failed to init group: {exc}."}, status=400)
        message = f"Succeeded to init group through {master}:{ports[0]} group."
        return web.json_response({"success": True, "message": message})

    async def send(self, request: web.Request) -> web.Response:
        """``POST /send_weights_to_remote_instance``: broadcast every parameter in order, then destroy the group. 400
        for a bad body or a failed broadcast; a send with no init ends the engine with a 500, as SGLang's KeyError
        ends the seed."""
        body = await read_object(request)
        try:
            ports = [int(p) for p in str(body["ports"]).split(",")]
            master = str(body["master_address"])
        except (KeyError, TypeError, ValueError) as exc:
            return web.json_response({"success": False, "message": f"Failed to send weights: {exc}."}, status=400)
        name = str(body.get("group_name", "weight_send_group"))
        key = f"{name}_{ports[0]}_0"
        async with self.serial:
            return await self._send(key, master, ports[0], name)

    async def _send(self, key: str, master: str, port: int, name: str) -> web.Response:
        group = self.groups.pop(key, None)
        if group is None:
            return self._fatal(f"KeyError: {key!r}")
        model = self.s.model

        def run() -> None:
            try:
                with self.s.engine.stalled(), torch.no_grad():
                    for _, tensor in model.named_parameters():
                        dist.broadcast(tensor.data, src=0, group=group)
            finally:
                destroy_group(group)

        try:
            await asyncio.to_thread(run)
        except (RuntimeError, ValueError, OSError) as exc:
            return web.json_response({"success": False, "message": f"Failed to send weights: {exc}."}, status=400)
        return web.json_response(
            {"success": True, "message": f"Succeeded to send weights through {master}:{port} {name}."}
        )
