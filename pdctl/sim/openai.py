"""OpenAI-compatible routes of the sim: /v1/models, /v1/completions, /v1/chat/completions.

The chat template is the sim's own (roles in ``<|role|>`` markers, then
``<|assistant|>\\n``); PD fields the router injects (``bootstrap_*``, scalars or per-choice
lists) are honoured as on /generate. Errors use SGLang's OpenAI ``ErrorResponse`` shape.
"""

from __future__ import annotations

import time
import uuid
from http import HTTPStatus
from typing import Any

from aiohttp import web

from pdctl.errors import SimError
from pdctl.sglang import Endpoint, openai_error_body, openai_stream_error_chunk
from pdctl.sim.body import read_json
from pdctl.sim.engine import Request, failure_of, first_failure
from pdctl.sim.model import decode, encode
from pdctl.sim.requests import ItemSpec, parallel_samples, weight_version_spans
from pdctl.sim.sampling import SamplingOptions
from pdctl.sim.service import SimService
from pdctl.sim.sse import EventStream


def add_routes(app: web.Application, service: SimService) -> None:
    routes = OpenAIRoutes(service)
    app.router.add_get(Endpoint.MODELS.value, routes.models)
    app.router.add_get("/v1/models/{model:.+}", routes.model)  # SGLang: {model:path}, ids may hold slashes
    app.router.add_post(Endpoint.COMPLETIONS.value, routes.completions)
    app.router.add_post(Endpoint.CHAT_COMPLETIONS.value, routes.chat)


def chat_prompt(messages: Any) -> str:
    if not isinstance(messages, list) or not messages:
        raise SimError("messages must be a non-empty list")
    parts = []
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise SimError("each message needs a role")
        content = m.get("content") or ""
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"<|{m['role']}|>\n{content}\n")
    return "".join(parts) + "<|assistant|>\n"


def _samples(body: dict[str, Any]) -> int:
    n = body.get("n", 1)
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise SimError("n must be a positive integer")
    return n


def _top_logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """None: no logprobs; else how many alternatives per token (completions: ``logprobs: N``;
    chat: ``logprobs: true`` with ``top_logprobs: N``)."""
    if chat:
        if not body.get("logprobs"):
            return None
        top = body.get("top_logprobs") or 0
    else:
        if body.get("logprobs") is None or body.get("logprobs") is False:
            return None
        top = body.get("logprobs")
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20:
        raise SimError("top_logprobs must be an integer in [0, 20]")
    return top


def _sampling(body: dict[str, Any], default_max: int | None) -> SamplingOptions:
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", default_max))
    raw: dict[str, Any] = {
        "max_new_tokens": max_tokens,
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "top_k": body.get("top_k"),
        "min_p": body.get("min_p"),
        "stop": body.get("stop"),
        "stop_token_ids": body.get("stop_token_ids"),
        "ignore_eos": body.get("ignore_eos"),
        "min_new_tokens": body.get("min_tokens"),
        "sampling_seed": body.get("seed"),
    }
    return SamplingOptions.from_json({k: v for k, v in raw.items() if v is not None})


def _pick(value: Any, i: int) -> Any:
    return value[i] if isinstance(value, list) else value


class OpenAIRoutes:
    def __init__(self, service: SimService):
        self.s = service

    def _model_card(self) -> dict[str, Any]:
        s = self.s
        return {
            "id": s.config.served_name,
            "object": "model",
            "created": int(s.started_at),
            "owned_by": "sglang",
            "root": s.config.model_path,
            "parent": None,
            "max_model_len": s.model.config.context,
        }

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        if request.match_info["model"] != self.s.config.served_name:
            body = openai_error_body(
                f"The model '{request.match_info['model']}' does not exist", status=404, err_type="NotFoundError"
            )
            body["code"] = "model_not_found"
            return web.json_response(body, status=404)
        return web.json_response(self._model_card())

    @staticmethod
    def _items(
        body: dict[str, Any], prompts: list[list[int]], sampling: SamplingOptions, top: int | None
    ) -> list[ItemSpec]:
        n = _samples(body)
        items = []
        for i, ids in enumerate(prompts):
            room = _pick(body.get("bootstrap_room"), i)
            item = ItemSpec(
                None,
                ids,
                sampling,
                top is not None,
                _pick(body.get("bootstrap_host"), i),
                _pick(body.get("bootstrap_port"), i),
                room,
                top_logprobs_num=top or 0,
            )
            items.extend(parallel_samples(item, n))
        return items

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await read_json(request)
            prompts = _prompts(body.get("prompt"))
            sampling = _sampling(body, 16)
            items = self._items(body, prompts, sampling, _top_logprobs(body, chat=False))
        except SimError as exc:
            return web.json_response(openai_error_body(str(exc), status=exc.status), status=exc.status)
        except AttributeError as exc:  # a body that is not an object
            return web.json_response(openai_error_body(f"invalid request: {exc}"), status=400)
        return await self._respond(request, body, items, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await read_json(request)
            prompts = [encode(chat_prompt(body.get("messages")))]
            items = self._items(body, prompts, _sampling(body, None), _top_logprobs(body, chat=True))
        except SimError as exc:
            return web.json_response(openai_error_body(str(exc), status=exc.status), status=exc.status)
        except AttributeError as exc:  # a body that is not an object
            return web.json_response(openai_error_body(f"invalid request: {exc}"), status=400)
        return await self._respond(request, body, items, chat=True)

    async def _respond(
        self, request: web.Request, body: dict[str, Any], items: list[ItemSpec], *, chat: bool
    ) -> web.StreamResponse:
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
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
            batch = await self.s.submit(items)
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


def _stream_error(message: str, status: int) -> dict[str, Any]:
    """SGLang's streamed OpenAI error: a bad request (a ValueError) is a ``BadRequestError``, an
    abort with a status names the status (``create_streaming_error_response(msg, code.name, code)``)."""
    err_type = "BadRequestError" if status == HTTPStatus.BAD_REQUEST else HTTPStatus(status).name
    return openai_stream_error_chunk(message, status=status, err_type=err_type)


def _prompts(prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        return [encode(prompt)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [encode(p) for p in prompt]
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        if all(isinstance(p, list) for p in prompt):
            return [list(p) for p in prompt]
    raise SimError("prompt must be a string, a list of strings, or token ids")


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
