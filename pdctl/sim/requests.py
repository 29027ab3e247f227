"""Parse SGLang ``/generate`` bodies into per-item specs, and shape responses like SGLang.

A body goes through SGLang 0.5.23's stages in order (body.py): pydantic's parse of
``GenerateReqInput``, the strict JSON contract, ``normalize_batch_and_arguments`` and the
tokenizer manager's per-request checks (length, sampling parameters), each refusing with its
own words. Batch rules follow SGLang: ``text`` as a list or ``input_ids`` as a list of lists is
a batch; ``n`` > 1 makes one too; a scalar ``bootstrap_room`` on a batch of k becomes
``room + i``; scalar host/port are repeated.

Deliberate deviations, all refusals (400) of what would harm the sim: token ids outside the
vocabulary (SGLang's GPU embedding clamps them; the sim's would crash), empty prompts, and
requests larger than the sim's bounds (``Limits``; SGLang has none).
"""

from __future__ import annotations

import time
from array import array
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

from pdctl.errors import SimError
from pdctl.sim.body import (
    BOOL,
    I64,
    STR,
    U64,
    Check,
    ValidationError,
    check_contract,
    field,
    lax_bool,
    lax_dict,
    lax_int,
    lax_list,
    lax_or_list,
    lax_str,
    lax_union,
    map_of,
    optional,
    or_list,
    seq_of,
    token_ids_or_list,
)
from pdctl.sim.config import SimConfig
from pdctl.sim.engine import Request, abort_reason
from pdctl.sim.model import decode, encode
from pdctl.sim.sampling import SamplingOptions, check_sampling_params


@dataclass(frozen=True)
class Limits:
    """What one request may ask: the model's vocabulary and context, and the sim's own bounds
    on a request's size (SGLang has none; a 70-byte body must not allocate without bound)."""

    vocab_size: int
    context_len: int
    max_n: int
    max_sequences: int
    max_request_tokens: int

    @classmethod
    def of(cls, config: SimConfig, vocab_size: int, context: int) -> Limits:
        """The limits of an engine with ``config``'s ``--sim-max-*`` bounds, the model's vocabulary and ``context``
        positions."""
        return cls(
            vocab_size,
            context,
            config.max_n,
            config.max_sequences_per_request,
            config.max_request_tokens,
        )

    def check_size(self, prompts: int, n: int, tokens: int) -> None:
        """``prompts`` prompts of ``tokens`` tokens in all, each sampled ``n`` times."""
        if n > self.max_n:
            raise SimError(f"n = {n} is more than this sim engine allows (--sim-max-n {self.max_n})")
        n = max(n, 1)
        if prompts * n > self.max_sequences:
            raise SimError(
                f"{prompts} prompts x n = {n} is {prompts * n} sequences, more than this sim engine allows "
                f"in one request (--sim-max-sequences-per-request {self.max_sequences})"
            )
        if tokens * n > self.max_request_tokens:
            raise SimError(
                f"the request's prompts hold {tokens * n} tokens (x n), more than this sim engine allows "
                f"in one request (--sim-max-request-tokens {self.max_request_tokens})"
            )

    def check_prompt(self, ids: list[int], max_new_tokens: Any, name: str = "input_ids") -> None:
        """The vocabulary (the sim's own check), then SGLang's ``_validate_one_request``:
        ``max_new_tokens`` counts only when the request gave it."""
        if not ids:
            raise SimError(f"{name} cannot be empty.")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise SimError(f"{name} contains out-of-vocabulary token id {bad}; valid range is [0, {self.vocab_size}).")
        n, c = len(ids), self.context_len
        if n >= c:
            raise SimError(f"The input ({n} tokens) is longer than the model's context length ({c} tokens).")
        if max_new_tokens is not None and max_new_tokens + n > c:
            raise SimError(
                f"Requested token count exceeds the model's maximum context length of {c} tokens. You requested "
                f"a total of {max_new_tokens + n} tokens: {n} tokens from the input messages and {max_new_tokens} "
                "tokens for the completion. Please reduce the number of tokens in the input messages or the "
                "completion to fit within the limit."
            )


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
    return_hidden_states: bool = False


@dataclass(frozen=True)
class GenerateBody:
    """A checked ``/generate`` body: one ``ItemSpec`` per sequence, whether the answer is a list (a batch) and whether
    it streams."""

    items: list[ItemSpec]
    is_batch: bool
    stream: bool


def _ids_1d(v: Any) -> None:
    """SGLang's ``validate_list_i64_1d`` (utils/field_validators.py)."""
    if not isinstance(v, list):
        raise ValueError(f"must be list; got {type(v).__name__}")
    if v and not isinstance(v[0], int):
        raise ValueError(f"elements must be int; got {type(v[0]).__name__}")
    try:
        array("q", v)
    except (TypeError, OverflowError) as exc:
        raise ValueError(f"contains non-int64 element: {exc}") from None


