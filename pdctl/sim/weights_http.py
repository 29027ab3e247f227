"""The sim's weight endpoints (sglang-protocol.md 4.1-4.2), SGLang 0.5.21+ semantics.

Blocking work (rendezvous, broadcasts, disk reads) runs in a thread so the server keeps
answering; the model is only touched under the engine's exclusive (writer) lock.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from pathlib import Path
from typing import Any

import torch
from aiohttp import web
from safetensors.torch import load_file

from pdctl.errors import SimError
from pdctl.sglang import DEFAULT_GROUP_NAME, Endpoint
from pdctl.sglang.control import (
    GROUP_DESTROYED,
    GROUP_INITIALIZED,
    NO_GROUP_TO_DESTROY,
    OUTSIDE_SESSION,
    PARTIALLY_UPDATED,
    RECEIVE_FAILED,
    UPDATED_ONLINE,
    group_name,
    missing_group,
)
from pdctl.sim.body import read_json
from pdctl.sim.service import SimService
from pdctl.sim.weights import GroupSpec, tensor_specs
from pdctl.weights.buckets import tensor_checksum

log = logging.getLogger("pdctl.sim")
NOT_FLUSHED = "Weights were updated, but the cache was not flushed because requests are still running or queued"


def add_routes(app: web.Application, service: SimService) -> None:
    routes = WeightRoutes(service)
    r = app.router
    r.add_post(Endpoint.INIT_WEIGHTS_UPDATE_GROUP.value, routes.init_group)
    r.add_post(Endpoint.DESTROY_WEIGHTS_UPDATE_GROUP.value, routes.destroy_group)
    r.add_post(Endpoint.BEGIN_WEIGHT_UPDATE.value, routes.begin)
    r.add_post(Endpoint.END_WEIGHT_UPDATE.value, routes.end)
    r.add_post(Endpoint.UPDATE_WEIGHTS_FROM_DISTRIBUTED.value, routes.update_from_distributed)
    r.add_post(Endpoint.UPDATE_WEIGHTS_FROM_DISK.value, routes.update_from_disk)
    r.add_post(Endpoint.UPDATE_WEIGHT_VERSION.value, routes.update_version)
    r.add_route("*", Endpoint.GET_WEIGHTS_BY_NAME.value, routes.get_weights_by_name)
    r.add_post(Endpoint.WEIGHTS_CHECKER.value, routes.checker)


def weights_checksum(model: torch.nn.Module) -> dict[str, str]:
    """sha256 of each parameter's bytes as the model holds them (no copy); the sim's
    /weights_checker answer."""
    return {name: _sha256_of(p) for name, p in model.named_parameters()}


def _sha256_of(tensor: torch.Tensor) -> str:
    data: Any = tensor.detach().contiguous().view(torch.uint8).numpy()  # a buffer (numpy's stubs do not say so)
    return hashlib.sha256(data).hexdigest()


def _overall_checksum(checksums: dict[str, str]) -> str:
    """SGLang's ``overall_checksum``: sha256 over each name and its checksum, by name."""
    h = hashlib.sha256()
    for name in sorted(checksums):
        h.update(name.encode())
        h.update(checksums[name].encode())
    return h.hexdigest()


def _parallelism(service: SimService) -> dict[str, Any]:
    tp = service.config.tp_size
    return {"role": "target", "tp_rank": 0, "tp_size": tp, "dp_rank": 0, "dp_size": 1, "pp_rank": 0,
            "pp_size": 1, "rank": 0, "size": tp}  # fmt: skip


def _ok(message: str, **extra: Any) -> web.Response:
    return web.json_response({"success": True, "message": message, **extra})


def _fail(message: str, status: int = 400, **extra: Any) -> web.Response:
    return web.json_response({"success": False, "message": message, **extra}, status=status)


async def _body(request: web.Request) -> dict[str, Any]:
    body = await read_json(request, default={})
    if not isinstance(body, dict):
        raise SimError("body must be a JSON object")
    return body


class _Received(Exception):
    """An update call's receive did not go into the model; ``touched``: part of it did."""

    def __init__(self, message: str, *, touched: bool):
        super().__init__(message)
        self.touched = touched


def _misfit(specs: list[tuple[str, torch.dtype, tuple[int, ...]]], params: dict[str, torch.nn.Parameter]) -> str | None:
    """Why the model cannot take an update's tensors (the first unknown name or wrong shape), if it cannot."""
    for name, _, shape in specs:
        if name not in params:
            return f"unknown parameter {name!r}"
        if tuple(params[name].shape) != shape:
            return f"{name}: shape {shape} != model's {tuple(params[name].shape)}"
    return None


