"""SGLang 0.5.23's control routes as a server reads them: the bodies of ``/pause_generation``,
``/init_weights_update_group``, ``/update_weights_from_distributed`` (the list form and the older
one-parameter form), ``/update_weights_from_disk`` and friends, parsed into frozen records, and the
messages SGLang answers with (sglang-protocol.md 4.1; ``entrypoints/http_server.py``,
``managers/io_struct.py``, ``model_runner_components/weight_updater.py``).

Every parser raises ValueError naming the field that is wrong. The sim (an engine) and the
router's facade (the whole fleet answering as one engine) read the same bodies with them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdctl.sglang.protocol import DEFAULT_GROUP_NAME, Endpoint, PauseMode

CONTROL_ROUTES: tuple[tuple[str, Endpoint], ...] = (
    ("POST", Endpoint.PAUSE_GENERATION),
    ("POST", Endpoint.CONTINUE_GENERATION),
    ("GET", Endpoint.FLUSH_CACHE),
    ("POST", Endpoint.FLUSH_CACHE),
    ("POST", Endpoint.ABORT_REQUEST),
    ("GET", Endpoint.RELEASE_MEMORY_OCCUPATION),
    ("POST", Endpoint.RELEASE_MEMORY_OCCUPATION),
    ("GET", Endpoint.RESUME_MEMORY_OCCUPATION),
    ("POST", Endpoint.RESUME_MEMORY_OCCUPATION),
    ("GET", Endpoint.GET_WEIGHT_VERSION),
    ("POST", Endpoint.UPDATE_WEIGHT_VERSION),
    ("POST", Endpoint.UPDATE_WEIGHTS_FROM_DISK),
    ("POST", Endpoint.INIT_WEIGHTS_UPDATE_GROUP),
    ("POST", Endpoint.UPDATE_WEIGHTS_FROM_DISTRIBUTED),
    ("POST", Endpoint.DESTROY_WEIGHTS_UPDATE_GROUP),
)
"""SGLang's control routes that RL frameworks send (SGLang's admin level: ``ADMIN_OPTIONAL``), as
(method, path); a router in front of a fleet answers them for all its engines (pdctl.router.facade)."""

GROUP_INITIALIZED = "Succeeded to initialize custom process group."
GROUP_DESTROYED = "Succeeded to destroy custom process group."
NO_GROUP_TO_DESTROY = "The group to be destroyed does not exist."
UPDATED_ONLINE = "Succeeded to update parameter online."
UPDATED_FROM_DISK = "Succeeded to update model weights."
OUTSIDE_SESSION = "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
PAUSED = {"message": "Generation paused successfully.", "status": "ok"}
CONTINUED = {"message": "Generation continued successfully.", "status": "ok"}
DP_REFUSED = "data-parallel replicas are not supported for update weights from distributed"
RECEIVE_FAILED = "Failed to receive weights"
"""How SGLang begins the answer of an update whose receive failed: its tensors arrive in buffers of
their own and reach the model only after the receive, so the model is untouched
(``scheduler_components/weight_updater.py``). A failure in the load that follows answers
``Failed to update parameter online: ... partially updated`` instead, with no rollback."""
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
"""What ``/release_memory_occupation`` releases when it names no tags (SGLang's ``constants.py``)."""
PARTIALLY_UPDATED = "The full weights of the ModelRunner are partially updated. Please discard the whole weights."
"""What SGLang adds to a failed load after the receive (``model_runner.py``): no rollback."""
BODY_REQUIRED = "1 validation error: body: Field required"
"""SGLang's 400 for a control route sent with no body (FastAPI's validation of a required body)."""


def left_untouched(message: str) -> bool:
    """Whether SGLang's failure ``message`` for an update call says the engine's model was not
    touched: a refusal before the receive (no session, no such group) or a failed receive. Any
    other failure (the load after the receive, which SGLang does not roll back) may have changed it."""
    text = message.strip()
    before_receive = text.startswith(OUTSIDE_SESSION) or "Please call `init_weights_update_group` first" in text
    return text.startswith(RECEIVE_FAILED) or before_receive


def missing_group(name: str, known: list[str]) -> str:
    """An update that names a group this engine never joined (SGLang's assertion, as answered)."""
    return f"Failed to receive weights: Group {name} not in {known}. Please call `init_weights_update_group` first."


def as_object(body: Any) -> Mapping[str, Any]:
    if body is None:
        return {}
    if not isinstance(body, Mapping):
        raise ValueError("the body must be a JSON object")
    return body


def text(body: Mapping[str, Any], key: str, default: str | None = None) -> str:
    value = body.get(key, default)
    if not isinstance(value, str) or (default is None and not value):
        raise ValueError(f"{key} must be a non-empty string")
    return value


def _opt_str(body: Mapping[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{key} must be a string or null")
    return value


def _int(body: Mapping[str, Any], key: str, *, numeric_string: bool = False) -> int:
    value = body.get(key)
    if numeric_string and isinstance(value, str) and value.strip().isdigit():
        return int(value)  # AReaL sends master_port as a string; SGLang's msgspec takes it
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key} must be an integer, not {value!r:.40}")
    return value


def flag(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false")
    return value


def pause_mode(body: Any) -> PauseMode:
    """``/pause_generation``'s ``mode`` (default ``abort``; SGLang 0.5.12+)."""
    mode = as_object(body).get("mode", PauseMode.ABORT.value)
    try:
        return PauseMode(mode)
    except ValueError:
        raise ValueError(f"mode must be one of abort, retract, in_place, not {mode!r:.40}") from None


def group_name(body: Any) -> str:
    """The ``group_name`` of a destroy body (an empty body names the default group)."""
    return text(as_object(body), "group_name", DEFAULT_GROUP_NAME)


def named_group(body: Any) -> str | None:
    """The ``group_name`` a body names, None when it names none (a missing body included)."""
    value = as_object(body).get("group_name")
    return None if value is None else text(as_object(body), "group_name")


def memory_tags(body: Any, *, required: bool = False) -> list[str] | None:
    """``tags`` of ``/release_memory_occupation`` and ``/resume_memory_occupation`` (None: all),
    read as SGLang 0.5.23 reads them (``io_struct.py``, a msgspec struct that ignores unknown
    keys): ``required``, a missing body is refused as SGLang refuses it."""
    if body is None and required:
        raise ValueError(BODY_REQUIRED)
    tags = as_object(body).get("tags")
    if tags is not None and (not isinstance(tags, list) or not all(isinstance(t, str) for t in tags)):
        raise ValueError("tags must be a list of strings (weights, kv_cache, cuda_graph) or null")
    return tags


@dataclass(frozen=True)
class InitGroup:
    """``POST /init_weights_update_group``."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP_NAME
    backend: str = "nccl"

    @classmethod
    def from_body(cls, body: Any) -> InitGroup:
        """Parse a request body; ValueError naming what is wrong."""
        b = as_object(body)
        spec = cls(
            master_address=text(b, "master_address"),
            master_port=_int(b, "master_port", numeric_string=True),
            rank_offset=_int(b, "rank_offset"),
            world_size=_int(b, "world_size"),
            group_name=text(b, "group_name", DEFAULT_GROUP_NAME),
            backend=text(b, "backend", "nccl"),
        )
        if not 0 < spec.master_port < 65536:
            raise ValueError(f"master_port must be 1 to 65535, not {spec.master_port}")
        if spec.rank_offset < 0 or spec.world_size < 1:
            raise ValueError("rank_offset must be >= 0 and world_size >= 1")
        if not spec.group_name:
            raise ValueError("Group name cannot be empty")
        return spec

    def to_body(self, rank_offset: int | None = None) -> dict[str, Any]:
        """The body for one engine of the group (at ``rank_offset``, else this one's)."""
        return {
            "master_address": self.master_address,
            "master_port": self.master_port,
            "rank_offset": self.rank_offset if rank_offset is None else rank_offset,
            "world_size": self.world_size,
            "group_name": self.group_name,
            "backend": self.backend,
        }


@dataclass(frozen=True)
class DistributedUpdate:
    """``POST /update_weights_from_distributed``: ``{names, dtypes, shapes, ...}`` or the older
    one-parameter ``{name, dtype, shape}`` (skyrl-train), read as a list of one. ``group_name``
    is None when the body names none (SGLang 0.5.23 then takes ``weight_update_group``; SGLang
    before named groups, which skyrl-train was written for, its one group)."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    group_name: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None

    @classmethod
    def from_body(cls, body: Any) -> DistributedUpdate:
        """Parse a request body in either form; ValueError naming what is wrong."""
        b = as_object(body)
        single = "names" not in b and "name" in b  # the one-parameter form
        lists: dict[str, Any] = {}
        for key in ("names", "dtypes", "shapes"):
            value = [b.get(key[:-1])] if single else b.get(key)
            if not isinstance(value, list):
                raise ValueError(f"{key} must be a list")
            lists[key] = value
        names, dtypes, shapes = lists["names"], lists["dtypes"], lists["shapes"]
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError("names, dtypes and shapes must have the same length")
        if not all(isinstance(n, str) and n for n in names):
            raise ValueError("names must be non-empty strings")
        if not all(isinstance(d, str) and d for d in dtypes):
            raise ValueError("dtypes must be torch dtype names (bfloat16, float32, ...)")
        dims: list[tuple[int, ...]] = []
        for shape in shapes:
            if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in shape):
                raise ValueError("each shape must be a list of integers")
            if any(s < 0 for s in shape):
                raise ValueError("shapes must not be negative")
            dims.append(tuple(shape))
        return cls(
            names=tuple(names),
            dtypes=tuple(d.removeprefix("torch.") for d in dtypes),
            shapes=tuple(dims),
            group_name=None if b.get("group_name") is None else text(b, "group_name"),
            flush_cache=flag(b, "flush_cache", True),
            abort_all_requests=flag(b, "abort_all_requests", False),
            weight_version=_opt_str(b, "weight_version"),
            load_format=_opt_str(b, "load_format"),
        )

    def to_body(self, *, flush_cache: bool, weight_version: str | None, group_name: str) -> dict[str, Any]:
        """The list form (SGLang 0.5.23 knows no other) over ``group_name``, with these
        ``flush_cache`` and version."""
        return {
            "names": list(self.names),
            "dtypes": list(self.dtypes),
            "shapes": [list(s) for s in self.shapes],
            "group_name": group_name,
            "flush_cache": flush_cache,
            "abort_all_requests": self.abort_all_requests,
            "weight_version": weight_version,
            "load_format": self.load_format,
        }


@dataclass(frozen=True)
class DiskUpdate:
    """``POST /update_weights_from_disk``."""

    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True

    @classmethod
    def from_body(cls, body: Any) -> DiskUpdate:
        """Parse a request body; ValueError naming what is wrong."""
        b = as_object(body)
        return cls(
            model_path=text(b, "model_path"),
            load_format=_opt_str(b, "load_format"),
            abort_all_requests=flag(b, "abort_all_requests", False),
            weight_version=_opt_str(b, "weight_version"),
            flush_cache=flag(b, "flush_cache", True),
        )

    def to_body(self, weight_version: str | None) -> dict[str, Any]:
        """The body for an engine, with ``weight_version`` as the version."""
        return {
            "model_path": self.model_path,
            "load_format": self.load_format,
            "abort_all_requests": self.abort_all_requests,
            "weight_version": weight_version,
            "flush_cache": self.flush_cache,
        }