def lax_token_ids(v: Any) -> Any:
    """SGLang's ``validate_optional_list_i64_1d_2d``: the pydantic check of ``input_ids``."""
    if not isinstance(v, list):
        raise ValueError(f"Value error, must be list or null; got {type(v).__name__}")
    if v and isinstance(v[0], list):
        for i, row in enumerate(v):
            try:
                _ids_1d(row)
            except ValueError as exc:
                raise ValueError(f"Value error, row {i}: {exc}") from None
    elif v:
        if not isinstance(v[0], int):
            raise ValueError(f"Value error, elements must be int or list; got {type(v[0]).__name__}")
        try:
            _ids_1d(v)
        except ValueError as exc:
            raise ValueError(f"Value error, {exc}") from None
    return v


# GenerateReqInput's fields (managers/io_struct.py) that the sim reads, as pydantic checks them.
_PYDANTIC = {
    "text": lax_or_list(lax_str),
    "input_ids": lax_token_ids,
    "rid": lax_or_list(lax_str),
    "sampling_params": lax_or_list(lax_dict),
    "return_logprob": lax_or_list(lax_bool),
    "logprob_start_len": lax_or_list(lax_int),
    "top_logprobs_num": lax_or_list(lax_int),
    "token_ids_logprob": lax_union(lax_list(lax_int), lax_list(lax_list(lax_int))),
    "bootstrap_host": lax_or_list(lax_str, optional_items=True),
    "bootstrap_port": lax_or_list(lax_int, optional_items=True),
    "bootstrap_room": lax_or_list(lax_int, optional_items=True),
}
_STR_OR_LIST = or_list("StringOrList", lambda v: isinstance(v, str), STR)
_BOOL_OR_LIST = or_list("BoolOrList", lambda v: isinstance(v, bool), BOOL)
_INT_OR_LIST = or_list("Int64OrList", lambda v: isinstance(v, int) and not isinstance(v, bool), I64)
_OPT_STR_OR_LIST = or_list("OptionalStringOrList", lambda v: isinstance(v, str), STR, optional(STR))
_OPT_INT_OR_LIST = or_list(
    "OptionalInt64OrList", lambda v: isinstance(v, int) and not isinstance(v, bool), I64, optional(I64)
)
# GenerateRequest's contract (sglang/api/v1/api_types.py), media and kv_hints fields left out:
# the sim has no use for them. Unknown keys are ignored, as there.
GENERATE_CONTRACT: dict[str, Check] = {
    "rid": _STR_OR_LIST,
    "text": _STR_OR_LIST,
    "input_ids": token_ids_or_list,
    "stream": BOOL,
    "sampling_params": or_list("SamplingParamsOrList", lambda v: isinstance(v, dict), check_sampling_params),
    "return_logprob": _BOOL_OR_LIST,
    "logprob_start_len": _INT_OR_LIST,
    "top_logprobs_num": _INT_OR_LIST,
    "token_ids_logprob": token_ids_or_list,
    "return_hidden_states": _BOOL_OR_LIST,
    "return_text_in_logprobs": BOOL,
    "bootstrap_host": _OPT_STR_OR_LIST,
    "bootstrap_port": _OPT_INT_OR_LIST,
    "bootstrap_room": _OPT_INT_OR_LIST,
    "bootstrap_pair_key": _OPT_STR_OR_LIST,
    "decode_tp_size": _OPT_INT_OR_LIST,
    "routed_dp_rank": I64,
    "disagg_prefill_dp_rank": I64,
    "extra_key": _STR_OR_LIST,
    "priority": I64,
    "cache_salt": _STR_OR_LIST,
    "require_reasoning": BOOL,
    "lora_path": _OPT_STR_OR_LIST,
    "routing_key": STR,
    "max_thinking_tokens": U64,
    "session_id": STR,
    "custom_logit_processor": _OPT_STR_OR_LIST,
    "custom_labels": map_of(STR),
    "return_sampling_mask": _BOOL_OR_LIST,
    "modalities": seq_of(optional(STR)),
}


def parse_generate(body: Any, limits: Limits) -> GenerateBody:
    """Raises ValidationError, ContractError or SimError (all HTTP 400; body.py) naming the field."""
    if not isinstance(body, dict):
        raise ValidationError("request body must be a JSON object")
    for name, check in _PYDANTIC.items():
        field(body, name, check, None)
    for name in ("stream", "return_text_in_logprobs"):  # bool, not Optional: null is refused
        field(body, name, lax_bool, False)
    check_contract(body, GENERATE_CONTRACT)
    return _normalize(body, limits)


