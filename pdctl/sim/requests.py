"""Parse SGLang ``/generate`` bodies into per-item specs, and shape responses like SGLang.

Batch rules follow SGLang (``_normalize_bootstrap_params``): ``text`` as a list or
``input_ids`` as a list of lists is a batch; a scalar ``bootstrap_room`` on a batch of n
becomes ``room + i``; scalar host/port are repeated.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

from pdctl.errors import SimError
from pdctl.sim.engine import Request, abort_reason
from pdctl.sim.model import decode, encode
from pdctl.sim.sampling import SamplingOptions


@dataclass(frozen=True)
class ItemSpec:
    """One prompt of a /generate body."""

    rid: str | None
    input_ids: list[int]
    sampling: SamplingOptions
    return_logprob: bool
    bootstrap_host: str | None
    bootstrap_port: int | None
    bootstrap_room: int | None
    top_logprobs_num: int = 0


@dataclass(frozen=True)
class GenerateBody:
    items: list[ItemSpec]
    is_batch: bool
    stream: bool


def parse_generate(body: Any) -> GenerateBody:
    """Raises SimError (HTTP 400) with a message naming the field."""
    if not isinstance(body, dict):
        raise SimError("request body must be a JSON object")
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise SimError("Either text or input_ids should be provided (exactly one).")
    prompts: list[list[int]]
    if text is not None:
        if isinstance(text, str):
            prompts, is_batch = [encode(text)], False
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            prompts, is_batch = [encode(t) for t in text], True
        else:
            raise SimError("text must be a string or a non-empty list of strings")
    else:
        if isinstance(ids, list) and ids and all(_is_token(i) for i in ids):
            prompts, is_batch = [list(ids)], False
        elif isinstance(ids, list) and ids and all(isinstance(x, list) and x and all(map(_is_token, x)) for x in ids):
            prompts, is_batch = [list(x) for x in ids], True
        else:
            raise SimError("input_ids must be a non-empty list of token ids or a list of such lists")
    n = len(prompts)
    sampling = _per_item(body.get("sampling_params"), n, "sampling_params", dict)
    logprob = _per_item(body.get("return_logprob"), n, "return_logprob", bool)
    rids = _per_item(body.get("rid"), n, "rid", str)
    hosts = _per_item(body.get("bootstrap_host"), n, "bootstrap_host", str)
    ports = _per_item(body.get("bootstrap_port"), n, "bootstrap_port", int)
    tops = _per_item(body.get("top_logprobs_num"), n, "top_logprobs_num", int)
    room = body.get("bootstrap_room")
    if isinstance(room, int) and not isinstance(room, bool) and is_batch:
        rooms: list[Any] = [room + i for i in range(n)]
    else:
        rooms = _per_item(room, n, "bootstrap_room", int)
    items = []
    for i in range(n):
        raw = sampling[i] or {}
        item = ItemSpec(
            rid=rids[i],
            input_ids=prompts[i],
            sampling=SamplingOptions.from_json(sampling[i]),
            return_logprob=bool(logprob[i]) or bool(tops[i]),
            bootstrap_host=hosts[i],
            bootstrap_port=ports[i],
            bootstrap_room=rooms[i],
            top_logprobs_num=int(tops[i] or 0),
        )
        items.extend(parallel_samples(item, int(raw.get("n") or 1)))
    return GenerateBody(items=items, is_batch=is_batch or len(items) > 1, stream=bool(body.get("stream", False)))


def parallel_samples(item: ItemSpec, n: int) -> list[ItemSpec]:
    """``n`` > 1 (parallel sampling, GRPO groups): n requests for one prompt, prompt-major. Sample
    j uses bootstrap room + j (both PD legs expand alike, so they meet) and sampling seed + j."""
    if n == 1:
        return [item]
    out = []
    for j in range(n):
        seed = item.sampling.sampling_seed
        out.append(
            replace(
                item,
                rid=f"{item.rid}-{j}" if item.rid else None,
                sampling=replace(item.sampling, sampling_seed=seed + j) if seed is not None else item.sampling,
                bootstrap_room=item.bootstrap_room + j if item.bootstrap_room is not None else None,
            )
        )
    return out


def _is_token(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _per_item(value: Any, n: int, name: str, kind: type) -> list[Any]:
    if isinstance(value, list):
        if len(value) != n:
            raise SimError(f"{name} has {len(value)} items for a batch of {n}")
        for v in value:
            if v is not None and not isinstance(v, kind):
                raise SimError(f"{name} items must be {kind.__name__}")
        return list(value)
    if value is not None and not isinstance(value, kind):
        raise SimError(f"{name} must be {kind.__name__}")
    return [value] * n


def generate_output(req: Request, n: int, weight_version: str, *, pd_decode: bool) -> dict[str, Any]:
    """SGLang's /generate output for ``req`` after its first ``n`` tokens."""
    ids = req.output_ids[:n]
    done = req.finish is not None and n == len(req.output_ids)
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finish if done else None,
        "prompt_tokens": len(req.input_ids),
        "weight_version": weight_version,
        "num_retractions": req.retractions,
        "reasoning_tokens": 0,
        "completion_tokens": len(ids),
        "cached_tokens": 0,
        "e2e_latency": time.monotonic() - req.created,
    }
    if req.return_logprob:
        # A PD decode returns no input logprobs: the router puts the prefill's in front.
        meta["input_token_logprobs"] = (
            [] if pd_decode else [[lp, tok, None] for lp, tok in zip(req.input_logprobs, req.input_ids, strict=False)]
        )
        meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(req.output_logprobs[:n], ids, strict=True)]
    if req.top_logprobs_num:
        # SGLang: per position a list of [logprob, token_id, text]; input positions are not computed here.
        meta["input_top_logprobs"] = [None] * len(req.input_ids) if not pd_decode else []
        meta["output_top_logprobs"] = [[[lp, tok, None] for lp, tok in top] for top in req.output_top_logprobs[:n]]
    if done:  # SGLang reports the spans of a finished request's output (utils/weight_versions.py)
        meta["weight_versions"] = weight_version_spans(req.version_events, weight_version, len(ids))
        meta["weight_version"] = meta["weight_versions"][-1]["version"]
    text = req.text() if done else decode(ids)
    return {"text": text, "output_ids": ids, "meta_info": meta}


def weight_version_spans(events: list[tuple[str, int]], current: str, n_tokens: int) -> list[dict[str, Any]]:
    """SGLang 0.5.23's ``compute_weight_version_spans`` then ``add_weight_versions_to_meta_info``:
    ``{"version", "start", "end"}`` over the output, one per version, in order."""
    spans: list[dict[str, Any]] = []
    for version, end in [*events, (current, n_tokens)]:
        end = min(end, n_tokens)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
    return [s for s in spans if s["start"] < n_tokens or s["start"] == 0]


def failed_output(item: ItemSpec, rid: str, exc: SimError, weight_version: str, *, pd_decode: bool) -> dict[str, Any]:
    """The one event SGLang streams for a request its scheduler aborts before the first token
    (a decode whose KV cannot come, a full queue): no tokens, finish_reason abort with the
    status (``_handle_abort_finish_reason`` yields it to a stream instead of raising)."""
    req = Request(rid=rid, input_ids=item.input_ids, sampling=item.sampling, emit=lambda _: None)
    req.finish = abort_reason(str(exc), exc.status)
    return generate_output(req, 0, weight_version, pd_decode=pd_decode)
