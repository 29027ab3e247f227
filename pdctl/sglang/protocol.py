"""SGLang HTTP endpoints and bodies (sglang-protocol.md sections 2, 4 and 5).

Body builders return plain dicts ready for JSON; parsers accept what SGLang 0.5.x sends.
"""

from __future__ import annotations

import random
import secrets
from collections.abc import Sequence
from typing import Any

from pdctl.choices import Choice

# Decode treats a request whose bootstrap_host is this as fake: no KV is transferred
# (SGLang disaggregation/utils.py FAKE_BOOTSTRAP_HOST, used by warm-up and /health).
SPOKEN_VERSION = "0.5.23"  # the SGLang whose API pdctl's own engines (sim, null) speak and report
FAKE_BOOTSTRAP_HOST = "2.2.2.2"
# Rooms are random in [0, 2**63 - 1]: SGLang stores them as signed int64.
MAX_BOOTSTRAP_ROOM = 2**63 - 1
DEFAULT_GROUP_NAME = "weight_update_group"
# /begin_weight_update and /end_weight_update exist from SGLang 0.5.21 on.
WEIGHT_SESSION_SINCE = (0, 5, 21)
# load_format "flattened_bucket" (one uint8 broadcast per update call) exists from 0.5.12 on.
FLATTENED_BUCKET_SINCE = (0, 5, 12)


class Endpoint(Choice):
    """Every SGLang server path pdctl speaks (server side in the sim, client side elsewhere)."""

    GENERATE = "/generate"
    COMPLETIONS = "/v1/completions"
    CHAT_COMPLETIONS = "/v1/chat/completions"
    MODELS = "/v1/models"
    TOKENIZE = "/v1/tokenize"
    """Text to token ids and their ``count`` (SGLang also answers it at ``/tokenize``)."""
    HEALTH = "/health"
    HEALTH_GENERATE = "/health_generate"
    MODEL_INFO = "/model_info"
    GET_MODEL_INFO = "/get_model_info"
    SERVER_INFO = "/server_info"
    GET_SERVER_INFO = "/get_server_info"
    FLUSH_CACHE = "/flush_cache"
    PAUSE_GENERATION = "/pause_generation"
    CONTINUE_GENERATION = "/continue_generation"
    ABORT_REQUEST = "/abort_request"
    INIT_WEIGHTS_UPDATE_GROUP = "/init_weights_update_group"
    DESTROY_WEIGHTS_UPDATE_GROUP = "/destroy_weights_update_group"
    UPDATE_WEIGHTS_FROM_DISTRIBUTED = "/update_weights_from_distributed"
    UPDATE_WEIGHTS_FROM_DISK = "/update_weights_from_disk"
    BEGIN_WEIGHT_UPDATE = "/begin_weight_update"
    END_WEIGHT_UPDATE = "/end_weight_update"
    UPDATE_WEIGHT_VERSION = "/update_weight_version"
    GET_WEIGHTS_BY_NAME = "/get_weights_by_name"
    WEIGHTS_CHECKER = "/weights_checker"
    GET_WEIGHT_VERSION = "/get_weight_version"  # gone since 0.5.18 (404); pdctl's router answers it
    PD_ROLE_SWITCH = "/pd_role_switch"
    INIT_WEIGHTS_SEND_GROUP_FOR_REMOTE_INSTANCE = "/init_weights_send_group_for_remote_instance"
    """A seed's side of engine-to-engine weights (sglang-protocol.md 7.3): join a receiver's pair group."""
    SEND_WEIGHTS_TO_REMOTE_INSTANCE = "/send_weights_to_remote_instance"
    """A seed's side of engine-to-engine weights: broadcast its weights over that group, then destroy it."""
    RELEASE_MEMORY_OCCUPATION = "/release_memory_occupation"
    RESUME_MEMORY_OCCUPATION = "/resume_memory_occupation"
    METRICS = "/metrics"
    LOADS = "/v1/loads"

    def __str__(self) -> str:
        return self.value


def resolve_server_args(args: dict[str, Any]) -> dict[str, Any]:
    """``args`` (flag values) as SGLang 0.5.23's ``/server_info`` reports them: resolved
    (``arg_groups/serving_hook.py``), so that clients that compare them (slime's external-engine
    mode asserts a PD prefill's ``load_balance_method``) read what a real engine says."""
    out = dict(args)
    mode = out.get("disaggregation_mode") or "null"
    if out.get("load_balance_method") == "auto":  # handle_load_balance_method
        out["load_balance_method"] = "follow_bootstrap_room" if mode == "prefill" else "round_robin"
    if "grammar_backend" in out and out["grammar_backend"] is None:  # handle_grammar_backend
        out["grammar_backend"] = "xgrammar"
    return out


def _version_tuple(version: str) -> tuple[int, ...]:
    parts: list[int] = []
    for piece in version.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def supports_weight_update_session(version: str) -> bool:
    """True when an SGLang ``version`` (e.g. ``0.5.23``) has begin/end weight-update sessions."""
    return _version_tuple(version) >= WEIGHT_SESSION_SINCE


