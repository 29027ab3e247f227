"""HTTP/1.1 bytes that both ends of the router write: its server's answers and its upstream requests."""

from __future__ import annotations


def header_lines(headers: dict[str, str]) -> bytes:
    """``headers`` as header lines, each ending in CRLF (joined by C calls: no Python frame per
    header). Values go out as the bytes they came in as (the server decodes headers as latin-1);
    a value that latin-1 cannot hold (a worker's key registered through the API, say) goes out
    as UTF-8."""
    lines = "\r\n".join(map(": ".join, headers.items())) + "\r\n"  # (a value not a str: TypeError)
    try:
        return lines.encode("latin-1")
    except UnicodeEncodeError:
        return lines.encode()
