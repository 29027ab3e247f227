"""Server-sent events as SGLang writes them: ``data: <json>\\n\\n`` per event, then ``data: [DONE]``.
The JSON is orjson's, with SGLang's options (``dumps_json`` in sglang/srt/utils/json_response.py):
compact, and non-string keys allowed."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

DONE = b"data: [DONE]\n\n"


class EventStream:
    """One streamed answer. ``open`` sends the headers; ``close`` sends [DONE] and ends the body."""

    def __init__(self, response: web.StreamResponse):
        self.response = response

    @classmethod
    async def open(cls, request: web.Request) -> EventStream:
        """Start a ``text/event-stream`` answer to ``request`` (the 200 head is sent now)."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        return cls(response)

    async def send(self, event: Any) -> None:
        """Write ``event`` as one ``data: <json>`` event."""
        await self.response.write(b"data: " + orjson.dumps(event, option=orjson.OPT_NON_STR_KEYS) + b"\n\n")

    async def close(self) -> web.StreamResponse:
        """Write ``data: [DONE]``, end the body and return the response for the handler to return."""
        await self.response.write(DONE)
        await self.response.write_eof()
        return self.response
