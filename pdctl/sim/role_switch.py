"""``POST /pd_role_switch``: a PD engine turns prefill <-> decode live (SGLang 0.5.23,
``entrypoints/http_server.py`` ``pd_role_switch``, ``disaggregation/role_switch.py``).

The body is ``PdRoleSwitchReqInput`` {new_role: "prefill" | "decode", decode_cuda_graph_bs?,
decode_cuda_graph_memory_gb?, prepare_only?}; the answer ``PdRoleSwitchReqOutput`` {success,
message, old_role, new_role, safe_to_restore}, 200 on success, 400 on a refusal, in SGLang's
order of checks and with its messages: the flag is missing, the role is invalid, the engine is
not in PD mode, its transfer backend cannot switch, the role is the one it has (a success, "ok"), it is not idle
(a request running, queued or waiting for its KV), or a switch to decode that would capture
decode CUDA graphs without ``decode_cuda_graph_memory_gb``. With the flag every PD engine runs its
bootstrap server from the start (``disagg_service.py``), so a switch starts and stops nothing.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

from pdctl.sim.body import ValidationError, read_object
from pdctl.sim.service import SimService

log = logging.getLogger("pdctl.sim")

ROLES = ("prefill", "decode")
SWITCHING_BACKENDS = ("mooncake", "mori")
"""The KV transfer backends whose manager supports a runtime switch (mooncake is the default)."""
NOT_ENABLED = "--enable-pd-role-switch is not set on this server"
NOT_IDLE = "instance is not idle; drain all requests before switching"
NOT_PD = "instance is not running in PD disaggregation mode"
GRAPHS_NEED_MEMORY = "decode_cuda_graph_memory_gb is required before capturing decode graphs"
NEGATIVE_MEMORY = "decode_cuda_graph_memory_gb must be non-negative"


def add_routes(app: web.Application, service: SimService) -> None:
    async def switch(request: web.Request) -> web.Response:
        return await pd_role_switch(service, request)

    app.router.add_post("/pd_role_switch", switch)


async def pd_role_switch(service: SimService, request: web.Request) -> web.Response:
    body = await read_object(request, {})
    new_role = body.get("new_role", "")
    if new_role not in ("prefill", "decode", ""):  # the Literal of PdRoleSwitchReqInput
        raise ValidationError(f"new_role: Input should be 'prefill', 'decode' or '' (got {new_role!r})")
    memory = body.get("decode_cuda_graph_memory_gb")
    if memory is not None and (isinstance(memory, bool) or not isinstance(memory, int | float)):
        raise ValidationError("decode_cuda_graph_memory_gb: Input should be a valid number")
    old_role = service.mode

    def answer(success: bool, message: str, *, safe: bool = False) -> web.Response:
        if not success:
            log.warning("PD role switch rejected (%s -> %s): %s", old_role, new_role, message)
        out: dict[str, Any] = {
            "success": success,
            "message": message,
            "old_role": old_role,
            "new_role": new_role,
            "safe_to_restore": safe,
        }
        return web.json_response(out, status=200 if success else 400)

    if not service.config.enable_pd_role_switch:
        return answer(False, NOT_ENABLED, safe=True)
    if new_role not in ROLES:
        return answer(False, f"invalid new_role={new_role!r}", safe=True)
    if old_role == "null":
        return answer(False, NOT_PD, safe=True)
    backend = dict(service.config.server_args).get("disaggregation_transfer_backend") or "mooncake"
    if backend not in SWITCHING_BACKENDS:
        return answer(False, f"transfer backend {backend!r} does not support runtime role switch", safe=True)
    if new_role == old_role:  # the scheduler's "already in target role", which the tokenizer says as "ok"
        return answer(True, "ok")
    if not service.idle():
        return answer(False, NOT_IDLE, safe=True)
    if new_role == "decode" and not service.decode_graphs:
        if memory is None:
            return answer(False, GRAPHS_NEED_MEMORY, safe=True)
        if memory < 0:
            return answer(False, NEGATIVE_MEMORY, safe=True)
    if body.get("prepare_only"):
        return answer(True, "ready", safe=True)
    if new_role == "decode" and not service.decode_graphs:
        profile = service.engine.profile
        if profile is not None:  # a profile engine pays the capture's time (the router has drained it)
            await asyncio.sleep(profile.graph_capture_secs)
        service.decode_graphs = True  # "captured" on the first flip to decode, as SGLang does
    service.mode = new_role
    service.engine.hold_transfers_apart(new_role == "decode")
    log.info("PD role switch succeeded: %s -> %s", old_role, new_role)
    return answer(True, "ok")