class WeightRoutes:
    """The handlers of SGLang's weight-update routes over one SimService (0.5.21+ semantics). Each answers ``{"success",
    "message"}`` with SGLang's messages, 400 on failure; blocking work runs in a thread."""

    def __init__(self, service: SimService):
        self.s = service

    async def init_group(self, request: web.Request) -> web.Response:
        """``POST /init_weights_update_group``: join the group on every TP rank of this engine; returns once all ranks
        joined, 400 when the body is bad or the rendezvous fails."""
        try:
            spec = GroupSpec.from_body(await _body(request))
            await asyncio.to_thread(self.s.members.init, spec)
        except (SimError, RuntimeError, ValueError) as exc:
            return _fail(f"Failed to initialize custom process group: {exc}")
        return _ok(GROUP_INITIALIZED)

    async def destroy_group(self, request: web.Request) -> web.Response:
        """``POST /destroy_weights_update_group``: leave the named group (default SGLang's); 400 when no such group was
        joined or leaving fails."""
        try:
            name = group_name(await read_json(request, default={}))
        except (SimError, ValueError) as exc:
            return _fail(str(exc))
        if name not in self.s.members.groups:
            return _fail(NO_GROUP_TO_DESTROY)
        try:
            await asyncio.to_thread(self.s.members.destroy, name)
        except (SimError, RuntimeError) as exc:
            return _fail(f"Failed to destroy custom process group: {exc}.")
        return _ok(GROUP_DESTROYED)

    async def begin(self, request: web.Request) -> web.Response:
        """``POST /begin_weight_update``: open a weight-update session; 400 when one is already open."""
        if self.s.weight_session_open:
            return _fail("a weight-update session is already open")
        self.s.weight_session_open = True
        return _ok("Weight update session opened.")

    async def end(self, request: web.Request) -> web.Response:
        """``POST /end_weight_update``: close the weight-update session; 400 when none is open."""
        if not self.s.weight_session_open:
            return _fail("no weight-update session is open")
        self.s.weight_session_open = False
        return _ok("Weight update session closed.")

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        """``POST /update_weights_from_distributed``: receive the named tensors over the group, under the engine's
        writer lock, and load them; set ``weight_version`` when given. 400 outside a session, for an unknown group,
        for a name or shape the model lacks (the model left untouched), for a failed receive, or when ``flush_cache``
        is asked while requests still run (the weights are then updated)."""
        try:
            body = await _body(request)
            specs = tensor_specs(body)
        except SimError as exc:
            return _fail(str(exc))
        if not self.s.weight_session_open:
            return _fail(OUTSIDE_SESSION)
        engine, members, model = self.s.engine, self.s.members, self.s.model
        name = str(body.get("group_name") or DEFAULT_GROUP_NAME)
        if name not in members.groups:
            return _fail(missing_group(name, list(members.groups)))

        load_format = body.get("load_format")

        def run() -> str | None:
            with engine.exclusive():
                params = dict(model.named_parameters())
                # The sim receives straight into its parameters; a name or shape it cannot take is
                # found first, and then the whole call is received into a buffer of its own (the
                # trainer's broadcast completes) and refused with the model untouched. SGLang
                # receives into buffers, loads after, and may be left partial (its message says so).
                misfit = _misfit(specs, params)
                in_place = misfit is None and load_format in (None, "auto")
                try:
                    received = members.receive(specs, load_format, params if in_place else None, group_name=name)
                except (SimError, RuntimeError) as exc:
                    raise _Received(str(exc), touched=in_place) from exc
                if misfit is not None:
                    raise _Received(misfit, touched=False)
                model.load_weights(received.tensors)
                if body.get("weight_version") is not None:
                    engine.set_weight_version(str(body["weight_version"]))
                if body.get("flush_cache", True) and engine.stats()["num_running_reqs"]:
                    return NOT_FLUSHED
            return None

        try:
            problem = await asyncio.to_thread(run)
        except _Received as exc:
            if exc.touched:
                return _fail(f"Failed to update parameter online: {exc}. {PARTIALLY_UPDATED}")
            return _fail(f"{RECEIVE_FAILED}: {exc}")
        except (SimError, RuntimeError) as exc:
            return _fail(f"{RECEIVE_FAILED}: {exc}")
        if problem:
            return _fail(problem)
        return _ok(UPDATED_ONLINE)

    async def update_from_disk(self, request: web.Request) -> web.Response:
        """``POST /update_weights_from_disk``: load the checkpoint at ``model_path`` under the engine's writer lock and
        set ``weight_version`` when given; 400 with the old weights kept when it cannot be read."""
        engine, model = self.s.engine, self.s.model
        try:
            body = await _body(request)
            path = Path(str(body["model_path"]))
        except (SimError, KeyError) as exc:
            return _fail(f"update_weights_from_disk needs model_path ({exc})")

        def run() -> None:
            tensors = load_file(str(path / "model.safetensors"))
            if self.s.config.disk_load_ms:  # the latency model: reading a real checkpoint takes a while
                time.sleep(self.s.config.disk_load_ms / 1000)
            with engine.exclusive():
                model.load_weights(list(tensors.items()))
                if body.get("weight_version") is not None:
                    engine.set_weight_version(str(body["weight_version"]))

        try:
            await asyncio.to_thread(run)
        except Exception as exc:  # a missing, unreadable or corrupt checkpoint (safetensors' own error
            # is no OSError): SGLang's answer, the old weights kept, one log line, no traceback
            log.warning("update_weights_from_disk %s: %s: %s", path, type(exc).__name__, exc)
            return _fail(f"Failed to load weights from {path}: {type(exc).__name__}: {exc}", num_paused_requests=0)
        return _ok(f"Succeeded to update model weights from {path}.", num_paused_requests=0)

    async def update_version(self, request: web.Request) -> web.Response:
        """``POST /update_weight_version``: set ``new_version``, aborting every request first unless
        ``abort_all_requests`` is false."""
        engine = self.s.engine
        try:
            body = await _body(request)
            version = str(body["new_version"])
        except (SimError, KeyError) as exc:
            return _fail(f"update_weight_version needs new_version ({exc})")
        if body.get("abort_all_requests", True):
            self.s.abort_epoch += 1
            engine.abort(None, "Aborted")
        engine.set_weight_version(version)
        return _ok(f"Weight version updated to {version}", new_version=version)

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        """``GET|POST /get_weights_by_name``: the named parameter's values as (nested) lists, cut to the first
        ``truncate_size`` (default 100) along its first dimension; 400 for an unknown name."""
        model = self.s.model
        try:
            body = await _body(request) if request.method == "POST" else dict(request.query)
            name = str(body["name"])
            truncate = int(body.get("truncate_size", 100))
        except (SimError, KeyError, ValueError) as exc:
            return web.json_response({"error": {"message": f"needs name ({exc})"}}, status=400)
        params = dict(model.named_parameters())
        if name not in params:
            return web.json_response({"error": {"message": f"unknown parameter {name!r}"}}, status=400)
        return web.json_response(params[name][:truncate].tolist())

    async def checker(self, request: web.Request) -> web.Response:
        """``POST /weights_checker`` (action ``checksum`` only): without ``names`` or ``mode``, sha256 of every
        parameter in SGLang's per-rank shape; else the named tensors' checksums as pdctl.weights computes the
        trainer's. 400 for another action or an unknown name."""
        model = self.s.model
        try:
            body = await _body(request)
        except SimError as exc:
            return _fail(str(exc))
        if body.get("action", "checksum") != "checksum":
            return _fail("the sim's weights_checker knows only action checksum")
        names, mode = body.get("names"), body.get("mode")
        if names is None and mode is None:  # the whole model, sha256 of every parameter
            # In SGLang's scheduler (a stall for the engine's requests), off the event loop.
            def compute() -> dict[str, str]:
                with self.s.engine.stalled():
                    return weights_checksum(model)

            sums = await asyncio.to_thread(compute)
            total = hashlib.sha256("".join(sums[k] for k in sorted(sums)).encode()).hexdigest()
            # SGLang's answer (weight_checker.py, tokenizer_control_mixin.py): one ChecksumInfo per
            # rank and the engine's sha256 over the ranks' per_gpu_checksum. The sim's model lives
            # on TP rank 0 alone, so it is one rank; ``checksum`` and ``checksums`` are the sim's own.
            per_gpu = _overall_checksum(sums)
            rank = {"checksums": sums, "per_gpu_checksum": per_gpu, "parallelism_info": [_parallelism(self.s)]}
            return _ok(
                "checksum",
                ranks=[rank],
                per_engine_checksum=hashlib.sha256(per_gpu.encode()).hexdigest(),
                checksum=total,
                checksums=sums,
                weight_version=self.s.weight_version,
            )
        # Named tensors, computed as pdctl.weights computes the trainer's (sample or full).
        params = dict(model.named_parameters())
        wanted = list(params) if names is None else [str(n) for n in names]
        unknown = [n for n in wanted if n not in params]
        if unknown:
            return _fail(f"unknown parameter {unknown[0]!r}")
        try:
            sums = {n: tensor_checksum(n, params[n], str(mode or "full")) for n in wanted}
        except ValueError as exc:
            return _fail(str(exc))
        return _ok("checksum", checksums=sums, weight_version=self.s.weight_version)
