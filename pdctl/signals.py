"""How pdctl's long-running servers (sim, null engine, router) learn to stop."""

from __future__ import annotations

import asyncio
import signal


def stop_event() -> asyncio.Event:
    """An event that SIGTERM (``pdctl down``) or SIGINT (Ctrl-C) sets, on the running loop."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop
