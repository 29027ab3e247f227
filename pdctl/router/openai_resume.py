"""Continuing an OpenAI stream (``/v1/completions``, ``/v1/chat/completions``) on another pair
after its decode died mid-stream, so that the client sees one stream.

OpenAI chunks carry text deltas, not token ids (SGLang 0.5.23 streams chat ids only at the end,
if asked), so the router keeps the events the client got of such a stream (``StreamLog``: a list
append per block; parsed only when the stream breaks) and asks for the rest as text: for a
completion, the prompt plus the text so far; for a chat, the messages plus the answer so far as
an assistant message with SGLang's ``continue_final_message`` (which renders the chat with its
generation prompt and appends that text, no end of turn). The rest of the budget is the token
budget less the tokens of the text so far, counted by an engine's ``/v1/tokenize`` (``counted``):
a content chunk is not one token, since SGLang (and the sim) send what a stream's reader has not
taken yet as one chunk when it falls behind; where no engine counts them, the chunks are the
count (a lower bound). The continuation's chunks take the first answer's ``id`` (SGLang's
``rid``) and a chat continuation's own opening role chunk is dropped.

Exact for greedy where the prefix re-tokenizes to the ids generated (the sim's byte vocabulary
always does; a BPE tokenizer may split the seam differently). Not continued (the stream ends with
an error event, as before): ``n`` > 1, ``echo``, logprobs, tool calls, reasoning content,
constrained decoding, token-id prompts, a prompt or message that is not text.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from pdctl.router.jsonutil import dumps, sse_data
from pdctl.router.streaming import DONE, events_of
from pdctl.sglang import Endpoint

COMPLETIONS, CHAT = Endpoint.COMPLETIONS.value, Endpoint.CHAT_COMPLETIONS.value
ROUTES = frozenset({COMPLETIONS, CHAT})
_NOT_CONTINUED = ("echo", "logprobs", "top_logprobs", "tools", "regex", "json_schema", "ebnf", "response_format")


@dataclass(slots=True)
class StreamLog:
    """The blocks of an OpenAI stream as the client got them."""

    blocks: list[bytes] = field(default_factory=list)

    def add(self, block: bytes) -> None:
        """Note a block as the client got it."""
        self.blocks.append(block)

    def events(self) -> list[dict[str, Any]]:
        """The JSON objects of every event the client got, in order (``[DONE]`` and non-object data left out)."""
        out = []
        for block in self.blocks:
            for event in events_of(block):
                data = sse_data(event)
                if isinstance(data, dict):
                    out.append(data)
        return out


@dataclass(frozen=True, slots=True)
class OpenAIResume:
    """What the client has of a broken one-choice OpenAI stream, and how to ask for the rest."""

    route: str
    body: dict[str, Any]
    id: str
    text: str
    tokens: int
    """Tokens generated: the content chunks sent until ``counted``, then an engine's count of the text."""
    finished: str | None
    """The finish reason the client got already (the stream broke only before its end)."""

    @classmethod
    def of(cls, route: str, body: dict[str, Any], log: StreamLog) -> OpenAIResume | None:
        """None when the stream cannot be continued (module docstring)."""
        if route not in ROUTES or body.get("n", 1) not in (1, None) or any(body.get(k) for k in _NOT_CONTINUED):
            return None
        if route == COMPLETIONS and not isinstance(body.get("prompt"), str):
            return None
        if route == CHAT and not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                     for m in body.get("messages") or [None]):  # fmt: skip
            return None
        pieces, ident, tokens, finished = [], None, 0, None
        for data in log.events():
            if "error" in data:
                return None
            ident = ident or data.get("id")
            for choice in data.get("choices") or []:
                if choice.get("index", 0) != 0:
                    return None
                if route == CHAT:
                    delta = choice.get("delta") or {}
                    if delta.get("tool_calls") or delta.get("reasoning_content"):
                        return None
                    piece = delta.get("content") or ""
                else:
                    piece = choice.get("text") or ""
                if piece:
                    pieces.append(piece)
                    tokens += 1
                finished = choice.get("finish_reason") or finished
        if not isinstance(ident, str):
            return None
        return cls(route, body, ident, "".join(pieces), tokens, finished)

    def counted(self, tokens: int) -> OpenAIResume:
        """This resume with the text's tokens as an engine counted them (never fewer than its chunks)."""
        return replace(self, tokens=max(tokens, self.tokens))

    def tokenize_body(self) -> dict[str, Any]:
        """The ``/v1/tokenize`` body that counts the text so far (no BOS: it is not a prompt)."""
        return {"model": self.body.get("model"), "prompt": self.text, "add_special_tokens": False}

    @property
    def budget(self) -> int | None:
        """The tokens the client asked for (None: as many as the engine allows)."""
        if self.route == COMPLETIONS:
            value = self.body.get("max_tokens", 16)  # SGLang's default for completions
        else:
            value = self.body.get("max_completion_tokens") or self.body.get("max_tokens")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def spent(self) -> bool:
        """Whether nothing is left to continue: the client has its finish reason, or as many tokens as it asked for."""
        budget = self.budget
        return self.finished is not None or (budget is not None and self.tokens >= budget)

    def continuation(self) -> dict[str, Any]:
        """The request for the rest: the prefix so far, the rest of the budget, the first answer's id."""
        body = {k: v for k, v in self.body.items() if k not in ("max_tokens", "max_completion_tokens", "min_tokens")}
        budget = self.budget
        if budget is not None:
            body["max_tokens"] = budget - self.tokens
        min_tokens = self.body.get("min_tokens")
        if isinstance(min_tokens, int) and min_tokens > self.tokens:
            body["min_tokens"] = min_tokens - self.tokens
        body["rid"] = self.id
        if self.route == COMPLETIONS:
            body["prompt"] = self.body["prompt"] + self.text
        else:
            body["messages"] = [*self.body["messages"], {"role": "assistant", "content": self.text}]
            body["continue_final_message"] = True
        return body

    def end(self) -> bytes:
        """The end of a stream whose budget was spent as it broke: its finish, then ``[DONE]``."""
        if self.finished is not None:
            return DONE
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        if self.route == CHAT:
            choice["delta"] = {}
        else:
            choice.update(text="", logprobs=None)
        obj = "chat.completion.chunk" if self.route == CHAT else "text_completion"
        chunk = {"id": self.id, "object": obj, "model": self.body.get("model"), "choices": [choice]}
        return b"data: " + dumps(chunk) + b"\n\n" + DONE

    def rewrite(self, event: bytes) -> bytes:
        """A continuation's event as one of the client's stream: its ``id``, no second role chunk."""
        data = sse_data(event)
        if not isinstance(data, dict) or "choices" not in data:
            return event  # [DONE] and errors pass
        choices = data["choices"]
        usage = data.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            # the whole answer's counts: the prefix was the client's answer, not its prompt
            usage = {**usage, "completion_tokens": usage["completion_tokens"] + self.tokens}
            if isinstance(usage.get("prompt_tokens"), int):
                usage["prompt_tokens"] = max(0, usage["prompt_tokens"] - self.tokens)
            data = {**data, "usage": usage}
        if self.route == CHAT and len(choices) == 1:
            delta = choices[0].get("delta") or {}
            if delta.get("role") and not delta.get("content") and not choices[0].get("finish_reason"):
                return b""  # the continuation's opening role chunk: the client had one
        if data.get("id") != self.id:
            data = {**data, "id": self.id}
        return b"data: " + dumps(data) + b"\n\n"
