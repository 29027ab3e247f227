"""What the router refuses in a request body before it reaches an engine: the types of the
fields it can read cheaply (``stream``, ``n``, ``max_new_tokens``/``max_tokens``) and the work a
request may ask for (``n`` and prompts x ``n``), so that one small body cannot make an engine
allocate without bound.

SGLang 0.5.23 has no limit on ``n`` or on a batch's size; the defaults here
(``AdmissionConfig.max_n``, ``max_sequences``) are pdctl's and documented there. Types follow
SGLang's strict ``/generate`` decoder (a bool is not an int, a float is not an int); the OpenAI
routes are held to the same types rather than pydantic's coercions ("yes" is not a boolean).
"""

from __future__ import annotations

from typing import Any

from pdctl.sglang import Endpoint, batch_size_of

GENERATE = Endpoint.GENERATE.value
COMPLETIONS = Endpoint.COMPLETIONS.value


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def body_problem(route: str, body: dict[str, Any], max_n: int, max_sequences: int) -> str | None:
    """Why ``body`` (a JSON object for ``route``) is refused with a 400, or None."""
    if route == GENERATE and min(max_n, max_sequences) >= 1 and _plain_generate(body):
        return None
    return full_problem(route, body, max_n, max_sequences)


def full_problem(route: str, body: dict[str, Any], max_n: int, max_sequences: int) -> str | None:
    """``body_problem`` read in full (what the common case's glance must agree with)."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        return f"stream must be true or false, got {type(stream).__name__} {stream!r:.40}"
    if route == GENERATE:
        params = body.get("sampling_params")
        items = params if isinstance(params, list) else [params]
        n = 1
        for item in items:
            if item is None:
                continue
            if not isinstance(item, dict):
                return "sampling_params must be an object (or a list of objects, one per prompt)"
            if (problem := _check_int(item, "max_new_tokens", "sampling_params.max_new_tokens", 0)) is not None:
                return problem
            if (problem := _check_int(item, "n", "sampling_params.n", None)) is not None:
                return problem
            n = max(n, item.get("n") or 1)
        batch = batch_size_of(body) or 1
    else:
        for name in ("max_tokens", "max_completion_tokens"):
            if (problem := _check_int(body, name, name, 0)) is not None:
                return problem
        if (problem := _check_int(body, "n", "n", None)) is not None:
            return problem
        n = body.get("n") or 1
        prompt = body.get("prompt") if route == COMPLETIONS else None
        batch = len(prompt) if isinstance(prompt, list) and prompt and not _int(prompt[0]) else 1
    if n > max_n:
        return f"n is {n}; this router allows at most {max_n} samples per prompt (--max-n)"
    if batch * n > max_sequences:
        return (
            f"{batch} prompt(s) x n={n} is {batch * n} sequences; this router allows at most {max_sequences} "
            "per request (--max-sequences-per-request)"
        )
    return None


def _plain_generate(body: dict[str, Any]) -> bool:
    """A /generate body that passes every rule at a glance, the common case: one prompt (text, not
    a list), ``stream`` absent or a bool, one ``sampling_params`` object whose ``max_new_tokens``
    is absent or an int >= 0 and with no ``n`` (one sample). Anything else is read in full."""
    if "input_ids" in body or type(body.get("text")) is list:
        return False
    stream = body.get("stream")
    if stream is not None and type(stream) is not bool:
        return False
    params = body.get("sampling_params")
    if params is None:
        return True
    if type(params) is not dict or "n" in params:
        return False
    tokens = params.get("max_new_tokens")
    return tokens is None or (type(tokens) is int and tokens >= 0)  # (type() is int: a bool is not)


def _check_int(where: dict[str, Any], key: str, name: str, minimum: int | None) -> str | None:
    value = where.get(key)
    if value is None:
        return None
    if not _int(value):
        return f"{name} must be an integer, got {type(value).__name__} {value!r:.40}"
    if minimum is not None and value < minimum:
        return f"{name} must be at least {minimum}, got {value}"
    return None
