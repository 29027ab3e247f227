"""OpenAI-compatible routes of the sim: /v1/models, /v1/completions, /v1/chat/completions,
/v1/tokenize.

The chat template is the sim's own (roles in ``<|role|>`` markers, then
``<|assistant|>\\n``); PD fields the router injects (``bootstrap_*``, scalars or per-choice
lists) are honoured as on /generate. Errors use SGLang's OpenAI ``ErrorResponse`` shape.

A body is checked as SGLang 0.5.23 checks it: the JSON content type, pydantic's lax parse of
``CompletionRequest`` / ``ChatCompletionRequest`` (``"5"`` is an int, ``"yes"`` a bool; type
"Bad Request"), ``_validate_request``, then the sampling and length checks shared with
/generate (type "BadRequestError"). Every refusal is a 400 before any stream starts.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from aiohttp import web

from pdctl.errors import SimError
from pdctl.sglang import Endpoint, openai_error_body, openai_stream_error_chunk
from pdctl.sim.body import (
    REQUIRED,
    ValidationError,
    field,
    lax_bool,
    lax_dict,
    lax_float,
    lax_int,
    lax_list,
    lax_or_list,
    lax_str,
    lax_union,
    read_openai_json,
)
from pdctl.sim.engine import Request, failure_of, first_failure
from pdctl.sim.model import decode, encode
from pdctl.sim.requests import ItemSpec, Limits, parallel_samples, per_item, weight_version_spans
from pdctl.sim.sampling import SamplingOptions
from pdctl.sim.service import SimService
from pdctl.sim.sse import EventStream

log = logging.getLogger("pdctl.sim")


def add_routes(app: web.Application, service: SimService) -> None:
    routes = OpenAIRoutes(service)
    app.router.add_get(Endpoint.MODELS.value, routes.models)
    app.router.add_get("/v1/models/{model:.+}", routes.model)  # SGLang: {model:path}, ids may hold slashes
    app.router.add_post(Endpoint.COMPLETIONS.value, routes.completions)
    app.router.add_post(Endpoint.CHAT_COMPLETIONS.value, routes.chat)
    for path in (Endpoint.TOKENIZE.value, "/tokenize"):
        app.router.add_post(path, routes.tokenize)


_ROLES = ("system", "assistant", "tool", "function", "developer", "latest_reminder", "root")


def lax_messages(value: Any) -> list[dict[str, Any]]:
    """``List[ChatCompletionMessageParam]``: objects with a known role (``user`` exactly, the
    others in any case) and string or content-part content (a user message needs some)."""
    if not isinstance(value, list):
        raise ValueError("Input should be a valid list")
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise ValueError(f"message {i}: Input should be a valid dictionary or object")
        role, content = m.get("role"), m.get("content")
        if role != "user" and not (isinstance(role, str) and role.lower() in _ROLES):
            raise ValueError(f"message {i}: 'role' must be 'user' or one of {', '.join(_ROLES)} (case-insensitive).")
        if content is None and role == "user":
            raise ValueError(f"message {i}: content: Field required")
        parts = content if isinstance(content, list) else []
        if not (content is None or isinstance(content, str | list)) or not all(_is_part(p) for p in parts):
            raise ValueError(f"message {i}: content must be a string or a list of content parts")
    return value


def _is_part(part: Any) -> bool:
    return isinstance(part, dict) and isinstance(part.get("type"), str) and isinstance(part.get("text", ""), str)


def chat_prompt(messages: list[dict[str, Any]], continue_final_message: bool = False) -> str:
    """The sim's chat template. A last assistant message with string content is, as SGLang 0.5.23
    renders it (``serving_chat.py`` ``_handle_last_assistant_message``): with
    ``continue_final_message``, the start of the answer (the template with its generation prompt,
    then that text, no end of turn); without, a user message."""
    prefix = ""
    last = messages[-1] if messages else None
    if last is not None and str(last.get("role")).lower() == "assistant" and isinstance(last.get("content"), str):
        if continue_final_message:
            prefix, messages = last["content"], messages[:-1]
        else:
            messages = [*messages[:-1], {**last, "role": "user"}]
    parts = []
    for m in messages:
        content = m.get("content") or ""
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content)
        parts.append(f"<|{m['role'].lower()}|>\n{content}\n")
    return "".join(parts) + "<|assistant|>\n" + prefix


def _prompt_type(value: Any) -> Any:
    raise ValueError("Input should be a string, a list of strings, a list of token ids or a list of such lists")


# ``Union[List[int], List[List[int]], str, List[str]]``: a value that is exactly one of the
# string forms stays a string (pydantic's smart union), else ints as lax as pydantic takes them.
lax_prompt = lax_union(lax_str, lax_list(lax_str), lax_list(lax_int), lax_list(lax_list(lax_int)), _prompt_type)


def _positive(check: Callable[[Any], int]) -> Callable[[Any], int]:
    def positive(value: Any) -> int:
        value = check(value)
        if value <= 0:
            raise ValueError("Value error, max_tokens must be positive")
        return value

    return positive


def _stream_options(value: Any) -> dict[str, Any]:
    usage = lax_dict(value).get("include_usage")
    return {"include_usage": usage is not None and lax_bool(usage)}


# The fields of CompletionRequest / ChatCompletionRequest (entrypoints/openai/protocol.py) that
# the sim reads: pydantic's check and the default (REQUIRED: none; None: Optional).
_SHARED: dict[str, tuple[Callable[[Any], Any], Any]] = {
    "model": (lax_str, ""),
    "stream": (lax_bool, False),
    "stream_options": (_stream_options, None),
    "n": (lax_int, 1),
    "frequency_penalty": (lax_float, 0.0),
    "presence_penalty": (lax_float, 0.0),
    "min_tokens": (lax_int, 0),
    "seed": (lax_int, None),
    "stop": (lax_or_list(lax_str), None),
    "stop_token_ids": (lax_list(lax_int), None),
    "stop_regex": (lax_or_list(lax_str), None),
    "regex": (lax_str, None),
    "ebnf": (lax_str, None),
    "ignore_eos": (lax_bool, False),
    "no_stop_trim": (lax_bool, False),
    "logit_bias": (lambda v: {k: lax_float(x) for k, x in lax_dict(v).items()}, None),
    "rid": (lax_or_list(lax_str), None),
    "bootstrap_host": (lax_or_list(lax_str), None),
    "bootstrap_port": (lax_or_list(lax_int, optional_items=True), None),
    "bootstrap_room": (lax_or_list(lax_int), None),
}
_COMPLETION = {
    **_SHARED,
    "prompt": (lax_prompt, REQUIRED),
    "echo": (lax_bool, False),
    "max_tokens": (_positive(lax_int), 16),
    "temperature": (lax_float, 1.0),
    "top_p": (lax_float, 1.0),
    "top_k": (lax_int, -1),
    "min_p": (lax_float, 0.0),
    "repetition_penalty": (lax_float, 1.0),
    "json_schema": (lax_str, None),
    "logprobs": (lax_int, None),
}
_CHAT = {
    **_SHARED,
    "messages": (lax_messages, REQUIRED),
    "continue_final_message": (lax_bool, False),
    "max_tokens": (lax_int, None),
    "max_completion_tokens": (lax_int, None),
    "temperature": (lax_float, None),
    "top_p": (lax_float, None),
    "top_k": (lax_int, None),
    "min_p": (lax_float, None),
    "repetition_penalty": (lax_float, None),
    "logprobs": (lax_bool, False),
    "top_logprobs": (lax_int, None),
}


def parse(body: dict[str, Any], fields: dict[str, tuple[Callable[[Any], Any], Any]]) -> dict[str, Any]:
    """The request as pydantic hands it over; raises ValidationError."""
    return {name: field(body, name, check, default) for name, (check, default) in fields.items()}


def _top_logprobs(req: dict[str, Any], chat: bool) -> int | None:
    """None: no logprobs; else how many alternatives per token (completions: ``logprobs: N``;
    chat: ``logprobs: true`` with ``top_logprobs: N``)."""
    if chat and not req["logprobs"]:
        return None
    top = (req["top_logprobs"] or 0) if chat else req["logprobs"]
    if top is not None and not 0 <= top <= 20:  # OpenAI's bound (SGLang has none)
        raise SimError("top_logprobs must be an integer in [0, 20]")
    return top


# Request fields that go into sampling_params under their own names.
_SAMPLING = [
    "temperature",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "regex",
    "json_schema",
    "ebnf",
    "n",
    "no_stop_trim",
    "ignore_eos",
    "logit_bias",
]


def _sampling(req: dict[str, Any], *, chat: bool) -> dict[str, Any]:
    """SGLang's ``_build_sampling_params`` / ``to_sampling_params``: the sampling_params object."""
    raw = {key: req.get(key) for key in _SAMPLING}
    raw.update(min_new_tokens=req["min_tokens"], sampling_seed=req["seed"])
    raw["max_new_tokens"] = (req["max_completion_tokens"] or req["max_tokens"]) if chat else req["max_tokens"]
    return raw


