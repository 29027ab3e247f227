"""Request bodies of the sim's routes, read and checked in SGLang 0.5.23's stages.

JSON is parsed with orjson, whose nesting limit (1024) and UTF-8 check turn hostile bodies
into a 400, never a RecursionError. A body SGLang refuses is refused with the same status and
the shape of the stage that refuses it:

- ``ValidationError``: FastAPI's pydantic parse (lax: ``"5"`` is an int, ``"yes"`` a bool).
  400 ``{"object": "error", "message", "type": "Bad Request", "param": null, "code": 400}``,
  streamed or not (``http_server.validation_exception_handler``).
- ``ContractError``: ``/generate``'s strict JSON contract (``sglang/api/v1/api_types.py``,
  serde's texts: a bool is never an int, a float never an int). 400 ``{"error": "<text>"}``.
  The texts are prefixed with the field's path, as serde_path_to_error does for the Rust server.
- a plain ``SimError``: a ``ValueError`` of a later stage (normalizing, sampling parameters,
  lengths): 400 ``{"error": {"message"}}``, or an error event in a 200 stream.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web

from pdctl.errors import SimError
from pdctl.sglang import openai_error_body

MAX_BODY_BYTES = 512 * 1024 * 1024
"""The sim's aiohttp ``client_max_size``: larger bodies get 413 before they are read."""


class ValidationError(SimError):
    """SGLang's pydantic stage refused the body (a FastAPI ``RequestValidationError``)."""

    def body(self) -> dict[str, Any]:
        """The OpenAI-style error body SGLang's validation handler answers with (400, ``type`` ``Bad Request``)."""
        return openai_error_body(str(self), err_type="Bad Request")


class ContractError(SimError):
    """``/generate``'s JSON contract refused the body."""

    def body(self) -> dict[str, Any]:
        """``{"error": "<text>"}``, as ``/generate``'s JSON contract answers."""
        return {"error": str(self)}


async def read_json(request: web.Request, default: Any = None) -> Any:
    """The parsed body; ``default`` when there is none (400 when none is allowed).

    Raises ValidationError (400) for bodies that are not JSON, not UTF-8 or nested too deep."""
    if not request.can_read_body:
        if default is not None:
            return default
        raise ValidationError("request body must be JSON")
    try:
        return orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise ValidationError(f"invalid JSON: {exc}") from exc


async def read_object(request: web.Request, default: Any = None) -> dict[str, Any]:
    body = await read_json(request, default)
    if not isinstance(body, dict):
        raise ValidationError("request body must be a JSON object")
    return body


async def read_openai_json(request: web.Request) -> dict[str, Any]:
    """An OpenAI route's body: SGLang's ``validate_json_request`` first, then a JSON object."""
    if request.content_type.lower() != "application/json":
        raise ValidationError("Unsupported Media Type: Only 'application/json' is allowed")
    return await read_object(request)


# -- pydantic's lax mode (python mode, as FastAPI validates a parsed body) ------------------------
_TRUE = {"1", "on", "t", "true", "y", "yes"}
_FALSE = {"0", "off", "f", "false", "n", "no"}
_INT_TEXT = re.compile(r"\s*[+-]?\d+(\.0*)?\s*")
REQUIRED: Any = object()
"""``field``'s default for a field the body must have."""


def lax_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, int | float) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in _TRUE | _FALSE:
        return v.strip().lower() in _TRUE
    raise ValueError("Input should be a valid boolean")


def lax_int(v: Any) -> int:
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float) and v.is_integer() and abs(v) < 2**63:
        return int(v)
    if isinstance(v, str) and _INT_TEXT.fullmatch(v):
        return int(v.strip().split(".")[0])
    raise ValueError("Input should be a valid integer")


def lax_float(v: Any) -> float:
    if isinstance(v, int | float):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            pass
    raise ValueError("Input should be a valid number")


def lax_str(v: Any) -> str:
    if isinstance(v, str):
        return v
    raise ValueError("Input should be a valid string")


def lax_dict(v: Any) -> dict[str, Any]:
    if isinstance(v, dict):
        return v
    raise ValueError("Input should be a valid dictionary")


def lax_list(item: Callable[[Any], Any], optional_items: bool = False) -> Callable[[Any], list[Any]]:
    def check(v: Any) -> list[Any]:
        if not isinstance(v, list):
            raise ValueError("Input should be a valid list")
        return [None if x is None and optional_items else item(x) for x in v]

    return check


def lax_or_list(item: Callable[[Any], Any], optional_items: bool = False) -> Callable[[Any], Any]:
    """``Union[X, List[X]]`` (``List[Optional[X]]`` with ``optional_items``)."""
    as_list = lax_list(item, optional_items)
    return lambda v: as_list(v) if isinstance(v, list) else item(v)