def supports_flattened_bucket(version: str) -> bool:
    """True when an SGLang ``version`` accepts ``load_format: flattened_bucket`` updates."""
    return _version_tuple(version) >= FLATTENED_BUCKET_SINCE


def batch_size_of(body: dict[str, Any]) -> int | None:
    """How many items a /generate body holds, or None for a single request.

    Follows MiniLB's rule (sglang-protocol.md 2.1): ``text`` as a list, or ``input_ids``
    whose first element is not an int, is a batch.
    """
    text = body.get("text")
    if isinstance(text, list):
        return len(text)
    ids = body.get("input_ids")
    if isinstance(ids, list) and ids and not isinstance(ids[0], int):
        return len(ids)
    return None


_ROOMS = random.Random(secrets.randbits(64))  # rooms must be unique, not secret: no syscall per request


def new_room() -> int:
    """A fresh random bootstrap room in [0, 2**63 - 1]."""
    return _ROOMS.getrandbits(63)


def inject_bootstrap(body: dict[str, Any], *, host: str, port: int | None, batch_size: int | None) -> dict[str, Any]:
    """A copy of ``body`` with ``bootstrap_host/port/room`` added; per item for batches.

    ``host`` is the prefill's host as the router reaches it (IPv6 in brackets).
    """
    if batch_size is None:  # (a dict display: a third cheaper than copy + update, once per request)
        return {**body, "bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": _ROOMS.getrandbits(63)}
    return {
        **body,
        "bootstrap_host": [host] * batch_size,
        "bootstrap_port": [port] * batch_size,
        "bootstrap_room": [new_room() for _ in range(batch_size)],
    }


def init_weights_update_group_body(
    *,
    master_address: str,
    master_port: int,
    rank_offset: int,
    world_size: int,
    group_name: str = DEFAULT_GROUP_NAME,
    backend: str = "nccl",
) -> dict[str, Any]:
    """Body of ``POST /init_weights_update_group`` (sglang-protocol.md 4.1)."""
    return {
        "master_address": master_address,
        "master_port": int(master_port),
        "rank_offset": rank_offset,
        "world_size": world_size,
        "group_name": group_name,
        "backend": backend,
    }


def update_weights_from_distributed_body(
    *,
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
    group_name: str = DEFAULT_GROUP_NAME,
    weight_version: str | None = None,
    flush_cache: bool = False,
    load_format: str | None = None,
) -> dict[str, Any]:
    """Body of ``POST /update_weights_from_distributed``; dtypes are torch names (``bfloat16``)."""
    return {
        "names": list(names),
        "dtypes": list(dtypes),
        "shapes": [list(s) for s in shapes],
        "group_name": group_name,
        "flush_cache": flush_cache,
        "abort_all_requests": False,
        "weight_version": weight_version,
        "load_format": load_format,
        "selector": "all",
        "torch_empty_cache": False,
    }


class PauseMode(Choice):
    """``/pause_generation``'s modes (0.5.12+): ``abort`` ends running and queued requests,
    ``retract`` sends running ones back to the queue, ``in_place`` keeps their KV and stops."""

    ABORT = "abort"
    RETRACT = "retract"
    IN_PLACE = "in_place"


def pause_generation_body(mode: PauseMode | str = PauseMode.RETRACT) -> dict[str, Any]:
    """Body of ``POST /pause_generation``."""
    return {"mode": PauseMode(mode).value}


def update_weight_version_body(version: str) -> dict[str, Any]:
    """Body of ``POST /update_weight_version``; running requests are not aborted."""
    return {"new_version": version, "abort_all_requests": False}


def destroy_weights_update_group_body(group_name: str = DEFAULT_GROUP_NAME) -> dict[str, Any]:
    """Body of ``POST /destroy_weights_update_group``."""
    return {"group_name": group_name}


def update_weights_from_disk_body(model_path: str, *, weight_version: str | None = None) -> dict[str, Any]:
    """Body of ``POST /update_weights_from_disk`` (sglang-protocol.md 4.1)."""
    return {"model_path": model_path, "abort_all_requests": False, "weight_version": weight_version}


def generate_error_body(message: str) -> dict[str, Any]:
    """The error body SGLang's native routes return (``http_server._create_error_response``)."""
    return {"error": {"message": message}}


def openai_stream_error_chunk(message: str, *, status: int = 400, err_type: str = "BadRequestError") -> dict[str, Any]:
    """The error an OpenAI route sends inside its SSE stream (``create_streaming_error_response``)."""
    return {"error": openai_error_body(message, status=status, err_type=err_type)}


def openai_error_body(message: str, *, status: int = 400, err_type: str = "BadRequestError") -> dict[str, Any]:
    """The error body of SGLang's OpenAI routes (``ErrorResponse``)."""
    return {"object": "error", "message": message, "type": err_type, "param": None, "code": status}