def _normalize(body: dict[str, Any], limits: Limits) -> GenerateBody:
    """``normalize_batch_and_arguments``, the sim's bounds, then each prompt's checks."""
    text, ids = body.get("text"), body.get("input_ids")
    if text is None and ids is None:
        if body.get("input_embeds") is not None:
            raise SimError("input_embeds is not supported by the sim engine")
        raise SimError("Either text, input_ids or input_embeds should be provided.")
    if ids is not None and not ids:
        raise SimError("input_ids cannot be empty.")
    shape: Any = text if text is not None else ids
    single = isinstance(shape, str) or (bool(shape) and isinstance(shape[0], int))
    size = 1 if single else len(shape)
    if size == 0:
        raise SimError("text cannot be an empty list")
    prompts = _prompts(text, ids, single, size)
    sampling = body.get("sampling_params")
    if isinstance(sampling, list) and not sampling:
        raise SimError("sampling_params cannot be an empty list")
    samples = [(p or {}).get("n", 1) for p in (sampling if isinstance(sampling, list) else [sampling])]
    if any(s != samples[0] for s in samples):
        raise SimError("The parallel_sample_num should be the same for all samples in sample params.")
    n = samples[0] if isinstance(samples[0], int) else 1  # n <= 1 (0, negative): one sample, as in SGLang
    limits.check_size(size, n, sum(map(len, prompts)))
    if n > 1:
        for name in ("return_logprob", "logprob_start_len", "top_logprobs_num"):
            if isinstance(body.get(name), list):
                raise SimError(f"Cannot use list {name} with parallel_sample_num > 1")
    rid = body.get("rid")
    if isinstance(rid, list):
        if len(rid) != size:
            raise SimError("The specified rids length mismatch with the batch_size for batch processing.")
        duplicates = [r for r, count in Counter(rid).items() if count > 1]
        if duplicates:
            raise SimError(f"Duplicate request IDs detected within the request: {duplicates}")
    sampling_of = per_item(sampling, size, "sampling_params")
    logprob = per_item(body.get("return_logprob"), size, "return_logprob")
    tops = per_item(body.get("top_logprobs_num"), size, "top_logprobs_num")
    hidden = per_item(body.get("return_hidden_states"), size, "return_hidden_states")
    hosts = per_item(body.get("bootstrap_host"), size, "bootstrap_host")
    ports = per_item(body.get("bootstrap_port"), size, "bootstrap_port")
    room = body.get("bootstrap_room")
    rooms = per_item(room, size, "bootstrap_room")
    rids = per_item(rid, size, "rid")
    items: list[ItemSpec] = []
    for i, prompt in enumerate(prompts):
        raw = sampling_of[i] or {}
        limits.check_prompt(prompt, raw.get("max_new_tokens"))
        item = ItemSpec(
            rid=rids[i],
            input_ids=prompt,
            sampling=SamplingOptions.from_json(raw, limits.vocab_size),
            return_logprob=bool(logprob[i]) or bool(tops[i]),
            bootstrap_host=hosts[i],
            bootstrap_port=ports[i],
            bootstrap_room=rooms[i],
            top_logprobs_num=int(tops[i] or 0),
            return_hidden_states=bool(hidden[i]),
        )
        items.extend(parallel_samples(item, n))
    batch = not single or n > 1
    if batch and (isinstance(rid, str) or isinstance(room, int)):  # SGLang: rid_k and room + k over the batch
        items = [
            replace(
                item,
                rid=f"{rid}_{k}" if isinstance(rid, str) else item.rid,
                bootstrap_room=room + k if isinstance(room, int) else item.bootstrap_room,
            )
            for k, item in enumerate(items)
        ]
    return GenerateBody(items=items, is_batch=batch, stream=bool(body.get("stream")))


def _prompts(text: Any, ids: Any, single: bool, size: int) -> list[list[int]]:
    """The prompts' token ids: ``input_ids`` when given (SGLang uses them even beside ``text``,
    which then sets the batch's shape), else the encoded text."""
    if ids is None:
        prompts = [encode(text)] if single else [encode(t) for t in text]
        if not all(prompts):
            raise SimError("text cannot be empty: the sim's tokenizer adds no BOS token")
        return prompts
    flat = isinstance(ids[0], int)
    if single != flat or (not flat and len(ids) != size):
        raise SimError(f"input_ids must be {'one list of' if single else f'{size} lists of'} token ids to go with text")
    return [ids] if flat else ids


def parallel_samples(item: ItemSpec, n: int) -> list[ItemSpec]:
    """``n`` > 1 (parallel sampling, GRPO groups): n requests for one prompt, prompt-major. Sample
    j uses bootstrap room + j (both PD legs expand alike, so they meet) and sampling seed + j."""
    if n <= 1:
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


def per_item(value: Any, n: int, name: str) -> list[Any]:
    """A per-prompt field (its type already checked): a list of one value per prompt, or one
    value for all."""
    if isinstance(value, list):
        if len(value) != n:
            raise SimError(f"{name} has {len(value)} items for a batch of {n}")
        return value
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
        "cached_tokens": req.cached_tokens,
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
    if req.return_hidden_states and done:  # (on the last answer of a stream only: the rows add up)
        meta["hidden_states"] = req.hidden_states[:n]
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
