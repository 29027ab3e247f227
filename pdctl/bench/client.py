"""One streamed request, timed from the client's side: TTFT, inter-token gaps, E2E, counts.

Three APIs: SGLang's native ``/generate`` (``meta_info`` carries cumulative token counts and
the weight version), OpenAI ``/v1/completions`` and ``/v1/chat/completions`` (streamed with
``stream_options.include_usage`` so that the last chunk carries the server's counts). A chunk
that brings k tokens counts as k inter-token gaps of 1/k of its wait each (bench_serving does
the same for SGLang's chunks).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from pdctl.bench.workloads import BenchRequest

APIS = ("generate", "completions", "chat")
_PATHS = {"generate": "/generate", "completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class RequestResult:
    """One request's outcome and timings as the client saw them; times are in seconds."""

    start: float
    """Monotonic send time (seconds)."""
    input_len: int
    output_len: int
    """Requested output tokens."""
    ok: bool = False
    error: str | None = None
    """Error kind: ``http_503``, ``connect``, ``timeout``, ``stream_error``, ``aborted``, ``empty``..."""
    detail: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    """The server's count (meta_info / usage), None when it gave none."""
    output_tokens: int = 0
    weight_version: str | None = None

    @property
    def end(self) -> float:
        """Monotonic time the answer ended."""
        return self.start + self.e2e

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (bench_serving's TPOT); None for one token."""
        if self.output_tokens <= 1:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def request_body(api: str, req: BenchRequest, model: str | None) -> dict[str, Any]:
    if api == "generate":
        params = {"max_new_tokens": req.output_len, "temperature": 0.0, "ignore_eos": True}
        return {"text": req.prompt, "sampling_params": params, "stream": True}
    body: dict[str, Any] = {
        "model": model or "default",
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "ignore_eos": True,  # SGLang's extra: the output is as long as asked
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if api == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


async def send(
    session: aiohttp.ClientSession,
    base_url: str,
    api: str,
    req: BenchRequest,
    *,
    model: str | None = None,
    headers: dict[str, str] | None = None,
    timeout_secs: float = 600.0,
) -> RequestResult:
    """Send ``req`` and time its stream; never raises for the server's or the network's faults."""
    result = RequestResult(start=time.monotonic(), input_len=req.input_len, output_len=req.output_len)
    body = orjson.dumps(request_body(api, req, model))
    try:
        async with session.post(
            base_url + _PATHS[api],
            data=body,
            headers={"Content-Type": "application/json", **(headers or {})},
            timeout=aiohttp.ClientTimeout(total=timeout_secs),
        ) as resp:
            if resp.status != 200:
                result.error = f"http_{resp.status}"
                result.detail = (await resp.text())[:300]
                return result
            await _read_stream(resp, api, result)
    except asyncio.TimeoutError:
        result.error, result.detail = "timeout", f"no answer within {timeout_secs:g}s"
    except aiohttp.ClientConnectorError as exc:
        result.error, result.detail = "connect", str(exc)
    except (aiohttp.ClientError, ConnectionError) as exc:
        result.error, result.detail = "disconnect", f"{type(exc).__name__}: {exc}"
    finally:
        result.e2e = time.monotonic() - result.start
    if result.error is None:
        if result.output_tokens == 0:
            result.error, result.detail = "empty", "the stream ended without a token"
        else:
            result.ok = True
    return result


async def _read_stream(resp: aiohttp.ClientResponse, api: str, result: RequestResult) -> None:
    """Read SSE events as the bytes arrive; events that arrive together share their arrival time
    (reading line by line would stamp them at parse time instead, and cost more)."""
    last = result.start
    tokens = 0
    pending = b""
    async for data in resp.content.iter_any():
        now = time.monotonic()
        lines = (pending + data).split(b"\n")
        pending = lines.pop()  # an incomplete line waits for the rest
        for raw in lines:
            if not raw.startswith(b"data:"):
                continue
            payload = raw[5:].strip()
            if payload == b"[DONE]":
                break
            try:
                chunk = orjson.loads(payload)
            except orjson.JSONDecodeError:
                result.error, result.detail = "bad_stream", payload[:200].decode(errors="replace")
                return
            if "error" in chunk:
                error = chunk["error"]
                result.error = "stream_error"
                result.detail = str(error.get("message") if isinstance(error, dict) else error)[:300]
                return
            new = _new_tokens(api, chunk, tokens, result)
            aborted = _abort_of(api, chunk)
            if aborted is not None:  # SGLang streams a failed or aborted request as a 200 that ends so
                result.error, result.detail = "aborted", aborted
                return
            if new <= 0:
                continue
            if tokens == 0:
                result.ttft = now - result.start
            else:
                gap = (now - last) / new
                result.itl.extend([gap] * new)
            tokens += new
            last = now
    if result.output_tokens < tokens:  # no server count: the chunks we saw
        result.output_tokens = tokens


def _abort_of(api: str, chunk: dict[str, Any]) -> str | None:
    """What ended the request, when this chunk says it was aborted (SGLang 0.5.23: a /generate
    output whose finish_reason is an abort, with a status_code when it failed; an OpenAI choice
    whose finish_reason is ``abort``), else None."""
    if api == "generate":
        reason = (chunk.get("meta_info") or {}).get("finish_reason")
        if not isinstance(reason, dict) or reason.get("type") != "abort":
            return None
        status = reason.get("status_code")
        return str(reason.get("message"))[:300] + (f" (status {status})" if status else "")
    choices = chunk.get("choices") or []
    if choices and isinstance(choices[0], dict) and choices[0].get("finish_reason") == "abort":
        return "finish_reason abort"
    return None


def _new_tokens(api: str, chunk: dict[str, Any], seen: int, result: RequestResult) -> int:
    """Tokens this chunk adds; records the server's counts and weight version as they come."""
    if api == "generate":
        meta = chunk.get("meta_info") or {}
        result.prompt_tokens = meta.get("prompt_tokens", result.prompt_tokens)
        result.weight_version = meta.get("weight_version", result.weight_version)
        total = int(meta.get("completion_tokens") or 0)
        result.output_tokens = max(result.output_tokens, total)
        return total - seen
    usage = chunk.get("usage")
    if isinstance(usage, dict):  # the last chunk: counts only, no text
        result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
        result.output_tokens = int(usage.get("completion_tokens") or result.output_tokens)
    if chunk.get("weight_version"):
        result.weight_version = chunk["weight_version"]
    choices = chunk.get("choices") or []
    if not choices:
        return 0
    choice = choices[0]
    text = choice.get("text") if api == "completions" else (choice.get("delta") or {}).get("content")
    return 1 if text else 0