PD_FIELDS = ("host", "port", "room")


class OpenAIRoutes:
    """The handlers of SGLang's OpenAI-compatible routes over one SimService: bodies checked as SGLang 0.5.23 checks
    them, errors in its OpenAI ``ErrorResponse`` shape."""

    def __init__(self, service: SimService):
        self.s = service
        self.limits = Limits.of(service.config, service.model.config.vocab_size, service.engine.context)

    def _model_card(self) -> dict[str, Any]:
        s = self.s
        return {
            "id": s.config.served_name,
            "object": "model",
            "created": int(s.started_at),
            "owned_by": "sglang",
            "root": s.config.model_path,
            "parent": None,
            "max_model_len": s.engine.context,
        }

    async def models(self, _: web.Request) -> web.Response:
        """``GET /v1/models``: a list holding the one served model's card, as SGLang answers."""
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        """``GET /v1/models/{model}``: the served model's card; 404 ``model_not_found`` for any other name."""
        if request.match_info["model"] != self.s.config.served_name:
            body = openai_error_body(
                f"The model '{request.match_info['model']}' does not exist", status=404, err_type="NotFoundError"
            )
            body["code"] = "model_not_found"
            return web.json_response(body, status=404)
        return web.json_response(self._model_card())

    async def tokenize(self, request: web.Request) -> web.Response:
        """``POST /v1/tokenize`` (and ``/tokenize``): a text's ids and ``count``, or a list of texts' (``prompt``),
        or rendered ``messages``' (the sim's chat template), as SGLang's ``OpenAIServingTokenize`` answers; the
        byte vocabulary has no special tokens, so ``add_special_tokens`` changes nothing."""
        try:
            req = await read_openai_json(request)
            prompt, messages = req.get("prompt"), req.get("messages")
            if messages is not None:
                tokens: Any = encode(chat_prompt(lax_messages(messages), bool(req.get("continue_final_message"))))
                count: Any = len(tokens)
            elif isinstance(prompt, str):
                tokens = encode(prompt)
                count = len(tokens)
            elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
                tokens = [encode(p) for p in prompt]
                count = [len(ids) for ids in tokens]
            else:
                raise SimError(f"Invalid prompt type: {type(prompt)}. Expected str or List[str].")
        except SimError as exc:
            return _refuse(request, exc)
        except ValueError as exc:  # lax_messages' refusal
            return _refuse(request, SimError(str(exc)))
        return web.json_response({"tokens": tokens, "count": count, "max_model_len": self.s.engine.context})

    def _items(self, req: dict[str, Any], prompts: list[list[int]], *, chat: bool) -> list[ItemSpec]:
        """SGLang's later stages: the sim's bounds, each prompt's length and the sampling values."""
        limits, n = self.limits, req["n"]
        raw = _sampling(req, chat=chat)
        limits.check_size(len(prompts), n, sum(map(len, prompts)))
        for ids in prompts:
            limits.check_prompt(ids, raw["max_new_tokens"], "messages" if chat else "prompt")
        sampling = SamplingOptions.from_json(raw, limits.vocab_size)
        top = _top_logprobs(req, chat)
        hosts, ports, rooms = (per_item(req[f"bootstrap_{k}"], len(prompts), f"bootstrap_{k}") for k in PD_FIELDS)
        items = []
        for ids, host, port, room in zip(prompts, hosts, ports, rooms, strict=True):
            item = ItemSpec(None, ids, sampling, top is not None, host, port, room, top_logprobs_num=top or 0)
            items.extend(parallel_samples(item, n))
        return items

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/completions``: text or token-id prompts, streamed or not; a refused body is a 400 before any
        stream starts."""
        try:
            req = parse(await read_openai_json(request), _COMPLETION)
            prompt = req["prompt"]
            if not prompt or (isinstance(prompt, list) and all(not p for p in prompt)):
                raise SimError("Prompt cannot be empty")
            if isinstance(prompt, str) or isinstance(prompt[0], str):
                prompts = [encode(p) for p in ([prompt] if isinstance(prompt, str) else prompt)]
            else:
                prompts = [prompt] if isinstance(prompt[0], int) else prompt
            items = self._items(req, prompts, chat=False)
        except SimError as exc:
            return _refuse(request, exc)
        return await self._respond(request, req, items, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/chat/completions``: the messages rendered with the sim's chat template, streamed or not; a refused
        body is a 400 before any stream starts."""
        try:
            req = parse(await read_openai_json(request), _CHAT)
            if not req["messages"]:
                raise SimError("Messages cannot be empty.")
            prompt = chat_prompt(req["messages"], req["continue_final_message"])
            items = self._items(req, [encode(prompt)], chat=True)
        except SimError as exc:
            return _refuse(request, exc)
        return await self._respond(request, req, items, chat=True)

    async def _respond(
        self, request: web.Request, body: dict[str, Any], items: list[ItemSpec], *, chat: bool
    ) -> web.StreamResponse:
        # SGLang's answer id is the request's rid (a continued stream keeps its id), else a new one
        given = body.get("rid")
        rid = given if isinstance(given, str) and given else ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        model = body.get("model") or self.s.config.served_name
        if body.get("stream"):
            options = body.get("stream_options")
            usage = isinstance(options, dict) and bool(options.get("include_usage"))
            echo = not chat and bool(body.get("echo"))
            return await self._stream(request, items, rid, created, model, chat=chat, include_usage=usage, echo=echo)
        try:
            batch = await self.s.submit(items)
        except SimError as exc:
            return web.json_response(openai_error_body(str(exc), status=exc.status), status=exc.status)
        with self.s.aborting_unfinished(batch):
            for running in batch:
                await self.s.finished(running)
        failure = first_failure(r.request for r in batch)
        if failure is not None:
            message, status = failure
            return web.json_response(openai_error_body(message, status=status), status=status)
        choices = [_choice(running.request, index, chat, body) for index, running in enumerate(batch)]
        obj = "chat.completion" if chat else "text_completion"
        first = batch[0].request
        # SGLang's build_endpoint_weight_version_metadata, from the first choice's meta_info.
        spans = weight_version_spans(first.version_events, self.s.weight_version, len(first.output_ids))
        return web.json_response(
            {
                "id": rid,
                "object": obj,
                "created": created,
                "model": model,
                "choices": choices,
                "usage": _usage([r.request for r in batch]),
                "metadata": {"weight_version": spans[-1]["version"], "weight_versions": spans},
            }
        )

    async def _stream(
        self,
        request: web.Request,
        items: list[ItemSpec],
        rid: str,
        created: int,
        model: str,
        *,
        chat: bool,
        include_usage: bool,
        echo: bool = False,
    ) -> web.StreamResponse:
        """Every choice streams side by side (chunks of different indexes interleave, as
        SGLang's do); each chunk sends what is new of its choice's text. The head goes out at
        once, as SGLang's does. A choice aborted with a status (a failure, or KV that could not
        come before the first token) ends the stream with SGLang's streamed error instead of
        its last chunk; one aborted without (abort_request, a pause) ends as any choice does,
        finish_reason abort."""
        stream = await EventStream.open(request)
        try:
            batch = await self.s.submit(items, stream=True)
        except SimError as exc:
            await stream.send(_stream_error(str(exc), exc.status))
            return await stream.close()
        obj = "chat.completion.chunk" if chat else "text_completion"

        async def send(choice: dict[str, Any]) -> None:
            await stream.send({"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]})

        sent = [""] * len(batch)
        # SGLang puts the prompt in a choice's first chunk (echo)
        prefix = [decode(r.request.input_ids) if echo else "" for r in batch]
        with self.s.aborting_unfinished(batch):
            if chat:
                for index in range(len(batch)):
                    await send({"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
            async for index, _, done in self.s.interleaved(batch):
                req = batch[index].request
                failure = failure_of(req.finish) if done else None
                if failure is not None:  # SGLang breaks out of the stream here
                    await stream.send(_stream_error(*failure))
                    break
                # Cumulative text, the stop string trimmed once finished; each chunk sends what is new.
                text = req.text() if done else decode(req.output_ids)
                delta, sent[index] = text[len(sent[index]) :], text
                if delta:
                    piece = {"delta": {"content": delta}} if chat else {"text": prefix[index] + delta, "logprobs": None}
                    prefix[index] = ""
                    await send({"index": index, **piece, "finish_reason": None})
                if done:
                    end: dict[str, Any] = {"delta": {}} if chat else {"text": prefix[index], "logprobs": None}
                    await send(
                        {"index": index, **end, "finish_reason": _finish_reason(req), "matched_stop": _matched(req)}
                    )
        if include_usage:  # SGLang's last chunk: no choices, the counts of every choice
            last = {"id": rid, "object": obj, "created": created, "model": model, "choices": []}
            await stream.send({**last, "usage": _usage([r.request for r in batch])})
        return await stream.close()


def _refuse(request: web.Request, exc: SimError) -> web.Response:
    """A refused body: 400 before any stream, pydantic's type or BadRequestError; one log line."""
    log.info("%s refused: %s", request.path, exc)
    body = exc.body() if isinstance(exc, ValidationError) else openai_error_body(str(exc), status=exc.status)
    return web.json_response(body, status=exc.status)


def _stream_error(message: str, status: int) -> dict[str, Any]:
    """SGLang's streamed OpenAI error: a bad request (a ValueError) is a ``BadRequestError``, an
    abort with a status names the status (``create_streaming_error_response(msg, code.name, code)``)."""
    err_type = "BadRequestError" if status == HTTPStatus.BAD_REQUEST else HTTPStatus(status).name
    return openai_stream_error_chunk(message, status=status, err_type=err_type)


def _finish_reason(req: Request) -> str | None:
    if not req.finish:
        return None
    kind = str(req.finish.get("type"))
    return {"length": "length", "stop": "stop", "abort": "abort"}.get(kind, kind)


def _matched(req: Request) -> Any:
    return req.finish.get("matched") if req.finish else None


def _token_text(token: int) -> str:
    return decode([token])


def _logprobs(req: Request, chat: bool) -> dict[str, Any] | None:
    """OpenAI's logprobs object for the generated tokens (None when not asked for)."""
    if not req.return_logprob:
        return None
    ids, lps = req.output_ids, req.output_logprobs
    tops = req.output_top_logprobs if req.top_logprobs_num else [[] for _ in ids]
    if chat:
        return {
            "content": [
                {
                    "token": _token_text(tok),
                    "logprob": lp,
                    "bytes": [tok] if tok < 256 else None,
                    "top_logprobs": [
                        {"token": _token_text(t), "logprob": v, "bytes": [t] if t < 256 else None} for v, t in top
                    ],
                }
                for tok, lp, top in zip(ids, lps, tops, strict=False)
            ]
        }
    offsets, at = [], 0
    for tok in ids:
        offsets.append(at)
        at += len(_token_text(tok))
    return {
        "tokens": [_token_text(t) for t in ids],
        "token_logprobs": list(lps),
        "top_logprobs": [{_token_text(t): v for v, t in top} for top in tops] if req.top_logprobs_num else None,
        "text_offset": offsets,
    }


def _choice(req: Request, index: int, chat: bool, body: dict[str, Any] | None = None) -> dict[str, Any]:
    if chat:
        message = {"role": "assistant", "content": req.text(), "reasoning_content": None, "tool_calls": None}
        return {
            "index": index,
            "message": message,
            "logprobs": _logprobs(req, chat=True),
            "finish_reason": _finish_reason(req),
            "matched_stop": _matched(req),
        }
    echo = decode(req.input_ids) if body and body.get("echo") else ""  # SGLang: the prompt, then the completion
    return {
        "index": index,
        "text": echo + req.text(),
        "logprobs": _logprobs(req, chat=False),
        "finish_reason": _finish_reason(req),
        "matched_stop": _matched(req),
    }


def _usage(reqs: list[Request]) -> dict[str, int]:
    prompt = sum(len(r.input_ids) for r in reqs)
    completion = sum(len(r.output_ids) for r in reqs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
