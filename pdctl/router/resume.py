"""Continuing a /generate stream on another pair after its decode died mid-stream.

SGLang's /generate stream sends cumulative ``text`` and ``output_ids`` with ``meta_info`` in
every event. When the decode dies after some events went out, the router can ask a new pair
for the rest: the prompt plus the text generated so far, for the remaining tokens, on the same
weight version, and rewrite the new stream's events so that the client sees one stream (text,
ids and token counts continue where they stopped; the request id stays). Greedy requests
continue exactly as they would have (the same weights, the same prefix); sampled ones continue
with a fresh draw.

Only what can be continued faithfully is: a single ``text`` prompt (no batch, no ``input_ids``,
one sample), without logprobs (their positions would need the original prompt's). Anything
else ends with an error event instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdctl.router.jsonutil import sse_data, sse_event

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default for /generate


@dataclass(frozen=True)
class Progress:
    """What the client has been sent so far, from the last event it got."""

    text: str
    ids: list[int]
    tokens: int
    prompt_tokens: int | None
    rid: str | None
    version: str | None


def resumable(path: str, body: dict[str, Any]) -> bool:
    sampling = body.get("sampling_params")
    sampling = sampling if isinstance(sampling, dict) else {}
    return (
        path == "/generate"
        and isinstance(body.get("text"), str)
        and "input_ids" not in body
        and not body.get("return_logprob")
        and sampling.get("n", 1) in (1, None)
    )


def progress_of(event: bytes | None) -> Progress | None:
    """The progress a forwarded ``data: {...}`` event shows; None if it shows none."""
    data = sse_data(event) if event else None
    if data is None:
        return None
    meta = data.get("meta_info")
    if not isinstance(meta, dict) or not isinstance(data.get("text"), str):
        return None
    raw_ids = data.get("output_ids")
    ids: list[int] = raw_ids if isinstance(raw_ids, list) else []
    return Progress(
        text=data["text"],
        ids=list(ids),
        tokens=int(meta.get("completion_tokens") or len(ids)),
        prompt_tokens=meta.get("prompt_tokens"),
        rid=meta.get("id"),
        version=meta.get("weight_version"),
    )


def remaining_tokens(body: dict[str, Any], done: Progress) -> int:
    raw = body.get("sampling_params")
    sampling: dict[str, Any] = raw if isinstance(raw, dict) else {}
    wanted = sampling.get("max_new_tokens")
    return (DEFAULT_MAX_NEW_TOKENS if wanted is None else int(wanted)) - done.tokens


def continuation_body(body: dict[str, Any], done: Progress) -> dict[str, Any]:
    """The request for the rest: prompt plus text so far, for the tokens still owed."""
    sampling = dict(body.get("sampling_params") or {})
    sampling["max_new_tokens"] = remaining_tokens(body, done)
    return {**body, "text": body["text"] + done.text, "sampling_params": sampling}


def rewrite(event: bytes, done: Progress) -> bytes:
    """A continuation's event as part of the original stream (``[DONE]`` and errors pass)."""
    data = sse_data(event)
    if data is None:
        return event
    meta = data.get("meta_info")
    if not isinstance(meta, dict):
        return event
    data["text"] = done.text + str(data.get("text", ""))
    data["output_ids"] = done.ids + list(data.get("output_ids") or [])
    meta["completion_tokens"] = done.tokens + int(meta.get("completion_tokens") or 0)
    if done.prompt_tokens is not None:
        meta["prompt_tokens"] = done.prompt_tokens
    if done.rid is not None:
        meta["id"] = done.rid
    return sse_event(data)
