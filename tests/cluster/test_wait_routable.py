"""A command that waits for the engine it switched or restarted asks the router to check that
engine only: a health round of every worker would wait out the slowest of them and count a
failed check against each slow one, on every switch and restart.

The slow worker here is SGLang's decode whose prealloc queue is full of requests waiting for
their KV: its ``/health`` (a one-token generation) answers nothing until their prefills end.
A real router process and a null engine; the slow decode is a small HTTP server that answers
until told to hang and counts what it was asked.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pdctl.cluster.restart import wait_routable
from pdctl.cluster.router_control import RouterControl
from tests.helpers import NullEngine, RouterProcess, pd_router_args


class SlowDecode:
    """Answers ``/health`` and ``/model_info`` as a decode until ``hang`` is set; from then on it
    holds every request open unanswered (until ``release``). ``asked`` counts the requests that
    came after ``hang``."""

    def __init__(self) -> None:
        self.hang = threading.Event()
        self.release = threading.Event()
        self.asked = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if owner.hang.is_set():
                    owner.asked += 1
                    owner.release.wait()
                    return
                body = json.dumps({"weight_version": "default", "disaggregation_mode": "decode"}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fleet(tmp_path) -> Iterator[tuple[RouterProcess, NullEngine, SlowDecode]]:
    prefill, decode = NullEngine(tmp_path, "prefill").start(), NullEngine(tmp_path, "decode").start()
    slow = SlowDecode()
    # The health loop checks a worker in rotation once an hour and the liveness loop is off: from
    # the first round on, only a command's refresh asks the slow decode anything; one failed
    # check takes a worker out of rotation.
    router = RouterProcess(
        tmp_path,
        *pd_router_args([prefill], [decode, slow]),
        "--health-check-interval-secs",
        "3600",
        "--liveness-interval-secs",
        "0",
        "--health-failure-threshold",
        "1",
    )
    try:
        router.start()
        yield router, decode, slow
    finally:
        router.stop()
        slow.close()
        prefill.stop()
        decode.stop()


def _in_rotation(control: RouterControl, url: str) -> bool:
    worker = control.worker(url)
    return bool(worker and worker["is_healthy"])


def test_waiting_for_one_engine_asks_the_router_to_check_that_engine_only(fleet) -> None:
    router, decode, slow = fleet
    control = RouterControl(router.url, None)
    # Both decodes in rotation first (each answered its first check), then the slow one hangs.
    control.refresh()
    assert _in_rotation(control, decode.url) and _in_rotation(control, slow.url), control.worker(slow.url)
    slow.hang.set()
    said: list[str] = []
    wait_routable(control, "decode-0", decode.url, 60, lambda unit, text: said.append(f"{unit}: {text}"))
    assert said == ["decode-0: back in rotation (weights default)"]
    assert slow.asked == 0, "the wait checked another worker than the one it waits for"
    assert _in_rotation(control, slow.url), "the wait counted a failed check against another worker"