def lax_union(*checks: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``Union[...]``: the first member that takes the value (the last one's error otherwise)."""

    def check(v: Any) -> Any:
        for member in checks[:-1]:
            try:
                return member(v)
            except ValueError:
                pass
        return checks[-1](v)

    return check


def field(body: dict[str, Any], name: str, check: Callable[[Any], Any], default: Any = REQUIRED) -> Any:
    """``body[name]`` as pydantic would hand it over: coerced by ``check``. A missing field is
    ``default`` (an error when REQUIRED); null stays null only when the default is None (an
    Optional field)."""
    value = body.get(name, REQUIRED)
    if value is REQUIRED:
        if default is REQUIRED:
            raise ValidationError(f"{name}: Field required")
        return default
    if value is None and default is None:
        return None
    try:
        return check(value)
    except ValueError as exc:
        raise ValidationError(f"{name}: {exc}") from None


# -- /generate's JSON contract (serde's texts) -------------------------------------------------
def _unexpected(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{'true' if v else 'false'}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v}"'
    return "sequence" if isinstance(v, list) else "map"


def _expect(ok: Callable[[Any], bool], expected: str) -> Callable[[Any, str], None]:
    def check(v: Any, path: str) -> None:
        if not ok(v):
            raise ContractError(f"{path}: invalid type: {_unexpected(v)}, expected {expected}")

    return check


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


Check = Callable[[Any, str], None]
BOOL = _expect(lambda v: isinstance(v, bool), "a boolean")
I64 = _expect(_is_int, "i64")
F64 = _expect(_is_number, "f64")
STR = _expect(lambda v: isinstance(v, str), "a string")


def U64(v: Any, path: str) -> None:
    _expect(_is_int, "u64")(v, path)
    if v < 0:
        raise ContractError(f"{path}: invalid value: integer `{v}`, expected u64")


MAP = _expect(lambda v: isinstance(v, dict), "a map")
_SEQ = _expect(lambda v: isinstance(v, list), "a sequence")


def optional(item: Check) -> Check:
    return lambda v, path: None if v is None else item(v, path)


def seq_of(item: Check) -> Check:
    def check(v: Any, path: str) -> None:
        _SEQ(v, path)
        for i, x in enumerate(v):
            item(x, f"{path}[{i}]")

    return check


def or_list(name: str, is_one: Callable[[Any], bool], one: Check, list_item: Check | None = None) -> Check:
    """The contract's ``XOrList``: an array of ``list_item`` (default ``one``), else one value
    (``is_one`` says whether it has the type; ``one`` checks it further)."""
    many, wrong = seq_of(list_item or one), _expect(lambda _: False, f"a value or an array of values for {name}")

    def check(v: Any, path: str) -> None:
        if isinstance(v, list):
            many(v, path)
        elif not is_one(v):
            wrong(v, path)
        else:
            one(v, path)

    return check


def map_of(item: Check) -> Check:
    def check(v: Any, path: str) -> None:
        MAP(v, path)
        for k, x in v.items():
            item(x, f"{path}.{k}")

    return check


def token_ids_or_list(v: Any, path: str) -> None:
    """``TokenIdsOrList``: [] and [number, ...] are one flat list; anything else is a batch."""
    if not isinstance(v, list):
        _expect(lambda _: False, "a value or an array of values for TokenIdsOrList")(v, path)
    elif not v or _is_number(v[0]):
        seq_of(I64)(v, path)
    else:
        seq_of(seq_of(I64))(v, path)


def unknown_field(path: str, key: str, fields: tuple[str, ...]) -> ContractError:
    if len(fields) <= 2:
        expected = " or ".join(f"`{f}`" for f in fields)
    else:
        expected = "one of " + ", ".join(f"`{f}`" for f in fields)
    return ContractError(f"{path}: unknown field `{key}`, expected {expected}")


def struct(name: str, fields: dict[str, Check]) -> Check:
    """A contract struct whose unknown keys are refused (SamplingParams); null is a default."""
    names, is_map = tuple(fields), _expect(lambda v: isinstance(v, dict), f"struct {name}")

    def check(v: Any, path: str) -> None:
        is_map(v, path)
        for key, x in v.items():
            if key not in fields:
                raise unknown_field(path, key, names)
            if x is not None:
                fields[key](x, f"{path}.{key}")

    return check


def check_contract(body: dict[str, Any], fields: dict[str, Check], path: str = "") -> None:
    """Each known key of ``body`` against its check; null is the default for every one."""
    for key, value in body.items():
        check = fields.get(key)
        if check is not None and value is not None:
            check(value, f"{path}{key}")
